# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/gpu: a bundle built from fake wheels (made here; nothing is downloaded:
pip resolves them with --no-index) holds the manifest's invariants, and
install.sh and stash.sh refuse what does not match it."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU))
import bundle  # noqa: E402
import manifest as mf  # noqa: E402
import verify  # noqa: E402
from closure import canonicalize_name  # noqa: E402
from wheels import check_record, trim_wheel  # noqa: E402

from .gpu_fakes import (  # noqa: E402
    KEPT_SO,
    OTHER_RELEASE_SO,
    TRIMMED,
    VERSION,
    fake_config,
    fake_index,
)

REAL = tomllib.loads((GPU / "bundle.toml").read_text())
PART_MIB = 0.125  # small parts, so that the fake main tar needs several


def python312() -> str:
    found = bundle.find_python(REAL["machine"]["python"])
    if found is None:
        pytest.skip("no python3.12: pip resolves for the machine's Python")
    return found


def build(out: Path, index: Path, vllm: Path, config: Path, *extra: str) -> None:
    argv = ["build", str(out), "--config", str(config), "--python", python312()]
    argv += ["--vllm-wheel", str(vllm), "--part-mib", str(PART_MIB)]
    argv += ["--pip-arg=--no-index", f"--pip-arg=--find-links={index}", *extra]
    with pytest.MonkeyPatch.context() as mp:
        # This machine's pip settings (other indexes, constraints) stay out.
        mp.setenv("PIP_CONFIG_FILE", os.devnull)
        for var in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_INDEX_URL"):
            mp.delenv(var, raising=False)
        assert bundle.main(argv) == 0


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("world")
    index = root / "index"
    index.mkdir()
    vllm = fake_index(index)
    config = fake_config(root / "bundle.toml", REAL)
    out = root / "bundle"
    build(out, index, vllm, config)
    manifest = json.loads((out / "manifest.json").read_text())
    unpacked = root / "unpacked"
    unpacked.mkdir()
    assert verify.unpack(out, manifest, unpacked) == []
    return dict(
        root=root,
        index=index,
        vllm=vllm,
        config=config,
        out=out,
        manifest=manifest,
        wheels=unpacked / "wheels",
    )


def by_name(manifest: dict, key: str) -> dict:
    return {e["name"]: e for e in manifest[key]}


def test_parts_at_most_the_limit(world):
    m, out = world["manifest"], world["out"]
    assert m["part_limit"] == int(PART_MIB * bundle.MiB)
    assert verify.check_parts(out, m) == []
    sizes = {p["name"]: (out / p["name"]).stat().st_size for p in m["parts"]}
    assert all(size <= m["part_limit"] for size in sizes.values())
    assert sorted(sizes) == sorted(p.name for p in out.glob("part-*"))
    main, nixl = m["tars"]
    assert main["name"] == "main.tar" and len(main["parts"]) > 1
    # NIXL travels in parts of its own, after vLLM's.
    assert nixl["name"] == "nixl.tar"
    assert [p["name"] for p in m["parts"]] == [
        p["name"] for t in m["tars"] for p in t["parts"]
    ]
    assert {w["name"] for w in m["wheels"] if w["tar"] == "nixl.tar"} == {
        "nixl",
        "nixl-cu13",
    }


def test_trimmed_paths_absent_and_record_consistent(world):
    m = world["manifest"]
    wheel = world["wheels"] / m["vllm_wheel"]["file"]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert not names & set(TRIMMED)
    assert KEPT_SO in names
    rules = m["vllm_wheel"]["cut"]
    cut = sorted(p for rule in rules for p in rule["paths"])
    assert cut == sorted(TRIMMED)
    assert all(rule["reason"] and rule["files"] for rule in rules)
    assert check_record(wheel) == []
    assert verify.check_vllm(wheel, m) == []
    # pip accepts it (and the rest): install.sh's tests install them all.


def test_every_requirement_bundled_present_or_optional(world):
    m = world["manifest"]
    wheels = sorted(world["wheels"].glob("*.whl"))
    assert verify.check_closure(wheels, m) == []
    bundled = {w["name"]: w["version"] for w in m["wheels"]}
    assert bundled == {
        "vllm": VERSION,
        "dep-a": "1.1",
        "dep-b": "1.0",
        "dep-c": "1.0",
        "dep-d": "1.0",
        "dep-e": "1.0",
        "numpy": "2.3.0",  # vLLM refuses the 2.5.2 there
        "hub": "2.0",  # vLLM refuses the 1.0 there
        "tf": "1.1",  # pip: the 1.0 there wants hub<2
        "dsl": "1.0",  # excluded for older releases only
        "nixl": "1.0.0",
        "nixl-cu13": "1.0.0",
    }
    present = by_name(m, "present")
    assert present["torch"]["satisfied"] is False  # 2.11.0 there, vLLM pins 2.14.0
    assert (
        present["torch"]["kept"] and present["torch"]["required"]["vllm"] == "==2.14.0"
    )
    assert present["cfg"]["satisfied"] is True
    assert present["click"]["satisfied"] is None
    assert "numpy" not in present and "numpy" not in m["present_names"]
    replaced = by_name(m, "replaced")
    assert replaced["numpy"]["because"] == {"vllm": "<2.4"}
    assert replaced["numpy"]["there"] == "2.5.2"
    assert replaced["hub"]["because"] == {"vllm": ">=2"}
    assert "tf==1.0" in replaced["tf"]["because"]["pip"]
    assert (replaced["tf"]["there"], replaced["tf"]["carried"]) == ("1.0", "1.1")
    excluded = by_name(m, "excluded")
    assert excluded["heavy-opt"]["required_by"] == ["vllm"]
    # Never resolved, so what only it needs is never fetched.
    assert excluded["heavy-opt"]["drops"] == [] and "heavy-only" not in bundled
    assert excluded["gone-opt"]["required_by"] == ["vllm"]
    assert excluded["nixl-cu12"]["required_by"] == ["nixl"]
    assert all(x["reason"] for x in m["excluded"])
    # What the machine keeps stays pinned; what travels is not.
    assert m["resolution"]["pins"] == {"cfg": "1.0", "torch": "2.11.0", "tri": "3.6.0"}


def test_carry_kept_takes_what_the_kept_needs(world, tmp_path):
    """Route 2: the kept torch travels at vLLM's pin, and so does the tri its
    requirement refuses there."""
    out = tmp_path / "b"
    build(out, world["index"], world["vllm"], world["config"], "--carry-kept")
    m = json.loads((out / "manifest.json").read_text())
    bundled = {w["name"]: w["version"] for w in m["wheels"]}
    assert bundled["torch"] == "2.14.0" and bundled["tri"] == "3.8.0"
    replaced = by_name(m, "replaced")
    assert replaced["torch"]["because"] == {"vllm": "==2.14.0"}
    assert replaced["tri"]["because"] == {"torch": "~=3.8"}
    assert not any(p.get("kept") for p in m["present"])
    assert verify.verify(out, tmp_path / "v") == []


def test_trim_rules_follow_the_release(world):
    """A rule's releases decide whether it applies: the other Python's
    DeepGEMM extension rule names releases before the fake one's."""
    m = world["manifest"]
    patterns = {rule["pattern"] for rule in m["vllm_wheel"]["cut"]}
    older = [r for r in REAL["trim"] if "releases" in r]
    assert older and not patterns & {r["pattern"] for r in older}
    with zipfile.ZipFile(world["wheels"] / m["vllm_wheel"]["file"]) as zf:
        assert OTHER_RELEASE_SO in zf.namelist()


def test_exclusions_follow_the_release(world):
    """An exclusion with releases holds for those only: the fake dsl, excluded
    before 0.1, travels; the real CuTe DSL travels from 0.34 on."""
    assert "dsl" in {w["name"] for w in world["manifest"]["wheels"]}
    assert "dsl" not in by_name(world["manifest"], "excluded")
    dsl = "nvidia-cutlass-dsl"
    assert dsl in bundle.excluded_for(REAL["excluded"], "0.26.0")
    assert dsl not in bundle.excluded_for(REAL["excluded"], "0.34.0")
    assert "nvidia-cutlass-dsl-libs-cu12" in bundle.excluded_for(
        REAL["excluded"], "0.34.0"
    )


def test_checksums_and_sizes_match_the_files(world):
    m = world["manifest"]
    for w in m["wheels"]:
        data = (world["wheels"] / w["file"]).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (w["sha256"], w["size"])
    text = (world["out"] / "manifest.json").read_text()
    assert "://" not in text  # no index's address
    assert verify.verify(world["out"], world["root"] / "v") == []


def test_same_inputs_same_bundle(world, tmp_path):
    build(tmp_path / "again", world["index"], world["vllm"], world["config"])
    again = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert again["parts"] == world["manifest"]["parts"]


def test_no_nixl(world, tmp_path):
    out = tmp_path / "b"
    build(out, world["index"], world["vllm"], world["config"], "--no-nixl")
    m = json.loads((out / "manifest.json").read_text())
    assert [t["name"] for t in m["tars"]] == ["main.tar"]
    assert "nixl" not in {w["name"] for w in m["wheels"]}


def run(script: str, *args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(GPU / script), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, **(env or {})},
        timeout=300,
    )


def carried(world, tmp_path) -> Path:
    """The parts and manifest as a device call carries them."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for p in [*world["out"].glob("part-*"), world["out"] / "manifest.json"]:
        shutil.copy(p, repo / p.name)
    return repo


def test_stash_then_install(world, tmp_path):
    repo, gather, site = (
        carried(world, tmp_path),
        tmp_path / "gather",
        tmp_path / "site",
    )
    for p in world["manifest"]["parts"]:
        done = run("stash.sh", repo / p["name"], gather)
        assert done.returncode == 0, done.stderr
        assert f"{p['name']} ok" in done.stdout
        assert not (repo / p["name"]).exists()
    done = run("install.sh", "--target", site, gather)
    assert done.returncode == 0, done.stderr
    assert f"export PYTHONPATH={site}" in done.stdout.splitlines()
    assert f"vllm {VERSION} imports from {site}" in done.stdout
    assert "nixl imports" in done.stdout
    assert (site / "vllm" / "__init__.py").exists()
    assert not (site / "vllm" / "vllm-rs").exists()
    # Python runs no .pth file of a PYTHONPATH folder: install.sh's
    # sitecustomize.py does, so the folder it names imports.
    env = {**os.environ, "PYTHONPATH": str(site)}
    imported = [sys.executable, "-c", "import dsl_mod"]
    assert subprocess.run(imported, env=env).returncode == 0
    # It hides the machine's own sitecustomize (Ubuntu's, on the H100), so
    # it runs that one after.
    machine = tmp_path / "machine"
    machine.mkdir()
    (machine / "sitecustomize.py").write_text("import sys; sys.machine_hook = 1\n")
    env["PYTHONPATH"] = f"{site}{os.pathsep}{machine}"
    both = [sys.executable, "-c", "import sys, dsl_mod; assert sys.machine_hook"]
    assert subprocess.run(both, env=env).returncode == 0
    again = run("install.sh", "--target", site, gather)
    assert again.returncode == 0, again.stderr
    assert "reusing it" in again.stdout


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_install_refuses_a_corrupted_or_missing_part(world, tmp_path):
    gather = carried(world, tmp_path)
    bad = world["manifest"]["parts"][1]["name"]
    corrupt(gather / bad)
    done = run("install.sh", "--target", tmp_path / "site", gather)
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"bad checksum: part {bad} has" in done.stderr
    assert not (tmp_path / "site").exists()
    (gather / bad).unlink()
    done = run("install.sh", "--check-only", gather)
    assert done.returncode == 1 and f"missing part(s) {bad} in" in done.stderr


def test_stash_refuses_a_corrupted_part(world, tmp_path):
    repo = carried(world, tmp_path)
    bad = world["manifest"]["parts"][0]["name"]
    corrupt(repo / bad)
    done = run("stash.sh", repo / bad, tmp_path / "gather")
    assert done.returncode == 1
    assert f"bad checksum: part {bad} has" in done.stderr
    assert (repo / bad).exists() and not (tmp_path / "gather" / bad).exists()
    (repo / "part-99").write_bytes(b"x")
    done = run("stash.sh", repo / "part-99", tmp_path / "gather")
    assert done.returncode == 1 and "part-99 is not a part of" in done.stderr


def test_verify_catches_breakage(world, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(world["out"], out, ignore=shutil.ignore_patterns("cache"))
    m = json.loads((out / "manifest.json").read_text())
    # A requirement that is neither bundled, present nor declared optional.
    m["present_names"].remove("torch")
    (out / "manifest.json").write_text(json.dumps(m))
    problems = verify.verify(out, tmp_path / "v1")
    assert any(p.startswith("torch==2.14.0 (required by vllm)") for p in problems)
    last = m["parts"][-1]
    corrupt(out / last["name"])
    problems = verify.verify(out, tmp_path / "v2")
    assert problems == [f"{last['name']}: sha256 or size differs from the manifest"]
    m["part_limit"] = last["size"] - 1
    assert f"{last['name']}: {last['size']} bytes, over the limit of " in "".join(
        verify.check_parts(out, m)
    )
    # A second version of a wheel, and a wheel that nothing needs.
    index = world["index"]
    extra = [
        index / "dep_a-1.0-py3-none-any.whl",
        index / "zen_thing-1.0-py3-none-any.whl",
    ]
    problems = verify.check_closure(sorted(world["wheels"].glob("*.whl")) + extra, m)
    assert "two versions of dep-a: 1.1 and 1.0" in problems
    assert "zen-thing is bundled but nothing needs it" in problems


def test_record_check_and_trim_rules_can_fail(world, tmp_path):
    # A wheel cut without its RECORD rewritten is caught.
    stale = tmp_path / world["vllm"].name
    with zipfile.ZipFile(world["vllm"]) as src, zipfile.ZipFile(stale, "w") as dst:
        for info in src.infolist():
            if info.filename != "vllm/vllm-rs":
                dst.writestr(info, src.read(info))
    assert check_record(stale) == [f"{stale.name}: RECORD lists missing vllm/vllm-rs"]
    # A rule that matches nothing means another wheel than the rules know.
    rules = [{"pattern": r"vllm/not-there\.so", "reason": "test"}]
    with pytest.raises(ValueError, match="match nothing"):
        trim_wheel(world["vllm"], tmp_path / "t.whl", rules)


def test_calls_are_short(world):
    lines = mf.calls(world["out"], world["manifest"], bundle.REPO)
    assert len(lines) == len(world["manifest"]["parts"])
    for line in lines:
        command = line.split("command=", 1)[1]
        assert len(command) < 300
    assert "install.sh" in lines[-1] and "install.sh" not in lines[0]


def test_config_names_are_canonical():
    for name in [
        *REAL["present"]["unversioned"],
        *REAL["present"]["versions"],
        *REAL["excluded"],
    ]:
        assert name == canonicalize_name(name)

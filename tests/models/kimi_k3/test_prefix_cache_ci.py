# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-cache suite's CI files, checked against this vLLM checkout.

``.buildkite/test_areas/models_basic.yaml`` must parse with unique keys,
name only paths that exist, trigger each step on every file of the suite that
the step imports, shard the Kimi-K3 matrix so that every case runs exactly
once, and allow the sharded step no less time than upstream's.
``.buildkite/scripts/install-kv-connectors.sh`` must pick the NIXL wheel
variant and the Mooncake build of torch's CUDA version (checked in its dry-run
mode against a stub ``python3``, and in a real run against stubs that record
what they are asked to do) and, on this platform, have installed a NIXL that
imports.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

import vllm
from tests.models.kimi_k3.test_prefix_cache_matrix import collected_ids
from vllm.platforms import current_platform

ROOT = Path(__file__).resolve().parents[3]
TESTS = ROOT / "tests"
AREA = ROOT / ".buildkite/test_areas/models_basic.yaml"
SCRIPT = ROOT / ".buildkite/scripts/install-kv-connectors.sh"
MATRIX_MODULE = "models/kimi_k3/test_prefix_cache.py"
SHARDED_KEY = "kimi-k3-prefix-cache-4xb200"
SINGLE_GPU_KEY = "kimi-k3-unit-tests-b200"
CPU_KEY = "hybrid-prefix-cache-cpu"
OUR_KEYS = (SINGLE_GPU_KEY, SHARDED_KEY, CPU_KEY)
# The folders of this suite: a step that imports a file of theirs must list
# it (or its folder) among its source_file_dependencies.
SUITE_FOLDERS = ("tests/models/hybrid_prefix_cache/", "tests/models/kimi_k3/")
MOONCAKE_CU12 = "mooncake-transfer-engine"
MOONCAKE_CU13 = "mooncake-transfer-engine-cuda13"
# The installed vllm package stands for the checkout's source vllm/ folder
# (same version); it is the folder that exists wherever the tests import vllm.
VLLM_SOURCE_ROOT = Path(vllm.__file__).resolve().parent.parent

# Nothing here sets up vLLM's distributed state or a device in-process: skip
# the global cleanup after each test (tests/conftest.py).
pytestmark = pytest.mark.skip_global_cleanup


def _steps() -> list[dict]:
    return yaml.safe_load(AREA.read_text())["steps"]


def _step(key: str) -> dict:
    (step,) = [s for s in _steps() if s["key"] == key]
    return step


def _pytest_commands(step: dict) -> list[list[str]]:
    commands = [
        *step["commands"],
        *step.get("mirror", {}).get("amd", {}).get("commands", []),
    ]
    return [shlex.split(c) for c in commands if c.startswith("pytest ")]


def _collect_args(argv: list[str], shard: tuple[int, int] | None) -> list[str]:
    args = []
    for arg in argv[1:]:
        if shard is not None:
            arg = arg.replace("$$BUILDKITE_PARALLEL_JOB_COUNT", str(shard[1]))
            arg = arg.replace("$$BUILDKITE_PARALLEL_JOB", str(shard[0]))
        if arg not in ("-v", "-s"):
            args.append(arg)
    assert not any("$" in arg for arg in args), args
    return args


def collect_in_process(
    argv: list[str], shard: tuple[int, int] | None = None
) -> list[str]:
    """What :func:`collect` returns, collected in this process (see
    collected_ids). Only for commands that select modules this session
    imports anyway (the matrix module); a command that imports other test
    modules, or whose imports are the point, goes to :func:`collect`."""
    args = []
    for arg in _collect_args(argv, shard):
        if arg.startswith("--ignore="):
            arg = f"--ignore={TESTS / arg.split('=', 1)[1]}"
        elif not arg.startswith("-"):
            arg = str(TESTS / arg)
        args.append(arg)
    return collected_ids(args)


def collect(
    argv: list[str],
    shard: tuple[int, int] | None = None,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> list[str]:
    """The node ids a step's pytest command selects, run from tests/ in a
    fresh interpreter (``extra`` pytest arguments and ``env`` added)."""
    args = _collect_args(argv, shard)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
            *extra,
            *args,
        ],
        cwd=TESTS,
        env=None if env is None else {**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


def in_matrix(node: str) -> bool:
    """Whether a collected node id is a case of the Kimi-K3 matrix module."""
    return node.split("::", 1)[0].endswith(MATRIX_MODULE)


def test_area_parses_with_unique_keys():
    keys = [step["key"] for step in _steps()]
    assert len(keys) == len(set(keys)), "models_basic.yaml repeats a key"
    for key in OUR_KEYS:
        assert keys.count(key) == 1, key


@pytest.mark.parametrize("key", OUR_KEYS)
def test_source_file_dependencies_exist(key):
    step = _step(key)
    paths = [
        *step["source_file_dependencies"],
        *step.get("mirror", {}).get("amd", {}).get("source_file_dependencies", []),
    ]
    missing = []
    for path in (p.lstrip("!") for p in paths):
        root = VLLM_SOURCE_ROOT if path.startswith("vllm/") else ROOT
        if not (root / path).exists():
            missing.append(path)
    assert not missing, f"{key}: no such paths: {missing}"


@pytest.mark.parametrize("key", OUR_KEYS)
def test_command_test_paths_exist(key):
    for argv in _pytest_commands(_step(key)):
        paths = [a for a in argv[1:] if not a.startswith("-")]
        ignored = [a.split("=", 1)[1] for a in argv if a.startswith("--ignore=")]
        missing = [p for p in paths + ignored if not (TESTS / p).exists()]
        assert not missing, f"{key}: {shlex.join(argv)} names missing {missing}"


# A pytest plugin that writes the file of every module imported by the end
# of collection (conftest.py files included) to $RECORD_IMPORTS_TO.
RECORD_IMPORTS = """
import os
import sys


def pytest_collection_finish(session):
    with open(os.environ["RECORD_IMPORTS_TO"], "w") as out:
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if path:
                print(path, file=out)
"""


def _has_code(path: Path) -> bool:
    """Whether a file holds more than blank lines and comments (an empty
    ``__init__.py`` cannot change what a step does)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return any(line and not line.startswith("#") for line in lines)


def imported_suite_files(argv: list[str], tmp_path: Path) -> set[str]:
    """The files of the suite's folders that collecting ``argv`` imports,
    relative to the checkout."""
    (tmp_path / "record_imports.py").write_text(RECORD_IMPORTS)
    record = tmp_path / "imports.txt"
    pythonpath = os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p
    )
    collect(
        argv,
        extra=("-p", "record_imports"),
        env={"PYTHONPATH": pythonpath, "RECORD_IMPORTS_TO": str(record)},
    )
    files = set()
    for line in record.read_text().splitlines():
        path = Path(line).resolve()
        if not path.is_relative_to(ROOT) or not path.is_file():
            continue
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(SUITE_FOLDERS) and _has_code(path):
            files.add(relative)
    return files


@pytest.mark.parametrize("key", OUR_KEYS)
def test_source_file_dependencies_cover_imported_suite_files(tmp_path, key):
    """A change to any file of the suite that a step's pytest commands import
    (conftest.py files, the harness, whatever it becomes) triggers the step."""
    step = _step(key)
    listed = step["source_file_dependencies"]

    def imports(index: int, argv: list[str]) -> set[str]:
        # Every shard imports the same files.
        argv = [a for a in argv if not a.startswith(("--shard-id", "--num-shards"))]
        folder = tmp_path / str(index)
        folder.mkdir()
        return imported_suite_files(argv, folder)

    # Each command's collection in a fresh interpreter of its own, all at once.
    commands = _pytest_commands(step)
    with ThreadPoolExecutor(len(commands)) as pool:
        imported = set().union(*pool.map(imports, range(len(commands)), commands))
    assert any(f.endswith("/conftest.py") for f in imported), imported
    missing = sorted(
        f
        for f in imported
        if not any(f == d or (d.endswith("/") and f.startswith(d)) for d in listed)
    )
    assert not missing, f"{key}: imports {missing}, not in its trigger list"


# dev/suite.sh and dev/provision.sh keep vLLM's sdist beside the checkout they
# unpack from it; this marker says that this is such a checkout.
SDIST_CHECKOUT_MARKER = ".hybrid-pc-complete"


def upstream_area() -> str:
    """Upstream's own models_basic.yaml: our overlay merged our steps into
    the checkout's copy, so the original is only in the sdist tarball."""
    tarball = ROOT.parent / f"{ROOT.name}.tar.gz"
    if not tarball.is_file():
        assert not (ROOT / SDIST_CHECKOUT_MARKER).exists(), (
            f"this checkout was unpacked from {tarball.name}, which is gone"
        )
        pytest.skip(
            f"no sdist {tarball} beside this checkout (not one made by "
            "dev/provision.sh), so upstream's original models_basic.yaml "
            "cannot be told from the merged one"
        )
    member = f"{ROOT.name}/{AREA.relative_to(ROOT).as_posix()}"
    with tarfile.open(tarball) as tar:
        data = tar.extractfile(member)
        assert data is not None, f"{member} in {tarball} is not a file"
        return data.read().decode()


def test_upstream_area_skips_only_outside_an_sdist_checkout(tmp_path, monkeypatch):
    checkout = tmp_path / "vllm-x"
    checkout.mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", checkout)
    with pytest.raises(pytest.skip.Exception, match="no sdist"):
        upstream_area()
    (checkout / SDIST_CHECKOUT_MARKER).touch()
    with pytest.raises(AssertionError, match="which is gone"):
        upstream_area()


def test_sharded_timeout_not_below_upstreams():
    upstream = yaml.safe_load(upstream_area())["steps"]
    # The step whose pytest runs the matrix module (not one that ignores it).
    (theirs,) = [
        step
        for step in upstream
        if any(MATRIX_MODULE in shlex.split(c) for c in step.get("commands", []))
    ]
    assert theirs["key"] == SHARDED_KEY
    ours = _step(SHARDED_KEY)["timeout_in_minutes"]
    assert ours >= theirs["timeout_in_minutes"], (
        f"{SHARDED_KEY}: {ours} min, below upstream's "
        f"{theirs['timeout_in_minutes']} min for fewer turns per case"
    )


def test_shards_select_every_matrix_case_once():
    (argv,) = _pytest_commands(_step(SHARDED_KEY))
    assert MATRIX_MODULE in argv
    everything = collect_in_process(
        [
            a
            for a in argv
            if not a.startswith("--shard-id") and not a.startswith("--num-shards")
        ]
    )
    shards = [collect_in_process(argv, shard=(i, 2)) for i in range(2)]
    assert all(shards), "a shard selects nothing"
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(everything)
    assert len(everything) == 31
    assert all(in_matrix(node) for node in everything)


def test_single_gpu_step_collects_no_matrix_case():
    argv = _pytest_commands(_step(SINGLE_GPU_KEY))[0]
    nodes = collect(argv)
    assert nodes, "the single-GPU Kimi K3 step collects nothing"
    assert not [n for n in nodes if in_matrix(n)]


def _requirements_pin(name: str) -> str:
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        if line.replace(" ", "").startswith("nixl=="):
            return line.replace(" ", "").split("==", 1)[1]
    raise AssertionError(f"requirements/{name} pins no nixl")


def dry_run(tmp_path: Path, probe: str) -> subprocess.CompletedProcess:
    """Run the install script against a stub python3 that reports ``probe``."""
    stub = tmp_path / "bin"
    stub.mkdir(parents=True)
    (stub / "python3").write_text(f"#!/bin/sh\ncat >/dev/null\necho '{probe}'\n")
    (stub / "python3").chmod(0o755)
    path = os.pathsep.join([str(stub), "/usr/bin", "/bin"])
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={"PATH": path, "KV_CONNECTORS_DRY_RUN": "1", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("major", "other", "requirements"),
    [("12", "13", "kv_connectors_cu12.txt"), ("13", "12", "kv_connectors.txt")],
)
def test_install_script_picks_the_cuda_variant(tmp_path, major, other, requirements):
    result = dry_run(tmp_path, f"cuda {major}")
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if line.startswith("+")]
    pin = _requirements_pin(requirements)
    assert any(f"requirements/{requirements}" in c for c in commands), commands
    assert any("uninstall" in c and f"nixl-cu{other}" in c for c in commands)
    (install,) = [c for c in commands if f"nixl-cu{major}==" in c]
    assert "--no-deps" in install
    assert install.endswith(f"nixl-cu{major}=={pin}"), install
    # torch is held at what is installed.
    assert all("-c " in c for c in commands if "-r " in c)


def _commands(result: subprocess.CompletedProcess) -> list[list[str]]:
    """The commands a dry run printed, each split into its words."""
    return [line[2:].split() for line in result.stdout.splitlines() if line[:2] == "+ "]


def _names(argv: list[str], package: str) -> bool:
    """Whether a command names ``package`` itself, with or without a version."""
    return any(re.split(r"[<>=!~;\[ ]", arg, maxsplit=1)[0] == package for arg in argv)


def _requires(requirements: str, package: str) -> bool:
    lines = (ROOT / "requirements" / requirements).read_text().splitlines()
    return any(_names([line.replace(" ", "")], package) for line in lines)


def _index(commands: list[list[str]], command: list[str]) -> int:
    """Where ``command`` stands in ``commands`` (by identity)."""
    (index,) = [i for i, c in enumerate(commands) if c is command]
    return index


MOONCAKE_CASES = [
    # (CUDA major, its requirements, its Mooncake build, the other build)
    ("12", "kv_connectors_cu12.txt", MOONCAKE_CU12, MOONCAKE_CU13),
    ("13", "kv_connectors.txt", MOONCAKE_CU13, MOONCAKE_CU12),
]


@pytest.mark.parametrize(
    ("major", "requirements", "build", "other"), MOONCAKE_CASES, ids=("cu12", "cu13")
)
def test_install_script_picks_the_mooncake_build(
    tmp_path, major, requirements, build, other
):
    """Upstream's rule: the requirements bring the CUDA 12 build, which a
    CUDA 13 image swaps for the CUDA 13 build of the same version."""
    result = dry_run(tmp_path, f"cuda {major}")
    assert result.returncode == 0, result.stderr
    assert f"Mooncake for CUDA {major}: {build}\n" in result.stdout, result.stdout
    commands = _commands(result)
    (requirements_install,) = [c for c in commands if "-r" in c]
    assert _index(commands, requirements_install) == 0
    assert requirements_install[-1].endswith(f"requirements/{requirements}")
    assert _requires(requirements, MOONCAKE_CU12)
    assert not _requires(requirements, MOONCAKE_CU13)
    installs = [c for c in commands if "install" in c and _names(c, build)]
    uninstalls = [c for c in commands if "uninstall" in c]
    # The other build is never installed by name.
    assert not [c for c in commands if "install" in c and _names(c, other)]
    if build == MOONCAKE_CU12:
        # The requirements install it; nothing removes it.
        assert not installs, installs
        assert not [c for c in uninstalls if _names(c, build)], uninstalls
        return
    # Both builds go (they share files), then the CUDA 13 build is installed
    # at the version the requirements resolved, with torch held.
    (removal,) = [c for c in uninstalls if _names(c, build) or _names(c, other)]
    assert _names(removal, build) and _names(removal, other), removal
    (install,) = installs
    assert _index(commands, requirements_install) < _index(commands, removal)
    assert _index(commands, removal) < _index(commands, install)
    assert install[-1] == f"{build}==<installed-{other}-version>", install
    assert "-c" in install and "--no-deps" not in install


# Stubs for a real (not dry) run: python3 and uv that record what they are
# asked to do. python3 answers the platform probe, says which version of the
# CUDA 12 Mooncake build the requirements installed, and fails the script it
# is given when that holds the marker in $STUB_FAIL_ON.
STUB_PYTHON = """#!{python}
import json
import os
import sys

script = "" if sys.stdin.isatty() else sys.stdin.read()
with open({log!r}, "a") as log:
    print(json.dumps({{"argv": sys.argv[1:], "script": script}}), file=log)
if "torch.version.hip" in script:
    print({probe!r})
elif sys.argv[1:] == ["-", {cu12!r}]:
    print({version!r})
elif os.environ.get("STUB_FAIL_ON") and os.environ["STUB_FAIL_ON"] in script:
    sys.exit(1)
"""
STUB_UV = """#!{python}
import json
import sys

with open({log!r}, "a") as log:
    print(json.dumps(sys.argv[1:]), file=log)
"""
STUB_MOONCAKE_VERSION = "0.3.13.post1"


def stubbed_run(
    tmp_path: Path, probe: str, fail_on: str = ""
) -> tuple[subprocess.CompletedProcess, list[dict], list[list[str]]]:
    """Run the install script for real against the stubs: its result, what
    python3 was asked to run, and the uv commands."""
    stub = tmp_path / "bin"
    stub.mkdir(parents=True)
    python_log, uv_log = tmp_path / "python3.jsonl", tmp_path / "uv.jsonl"
    for name, text in (
        (
            "python3",
            STUB_PYTHON.format(
                python=sys.executable,
                log=str(python_log),
                probe=probe,
                cu12=MOONCAKE_CU12,
                version=STUB_MOONCAKE_VERSION,
            ),
        ),
        ("uv", STUB_UV.format(python=sys.executable, log=str(uv_log))),
    ):
        (stub / name).write_text(text)
        (stub / name).chmod(0o755)
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        env={
            "PATH": os.pathsep.join([str(stub), "/usr/bin", "/bin"]),
            "HOME": str(tmp_path),
            "STUB_FAIL_ON": fail_on,
        },
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )

    def read(log: Path) -> list:
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]

    return result, read(python_log), read(uv_log)


@pytest.mark.parametrize(
    ("major", "requirements", "build", "other"), MOONCAKE_CASES, ids=("cu12", "cu13")
)
def test_install_script_checks_mooncake_on_cuda(
    tmp_path, major, requirements, build, other
):
    """A real run installs this major's build and then makes python3 load
    its engine and store, with that build named as the only one allowed."""
    result, python_calls, uv_calls = stubbed_run(tmp_path, f"cuda {major}")
    assert result.returncode == 0, result.stderr
    installs = [c for c in uv_calls if c[:2] == ["pip", "install"]]
    assert any(c[-1].endswith(f"requirements/{requirements}") for c in installs)
    if build == MOONCAKE_CU13:
        # The version python3 reported for the CUDA 12 build.
        assert [c[-1] for c in installs if _names(c, build)] == [
            f"{build}=={STUB_MOONCAKE_VERSION}"
        ]
    checks = [c for c in python_calls if "mooncake.engine" in c["script"]]
    assert len(checks) == 1, f"python3 was asked to load Mooncake {len(checks)} times"
    (check,) = checks
    assert check["argv"] == ["-", build, MOONCAKE_CU12, MOONCAKE_CU13]
    for line in ("from mooncake.engine import", "from mooncake.store import"):
        assert line in check["script"]
    assert 'shutil.which("mooncake_master")' in check["script"]
    # NIXL is checked first, and the Mooncake check is the last call.
    assert python_calls[-1] is check
    assert "import nixl" in python_calls[-2]["script"]

    failed, _, _ = stubbed_run(tmp_path / "fails", f"cuda {major}", "mooncake")
    assert failed.returncode == 1
    assert f"Mooncake ({build}) is not installed alone" in failed.stderr


def test_install_script_leaves_mooncake_off_cpu(tmp_path):
    """On CPU a real run installs and checks NIXL alone."""
    result, python_calls, uv_calls = stubbed_run(tmp_path, "cpu -")
    assert result.returncode == 0, result.stderr
    assert uv_calls and python_calls
    assert not [c for c in uv_calls if "mooncake" in " ".join(c)], uv_calls
    assert not [c for c in python_calls if "mooncake" in json.dumps(c)]
    assert "import nixl" in python_calls[-1]["script"]


def test_install_script_rocm_and_unknown_cuda(tmp_path):
    rocm = dry_run(tmp_path / "rocm", "rocm -")
    assert rocm.returncode == 0, rocm.stderr
    assert "requirements/kv_connectors_rocm.txt" in rocm.stdout
    cuda11 = dry_run(tmp_path / "cuda11", "cuda 11")
    assert cuda11.returncode == 1
    assert "no NIXL wheel variant for CUDA 11" in cuda11.stderr


@pytest.mark.skipif(
    not current_platform.is_cpu(), reason="checks the CPU install of NIXL"
)
def test_nixl_installed_on_cpu():
    """install-kv-connectors.sh ran before this suite; NIXL must import."""
    from vllm.distributed import nixl_utils
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    connector = KVConnectorFactory.get_connector_class_by_name("NixlConnector")
    assert "Nixl" in connector.__name__, connector
    # vLLM's NIXL loader answers None when the nixl package does not import.
    assert nixl_utils.NixlWrapper is not None, "vLLM finds no usable NIXL"
    assert nixl_utils.nixl_agent_config is not None

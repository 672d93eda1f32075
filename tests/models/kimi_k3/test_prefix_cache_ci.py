# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-cache suite's CI files, checked against this vLLM checkout.

``.buildkite/test_areas/models_basic.yaml`` must parse with unique keys,
name only paths that exist, trigger each step on every file of the suite that
the step imports and on the scripts it runs, shard the Kimi-K3 matrix so that
every case runs exactly once, allow the sharded step no less time than
upstream's, and take upstream's form, setup and mirror where upstream has the
step; the GPU tier's step runs the whole tier per PR on one GPU of a pool
upstream's per-PR steps use, set up as the KV connector step.
``.buildkite/scripts/install-kv-connectors.sh`` must install vLLM's KV
connector lock where the checkout has one, exactly, and elsewhere pick the
NIXL wheel variant and the Mooncake build of torch's CUDA version (checked in
its dry-run mode against a stub ``python3``, and in a real run against stubs
that record what they are asked to do) and, on this platform, have installed
a NIXL that imports.
"""

import ast
import contextlib
import functools
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

import vllm
from tests.models.hybrid_prefix_cache.harness import CASE_TURNS, case_seconds
from tests.models.kimi_k3 import test_prefix_cache as kimi
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
GPU_KEY = "hybrid-prefix-cache-gpu"
OUR_KEYS = (SINGLE_GPU_KEY, SHARDED_KEY, GPU_KEY, CPU_KEY)
GPU_TIER_MODULE = "models/hybrid_prefix_cache/test_gpu_tier.py"
# The folders of this suite: a step that imports a file of theirs must list
# it (or its folder) among its source_file_dependencies.
SUITE_FOLDERS = ("tests/models/hybrid_prefix_cache/", "tests/models/kimi_k3/")
HARNESS = "tests/models/hybrid_prefix_cache/harness/"
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
    return [argv for argv, _ in _pytest_runs(step)]


# Where a step's commands run unless it says otherwise (vLLM's pipeline
# generator gives every step of .buildkite/test_areas this working_dir).
DEFAULT_WORKING_DIR = "/vllm-workspace/tests"


def _here(working_dir: str) -> Path:
    """The folder of this checkout that a CI working_dir is."""
    relative = Path(working_dir).relative_to("/vllm-workspace")
    return ROOT / relative


def _pytest_runs(step: dict) -> list[tuple[list[str], Path]]:
    """A step's pytest commands (its mirror's too), each split into words,
    with the folder of this checkout it runs in."""
    here = step.get("working_dir", DEFAULT_WORKING_DIR)
    amd = step.get("mirror", {}).get("amd", {})
    runs = [(c, here) for c in step.get("commands", [])]
    runs += [(c, amd.get("working_dir", here)) for c in amd.get("commands", [])]
    return [
        (shlex.split(c), _here(folder)) for c, folder in runs if c.startswith("pytest ")
    ]


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


class Collection(NamedTuple):
    """A command's ``pytest --collect-only`` in a fresh interpreter."""

    result: subprocess.CompletedProcess
    # Where RECORD_IMPORTS wrote the imported files (nothing there if pytest
    # never finished collecting).
    imports: Path


@functools.cache
def _recorder() -> tempfile.TemporaryDirectory:
    """The session's folder of RECORD_IMPORTS and what it records (held
    here, it goes when the interpreter exits)."""
    folder = tempfile.TemporaryDirectory(prefix="record-imports-")
    (Path(folder.name) / "record_imports.py").write_text(RECORD_IMPORTS)
    return folder


# A fresh interpreter imports vllm and torch, and so several tests asking for
# the same step's collection cost most of this module's time: each distinct
# collection runs once a session, recording its node ids and its imports at
# once, at most two at a time (each keeps a core busy).
_COLLECTORS = ThreadPoolExecutor(2)


@functools.cache
def _collection(args: tuple[str, ...], cwd: Path) -> Future[Collection]:
    """The collection of pytest arguments ``args`` run from ``cwd``, started
    on the first call."""
    recorder = Path(_recorder().name)
    imports = Path(tempfile.mkdtemp(dir=recorder)) / "imports.txt"
    pythonpath = os.pathsep.join(
        p for p in (str(recorder), os.environ.get("PYTHONPATH")) if p
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        "-p",
        "record_imports",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": pythonpath, "RECORD_IMPORTS_TO": str(imports)}

    def run() -> Collection:
        result = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        )
        return Collection(result, imports)

    return _COLLECTORS.submit(run)


def _start(
    argv: list[str], shard: tuple[int, int] | None = None, cwd: Path = TESTS
) -> Future[Collection]:
    return _collection(tuple(_collect_args(argv, shard)), cwd.resolve())


@pytest.fixture(scope="module", autouse=True)
def _start_collections(request):
    """Queue the collections of the steps whose coverage test this run
    selected (in a full run every step that collects from the suite's
    folders, whose collections all the other tests here ask for)."""
    cover = test_source_file_dependencies_cover_imported_suite_files
    for item in request.session.items:
        if getattr(item, "function", None) is cover:
            for argv, here in _pytest_runs(_step(item.callspec.params["key"])):
                # A command that cannot be collected fails the test itself.
                with contextlib.suppress(AssertionError):
                    _start(_unsharded(argv), cwd=here)
    yield
    # Collections still queued when the run stops early (-x) never start.
    _COLLECTORS.shutdown(wait=False, cancel_futures=True)


def collection(
    argv: list[str], shard: tuple[int, int] | None = None, cwd: Path = TESTS
) -> Collection:
    """A step's pytest command collected from ``cwd`` (tests/, where our
    steps run) in a fresh interpreter, once a session."""
    found = _start(argv, shard, cwd).result()
    result = found.result
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    return found


def collect(
    argv: list[str],
    shard: tuple[int, int] | None = None,
    cwd: Path = TESTS,
    errors: list[str] | None = None,
) -> list[str]:
    """The node ids a step's pytest command selects (:func:`collection`);
    ``errors`` gets the modules that failed to collect, with pytest's
    error."""
    result = collection(argv, shard, cwd).result
    if errors is not None:
        errors += [
            line.strip("_ ")
            for line in result.stdout.splitlines()
            if "ERROR collecting" in line or line.startswith("E   ")
        ]
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
    for argv, here in _pytest_runs(_step(key)):
        paths = [a for a in argv[1:] if not a.startswith("-")]
        ignored = [a.split("=", 1)[1] for a in argv if a.startswith("--ignore=")]
        missing = [p for p in paths + ignored if not (here / p).exists()]
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


def imported_suite_files(argv: list[str], cwd: Path = TESTS) -> set[str]:
    """The files of the suite's folders that collecting ``argv`` (run from
    ``cwd``) imports, relative to the checkout."""
    record = collection(argv, cwd=cwd).imports
    files = set()
    for line in record.read_text().splitlines():
        path = Path(line).resolve()
        if not path.is_relative_to(ROOT) or not path.is_file():
            continue
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(SUITE_FOLDERS) and _has_code(path):
            files.add(relative)
    return files


def _collects_suite_folders(step: dict) -> bool:
    """Whether one of a step's pytest commands collects from a folder of
    the suite (and so loads what pytest loads there)."""
    for argv, here in _pytest_runs(step):
        for arg in argv[1:]:
            if arg.startswith("-"):
                continue
            path = (here / arg.split("::")[0]).resolve()
            if not path.is_relative_to(ROOT):
                continue
            relative = path.relative_to(ROOT).as_posix() + "/"
            if relative.startswith(SUITE_FOLDERS):
                return True
    return False


# Every step of the merged file, ours or upstream's, that collects from the
# suite's folders: upstream's too load what the suite puts there (0.33.0's
# kimi-k3-specialized-decode-amd collects models/kimi_k3/amd_specialized_decode).
COLLECTING_KEYS = [s["key"] for s in _steps() if _collects_suite_folders(s)]


def covered(path: str, listed: list[str]) -> bool:
    """Whether a trigger of ``listed`` (a file, or a folder ending in /)
    covers ``path``."""
    return any(path == d or (d.endswith("/") and path.startswith(d)) for d in listed)


def step_imports(step: dict) -> set[str]:
    """The files of the suite that a step's pytest commands import."""
    # Every shard imports the same files.
    runs = [(_unsharded(argv), here) for argv, here in _pytest_runs(step)]
    # Each command's collection in a fresh interpreter of its own, all started
    # before waiting on the first.
    for argv, here in runs:
        _start(argv, cwd=here)
    return set().union(*(imported_suite_files(argv, here) for argv, here in runs))


@pytest.mark.parametrize("key", COLLECTING_KEYS)
def test_source_file_dependencies_cover_imported_suite_files(key):
    """A change to any file of the suite that a step's pytest commands import
    (conftest.py files, the harness, whatever it becomes) triggers the step:
    ours, and upstream's that collect from the suite's folders, which must
    import nothing of ours that is not among their triggers (no conftest.py
    of ours in models/kimi_k3/: the Kimi module loads the plugin itself)."""
    step = _step(key)
    imported = step_imports(step)
    if key in OUR_KEYS:
        # The recorder saw the suite: every step of ours loads the harness.
        assert any(f.startswith(HARNESS) for f in imported), imported
    listed = step.get("source_file_dependencies") or []
    listed = [
        *listed,
        *step.get("mirror", {}).get("amd", {}).get("source_file_dependencies", []),
    ]
    missing = sorted(f for f in imported if not covered(f, listed))
    assert not missing, f"{key}: imports {missing}, not in its trigger list"


def test_upstream_steps_in_the_suite_folders_load_no_suite_conftest():
    """No conftest.py of ours in models/kimi_k3/, where upstream's own steps
    collect: the Kimi module loads the suite's plugin itself."""
    ours = [
        path
        for path in (TESTS / "models/kimi_k3").rglob("conftest.py")
        if "hybrid_prefix_cache" in path.read_text()
    ]
    assert not ours, ours
    assert (
        "tests.models.hybrid_prefix_cache.harness.plugin"
        in (TESTS / MATRIX_MODULE).read_text()
    )


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


def upstream_steps(text: str) -> list[tuple[dict, list[str] | None]]:
    """Upstream's steps, active and commented out, in order: (the step,
    None for an active one, else the comment lines right above it). A
    commented-out step is a ``# - `` line and the ``#   `` lines under it
    (how vLLM disables a step), which read as one step once uncommented."""
    steps: list[tuple[dict, list[str] | None]] = []
    lines = text.splitlines()
    active = iter(yaml.safe_load(text)["steps"])
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("- "):
            steps.append((next(active), None))
        elif line.startswith("# - "):
            end = next(
                (j for j in range(i + 1, len(lines)) if not lines[j].startswith("#  ")),
                len(lines),
            )
            block = "\n".join(x[2:] for x in lines[i:end])
            with contextlib.suppress(yaml.YAMLError, ValueError, KeyError, TypeError):
                (step,) = yaml.safe_load(block)
                step["key"]  # prose that reads as a list item is no step
                lead = []
                for above in reversed(lines[:i]):
                    if not above.startswith("#") or above.startswith("#  "):
                        break
                    lead.insert(0, above)
                steps.append((step, lead))
            i = end
            continue
        i += 1
    return steps


def upstream_step(key: str) -> tuple[dict | None, list[str] | None]:
    """Upstream's step ``key`` (active first, else commented out) and the
    comment above it if commented out; (None, None) where upstream has none."""
    found = [
        (s, lead) for s, lead in upstream_steps(upstream_area()) if s["key"] == key
    ]
    found.sort(key=lambda pair: pair[1] is not None)
    return found[0] if found else (None, None)


# The fields in which upstream decides how a step is scheduled and sharded
# (dev/merge_steps.py takes them from upstream's step, active or not).
FORM = ("label", "optional", "soft_fail", "automatic_shard", "parallelism")
FORM += ("device", "num_devices")
SHARD_FLAGS = ("--shard-id=$$BUILDKITE_PARALLEL_JOB",)
SHARD_FLAGS += ("--num-shards=$$BUILDKITE_PARALLEL_JOB_COUNT",)
TRIGGERS = "source_file_dependencies"
# What vLLM 0.34.0's KV connector steps run instead of installing them: the
# packages are baked into its CI image, and the script only verifies them.
CHECK_SCRIPT = ".buildkite/scripts/check-kv-connectors.sh"
INSTALL_SCRIPT = SCRIPT.relative_to(ROOT).as_posix()
# Our steps that declare no mirror of their own: where upstream's step has
# one (0.34.0's 4xB200 step, on MI355), the merged step's is upstream's.
WITHOUT_OWN_MIRROR = (SHARDED_KEY, CPU_KEY)


def setup(commands: list) -> list:
    """A step's setup: its commands before its first pytest command."""
    pytest_at = [i for i, c in enumerate(commands) if c.startswith("pytest ")]
    return commands[: pytest_at[0] if pytest_at else len(commands)]


def scripts(commands: list) -> list[str]:
    """The files of the checkout's .buildkite/scripts/ that commands run."""
    found = re.findall(r"(?<![\w.-])(\.buildkite/scripts/[\w./-]+)", " ".join(commands))
    return list(dict.fromkeys(found))


def _sharding(step: dict) -> tuple:
    return bool(step.get("automatic_shard")), step.get("parallelism")


def test_upstream_steps_reads_commented_out_steps():
    text = (
        "steps:\n- label: a\n  key: a\n\n# Off until X.\n# - label: b\n"
        "#   key: b\n#   # why\n#   optional: true\n\n# - prose, not a step\n"
    )
    (a, none), (b, lead) = upstream_steps(text)
    assert (a["key"], none) == ("a", None)
    assert b == {"label": "b", "key": "b", "optional": True}
    assert lead == ["# Off until X."]


def test_sharded_timeout_not_below_upstreams():
    """Where upstream shards the step as ours does, ours allows no less
    time than upstream's; where it shards it otherwise (automatic_shard),
    the merged step has upstream's timeout, which its shards are sized for."""
    theirs, _ = upstream_step(SHARDED_KEY)
    assert theirs is not None, f"upstream has no {SHARDED_KEY}, not even commented out"
    assert MATRIX_MODULE in " ".join(theirs["commands"])
    merged = _step(SHARDED_KEY)
    ours, upstreams = merged["timeout_in_minutes"], theirs["timeout_in_minutes"]
    if _sharding(merged) == _sharding(theirs) and "parallelism" in theirs:
        assert ours >= upstreams, (
            f"{SHARDED_KEY}: {ours} min, below upstream's {upstreams} min for "
            "fewer turns per case"
        )
    else:
        assert ours == upstreams, (ours, upstreams)


def _block(text: str, key: str) -> list[str]:
    """The lines of step ``key`` in a test-area file (uncommented, if it is
    commented out there), from its ``- `` line to the next blank line."""
    lines = [line[2:] if line.startswith("# ") else line for line in text.splitlines()]
    (at,) = [i for i, line in enumerate(lines) if line == f"  key: {key}"]
    start = max(i for i in range(at) if lines[i].startswith("- "))
    end = next((i for i in range(at, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def _form_comments(block: list[str]) -> list[str]:
    """The comment lines of a step that stand above one of its FORM fields."""
    found, pending = [], []
    for line in block:
        if line.strip().startswith("#"):
            pending.append(line)
            continue
        field = re.match(r"  ([a-z_]+):", line)
        if field and field.group(1) in FORM:
            found += pending
        pending = []
    return found


@pytest.mark.parametrize("key", OUR_KEYS)
def test_merged_step_takes_upstreams_form(key):
    """Where upstream has the step, active or commented out, the merged step
    is scheduled and sharded as upstream's (0.33.0: the 4xB200 step as
    [Nightly], optional and automatic_shard, without pytest-shard's flags;
    0.32.0: a per-PR step in 2 pytest-shard jobs, as before), upstream's
    comments on those fields come with them, and a commented-out step's
    comment stays right above it. A step upstream lacks is appended."""
    theirs, lead = upstream_step(key)
    merged = _step(key)
    keys = [s["key"] for s in _steps()]
    if theirs is None:
        upstream_keys = [s["key"] for s, _ in upstream_steps(upstream_area())]
        assert all(keys.index(key) > keys.index(k) for k in upstream_keys if k in keys)
        return
    for field in FORM:
        assert merged.get(field) == theirs.get(field), (key, field)
    # Its mirrors too: each of upstream's is there, in upstream's form.
    for platform, job in (theirs.get("mirror") or {}).items():
        mine = (merged.get("mirror") or {}).get(platform)
        assert mine is not None, f"{key}: upstream's {platform} mirror is lost"
        for field in FORM:
            assert mine.get(field) == job.get(field), (key, platform, field)
        if key in WITHOUT_OWN_MIRROR:
            assert mine == job, f"{key}: the {platform} mirror is not upstream's"
    for command in merged["commands"]:
        if command.startswith("pytest "):
            flags = [flag in command for flag in SHARD_FLAGS]
            assert flags == [bool(merged.get("parallelism"))] * 2, (key, command)
    text = AREA.read_text()
    block = _block(text, key)
    for comment in _form_comments(_block(upstream_area(), key)):
        assert comment in block, f"{key}: upstream's {comment.strip()!r} is lost"
    if lead is not None:
        lines = text.splitlines()
        label = lines.index(block[0])
        assert lines[label - len(lead) : label] == lead, (
            f"{key}: upstream's {lead} is not right above it"
        )


def test_merged_step_runs_upstreams_setup():
    """How a job gets its packages is upstream's to say: where upstream's
    step has a setup (the commands before its first pytest), the merged step
    runs exactly it, with no install of ours: vLLM 0.34.0 bakes the KV
    connectors into its CI image and its 4xB200 step runs
    check-kv-connectors.sh ("jobs must not install packages at runtime"),
    where 0.32.0 and 0.33.0 run install-kv-connectors.sh as ours does."""
    theirs, _ = upstream_step(SHARDED_KEY)
    assert theirs is not None, f"upstream has no {SHARDED_KEY}, not even commented out"
    merged = _step(SHARDED_KEY)
    their_setup = setup(theirs["commands"])
    assert their_setup, f"upstream's {SHARDED_KEY} has no setup: {theirs['commands']}"
    assert setup(merged["commands"]) == their_setup, (merged["commands"], their_setup)
    assert scripts(merged["commands"]) == scripts(their_setup)
    if (ROOT / CHECK_SCRIPT).is_file():
        # The checkout verifies baked-in packages: nothing may install them.
        assert CHECK_SCRIPT in scripts(merged["commands"]), merged["commands"]
        assert INSTALL_SCRIPT not in " ".join(merged["commands"]), merged["commands"]


@pytest.mark.parametrize("key", OUR_KEYS)
def test_steps_trigger_on_the_scripts_they_run(key):
    """A step starts on a change to a script it runs (its mirrors run its
    commands too), and on no script it does not run."""
    step = _step(key)
    ran = scripts(step.get("commands", []))
    listed = [t for t in step.get(TRIGGERS, []) if t.startswith(".buildkite/scripts/")]
    missing = [path for path in ran if not (ROOT / path).is_file()]
    assert not missing, f"{key} runs scripts this checkout lacks: {missing}"
    assert sorted(listed) == sorted(ran), f"{key}: runs {ran}, triggers on {listed}"


def _unsharded(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith(("--shard-id", "--num-shards"))]


def test_shards_select_every_matrix_case_once():
    step = _step(SHARDED_KEY)
    (argv,) = _pytest_commands(step)
    assert MATRIX_MODULE in argv
    everything = collect_in_process(_unsharded(argv))
    # Every matrix case (cells and workload cases), the resends, Mooncake's.
    assert len(everything) == len(kimi.MATRIX.cases) + len(kimi.RESEND_LENGTHS) + 1
    assert all(in_matrix(node) for node in everything)
    jobs = step.get("parallelism")
    if not jobs:
        # One job runs everything unless vLLM's generator shards it.
        assert step.get("automatic_shard"), f"{SHARDED_KEY} runs as one job"
        return
    shards = [collect_in_process(argv, shard=(i, jobs)) for i in range(jobs)]
    assert all(shards), "a shard selects nothing"
    for i, shard in enumerate(shards):
        assert not set(shard) & set().union(*shards[i + 1 :]), i
    assert sorted(sum(shards, [])) == sorted(everything)


# The shard-balance check's own cost model of the Kimi matrix, in units of a
# one-server cell: a P/D cell runs a prefiller and a decoder, twice the work
# and the starts; a resend plays two requests on its cell's running servers;
# the Mooncake resend starts one server for two requests.
PD_CELL, ONE_SERVER_CELL, RESEND, MOONCAKE = 2.0, 1.0, 0.25, 0.75


def _cost_and_servers(node: str) -> tuple[float, str]:
    """A matrix test's cost and the key of the servers it runs on."""
    name = node.split("::", 1)[1]
    if name.startswith("test_prefix_cache["):
        case = kimi.MATRIX.cases[name[len("test_prefix_cache[") : -1]]
        pd = kimi.DEPLOYMENTS[case.deployment].prefill is not None
        if case.workload is not None:
            # Its turns on its cell's running servers, in one-server cells.
            servers = 2 if pd else 1
            seconds = case_seconds(servers, case.turns, start=False)
            return seconds / case_seconds(1, CASE_TURNS), case.cell
        return (PD_CELL if pd else ONE_SERVER_CELL), case.cell
    if name.startswith("test_exact_resend["):
        return RESEND, f"plain-{kimi.RESEND_MODE}"
    assert name == "test_mooncake_store_resend", name
    return MOONCAKE, "mooncake"


def test_shards_balance_cost_and_keep_servers_together():
    """pytest-shard's hash of the node ids put 19 of the 31 tests, 9 of the
    12 P/D cells, in one of 2 shards; the harness's plugin splits them by
    cost instead. Each job's cost is within one one-server cell of an even
    split, P/D cells are spread evenly, and tests that share servers share
    a job."""
    step = _step(SHARDED_KEY)
    jobs = step.get("parallelism")
    if not jobs:
        pytest.skip(
            "no pytest-shard jobs: vLLM's generator shards this step "
            "(test_automatic_shard_gets_a_command_it_can_shard)"
        )
    (argv,) = _pytest_commands(step)
    shards = [collect_in_process(argv, shard=(i, jobs)) for i in range(jobs)]
    costs = [sum(_cost_and_servers(node)[0] for node in shard) for shard in shards]
    assert max(costs) <= sum(costs) / jobs + ONE_SERVER_CELL, costs
    pd = [sum(_cost_and_servers(n)[0] == PD_CELL for n in shard) for shard in shards]
    assert max(pd) - min(pd) <= 1, pd
    where: dict[str, set[int]] = {}
    for i, shard in enumerate(shards):
        for node in shard:
            where.setdefault(_cost_and_servers(node)[1], set()).add(i)
    split = {servers: jobs for servers, jobs in where.items() if len(jobs) > 1}
    assert not split, f"tests that share servers run in several jobs: {split}"


def test_automatic_shard_gets_a_command_it_can_shard():
    """Under automatic_shard (0.33.0's form), vLLM's pipeline generator
    collects the step's pytest commands and plans shards from main's timings
    of each test, cutting only between tests in collection order; it refuses
    a pytest command with shell syntax or pytest-shard's flags and then runs
    the step as one job (ci-infra's buildkite/pipeline_generator/
    runtime_shard.py, split_commands and plan). So: plain pytest commands,
    and tests that share servers next to each other in collection order."""
    step = _step(SHARDED_KEY)
    if not step.get("automatic_shard"):
        pytest.skip("pytest-shard jobs (test_shards_balance_...)")
    assert "parallelism" not in step
    commands = step["commands"]
    first = next(i for i, c in enumerate(commands) if c.startswith("pytest "))
    for command in commands[first:]:
        assert command.startswith("pytest "), command
        assert not re.search(r"[;&|<>`$]", command), command
        assert "--shard-id" not in command and "--num-shards" not in command
    (argv,) = _pytest_commands(step)
    order = [_cost_and_servers(node)[1] for node in collect_in_process(argv)]
    runs = [key for i, key in enumerate(order) if i == 0 or order[i - 1] != key]
    assert len(runs) == len(set(runs)), f"servers apart in collection: {runs}"


def test_single_gpu_step_collects_no_matrix_case():
    argv = _pytest_commands(_step(SINGLE_GPU_KEY))[0]
    nodes = collect(argv)
    assert nodes, "the single-GPU Kimi K3 step collects nothing"
    assert not [n for n in nodes if in_matrix(n)]


# ---------------------------------------------------------------------------
# What the suite reads of vLLM, derived from the suite's files a step imports,
# and the step's triggers, which must cover it.

# A vLLM path as the suite's comments and strings name one ("the DCP branch
# of v1/attention/backends/mla/flashinfer_mla.py"): under vllm/, or under one
# of vLLM's own top folders (not models/, which the suite's comments use for
# its tests/models/ folders).
NAMED_PATH = re.compile(
    r"(?<![\w/.])(?:vllm/([\w/]*\w(?:\.py)?)|((?:v1|distributed|entrypoints|"
    r"model_executor|config|engine|attention)/[\w/]*\w(?:\.py)?))"
)
# What the suite imports of vLLM to run, not to check (its configs, argument
# parsing, the platform it asks for, helpers): a change there shows in every
# step of vLLM's, not in this suite's results.
USED_NOT_CHECKED = (
    "vllm/config/",
    "vllm/engine/arg_utils.py",
    "vllm/entrypoints/cli/",
    "vllm/model_executor/models/",
    "vllm/platforms/",
    "vllm/sampling_params.py",
    "vllm/utils/",
    "vllm/v1/structured_output/",
)
METRIC_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")


def _vllm_path(path: str) -> str | None:
    """``path`` under vllm/ as a trigger (a folder ends in /), if vLLM has it."""
    path = path.removeprefix("vllm/").rstrip("/")
    full = VLLM_SOURCE_ROOT / "vllm" / path
    if full.is_dir():
        return f"vllm/{path}/"
    if full.is_file():
        return f"vllm/{path}"
    return None


def _module_path(module: str) -> str | None:
    """The file (or package folder) of a vllm module, as a trigger."""
    relative = module.replace(".", "/")
    for candidate in (f"{relative}.py", f"{relative}/"):
        if (found := _vllm_path(candidate)) is not None:
            return found
    return None


def _imported_modules(node: ast.ImportFrom) -> list[str]:
    """The vllm modules that ``from M import a, b`` reads: a submodule
    imported by name (``from vllm.v1.engine import output_processor``) is
    its own module, not its package's ``__init__``."""
    found = []
    for alias in node.names:
        module = f"{node.module}.{alias.name}"
        if _module_path(module) is None:
            module = node.module or ""
        if module not in found:
            found.append(module)
    return found


def _vllm_files_with(literal: str, under: str = "") -> set[str]:
    """The vLLM files (under ``under``) whose text holds ``literal``."""
    root = VLLM_SOURCE_ROOT / "vllm" / under
    return {
        path.relative_to(VLLM_SOURCE_ROOT).as_posix()
        for path in root.rglob("*.py")
        if literal in path.read_text(errors="replace")
    }


def _vllm_files_serving(route: str) -> set[str]:
    """The vLLM entrypoint files that serve ``route``: those registering it,
    the path the first argument of a call (a router's ``post`` or ``get``, a
    ``Mount``), not every file that names it (0.34.0's
    entrypoints/launchers/run_batch.py compares a batch line's URL with
    "/v1/completions" and serves nothing)."""
    found = set()
    for path in _vllm_files_with(f'"{route}"', "entrypoints"):
        tree = ast.parse((VLLM_SOURCE_ROOT / path).read_text(errors="replace"))
        for node in ast.walk(tree):
            first = node.args[0] if isinstance(node, ast.Call) and node.args else None
            if isinstance(first, ast.Constant) and first.value == route:
                found.add(path)
                break
    return found


# Where the suite's drafter rule comes from (harness/drafting.py asks
# SpeculativeConfig.use_eagle_block_drop): vllm/config/speculative.py, and the
# drafter configs it imports (0.34.0 moved them to
# vllm/v1/worker/gpu/spec_decode/; before, it held them itself).
SPECULATIVE_CONFIG = "vllm/config/speculative.py"


def drafter_configs() -> dict[str, str]:
    """The modules of vLLM's spec-decode packages that SpeculativeConfig
    imports (of the vLLM under test), as triggers: {path: why}."""
    tree = ast.parse((VLLM_SOURCE_ROOT / SPECULATIVE_CONFIG).read_text())
    found = {}
    for node in ast.walk(tree):
        module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
        if "spec_decode" in module.split(".") and (path := _module_path(module)):
            found[path] = f"{SPECULATIVE_CONFIG} imports {module}"
    return found


def _asks_speculative_config(node: ast.ImportFrom) -> bool:
    names = {alias.name for alias in node.names}
    return node.module == "vllm.config.speculative" or (
        node.module == "vllm.config" and "SpeculativeConfig" in names
    )


def _connector_module(name: str) -> str:
    """The module vLLM's connector factory loads for connector ``name``
    (vllm/distributed/kv_transfer/kv_connector/factory.py registers each
    with a lazy loader that holds its module path)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    loader = KVConnectorFactory._registry[name]
    return inspect.getclosurevars(loader).nonlocals["module_path"]


def vllm_reads(files: set[str], named: bool = True) -> dict[str, str]:
    """What the suite's ``files`` read of vLLM, as triggers: {path: why}.
    The vLLM modules they import (less USED_NOT_CHECKED, but with the
    drafter configs that SpeculativeConfig imports, where they ask it), the
    files they name (``named``), the files defining the /metrics counters
    they read, the files serving the routes they call (``url_for``) and the
    connectors they configure (``kv_connector``)."""
    reads: dict[str, str] = {}
    for file in sorted(files):
        text = (ROOT / file).read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "vllm."
            ):
                for module in _imported_modules(node):
                    path = _module_path(module)
                    if path and not covered(path, list(USED_NOT_CHECKED)):
                        reads.setdefault(path, f"{file} imports {module}")
                if _asks_speculative_config(node):
                    for path, why in drafter_configs().items():
                        reads.setdefault(path, f"{file} asks SpeculativeConfig: {why}")
            if isinstance(node, ast.Call) and node.args:
                first = node.args[0]
                if not isinstance(first, ast.Constant) or not isinstance(
                    first.value, str
                ):
                    continue
                called = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if called == "url_for":
                    route = f"/{first.value}"
                    found = _vllm_files_serving(route)
                    assert found, f"{file} calls {route}, which vLLM serves nowhere"
                    for path in found:
                        reads.setdefault(path, f"{file} calls {route}")
                elif called == "kv_connector":
                    path = _module_path(_connector_module(first.value))
                    assert path, first.value
                    reads.setdefault(path, f"{file} configures {first.value}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                metric = re.fullmatch(r"vllm:\w+", node.value)
                if metric:
                    base = node.value
                    for suffix in METRIC_SUFFIXES:
                        base = base.removesuffix(suffix)
                    found = _vllm_files_with(f'"{base}"')
                    assert found, (
                        f"{file} reads {node.value}, which vLLM defines nowhere"
                    )
                    for path in found:
                        reads.setdefault(path, f"{file} reads {node.value}")
        if named:
            for match in NAMED_PATH.finditer(text):
                path = _vllm_path(match.group(1) or match.group(2))
                # vllm/__init__.py names the package (what a reproducer must
                # not import), not where a rule comes from.
                if path and path != "vllm/__init__.py":
                    reads.setdefault(path, f"{file} names {match.group(0)}")
    return reads


def _uncovered(step: dict, reads: dict[str, str]) -> list[str]:
    listed = step["source_file_dependencies"]
    return [
        f"{path} ({why})" for path, why in reads.items() if not covered(path, listed)
    ]


# What the issue named as missing from the 4xB200 step's triggers; the
# derivation must find each (a derivation that found nothing would pass).
SHARDED_STEP_READS = (
    "vllm/v1/metrics/",
    "vllm/v1/engine/output_processor.py",
    "vllm/entrypoints/serve/dev/cache/api_router.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
    "vllm/v1/attention/backends/mla/flashinfer_mla.py",
)


def test_sharded_step_triggers_on_what_the_harness_reads():
    """The 4xB200 step starts on a change to whatever vLLM file the suite's
    files it imports read (vllm_reads), e.g. a fix to vLLM #59392 in
    flashinfer_mla.py, which its known-failure table names."""
    step = _step(SHARDED_KEY)
    reads = vllm_reads(step_imports(step))
    for path in SHARDED_STEP_READS:
        assert any(covered(r, [path]) or r == path for r in reads), (path, reads)
    missing = _uncovered(step, reads)
    assert not missing, f"{SHARDED_KEY} misses triggers: {missing}"


def drafter_code(method: str) -> list[str]:
    """The code of a speculative method's drafter, as triggers: what vLLM's
    spec-decode folders hold under the method's name (DSpark's is
    vllm/v1/worker/gpu/spec_decode/dspark/ in 0.32.0 to 0.34.0)."""
    found = []
    for folder in sorted((VLLM_SOURCE_ROOT / "vllm").rglob("spec_decode")):
        for path in sorted(folder.glob(f"{method}*")):
            if path.stem == method:
                found.append(_vllm_path(path.relative_to(VLLM_SOURCE_ROOT).as_posix()))
    return found


def test_sharded_step_triggers_on_its_drafters():
    """The 4xB200 step starts on a change to the drafter of every
    speculative mode of the matrix, where this vLLM keeps it, and on the
    drafter configs SpeculativeConfig answers the harness from."""
    listed = _step(SHARDED_KEY)[TRIGGERS]
    methods = {mode.spec["method"] for mode in kimi.MODES.values() if mode.spec}
    assert methods, "the Kimi-K3 matrix has no speculative mode"
    for method in sorted(methods):
        code = drafter_code(method)
        assert code, f"vLLM has no spec_decode code named {method!r}"
        missing = [path for path in code if not covered(path, listed)]
        assert not missing, f"{SHARDED_KEY} misses {method}'s drafter: {missing}"
    missing = [path for path in drafter_configs() if not covered(path, listed)]
    assert not missing, f"{SHARDED_KEY} misses the drafter configs: {missing}"


def test_drafter_configs_are_what_speculative_config_imports():
    """The drafter configs read from vllm/config/speculative.py's text are
    those its imported module holds (0.34.0: SpeculatorConfig and the method
    registry from vllm/v1/worker/gpu/spec_decode/; none before)."""
    import vllm.config.speculative as speculative

    held = {
        _module_path(module)
        for value in vars(speculative).values()
        if "spec_decode" in (module := getattr(value, "__module__", None) or "")
    }
    assert held <= set(drafter_configs()), (held, drafter_configs())


def test_a_submodule_imported_by_name_is_read_as_itself():
    """``from vllm.v1.engine import output_processor`` reads that file, not
    the whole vllm/v1/engine/ package; a name that is no module reads its
    package."""
    (node,) = ast.parse(
        "from vllm.v1.engine import output_processor, EngineCoreRequest"
    ).body
    assert _imported_modules(node) == [
        "vllm.v1.engine.output_processor",
        "vllm.v1.engine",
    ]
    assert _module_path(_imported_modules(node)[0]) == (
        "vllm/v1/engine/output_processor.py"
    )


def test_routes_are_read_where_vllm_serves_them():
    """A route's trigger is the file that registers it, not one that only
    names it."""
    for route in ("/v1/completions", "/reset_prefix_cache", "/metrics"):
        serving = _vllm_files_serving(route)
        assert serving, route
        assert all(p.startswith("vllm/entrypoints/") for p in serving), serving
    naming = _vllm_files_with('"/v1/completions"', "entrypoints")
    assert _vllm_files_serving("/v1/completions") <= naming
    assert not _vllm_files_serving("/not/a/route")


# The scheduler tier: the per-PR fast signal for the Kimi matrix, on CPU.
SCHEDULER_TIER = (
    *sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests/models/hybrid_prefix_cache/scheduler").glob("*.py")
    ),
    "tests/models/hybrid_prefix_cache/test_scheduler_conformance.py",
)


def test_cpu_step_runs_the_scheduler_tier():
    """The CPU step's pytest commands select the scheduler tier's Kimi-K3
    cells (test_scheduler_conformance.py), and it collects."""
    errors: list[str] = []
    nodes = []
    for argv, here in _pytest_runs(_step(CPU_KEY)):
        nodes += collect(argv, cwd=here, errors=errors)
    tier = [n for n in nodes if "/test_scheduler_conformance.py::" in n]
    assert any("kimi" in n for n in tier), (
        f"{CPU_KEY} runs no Kimi-K3 cell of the scheduler tier: "
        + ("\n".join(errors) or "its commands do not select it")
    )


def test_cpu_step_triggers_on_what_the_scheduler_tier_checks():
    """The CPU step starts on a change to what the scheduler tier checks:
    the vLLM modules it replays the cells through, the connectors it
    configures, and what the suite's other files it imports read of vLLM
    (routes, counters, the files their rules come from; not the files the
    Kimi module's GPU failures name)."""
    step = _step(CPU_KEY)
    imported = step_imports(step) | set(SCHEDULER_TIER)
    reads = vllm_reads(imported - {f"tests/{MATRIX_MODULE}"})
    reads.update(vllm_reads({f"tests/{MATRIX_MODULE}"}, named=False))
    assert any("scheduler/engine.py imports" in why for why in reads.values())
    missing = _uncovered(step, reads)
    assert not missing, f"{CPU_KEY} misses triggers: {missing}"


# ---------------------------------------------------------------------------
# The GPU tier's step: the suite's own tiny model on one GPU, per PR.


def upstream_one_gpu_pools() -> set[str]:
    """The devices of upstream's per-PR NVIDIA steps on one GPU (every test
    area of this checkout, less our steps)."""
    pools = set()
    for area in sorted(AREA.parent.glob("*.yaml")):
        for step in yaml.safe_load(area.read_text()).get("steps") or []:
            if step.get("key") in OUR_KEYS or step.get("optional"):
                continue
            one = step.get("num_devices", 1) == 1
            if one and str(step.get("label", "")).startswith(":nvidia:"):
                pools.add(step.get("device"))
    pools.discard(None)
    return pools


def test_gpu_step_runs_per_pr_on_one_gpu_of_an_ordinary_pool():
    """Not nightly (optional) as the 4xB200 step is: one GPU of a pool that
    upstream's own per-PR one-GPU NVIDIA steps run on, one job."""
    step = _step(GPU_KEY)
    assert not step.get("optional"), f"{GPU_KEY} is optional (nightly only)"
    assert step.get("num_devices", 1) == 1, step.get("num_devices")
    pools = upstream_one_gpu_pools()
    assert step.get("device") in pools, (step.get("device"), sorted(pools))
    assert not step.get("parallelism") and not step.get("automatic_shard")


def test_gpu_step_runs_the_whole_gpu_tier():
    """Its pytest command selects every case of the tier's matrix and the
    default budget's tests, and nothing else."""
    from tests.models.hybrid_prefix_cache import gpu_binding

    errors: list[str] = []
    nodes = []
    for argv, here in _pytest_runs(_step(GPU_KEY)):
        nodes += collect(argv, cwd=here, errors=errors)
    assert not errors, errors
    assert all(node.split("::")[0].endswith(GPU_TIER_MODULE) for node in nodes)
    cases = {n.split("[", 1)[1][:-1] for n in nodes if "::test_prefix_cache[" in n}
    assert cases == set(gpu_binding.MATRIX.cases), cases ^ set(gpu_binding.MATRIX.cases)
    assert [n for n in nodes if "::test_default_budget[" in n], nodes


# The GPU tier's costs: a server start and the first one's more with a cold
# Triton cache, as dev/gpu/README.md records them on an H200 (vLLM 0.26.0);
# allowances for a test's requests on a P/D pair and on one server.
# models_basic.yaml states the arithmetic.
GPU_START, GPU_COLD_START, GPU_PD_TEST, GPU_ONE_SERVER_TEST = 50, 135, 35, 15


def test_gpu_step_timeout_covers_the_tier():
    """The step's timeout is no less than its stated arithmetic on the
    tier's matrix as it is: one start per server of each cell (a P/D pair
    counted as 2) and of each default-budget test, then every test's
    requests."""
    from tests.models.hybrid_prefix_cache import gpu_binding

    (argv,) = _pytest_commands(_step(GPU_KEY))
    nodes = collect(argv)
    matrix = gpu_binding.MATRIX
    servers = {
        (case.deployment, case.mode): (
            2 if gpu_binding.DEPLOYMENTS[case.deployment].prefill else 1
        )
        for case in matrix.cases.values()
    }
    default = len([n for n in nodes if "::test_default_budget[" in n])
    pd_tests = sum(servers[(c.deployment, c.mode)] == 2 for c in matrix.cases.values())
    one_server_tests = len(matrix.cases) - pd_tests + default
    seconds = (sum(servers.values()) + default) * GPU_START + GPU_COLD_START
    seconds += pd_tests * GPU_PD_TEST + one_server_tests * GPU_ONE_SERVER_TEST
    timeout = _step(GPU_KEY)["timeout_in_minutes"]
    assert timeout * 60 >= seconds, f"{GPU_KEY}: {timeout} min < {seconds / 60:.0f}"


def test_gpu_step_runs_the_setup_of_the_kv_connector_step():
    """How a job on vLLM's CUDA image gets the KV connectors is upstream's to
    say: the GPU step runs the 4xB200 step's setup as merged (0.34.0:
    check-kv-connectors.sh, which verifies what the image has baked in;
    before, install-kv-connectors.sh), and installs nothing where the
    checkout verifies."""
    merged = _step(GPU_KEY)["commands"]
    assert setup(merged), merged
    assert setup(merged) == setup(_step(SHARDED_KEY)["commands"])
    if (ROOT / CHECK_SCRIPT).is_file():
        assert CHECK_SCRIPT in scripts(merged), merged
        assert INSTALL_SCRIPT not in " ".join(merged), merged


# What the GPU tier configures that the derivation must find among its reads
# (a derivation that found nothing would pass).
GPU_STEP_READS = (
    "vllm/distributed/kv_transfer/kv_connector/v1/nixl/",
    "vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
)


def test_gpu_step_triggers_on_what_the_tier_reads():
    """The GPU step starts on a change to whatever vLLM file the suite's
    files it imports read (vllm_reads): the connectors it configures, the
    routes it calls, the counters it reads, the files its rules and known
    failures name."""
    step = _step(GPU_KEY)
    reads = vllm_reads(step_imports(step))
    for path in GPU_STEP_READS:
        assert path in reads, (path, sorted(reads))
    missing = _uncovered(step, reads)
    assert not missing, f"{GPU_KEY} misses triggers: {missing}"


def served_model_files() -> dict[str, str]:
    """The vLLM files that serve the GPU tier's model, as triggers: the
    model files of its architecture and of its MTP drafter's (as vLLM's
    registry maps them; SpeculativeConfig names the drafter's), and the
    Mamba layers they import."""
    from transformers import AutoConfig

    from tests.models.hybrid_prefix_cache import tiny_hybrid
    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.models.registry import _VLLM_MODELS

    def config():
        values = dict(tiny_hybrid._config("mtp"))
        return AutoConfig.for_model(values.pop("model_type"), **values)

    target = config().architectures
    draft = SpeculativeConfig.hf_config_override(config()).architectures
    found: dict[str, str] = {}
    for architecture in [*target, *draft]:
        module = _VLLM_MODELS[architecture][0]
        path = _module_path(f"vllm.model_executor.models.{module}")
        assert path, (architecture, module)
        found[path] = f"vLLM serves {architecture} from it"
    for path in list(found):
        tree = ast.parse((VLLM_SOURCE_ROOT / path).read_text())
        for node in ast.walk(tree):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if module.startswith("vllm.model_executor.layers.mamba"):
                for name in _imported_modules(node):
                    if layer := _module_path(name):
                        found.setdefault(layer, f"{path} imports {name}")
    return found


def test_gpu_step_triggers_on_its_model_and_drafter():
    """The GPU step starts on a change to the files that serve its model
    (qwen3_next.py, qwen3_next_mtp.py and the Mamba layers they use), to
    the MTP drafter's code in every spec_decode folder vLLM keeps one (the
    model runner's vllm/v1/spec_decode/, and vllm/v1/worker/gpu/spec_decode/
    where the release has it), and to the drafter configs SpeculativeConfig
    answers the harness from."""
    from tests.models.hybrid_prefix_cache import gpu_binding

    listed = _step(GPU_KEY)[TRIGGERS]
    model = served_model_files()
    assert any(p.endswith("_mtp.py") for p in model), model
    missing = [f"{p} ({why})" for p, why in model.items() if not covered(p, listed)]
    assert not missing, f"{GPU_KEY} misses its model's files: {missing}"
    methods = {mode.spec["method"] for mode in gpu_binding.MODES.values() if mode.spec}
    assert methods == {"mtp"}, methods
    folders = [
        _vllm_path(folder.relative_to(VLLM_SOURCE_ROOT).as_posix())
        for folder in sorted((VLLM_SOURCE_ROOT / "vllm" / "v1").rglob("spec_decode"))
    ]
    assert folders, "vLLM has no spec_decode folder"
    drafters = [*drafter_code("mtp"), *folders, *drafter_configs()]
    missing = [path for path in drafters if not covered(path, listed)]
    assert not missing, f"{GPU_KEY} misses the MTP drafter: {missing}"


def _requirements_pin(name: str) -> str:
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        if line.replace(" ", "").startswith("nixl=="):
            return line.replace(" ", "").split("==", 1)[1]
    raise AssertionError(f"requirements/{name} pins no nixl")


def _script_setting(name: str) -> str:
    """A NAME=value setting of the install script."""
    (value,) = re.findall(rf"^{name}=(\S+)$", SCRIPT.read_text(), re.MULTILINE)
    return value


# A python3 for the script's dry runs: it answers the platform probe with
# $STUB_PROBE and runs every other script it is given with this interpreter;
# with $STUB_SITE, one that sees only the distributions installed there (no
# site-packages), so that what the script reads as installed is the test's.
STUB_PROBING_PYTHON = """#!{python}
import os
import subprocess
import sys

script = sys.stdin.read()
if "torch.version.hip" in script:
    print(os.environ["STUB_PROBE"])
    sys.exit(0)
argv, env = [{python!r}, *sys.argv[1:]], dict(os.environ)
if os.environ.get("STUB_SITE"):
    argv.insert(1, "-S")
    env["PYTHONPATH"] = os.environ["STUB_SITE"]
run = subprocess.run(argv, input=script, text=True, env=env)
sys.exit(run.returncode)
"""


def dry_run(
    tmp_path: Path,
    probe: str,
    requirements: Path | None = None,
    site: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run the install script in its dry-run mode on a platform that the
    stub python3 reports as ``probe``, with the distributions of ``site``
    alone installed, if given. Its temporary files go to tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(parents=True)
    env = {
        "KV_CONNECTORS_DRY_RUN": "1",
        "TMPDIR": str(tmp_path / "tmp"),
        "STUB_PROBE": probe,
        "STUB_SITE": str(site or ""),
    }
    if requirements is not None:
        env["KV_CONNECTORS_REQUIREMENTS"] = str(requirements)
    stubs = {"python3": STUB_PROBING_PYTHON.format(python=sys.executable)}
    return run_script(tmp_path, stubs, env)


def run_script(
    tmp_path: Path, stubs: dict[str, str], env: dict[str, str]
) -> subprocess.CompletedProcess:
    """Run the install script with ``stubs`` (name: text) first on PATH,
    HOME in tmp_path and ``env`` beside them."""
    stub = tmp_path / "bin"
    stub.mkdir(parents=True)
    for name, text in stubs.items():
        (stub / name).write_text(text)
        (stub / name).chmod(0o755)
    path = os.pathsep.join([str(stub), "/usr/bin", "/bin"])
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={"PATH": path, "HOME": str(tmp_path), **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def read_jsonl(log: Path) -> list:
    """The JSON lines a stub logged, none where it never ran."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


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


def _installs(commands: list[list[str]]) -> list[list[str]]:
    return [c for c in commands if "install" in c and "uninstall" not in c]


def _locked_packages(command: list[str]) -> dict[str, str]:
    """The NAME==VERSION arguments of an install command, which must install
    those alone: --no-deps, no requirements file, no range."""
    assert "--no-deps" in command, f"resolves dependencies: {command}"
    assert "-r" not in command and "-c" not in command, command
    packages = command[command.index("--no-deps") + 1 :]
    assert packages, command
    for package in packages:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", package), package
    return dict(package.split("==") for package in packages)


# vLLM's KV connector lock (0.34.0 on), and the input it is compiled from.
KV_LOCK = ROOT / "requirements/test/kv_connectors_cuda.txt"


def _without_kv_lock() -> None:
    if KV_LOCK.is_file():
        pytest.skip(
            f"this checkout has vLLM's KV connector lock ({KV_LOCK.name}), which "
            "the script installs instead (test_install_script_installs_the_lock)"
        )


MOONCAKE_CASES = [
    # (CUDA major, its requirements, its Mooncake build, the other build)
    ("12", "kv_connectors_cu12.txt", MOONCAKE_CU12, MOONCAKE_CU13),
    ("13", "kv_connectors.txt", MOONCAKE_CU13, MOONCAKE_CU12),
]


@pytest.mark.parametrize(
    ("major", "requirements", "build", "other"), MOONCAKE_CASES, ids=("cu12", "cu13")
)
def test_install_script_installs_locked_versions_on_cuda(
    tmp_path, major, requirements, build, other
):
    """Without vLLM's KV connector lock: exactly NIXL at the requirements'
    pin in this CUDA major's variant, and this major's Mooncake build at the
    script's lock (within the requirements' range), each --no-deps; the
    requirements' unlocked rest, which upstream's own steps use, is named as
    not locked and installed last, apart, with torch held."""
    _without_kv_lock()
    result = dry_run(tmp_path, f"cuda {major}")
    assert result.returncode == 0, result.stderr
    commands = _commands(result)
    *locked, rest = _installs(commands)
    installed = {}
    for command in locked:
        installed.update(_locked_packages(command))
    assert "-r" in rest and "-c" in rest and "--no-deps" not in rest, rest
    pin, mooncake = _requirements_pin(requirements), _script_setting("MOONCAKE_VERSION")
    assert installed == {"nixl": pin, f"nixl-cu{major}": pin, build: mooncake}
    assert _requires(requirements, MOONCAKE_CU12)
    assert f"Mooncake for CUDA {major}: {build}\n" in result.stdout, result.stdout
    uninstalls = [c for c in commands if "uninstall" in c]
    other_nixl = "13" if major == "12" else "12"
    assert any(_names(c, f"nixl-cu{other_nixl}") for c in uninstalls), uninstalls
    # Both builds go (they share files) before this one is installed.
    (removal,) = [c for c in uninstalls if _names(c, build) or _names(c, other)]
    assert _names(removal, build) and _names(removal, other), removal
    (install,) = [c for c in _installs(commands) if _names(c, build)]
    assert _index(commands, removal) < _index(commands, install)
    assert "lmcache" in result.stdout.split("not locked (no lock in vLLM")[1], (
        result.stdout
    )


def test_install_script_keeps_mooncake_within_the_requirements(tmp_path):
    """A requirements range that excludes the locked Mooncake fails the
    script, which names both."""
    requirements = tmp_path / "kv.txt"
    requirements.write_text(f"nixl == 1.5.0\n{MOONCAKE_CU12} >= 99\n")
    result = dry_run(tmp_path / "run", "cuda 13", requirements)
    assert result.returncode == 1
    locked = _script_setting("MOONCAKE_VERSION")
    assert f"outside the locked Mooncake {locked}" in result.stderr, result.stderr


def test_install_script_installs_locked_versions_on_cpu(tmp_path):
    result = dry_run(tmp_path, "cpu -")
    assert result.returncode == 0, result.stderr
    (install,) = _installs(_commands(result))
    version = _script_setting("CPU_NIXL_VERSION")
    assert _locked_packages(install) == {"nixl": version, "nixl-cu12": version}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _rocm_lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements/test/rocm.txt").read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, version = line.split("==", 1)
            pins[_canonical(name)] = version.strip()
    return pins


def test_install_script_installs_locked_versions_on_rocm(tmp_path):
    """The ROCm requirements at the versions of vLLM's ROCm test lock; a
    package the lock does not pin fails the script. Where vLLM has no ROCm
    KV connector requirements (0.34.0: its image holds them from the ROCm
    test lock), nothing is installed."""
    result = dry_run(tmp_path, "rocm -")
    assert result.returncode == 0, result.stderr
    if (ROOT / "requirements/kv_connectors_rocm.txt").is_file():
        (install,) = _installs(_commands(result))
        lock = _rocm_lock()
        names = [
            _canonical(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0])
            for line in (ROOT / "requirements/kv_connectors_rocm.txt")
            .read_text()
            .splitlines()
            if line.strip() and not line.startswith(("#", "-"))
        ]
        assert _locked_packages(install) == {name: lock[name] for name in names}
    else:
        assert not _installs(_commands(result)), result.stdout
        assert "nothing to install" in result.stdout, result.stdout
    requirements = tmp_path / "rocm.txt"
    requirements.write_text("tblib\nnot-a-package-the-lock-pins\n")
    unlocked = dry_run(tmp_path / "unlocked", "rocm -", requirements)
    assert unlocked.returncode == 1
    assert "not-a-package-the-lock-pins: no version in" in unlocked.stderr


def test_install_script_rejects_an_unknown_cuda(tmp_path):
    cuda11 = dry_run(tmp_path, "cuda 11")
    assert cuda11.returncode == 1
    assert "no NIXL wheel variant for CUDA 11" in cuda11.stderr


def lock_entries(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """A hash lock's entries, as pip reads them: {name: (version, hashes)}
    (``uv pip compile --generate-hashes`` output: ``NAME==VERSION \\`` and
    the ``--hash=`` lines under it)."""
    entries: dict[str, tuple[str, frozenset[str]]] = {}
    name = None
    for line in text.splitlines():
        match = re.match(r"([A-Za-z0-9][\w.-]*)==([^\s;\\]+)", line)
        if match:
            name = _canonical(match.group(1))
            assert name not in entries, f"{name} twice"
            entries[name] = (match.group(2), frozenset())
        elif name and line[:1].isspace():
            version, hashes = entries[name]
            entries[name] = (version, hashes | set(re.findall(r"--hash=(\S+)", line)))
        else:
            name = None
    return entries


def _lock_install(result: subprocess.CompletedProcess) -> str:
    """The text a dry run installs a lock from: its only install command
    must be hash-checked, --no-deps, from one file."""
    (install,) = _installs(_commands(result))
    assert "--require-hashes" in install and "--no-deps" in install, install
    at = install.index("-r")
    assert [a for a in install[at + 2 :] if not a.startswith("-")] == [], install
    flags = install[install.index("install") + 1 : at]
    assert not [f for f in flags if not f.startswith("-") or "=" in f], flags
    return Path(install[at + 1]).read_text()


def test_install_script_installs_the_lock(tmp_path):
    """Where the checkout has vLLM's KV connector lock (0.34.0 on), CUDA 13
    gets exactly it: into an environment that has none of it, every entry
    with its version and every hash, installed hash-checked and --no-deps
    from one file, and nothing else (no pin of the script's own, nothing
    unlocked); NIXL and Mooncake are then checked at the lock's versions."""
    if not KV_LOCK.is_file():
        pytest.skip(f"this checkout has no {KV_LOCK.name} (vLLM before 0.34.0)")
    site = tmp_path / "site"
    site.mkdir()
    result = dry_run(tmp_path / "run", "cuda 13", site=site)
    assert result.returncode == 0, result.stderr
    commands = _commands(result)
    assert not [c for c in commands if "uninstall" in c], commands
    lock = lock_entries(KV_LOCK.read_text())
    assert lock and all(hashes for _, hashes in lock.values()), "not a hash lock"
    assert lock_entries(_lock_install(result)) == lock
    assert f"Mooncake for CUDA 13: {MOONCAKE_CU13}\n" in result.stdout
    assert "not locked" not in result.stdout, result.stdout
    # On CUDA 12 the lock (CUDA 13's, as vLLM bakes it) is refused.
    cuda12 = dry_run(tmp_path / "cuda12", "cuda 12", site=site)
    assert cuda12.returncode == 1
    assert "locks the KV connectors for CUDA 13" in cuda12.stderr, cuda12.stderr


def _installed(site: Path, name: str, version: str) -> None:
    """Make ``name`` ``version`` an installed distribution of ``site``."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )


def _fake_lock(folder: Path, entries: dict[str, str], owned: list[str]) -> Path:
    """A hash lock of ``entries`` ({name: version}) compiled from an input
    naming ``owned``, as vLLM keeps kv_connectors_cuda.txt beside its .in."""
    folder.mkdir(parents=True)
    lock = folder / "kv_connectors_cuda.txt"
    lock.write_text(
        "# a lock as uv pip compile writes one\n"
        + "".join(
            f"{name}=={version} \\\n"
            f"    --hash=sha256:{name.encode().hex():0<64} \\\n"
            f"    --hash=sha256:{version.encode().hex():1<64}\n"
            "    # via -r kv_connectors_cuda.in\n"
            for name, version in entries.items()
        )
    )
    lock.with_suffix(".in").write_text("".join(f"{n}\n" for n in owned))
    return lock


def test_install_script_installs_a_lock_over_what_is_installed(tmp_path):
    """A lock over an environment that has some of it: what is missing is
    installed, a package of the lock's input at another version is replaced,
    any other package at another version is left and named (the
    environment's, as vLLM's image leaves it), one at the lock's version is
    not touched; the other CUDA major's NIXL and Mooncake builds go first,
    and with the other Mooncake build, this one's (they share files)."""
    owned = ["nixl", "nixl-cu13", MOONCAKE_CU13]
    entries = {"nixl": "2.0", "nixl-cu13": "2.0", MOONCAKE_CU13: "1.0"}
    entries |= {"dep-kept": "1.0", "dep-same": "1.0", "dep-missing": "1.0"}
    lock = _fake_lock(tmp_path / "lock", entries, owned)
    site = tmp_path / "site"
    for name, version in (
        ("nixl", "1.9"),  # owned, another version: replaced
        ("nixl-cu13", "2.0"),  # at the lock's version
        ("nixl-cu12", "1.9"),  # the other variant
        (MOONCAKE_CU12, "0.9"),  # the other build
        (MOONCAKE_CU13, "1.0"),  # shares the other build's files
        ("dep-kept", "0.5"),
        ("dep-same", "1.0"),
    ):
        _installed(site, name, version)
    result = dry_run(tmp_path / "run", "cuda 13", lock, site)
    assert result.returncode == 0, result.stderr
    commands = _commands(result)
    (removal,) = [c for c in commands if "uninstall" in c]
    for build in ("nixl-cu12", MOONCAKE_CU12, MOONCAKE_CU13):
        assert _names(removal, build), removal
    assert not _names(removal, "nixl") and not _names(removal, "nixl-cu13")
    (install,) = _installs(commands)
    assert _index(commands, removal) < _index(commands, install)
    full = lock_entries(lock.read_text())
    planned = lock_entries(_lock_install(result))
    assert planned == {n: full[n] for n in ("nixl", MOONCAKE_CU13, "dep-missing")}
    assert "  dep-kept 0.5 (the lock's: 1.0)\n" in result.stdout, result.stdout

    # A lock entry without a hash, or one for another CUDA major, is refused.
    (lock.parent / "bare").mkdir()
    bare = lock.parent / "bare" / lock.name
    bare.write_text(lock.read_text() + "unhashed==1.0 \\\n    # via x\n")
    refused = dry_run(tmp_path / "bare", "cuda 13", bare, site)
    assert refused.returncode == 1
    assert "unhashed==1.0 has no --hash" in refused.stderr, refused.stderr
    cuda12 = dry_run(tmp_path / "cuda12", "cuda 12", lock, site)
    assert cuda12.returncode == 1
    assert "locks the KV connectors for CUDA 13" in cuda12.stderr, cuda12.stderr


# Stubs for a real (not dry) run: python3 and uv that record what they are
# asked to do. python3 answers the platform probe and fails the script it is
# given when that holds the marker in $STUB_FAIL_ON.
STUB_PYTHON = """#!{python}
import json
import os
import sys

script = "" if sys.stdin.isatty() else sys.stdin.read()
with open({log!r}, "a") as log:
    print(json.dumps({{"argv": sys.argv[1:], "script": script}}), file=log)
if "torch.version.hip" in script:
    print({probe!r})
elif os.environ.get("STUB_FAIL_ON") and os.environ["STUB_FAIL_ON"] in script:
    sys.exit(1)
"""
STUB_UV = """#!{python}
import json
import sys

with open({log!r}, "a") as log:
    print(json.dumps(sys.argv[1:]), file=log)
"""


def stubbed_run(
    tmp_path: Path, probe: str, fail_on: str = ""
) -> tuple[subprocess.CompletedProcess, list[dict], list[list[str]]]:
    """Run the install script for real against the stubs: its result, what
    python3 was asked to run, and the uv commands."""
    python_log, uv_log = tmp_path / "python3.jsonl", tmp_path / "uv.jsonl"
    stubs = {
        "python3": STUB_PYTHON.format(
            python=sys.executable, log=str(python_log), probe=probe
        ),
        "uv": STUB_UV.format(python=sys.executable, log=str(uv_log)),
    }
    result = run_script(tmp_path, stubs, {"STUB_FAIL_ON": fail_on})
    return result, read_jsonl(python_log), read_jsonl(uv_log)


@pytest.mark.parametrize(
    ("major", "requirements", "build", "other"), MOONCAKE_CASES, ids=("cu12", "cu13")
)
def test_install_script_checks_mooncake_on_cuda(
    tmp_path, major, requirements, build, other
):
    """A real run installs this major's build at its lock and then makes
    python3 load its engine and store, with that build at that version named
    as the only one allowed."""
    _without_kv_lock()
    result, python_calls, uv_calls = stubbed_run(tmp_path, f"cuda {major}")
    assert result.returncode == 0, result.stderr
    installs = [c for c in uv_calls if c[:2] == ["pip", "install"]]
    locked = _script_setting("MOONCAKE_VERSION")
    assert [c[-1] for c in installs if _names(c, build)] == [f"{build}=={locked}"]
    checks = [c for c in python_calls if "mooncake.engine" in c["script"]]
    assert len(checks) == 1, f"python3 was asked to load Mooncake {len(checks)} times"
    (check,) = checks
    assert check["argv"] == ["-", build, locked, MOONCAKE_CU12, MOONCAKE_CU13]
    for line in ("from mooncake.engine import", "from mooncake.store import"):
        assert line in check["script"]
    assert 'shutil.which("mooncake_master")' in check["script"]
    # NIXL is checked first, at the requirements' pin, and the Mooncake
    # check is the last call.
    assert python_calls[-1] is check
    assert "import nixl" in python_calls[-2]["script"]
    assert python_calls[-2]["argv"] == ["-", _requirements_pin(requirements)]

    failed, _, _ = stubbed_run(tmp_path / "fails", f"cuda {major}", "mooncake")
    assert failed.returncode == 1
    assert f"Mooncake ({build}) is not installed alone" in failed.stderr


def test_install_script_leaves_mooncake_off_cpu(tmp_path):
    """On CPU a real run installs and checks NIXL alone, at its lock."""
    result, python_calls, uv_calls = stubbed_run(tmp_path, "cpu -")
    assert result.returncode == 0, result.stderr
    assert uv_calls and python_calls
    assert not [c for c in uv_calls if "mooncake" in " ".join(c)], uv_calls
    assert not [c for c in python_calls if "mooncake" in json.dumps(c)]
    assert "import nixl" in python_calls[-1]["script"]
    assert python_calls[-1]["argv"] == ["-", _script_setting("CPU_NIXL_VERSION")]


def _site_run(
    tmp_path: Path, probe: str, lock: Path, site: Path
) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run the install script for real with ``lock``, python3 seeing the
    distributions of ``site`` alone and uv recording what it is asked: the
    result and the uv commands."""
    uv_log = tmp_path / "uv.jsonl"
    stubs = {
        "python3": STUB_PROBING_PYTHON.format(python=sys.executable),
        "uv": STUB_UV.format(python=sys.executable, log=str(uv_log)),
        "mooncake_master": "#!/bin/sh\n",
    }
    env = {
        "TMPDIR": str(tmp_path),
        "STUB_PROBE": probe,
        "STUB_SITE": str(site),
        "KV_CONNECTORS_REQUIREMENTS": str(lock),
    }
    return run_script(tmp_path, stubs, env), read_jsonl(uv_log)


def test_install_script_checks_the_lock_after_installing(tmp_path):
    """A real run installs a lock and then holds the environment to it: a
    package of the lock's input that the install did not bring to its
    version fails the run, naming it; where everything is as locked, nothing
    is installed, and NIXL and the lock's Mooncake build must import, at the
    lock's versions."""
    owned = ["nixl", "nixl-cu13", MOONCAKE_CU13]
    entries = {"nixl": "2.0", "nixl-cu13": "2.0", MOONCAKE_CU13: "1.0", "dep": "1"}
    lock = _fake_lock(tmp_path / "lock", entries, owned)
    site = tmp_path / "site"
    for name, version in entries.items():
        _installed(site, name, version)
    for module in ("nixl/__init__", "mooncake/__init__"):
        (site / f"{module}.py").parent.mkdir(parents=True, exist_ok=True)
        (site / f"{module}.py").write_text("")
    (site / "mooncake/engine.py").write_text("TransferEngine = object\n")
    (site / "mooncake/store.py").write_text("MooncakeDistributedStore = object\n")
    result, uv_calls = _site_run(tmp_path / "as-locked", "cuda 13", lock, site)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not [c for c in uv_calls if "install" in c], uv_calls
    assert f"{MOONCAKE_CU13} 1.0\n" in result.stdout, result.stdout
    assert "nixl-cu13 2.0\n" in result.stdout, result.stdout

    # The stub uv installs nothing: nixl stays at 1.9.
    for old in site.glob("nixl-2.0.dist-info"):
        shutil.rmtree(old)
    _installed(site, "nixl", "1.9")
    result, uv_calls = _site_run(tmp_path / "not-taken", "cuda 13", lock, site)
    assert result.returncode == 1, result.stdout
    assert [c for c in uv_calls if "--require-hashes" in c], uv_calls
    assert f"not as {lock} locks them: nixl\n" in result.stderr, result.stderr


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

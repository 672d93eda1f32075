# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-cache suite's steps in ``.buildkite/test_areas/models_basic.yaml``,
checked against this vLLM checkout: unique keys, paths that exist, and
triggers on every file of the suite a step imports and every script it runs.
The other ``test_prefix_cache_ci_*.py`` modules check the rest of the CI
files."""

import contextlib
import shlex

import pytest
from prefix_cache_ci_area import (
    HARNESS,
    MATRIX_MODULE,
    OUR_KEYS,
    ROOT,
    SINGLE_GPU_KEY,
    SUITE_FOLDERS,
    TESTS,
    TRIGGERS,
    VLLM_SOURCE_ROOT,
    _pytest_commands,
    _pytest_runs,
    _step,
    _steps,
    _unsharded,
    covered,
    in_matrix,
    scripts,
)
from prefix_cache_ci_collect import (
    _COLLECTORS,
    _start,
    collect,
    step_imports,
)

# No distributed state or device in-process: skip vLLM's global cleanup.
pytestmark = pytest.mark.skip_global_cleanup


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


# Session-scoped: the other test_prefix_cache_ci_*.py modules share the
# collections, and so the queue, until the session ends.
@pytest.fixture(scope="session", autouse=True)
def _start_collections(request):
    """Queue the collections of the steps whose coverage test this run
    selected (in a full run every step that collects from the suite's
    folders, whose collections most other CI tests ask for)."""
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


def test_single_gpu_step_collects_no_matrix_case():
    argv = _pytest_commands(_step(SINGLE_GPU_KEY))[0]
    nodes = collect(argv)
    assert nodes, "the single-GPU Kimi K3 step collects nothing"
    assert not [n for n in nodes if in_matrix(n)]

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The 4xB200 and CPU steps trigger on what the suite's files they import
read of vLLM (``prefix_cache_ci_reads.vllm_reads``), the drafters included."""

import ast

import pytest
from prefix_cache_ci_area import (
    BINDING_MODULE,
    CPU_KEY,
    MATRIX_MODULE,
    ROOT,
    SHARDED_KEY,
    TRIGGERS,
    _pytest_runs,
    _step,
    covered,
)
from prefix_cache_ci_collect import collect, step_imports
from prefix_cache_ci_reads import (
    _imported_modules,
    _module_path,
    _uncovered,
    _vllm_files_serving,
    _vllm_files_with,
    drafter_code,
    drafter_configs,
    vllm_reads,
)

from tests.models.kimi_k3 import prefix_cache_binding as kimi

# No distributed state or device in-process: skip vLLM's global cleanup.
pytestmark = pytest.mark.skip_global_cleanup


# The missing 4xB200 triggers, which the derivation must find.
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
    "tests/models/kimi_k3/prefix_cache_replay.py",
    "tests/models/kimi_k3/test_prefix_cache_scheduler.py",
)


def test_cpu_step_runs_the_scheduler_tier():
    """The CPU step's pytest commands select the scheduler tier's Kimi-K3
    cells (test_prefix_cache_scheduler.py), and it collects."""
    errors: list[str] = []
    nodes = []
    for argv, here in _pytest_runs(_step(CPU_KEY)):
        nodes += collect(argv, cwd=here, errors=errors)
    tier = [n for n in nodes if "/test_prefix_cache_scheduler.py::test_kimi_cell" in n]
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
    kimi = {f"tests/{MATRIX_MODULE}", f"tests/{BINDING_MODULE}"}
    reads = vllm_reads(imported - kimi)
    reads.update(vllm_reads(kimi, named=False))
    assert any("scheduler/engine.py imports" in why for why in reads.values())
    missing = _uncovered(step, reads)
    assert not missing, f"{CPU_KEY} misses triggers: {missing}"

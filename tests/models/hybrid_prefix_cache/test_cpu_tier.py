# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tier of the hybrid prefix-cache suite.

Serves a tiny Qwen3-Next model (three Gated DeltaNet layers, one attention
layer) that the suite writes itself, on vLLM's CPU backend, and runs the
shared harness against it: the same deployment x mode table as the Kimi-K3
matrix, so the two tiers read alike. Every cell either passes, fails as a
known vLLM bug (it runs and must fail with the listed evidence; a fix shows
as a strict XPASS failure), or is refused by the CPU backend (the refusal
must show the listed evidence; the cell then skips). A failure that several
cells share is confirmed once (cpu_known.py).

The plain deployment also sweeps the first prompt's tail past the last hit
unit and plays those conversations concurrently, on servers of one OpenMP
thread, where each batched hit must equal its recompute alone bit for bit.
"""

import pytest

from tests.models.hybrid_prefix_cache.cpu_binding import (
    CPU_ONLY,
    check_geometry,
    cpu_binding,
    eviction_plan,
    resolved_budget,
    resolved_units,
)
from tests.models.hybrid_prefix_cache.cpu_known import (
    MATRIX,
    confirm_at_config,
    core_shortage,
)
from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    Suite,
    run_case,
    run_workload,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid

pytestmark = CPU_ONLY

# The geometry that the scheduler tier resolves in-process for this model
# must be what a real server reports; held on the reference case of each mode
# of the plain deployment.
GEOMETRY_CHECKED = ("plain-block", "plain-partial")


@pytest.fixture(scope="module")
def binding(tmp_path_factory) -> Binding:
    return cpu_binding(write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid")))


@pytest.mark.parametrize("case_id", MATRIX.params(skip=core_shortage))
def test_prefix_cache(hybrid_suite: Suite, binding: Binding, case_id: str) -> None:
    case, known = MATRIX.cases[case_id], MATRIX.known_for(case_id)
    deployment, mode = MATRIX.served(case_id)
    for entry in known:
        if entry.confirmed_by is not None:
            # The outcome its confirming case has: xfail for a bug, skip for
            # a refusal.
            outcome = pytest.xfail if entry.kind == "xfail" else pytest.skip
            outcome(f"{entry.reason} (as in {entry.confirmed_by}, which confirms it)")
        if entry.at_config:
            confirm_at_config(binding, case_id, entry)
    if case.workload is not None:
        # The abort's prompt takes two prefill steps of the servers' budget.
        budget = eviction = None
        if case.workload == "abort-retry":
            budget = resolved_budget(binding, deployment, mode)
        # The pool and pressure, replayed first by vLLM's scheduler.
        if case.workload == "eviction":
            eviction = eviction_plan(binding, deployment, mode, case_id)
        record = run_workload(
            hybrid_suite,
            case_id,
            binding,
            deployment,
            mode,
            case.workload,
            known,
            budget=budget,
            eviction=eviction,
        )
        assert record.ok, record.explain()
        return
    shapes: tuple[str, ...] = (case.shape,) if case.shape else ()
    if case.concurrent:
        units = resolved_units(binding, mode)
        shapes = MATRIX.concurrent_shapes(case_id, units)
        if not shapes:
            pytest.skip(f"every sweep shape of {case.cell} fails alone at {units}")
    record = run_case(
        hybrid_suite,
        case_id,
        binding,
        deployment,
        mode,
        shapes=shapes,
        concurrent=case.concurrent,
        known=known,
    )
    assert record.ok, record.explain()
    if case_id in GEOMETRY_CHECKED:
        check_geometry(binding, mode, record)

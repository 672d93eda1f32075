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
unit and plays those conversations concurrently.
"""

import pytest

from tests.models.hybrid_prefix_cache.cpu_binding import (
    CPU_ONLY,
    DEPLOYMENTS,
    MODES,
    check_geometry,
    cpu_binding,
    resolved_units,
)
from tests.models.hybrid_prefix_cache.cpu_known import (
    CASES,
    concurrent_shapes,
    confirm_at_config,
    core_shortage,
    known_entries,
)
from tests.models.hybrid_prefix_cache.harness import Binding, expect_known, run_case
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid

pytestmark = CPU_ONLY

# The geometry that the scheduler tier resolves in-process for this model
# must be what a real server reports; held on the reference case of each mode
# of the plain deployment.
GEOMETRY_CHECKED = ("plain-block", "plain-partial")


def _params() -> list:
    params = []
    for case_id in CASES:
        shortage = core_shortage(case_id)
        marks = [pytest.mark.skip(reason=shortage)] if shortage else []
        params.append(pytest.param(case_id, id=case_id, marks=marks))
    return params


@pytest.fixture(scope="module")
def binding(tmp_path_factory) -> Binding:
    return cpu_binding(write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid")))


@pytest.mark.parametrize("case_id", _params())
def test_prefix_cache(binding: Binding, case_id: str) -> None:
    case = CASES[case_id]
    known = known_entries(case_id)
    for entry in known:
        if entry.confirmed_by is not None:
            # The outcome its confirming case has: xfail for a bug, skip for
            # a refusal.
            outcome = pytest.xfail if entry.kind == "xfail" else pytest.skip
            outcome(f"{entry.reason} (as in {entry.confirmed_by}, which confirms it)")
        if entry.at_config:
            confirm_at_config(binding, case, entry)
    shapes: tuple[str, ...] = (case.shape,) if case.shape else ()
    if case.concurrent:
        units = resolved_units(binding, MODES[case.mode])
        shapes = concurrent_shapes(case, units)
        if not shapes:
            pytest.skip(f"every sweep shape of {case.cell} fails alone at {units}")
    with expect_known(case_id, known) as run:
        run.record = run_case(
            case_id,
            binding,
            DEPLOYMENTS[case.deployment],
            MODES[case.mode],
            shapes=shapes,
            concurrent=case.concurrent,
        )
    if case_id in GEOMETRY_CHECKED:
        check_geometry(binding, MODES[case.mode], run.record)

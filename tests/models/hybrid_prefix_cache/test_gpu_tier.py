# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tier: the suite's tiny Qwen3-Next with MTP on one CUDA GPU, plain,
offload and P/D, block and partial, with MTP drafts. A one-block budget makes
block-boundary hits exact (rules.exact_budget); two cases keep the default
budget under check_logprobs_close. Skips without CUDA vLLM."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache.gpu_binding import (
    DEPLOYMENTS,
    GPU_ONLY,
    MATRIX,
    MODES,
    gpu_binding,
    served,
    served_mode,
)
from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    Suite,
    Units,
    WorkloadRun,
    cache_config,
    run_case,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid, write_tiny_hybrid

pytestmark = GPU_ONLY


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> TinyHybrid:
    return write_tiny_hybrid(tmp_path_factory.mktemp("tiny-mtp"), "mtp")


# shares the geometry read with dev/gpu/run_tier.sh's sibling sessions
UNITS_FILE_ENV = "HYBRID_PC_GPU_UNITS_FILE"


@pytest.fixture(scope="module")
def units(hybrid_suite: Suite, model: TinyHybrid) -> Units:
    """The geometry the plain default-budget server reports, or a sibling
    session's from UNITS_FILE_ENV."""
    shared = os.environ.get(UNITS_FILE_ENV)
    if shared and Path(shared).exists():
        return Units(**json.loads(Path(shared).read_text()))
    binding = gpu_binding(model, exact=False)
    (server,) = hybrid_suite.pool.acquire(binding, DEPLOYMENTS["plain"], MODES["block"])
    units = Units.from_cache_config(cache_config(server), MODES["block"])
    if shared:
        Path(shared).write_text(json.dumps(dataclasses.asdict(units)))
    return units


@pytest.mark.parametrize("mode_name", ["block", "partial"])
def test_default_budget(
    hybrid_suite: Suite, model: TinyHybrid, units: Units, mode_name: str
) -> None:
    """The default budget chunks a hit and its recompute apart: only
    check_logprobs_close holds them, as upstream does."""
    binding = gpu_binding(model, exact=False)
    mode = served_mode(MODES[mode_name], units)
    case_id = f"plain-{mode_name}-default-budget"
    run = WorkloadRun(hybrid_suite, case_id, binding, DEPLOYMENTS["plain"], mode)
    record = run_case(run)
    assert record.ok, record.explain()


@pytest.fixture(scope="module")
def binding(model: TinyHybrid) -> Binding:
    return gpu_binding(model)


@pytest.mark.parametrize("case_id", MATRIX.params())
def test_prefix_cache(
    hybrid_suite: Suite, binding: Binding, units: Units, case_id: str
) -> None:
    run = WorkloadRun(hybrid_suite, case_id, *served(case_id, units, binding))
    record = MATRIX.run(run)
    assert record.ok, record.explain()

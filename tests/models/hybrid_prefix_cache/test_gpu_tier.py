# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU tier of the hybrid prefix-cache suite: the tiny Qwen3-Next model that
the suite writes itself (with its MTP layer), served by CUDA vLLM on one GPU,
through the shared harness: plain, CPU offload, and P/D over NIXL with both
instances on the one GPU, with and without offload; block and partial mode,
each with MTP drafts.

Exact by construction: the servers schedule a prefill budget of one block
(rules.exact_budget of the geometry a first server reports), so that a hit
on a block boundary and its recompute are cut into the same chunks and must
agree bit for bit; a hit that resumes inside a block is held to the noise
its case measures on cold decode-against-prefill pairs. Two cases measure
what the default budget gives instead, under check_logprobs_close.

Runs with plain ``pytest -v -s`` wherever CUDA vLLM is installed; skips
elsewhere with its reason. dev/gpu/ runs it on a machine without a package
index.
"""

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
    cache_config,
    run_case,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid, write_tiny_hybrid

pytestmark = GPU_ONLY


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> TinyHybrid:
    return write_tiny_hybrid(tmp_path_factory.mktemp("tiny-mtp"), "mtp")


# Where a session writes the geometry it read, for the sessions that
# dev/gpu/run_tier.sh starts beside it to read instead of starting a server.
UNITS_FILE_ENV = "HYBRID_PC_GPU_UNITS_FILE"


@pytest.fixture(scope="module")
def units(hybrid_suite: Suite, model: TinyHybrid) -> Units:
    """The geometry the model resolves on this GPU, as its plain server at
    vLLM's default budget reports it (vllm:cache_config_info); the default
    budget's own cases then run on that server. Read from the file that
    UNITS_FILE_ENV names where another session of this run wrote it."""
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
    """The reference conversation at vLLM's default prefill budget, where a
    hit and its recompute are cut into different chunks: its gaps are
    recorded, and only check_logprobs_close holds them (upstream's rule)."""
    binding = gpu_binding(model, exact=False)
    mode = served_mode(MODES[mode_name], units)
    case_id = f"plain-{mode_name}-default-budget"
    record = run_case(hybrid_suite, case_id, binding, DEPLOYMENTS["plain"], mode)
    assert record.ok, record.explain()


@pytest.fixture(scope="module")
def binding(model: TinyHybrid) -> Binding:
    return gpu_binding(model)


@pytest.mark.parametrize("case_id", MATRIX.params())
def test_prefix_cache(
    hybrid_suite: Suite, binding: Binding, units: Units, case_id: str
) -> None:
    deployment, mode = served(case_id, units)
    record = MATRIX.run(hybrid_suite, case_id, binding, deployment, mode)
    assert record.ok, record.explain()

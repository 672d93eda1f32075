# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tier of the hybrid prefix-cache suite: a tiny Qwen3-Next model (three
Gated DeltaNet layers, one attention layer) that the suite writes itself,
served on vLLM's CPU backend, through the same deployment x mode table as
the Kimi-K3 matrix. Each case passes, fails as a known vLLM bug with its
evidence, or is refused by the CPU backend with its evidence (cpu_known.py).
"""

from dataclasses import replace

import pytest

from tests.models.hybrid_prefix_cache.cpu_binding import (
    CPU_ONLY,
    CpuInProcess,
    check_geometry,
    cpu_binding,
)
from tests.models.hybrid_prefix_cache.cpu_known import (
    MATRIX,
    confirm_at_config,
    core_shortage,
)
from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    Suite,
    WorkloadRun,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid

pytestmark = CPU_ONLY

# The geometry that the scheduler tier resolves in-process must be what a
# real server reports: held on the plain deployment's reference cases.
GEOMETRY_CHECKED = ("plain-block", "plain-partial")


@pytest.fixture(scope="module")
def binding(tmp_path_factory) -> Binding:
    return cpu_binding(write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid")))


@pytest.mark.parametrize("case_id", MATRIX.params(skip=core_shortage))
def test_prefix_cache(hybrid_suite: Suite, binding: Binding, case_id: str) -> None:
    for entry in MATRIX.known_for(case_id):
        if entry.at_config and entry.confirmed_by is None:
            confirm_at_config(binding, case_id, entry)
    deployment, mode = MATRIX.served(case_id)
    run = WorkloadRun(hybrid_suite, case_id, binding, deployment, mode)
    record = MATRIX.run(replace(run, in_process=CpuInProcess(binding)))
    assert record.ok, record.explain()
    if case_id in GEOMETRY_CHECKED:
        check_geometry(binding, mode, record)

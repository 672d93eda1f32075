# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU tier's second model (tiny_hybrid "wide-kv"): the reference
conversation at a second geometry, block and partial, its reported geometry
held to vLLM's in-process resolution."""

import pytest

from tests.models.hybrid_prefix_cache import cpu_binding as cpu
from tests.models.hybrid_prefix_cache.harness import (
    WorkloadRun,
    run_case,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid

pytestmark = cpu.CPU_ONLY


@pytest.fixture(scope="module")
def binding(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hybrid-wide-kv")
    return cpu.cpu_binding(write_tiny_hybrid(folder, variant="wide-kv"))


@pytest.mark.parametrize("mode", ["block", "partial"])
def test_reference_conversation(hybrid_suite, binding, mode):
    plain, matching = cpu.DEPLOYMENTS["plain"], cpu.MODES[mode]
    case_id = f"wide-kv-plain-{mode}"
    record = run_case(WorkloadRun(hybrid_suite, case_id, binding, plain, matching))
    assert record.ok, record.explain()
    cpu.check_geometry(binding, matching, record)

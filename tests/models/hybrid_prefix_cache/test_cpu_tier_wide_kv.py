# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU tier's second model: the tiny Qwen3-Next with four KV heads
(tiny_hybrid.VARIANTS["wide-kv"]), which resolves to block 128 and Mamba
block 128 where the first resolves to 256 and 256, so the same harness and
checks run at a second geometry: the reference conversation on the plain
deployment, in block and partial mode, with the geometry each server reports
held to vLLM's own in-process resolution."""

import pytest

from tests.models.hybrid_prefix_cache import cpu_binding as cpu
from tests.models.hybrid_prefix_cache.harness import run_case
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid

pytestmark = cpu.CPU_ONLY


@pytest.fixture(scope="module")
def binding(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hybrid-wide-kv")
    return cpu.cpu_binding(write_tiny_hybrid(folder, variant="wide-kv"))


@pytest.mark.parametrize("mode", ["block", "partial"])
def test_reference_conversation(hybrid_suite, binding, mode):
    plain, matching = cpu.DEPLOYMENTS["plain"], cpu.MODES[mode]
    record = run_case(hybrid_suite, f"wide-kv-plain-{mode}", binding, plain, matching)
    assert record.ok, record.explain()
    cpu.check_geometry(binding, matching, record)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi-K3 prefix-cache reuse in every deployment and mode of prefix_cache_binding.py,
through the shared harness. Needs the SM100 family (B200/GB200) or MI355 (gfx950), up
to 4 GPUs; ``KIMI_K3_PREFIX_CACHE_MODEL``/``_DRAFT`` point at local copies."""

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import CaseRecord, Suite, WorkloadRun
from tests.models.kimi_k3 import prefix_cache_binding as kimi
from tests.models.kimi_k3.prefix_cache_mooncake import mooncake_master
from tests.utils import multi_gpu_marks

# The suite's plugin, loaded here: a conftest.py would load the harness into every
# upstream step collecting models/kimi_k3 (0.33.0's amd_specialized_decode).
pytest_plugins = ("tests.models.hybrid_prefix_cache.harness.plugin",)

pytestmark = kimi.PLATFORM_SKIP

PARAMS = kimi.MATRIX.params(device_marks=lambda n: multi_gpu_marks(num_gpus=n))
# The resends run right after the plain cell in RESEND_MODE, on its servers
# (a cold request and the resend each).
RESEND_CELL = f"plain-{kimi.RESEND_MODE}"


@pytest.mark.parametrize("case_id", PARAMS)
def test_prefix_cache(hybrid_suite: Suite, case_id: str) -> None:
    run = WorkloadRun(hybrid_suite, case_id, *kimi.served(case_id))
    record = kimi.MATRIX.run(run)
    check_stated_block(record, run)
    assert record.ok, record.explain()


def check_stated_block(record: CaseRecord, run: WorkloadRun):
    """Servers must report the block KIMI_BLOCKS states (budget and replay take it)."""
    stated = kimi.stated_block(run.deployment.instances[0], run.mode)
    if record.units is not None and not isinstance(stated, str):
        assert record.units.block == stated, (
            f"{record.case_id}: the servers report block {record.units.block}, "
            f"KIMI_BLOCKS states {stated}: update KIMI_BLOCKS"
        )


@harness.servers_mark(RESEND_CELL, harness.case_seconds(1, 2, start=False))
@pytest.mark.parametrize("prompt_len", kimi.RESEND_LENGTHS, ids=lambda n: f"resend-{n}")
def test_exact_resend(request, hybrid_suite: Suite, prompt_len: int) -> None:
    case_id = f"{RESEND_CELL}-{request.node.callspec.id}"
    run = WorkloadRun(hybrid_suite, case_id, *kimi.served(RESEND_CELL))
    record = harness.run_resend(run, prompt_len)
    assert record.ok, record.explain()


@pytest.fixture
def mooncake_config(tmp_path: Path, hybrid_suite: Suite) -> Iterator[str]:
    with mooncake_master(tmp_path, hybrid_suite.pool) as config:
        yield config


@harness.servers_mark("mooncake-store", harness.case_seconds(1, 2))
def test_mooncake_store_resend(hybrid_suite: Suite, mooncake_config: str) -> None:
    mode = kimi.MODES[kimi.RESEND_MODE]
    binding, served = kimi.exact(kimi.MOONCAKE_DEPLOYMENT, mode)
    store = {**kimi.MOONCAKE_ENV, "MOONCAKE_CONFIG_PATH": mooncake_config}
    binding = replace(binding, env={**binding.env, **store})
    case_id = f"mooncake-{kimi.RESEND_MODE}-resend-{kimi.MOONCAKE_RESEND_LENGTH}"
    run = WorkloadRun(hybrid_suite, case_id, binding, served, mode)
    record = harness.run_resend(run, kimi.MOONCAKE_RESEND_LENGTH)
    assert record.ok, record.explain()

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi-K3 prefix-cache reuse in every deployment and mode.

Kimi-K3 interleaves Kimi Delta Attention with MLA layers, so a prefix is
reused only at a saved recurrent-state checkpoint. Every deployment (plain,
CPU offload, DCP, P/D over NIXL and their combinations) runs every mode
(block, partial, each with and without DSpark) through the shared harness in
``tests/models/hybrid_prefix_cache/harness/``; this module only binds it.

Needs the SM100 family (B200/GB200) or MI355 (gfx950), up to 4 GPUs.
``KIMI_K3_PREFIX_CACHE_MODEL``/``_DRAFT`` point the model and draft at local copies.
"""

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    CaseRecord,
    Deployment,
    Mode,
    Suite,
    case_seconds,
    run_resend,
    servers_mark,
)
from tests.models.kimi_k3.prefix_cache_binding import (
    MATRIX,
    MODES,
    MOONCAKE_DEPLOYMENT,
    MOONCAKE_ENV,
    MOONCAKE_RESEND_LENGTH,
    PLATFORM_SKIP,
    RESEND_LENGTHS,
    RESEND_MODE,
    exact,
    served,
    stated_block,
)
from tests.models.kimi_k3.prefix_cache_mooncake import mooncake_master
from tests.utils import multi_gpu_marks

# The suite's plugin, loaded here: a conftest.py would load the harness into every
# upstream step collecting models/kimi_k3 (0.33.0's amd_specialized_decode).
pytest_plugins = ("tests.models.hybrid_prefix_cache.harness.plugin",)


pytestmark = PLATFORM_SKIP

PARAMS = MATRIX.params(device_marks=lambda n: multi_gpu_marks(num_gpus=n))


@pytest.mark.parametrize("case_id", PARAMS)
def test_prefix_cache(hybrid_suite: Suite, case_id: str) -> None:
    binding, deployment, mode = served(case_id)
    record = MATRIX.run(hybrid_suite, case_id, binding, deployment, mode)
    check_stated_block(record, deployment, mode)
    assert record.ok, record.explain()


def check_stated_block(record: CaseRecord, deployment: Deployment, mode: Mode):
    """The block a cell's servers report must be the one KIMI_BLOCKS states
    for them, which its budget and the scheduler tier's replay take."""
    stated = stated_block(deployment.instances[0], mode)
    if record.units is None or isinstance(stated, str):
        return
    assert record.units.block == stated, (
        f"{record.case_id}: the servers report block {record.units.block}, "
        f"KIMI_BLOCKS states {stated}: update KIMI_BLOCKS"
    )


# The resends run right after the plain cell in RESEND_MODE, on its servers
# (a cold request and the resend each).
@servers_mark(f"plain-{RESEND_MODE}", case_seconds(1, 2, start=False))
@pytest.mark.parametrize("prompt_len", RESEND_LENGTHS, ids=lambda n: f"resend-{n}")
def test_exact_resend(request, hybrid_suite: Suite, prompt_len: int) -> None:
    case_id = f"plain-{RESEND_MODE}-{request.node.callspec.id}"
    binding, plain, mode = served(f"plain-{RESEND_MODE}")
    record = run_resend(hybrid_suite, case_id, binding, plain, mode, prompt_len)
    assert record.ok, record.explain()


@pytest.fixture
def mooncake_config(tmp_path: Path, hybrid_suite: Suite) -> Iterator[str]:
    with mooncake_master(tmp_path, hybrid_suite.pool) as config:
        yield config


@servers_mark("mooncake-store", case_seconds(1, 2))
def test_mooncake_store_resend(hybrid_suite: Suite, mooncake_config: str) -> None:
    mode = MODES[RESEND_MODE]
    binding, deployment = exact(MOONCAKE_DEPLOYMENT, mode)
    store = {**MOONCAKE_ENV, "MOONCAKE_CONFIG_PATH": mooncake_config}
    binding = replace(binding, env={**binding.env, **store})
    record = run_resend(
        hybrid_suite,
        f"mooncake-{RESEND_MODE}-resend-{MOONCAKE_RESEND_LENGTH}",
        binding,
        deployment,
        mode,
        MOONCAKE_RESEND_LENGTH,
    )
    assert record.ok, record.explain()

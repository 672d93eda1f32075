# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Kimi-K3 matrix as the scheduler tier replays it (:data:`KIMI`): every cell at
its stated B200 geometry, on the tiny model's config, with B200's scheduler settings."""

from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache import harness, scheduler
from tests.models.hybrid_prefix_cache.scheduler.cell import Build, ReplayTier, Setting
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid
from tests.models.kimi_k3 import prefix_cache_binding as kimi

# A B200 server's scheduler settings: vLLM's default budget for a GPU of 160 GB or
# more (EngineArgs.get_batch_defaults), the matrix's --max-num-seqs, asynchronous
# scheduling (CUDA's default), and a pool where nothing is evicted.
KIMI_SETTINGS = {
    "max_model_len": 32768,
    "max_num_batched_tokens": 16384,
    "max_num_seqs": 8,
    "async_scheduling": True,
    "num_blocks": 2048,
}
# KDA saves the prompt's checkpoint inside the last chunk with FlashKDA (alignment
# 16), not the Triton prefill; a B200 may run either, so every Kimi cell replays
# both (kda_prefill_checkpoint_alignment).
KDA_CHECKPOINTS = {"flashkda": 16, "triton": None}


def kimi_engines(
    model: Path,
    deployment: harness.Deployment,
    mode: harness.Mode,
    kda_checkpoint: int | None,
    **overrides,
) -> list[scheduler.Engine]:
    """The engines of a Kimi-K3 cell at its stated block (skips where none is)."""
    settings = {**KIMI_SETTINGS, **overrides}
    engines = []
    for instance in deployment.instances:
        block = kimi.stated_block(instance, mode)
        if isinstance(block, str):
            pytest.skip(block)
        stated = scheduler.StatedGeometry(block, kda_checkpoint)
        engine = scheduler.stated_engine(str(model), stated, instance, mode, **settings)
        engines.append(engine)
    return engines


def _kimi_build(
    model: TinyHybrid,
    binding: harness.Binding | None,
    deployment: harness.Deployment,
    mode: harness.Mode,
) -> Build:
    def build(setting: Setting, kda: int | None) -> list[scheduler.Engine]:
        overrides = {
            "max_num_batched_tokens": setting.budget,
            "num_blocks": setting.num_blocks,
            "async_scheduling": setting.async_scheduling,
            "max_model_len": setting.max_model_len,
            "scheduling_policy": setting.policy,
        }
        given = {key: value for key, value in overrides.items() if value is not None}
        return kimi_engines(model.path, deployment, mode, kda, **given)

    return build


KIMI = ReplayTier(
    "kimi",
    kimi.MATRIX,
    _kimi_build,
    token_ids=kimi.BINDING.token_ids,
    kda_checkpoints=KDA_CHECKPOINTS,
)

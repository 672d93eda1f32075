# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU tier's cells as the scheduler tier replays them (:data:`CPU`), engines built
from exactly its servers' arguments (Kimi-K3's own: kimi_k3/prefix_cache_replay.py)."""

from collections.abc import Sequence

import pytest

from tests.models.hybrid_prefix_cache import cpu_known, harness, scheduler
from tests.models.hybrid_prefix_cache.harness import Binding, Deployment, Mode
from tests.models.hybrid_prefix_cache.scheduler.cell import Build, ReplayTier, Setting
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid


def cpu_engines(
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    extra: Sequence[str] = (),
    memory: Sequence[int] | None = None,
) -> list[scheduler.Engine]:
    """Each CPU server's engine from exactly its arguments and environment, ``extra``
    ones and per server ``memory`` KV bytes; skips on a refusal cpu_known lists."""
    engines = []
    for index, spec in enumerate(harness.server_specs(binding, deployment, mode)):
        args = [*spec.args, *extra]
        if memory is not None:
            args += ["--kv-cache-memory-bytes", str(memory[index])]
        try:
            engines.append(scheduler.cpu_engine(spec.model, args, dict(spec.env)))
        except Exception as e:
            shown = [k for k in cpu_known.UNSUPPORTED.values() if k.shown(str(e))]
            if not shown:
                raise
            pytest.skip(
                "vLLM refuses this configuration in-process as its server does "
                f"({shown[0].reason}; confirmed: {shown[0].evidence!r})"
            )
    return engines


def _cpu_build(
    model: TinyHybrid, binding: Binding | None, deployment: Deployment, mode: Mode
) -> Build:
    assert binding is not None, "the CPU tier's cells are its binding's servers"

    def build(setting: Setting, kda: int | None) -> list[scheduler.Engine]:
        extra: list[str] = []
        if setting.budget is not None:
            extra += ["--max-num-batched-tokens", str(setting.budget)]
        if setting.async_scheduling is not None:
            on = setting.async_scheduling
            extra.append("--async-scheduling" if on else "--no-async-scheduling")
        if setting.max_model_len is not None:
            extra += ["--max-model-len", str(setting.max_model_len)]
        if setting.policy is not None:
            extra += ["--scheduling-policy", setting.policy]
        engines = cpu_engines(binding, deployment, mode, extra)
        if setting.num_blocks is None:
            return engines
        memory = [setting.num_blocks * engine.block_bytes for engine in engines]
        return cpu_engines(binding, deployment, mode, extra, memory)

    return build


CPU = ReplayTier("cpu", cpu_known.MATRIX, _cpu_build)

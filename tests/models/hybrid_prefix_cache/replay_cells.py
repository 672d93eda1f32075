# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's cells: every cell of the Kimi-K3 matrix at its stated
B200 geometry, and of the CPU tier's at the geometry vLLM resolves here, as
:class:`scheduler.ReplayCell`, their engines and the tier's own known
failures."""

from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache import cpu_known, harness, scheduler
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell, Setting
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid
from tests.models.kimi_k3 import prefix_cache_binding as kimi

# What a B200 server runs with that its scheduler reads: vLLM's default
# budget for a GPU of 160 GB or more (EngineArgs.get_batch_defaults), the
# matrix's --max-num-seqs, asynchronous scheduling (CUDA's default), and a
# pool where nothing is evicted.
KIMI_SETTINGS = {
    "max_model_len": 32768,
    "max_num_batched_tokens": 16384,
    "max_num_seqs": 8,
    "async_scheduling": True,
    "num_blocks": 2048,
}
# KDA saves the prompt's checkpoint inside the last chunk with FlashKDA
# (alignment 16), not with the Triton prefill; a B200 may run either, so
# every Kimi cell replays both (kda_prefill_checkpoint_alignment).
KDA_CHECKPOINTS = {"flashkda": 16, "triton": None}

# What vLLM's scheduler does not do of a workload, by (workload, cell).
KNOWN: dict[tuple[str, str], harness.Known] = {
    ("aligned", "kimi-dcp2-offload-partial"): harness.Known(
        "xfail",
        "DCP2 with CPU offload in partial mode: after a first prompt that "
        "ends exactly on a block (three blocks), the next turn, its "
        "device cache reset, restores nothing from the host where the "
        "prompt's checkpoint one hit unit inside its last block should be; "
        "the same prompt's checkpoint is restored without DCP "
        "(kimi-offload-partial) and after an unaligned prompt (the "
        "reference turns, as on B200). The offload scheduler's store of "
        "that state under DCP (offloading/scheduler.py) is where to look",
        evidence="exact turn 1: vLLM's scheduler hits 0,",
        # 0.34.0's scheduler restores it (a strict XPASS there).
        releases=kimi.HOST_LOSS_RELEASES,
    ),
}


def kimi_engines(
    model: Path,
    deployment: harness.Deployment,
    mode: harness.Mode,
    kda_checkpoint: int | None,
    **overrides,
) -> list[scheduler.Engine]:
    """The engines of a Kimi-K3 cell at its stated block (skips where none
    is stated)."""
    settings = {**KIMI_SETTINGS, **overrides}
    engines = []
    for instance in deployment.instances:
        block = kimi.stated_block(instance, mode)
        if isinstance(block, str):
            pytest.skip(block)
        geometry = scheduler.StatedGeometry(block, kda_checkpoint)
        engines.append(
            scheduler.stated_engine(str(model), geometry, instance, mode, **settings)
        )
    return engines


def cpu_engines(
    binding: harness.Binding,
    deployment: harness.Deployment,
    mode: harness.Mode,
    extra: Sequence[str] = (),
    memory: Sequence[int] | None = None,
) -> list[scheduler.Engine]:
    """Each CPU server's engine from exactly its arguments and environment,
    then ``extra`` arguments and, per server, ``memory`` bytes of KV cache; a
    configuration vLLM refuses as the server does skips with the CPU tier's
    reason."""
    engines = []
    specs = harness.server_specs(binding, deployment, mode)
    for index, spec in enumerate(specs):
        args = [*spec.args, *extra]
        if memory is not None:
            args += ["--kv-cache-memory-bytes", str(memory[index])]
        try:
            engines.append(scheduler.cpu_engine(spec.model, args, dict(spec.env)))
        except Exception as e:
            unsupported = [
                known
                for entries in cpu_known.KNOWN.values()
                for known in entries
                if known.kind == "unsupported" and known.evidence in str(e)
            ]
            if not unsupported:
                raise
            pytest.skip(
                f"vLLM refuses this configuration in-process as its server "
                f"does ({unsupported[0].reason}; confirmed: "
                f"{unsupported[0].evidence!r})"
            )
    return engines


def _cpu_build(binding: harness.Binding, deployment, mode):
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


def _kimi_build(model: Path, deployment, mode):
    def build(setting: Setting, kda: int | None) -> list[scheduler.Engine]:
        overrides = {
            "max_num_batched_tokens": setting.budget,
            "num_blocks": setting.num_blocks,
            "async_scheduling": setting.async_scheduling,
            "max_model_len": setting.max_model_len,
            "scheduling_policy": setting.policy,
        }
        given = {key: value for key, value in overrides.items() if value is not None}
        return kimi_engines(model, deployment, mode, kda, **given)

    return build


def _cells() -> dict[str, tuple[str, str, str]]:
    return {
        f"{tier}-{name}-{mode}": (tier, name, mode)
        for tier, matrix in (("kimi", kimi.MATRIX), ("cpu", cpu_known.MATRIX))
        for name in matrix.deployments
        for mode in matrix.modes
    }


CELLS = _cells()


def cell_params(replay: Replay) -> list:
    """One pytest param per cell of both matrices that ``replay`` applies
    to."""
    params = []
    for cell_id, (tier, name, mode) in CELLS.items():
        matrix = kimi.MATRIX if tier == "kimi" else cpu_known.MATRIX
        if replay.applies(matrix.deployments[name], matrix.modes[mode]):
            params.append(pytest.param(cell_id, id=cell_id))
    return params


def replay_cell(
    cell_id: str, model: TinyHybrid, binding: harness.Binding
) -> ReplayCell:
    """``cell_id`` of :data:`CELLS`, its engines built on ``model`` (Kimi-K3)
    or from ``binding``'s servers (the CPU tier)."""
    tier, name, mode_name = CELLS[cell_id]
    matrix = kimi.MATRIX if tier == "kimi" else cpu_known.MATRIX
    deployment, mode = matrix.deployments[name], matrix.modes[mode_name]
    known = {
        workload: entry
        for (workload, cell), entry in KNOWN.items()
        if cell == cell_id and entry.holds()
    }
    plans = {
        case.workload: (case.num_turns, case.resend)
        for case in matrix.cases.values()
        if case.cell == f"{name}-{mode_name}" and case.workload is not None
    }
    if tier == "kimi":
        return ReplayCell(
            cell_id,
            tier,
            deployment,
            mode,
            kimi.BINDING.token_ids,
            _kimi_build(model.path, deployment, mode),
            KDA_CHECKPOINTS,
            known,
            plans,
        )
    build = _cpu_build(binding, deployment, mode)
    return ReplayCell(
        cell_id,
        tier,
        deployment,
        mode,
        binding.token_ids,
        build,
        {"": None},
        known,
        plans,
    )

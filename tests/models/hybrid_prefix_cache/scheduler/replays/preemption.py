# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of workloads/preemption.py."""

import functools

from tests.models.hybrid_prefix_cache.harness import rules
from tests.models.hybrid_prefix_cache.harness.deployment import Deployment, Mode
from tests.models.hybrid_prefix_cache.scheduler import preempt
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell, Setting
from tests.models.hybrid_prefix_cache.scheduler.judge import controls
from tests.models.hybrid_prefix_cache.workloads import preemption


def problems_of(
    result: preempt.Preemption | None,
    shape: preemption.Shape,
    mode: Mode,
    deployment: Deployment,
) -> list[str]:
    missing = preemption.untested(result, shape)
    if result is None or missing:
        return [missing]
    unit = shape.units.hit
    checkpoint = rules.prompt_end_checkpoint(shape.prompt_len, unit, mode.drops_unit)
    # A resumed prefill's chunk ending short of its end off a block files no state:
    # only the prompt's own checkpoint may end one there (_mamba_block_aligned_split).
    block, prefill_end = result.block, result.prefill_end
    found = [
        f"a chunk of the resumed prefill ended at {end}, inside block "
        f"{end // block} ({block} tokens), short of the prefill's end {prefill_end}"
        for start, end in result.chunks
        if end < prefill_end and end % block and end != checkpoint
    ]
    # A follow-up's bound is what its request computed (a replayed prefill files
    # states past its prompt).
    stored = shape.prompt_len + shape.max_tokens - 1
    length = stored + 1 + rules.FIRST_PROMPT_TAIL
    bound = rules.hit_bound(stored - deployment.cache_backoff, length, unit)
    for who, hit in zip(("the resumed request's", "the other's"), result.hits):
        if hit > bound:
            found.append(f"{who} follow-up cached {hit}, beyond the bound {bound}")
        elif hit % unit:
            found.append(f"{who} follow-up cached {hit}, off the unit {unit}")
    return found


def replay(cell: ReplayCell) -> None:
    """The pool where vLLM preempts a decoding request after its outputs
    (:func:`sized_preemption`): its resumed prefill's chunks and both requests'
    follow-ups, held to the rule."""
    for kda, alignment in cell.kda_checkpoints.items():
        engines = cell.engines(kda=alignment)
        units, _ = cell.servers_of(engines)
        shape = preemption.shape_of(units, cell.deployment, engines[0].vllm_config)

        def build(blocks: int | None, alignment=alignment, shape=shape):
            setting = Setting(shape.budget, blocks, None, shape.max_len, "priority")
            return cell.servers_of(cell.engines(setting, alignment))[1]

        def replayed(servers, requests: int, reverse=False, shape=shape):
            played = (*shape.lengths, requests, cell.cell_id, cell.token_ids)
            return preempt.play_preemption(servers, *played, reverse)

        wanted = functools.partial(preemption.tested, shape=shape)
        size, servers, result = preempt.sized_preemption(build, replayed, wanted)
        problems = problems_of(result, shape, cell.mode, cell.deployment)
        if result is not None:
            problems += controls(max(result.recompute_hits), servers)
            # A real server's arrival order is not the replay's.
            again = replayed(build(size), result.requests, reverse=True)
            if isinstance(again, preempt.Unpreempted):
                problems.append(f"its pool preempted nothing sent last first: {again}")
            elif (again.resumed, again.hits) != (result.resumed, result.hits):
                problems.append(
                    f"sent last first, the replay preempted differently ({again}): "
                    f"which request vLLM resumes depends on arrival, not priority"
                )
        cell.fail(preemption.WORKLOAD, problems, f"{kda} {result}")


def _applies(deployment: Deployment, mode: Mode) -> bool:
    """Not under P/D (the decoder would replay a transfer), DCP or a drafter that
    drops a hit unit or hashes lookahead tokens (rules.drafting): there no pool
    the sizing tries preempts a decoding request (findings/preemption.md)."""
    rule = mode.drafting(deployment.instances[0])
    plain = deployment.prefill is None and deployment.instances[0].dcp <= 1
    return plain and not (rule.drops_unit or rule.lookahead)


REPLAY = Replay(preemption.WORKLOAD, replay, applies=_applies)

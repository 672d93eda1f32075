# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of workloads/abort_retry.py."""

from tests.models.hybrid_prefix_cache.harness import rules
from tests.models.hybrid_prefix_cache.harness.deployment import Units
from tests.models.hybrid_prefix_cache.scheduler import abort, judge
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell, Setting
from tests.models.hybrid_prefix_cache.workloads.abort_retry import WORKLOAD


def abort_length(units: Units, budget: int) -> int:
    """A prompt whose prefill takes two steps or more of ``budget`` tokens."""
    first = max(budget, rules.FIRST_PROMPT_BLOCKS * units.block)
    return first + units.block + rules.FIRST_PROMPT_TAIL


def abort_problems(
    hit: int, written: int, in_flight: int, prompt_len: int, units: Units
) -> list[str]:
    """Why the retry's ``hit`` cannot be real: the engine completes the steps
    scheduled before the abort (EngineCore.step_with_batch_queue), so the retry
    may resume from the ``written`` and ``in_flight`` tokens and no others."""
    problems = []
    if hit % units.hit:
        problems.append(f"retry cached {hit}, not a multiple of the hit unit")
    if hit > written + in_flight:
        problems.append(
            f"retry cached {hit} > the {written + in_flight} tokens the aborted "
            f"request's steps wrote ({written} processed, {in_flight} in flight, "
            f"of {prompt_len}): a published boundary was never written"
        )
    return problems


def overlap_problems(
    hit: int, written: int, prompt_len: int, units: Units
) -> list[str]:
    """Why an overlapping retry's ``hit`` cannot be real: a step writes the states
    its chunks publish only as it runs, so the retry may resume from the ``written``
    tokens scheduled before its own step alone (MambaManager.get_num_blocks_to_allocate,
    cached_blocks_this_step)."""
    problems = []
    if hit % units.hit:
        problems.append(f"retry cached {hit}, not a multiple of the hit unit")
    if hit > written:
        problems.append(
            f"retry cached {hit} > the {written} tokens of the {prompt_len}-token "
            f"prompt that the original's steps before the retry's own had "
            f"written: it resumed from a state its own step publishes"
        )
    return problems


def replay(cell: ReplayCell, scheduling: str) -> None:
    """An abort after the first chunk (asynchronously, with a step in flight), then
    the retry: it resumes from no more than the aborted request's steps wrote, and
    the counters count that request once. Then a retry sent while its original
    still prefills: it never resumes from a state its own step publishes."""
    setting = Setting(async_scheduling=scheduling == "async")
    for kda, alignment in cell.kda_checkpoints.items():
        engines = cell.engines(setting, alignment)
        units, servers = cell.servers_of(engines)
        budget = engines[0].vllm_config.scheduler_config.max_num_batched_tokens
        prompt_len = abort_length(units, budget)
        result = abort.play_abort_retry(cell, servers, prompt_len)
        problems = abort_problems(
            result.hit, result.written, result.in_flight, prompt_len, units
        )
        problems += judge.controls(result.recompute_hit, servers)
        cell.fail(WORKLOAD, problems, f"{kda} {result}")
        units, servers = cell.servers_of(engines)
        overlap = abort.play_overlapping_retry(cell, servers, prompt_len)
        problems = overlap_problems(overlap.hit, overlap.written, prompt_len, units)
        problems += judge.controls(overlap.recompute_hit, servers)
        cell.fail(WORKLOAD, problems, f"{kda} {overlap}")


REPLAY = Replay(WORKLOAD, replay, variants=("sync", "async"))

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Siblings of a shared system prompt that ends inside a block: the first computes
it, the second finds the junction (its attention blocks hit past any Mamba state)
and caches the state there, every later one resumes at its checkpoint."""

import random

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import Units, conversation, rules

NUM_SIBLINGS = 4
SHARED_PREFIX_BLOCKS = 2.5


def shared_prefix_length(units: Units) -> int:
    """It ends inside a block, where no sibling's own prompt-end checkpoint falls."""
    return int(SHARED_PREFIX_BLOCKS * units.block)


def sibling_tail_length(units: Units) -> int:
    """Each sibling's own checkpoint lies past the shared prefix."""
    return units.block + rules.FIRST_PROMPT_TAIL


def junction_checkpoint(prefix_len: int, units: Units, drops_unit: bool) -> int:
    """The shared prefix's own end checkpoint at the block: the junction is
    the longest single-group hit (KVCacheManager.get_computed_blocks), which
    Scheduler._mamba_block_aligned_split floors to the block."""
    return rules.prompt_end_checkpoint(prefix_len, units.block, drops_unit)


def play(run: harness.WorkloadRun) -> harness.CaseRecord:
    """The siblings of one salt, each played as a turn (hit, then its
    recompute): from the third on each hits the junction's checkpoint."""
    __tracebackhide__ = True
    with run.session() as case, case.serve(run) as p:
        rng, tokens = random.Random(run.case_id), run.binding.token_ids
        shared = conversation.random_tokens(rng, tokens, shared_prefix_length(p.units))
        junction = junction_checkpoint(len(shared), p.units, run.mode.drops_unit)
        salt, tail = conversation.fresh_salt("siblings"), sibling_tail_length(p.units)
        for index in range(NUM_SIBLINGS):
            prompt = shared + conversation.random_tokens(rng, tokens, tail)
            planned = rules.PlannedTurn(index, len(prompt), len(shared))
            turn = conversation.planned_turn(p, "sibling", planned)
            # The first two need not hit; the bound stays the shared prefix.
            turn.expected = junction if index >= 2 else 0
            case.add(turn)
            conversation.play_turn(p, turn, prompt, salt)
        conversation.finish_turns(p, case.turns)
        if any(turn.problems for turn in case.turns):
            prefix = f"the junction checkpoint of the shared {len(shared)}-token prefix"
            case.add(problem=WORKLOAD.failure(f"{prefix} is {junction}"))
    assert case.record is not None
    return case.record


WORKLOAD = harness.Workload(
    "shared-prefix",
    "siblings reach their junction checkpoint",
    "v1/core/kv_cache_manager.py KVCacheManager.get_computed_blocks "
    "(shared_prefix_boundary: the longest single-group hit) and "
    "v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split "
    "(a chunk stops at the block-floored junction)",
    play=play,
)

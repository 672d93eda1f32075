# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Siblings of a shared system prompt that ends inside a block: the first computes
it, the second finds the junction (its attention blocks hit past any Mamba state)
and caches the state there, every later one resumes at its checkpoint."""

import random

from tests.models.hybrid_prefix_cache.harness.conversation import (
    finish_turns,
    fresh_salt,
    planned_turn,
    play_turn,
    random_tokens,
)
from tests.models.hybrid_prefix_cache.harness.deployment import Units
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import (
    FIRST_PROMPT_TAIL,
    PlannedTurn,
    prompt_end_checkpoint,
)
from tests.models.hybrid_prefix_cache.harness.workload import Workload, WorkloadRun

NUM_SIBLINGS = 4
SHARED_PREFIX_BLOCKS = 2.5


def shared_prefix_length(units: Units) -> int:
    """It ends inside a block, where no sibling's own prompt-end checkpoint falls."""
    return int(SHARED_PREFIX_BLOCKS * units.block)


def sibling_tail_length(units: Units) -> int:
    """Each sibling's own checkpoint lies past the shared prefix."""
    return units.block + FIRST_PROMPT_TAIL


def junction_checkpoint(prefix_len: int, units: Units, drops_unit: bool) -> int:
    """The shared prefix's own end checkpoint at the block: the junction is
    the longest single-group hit (KVCacheManager.get_computed_blocks), which
    Scheduler._mamba_block_aligned_split floors to the block."""
    return prompt_end_checkpoint(prefix_len, units.block, drops_unit)


def play(run: WorkloadRun) -> CaseRecord:
    """The siblings of one salt, each played as a turn (hit, then its
    recompute): from the third on each hits the junction's checkpoint."""
    __tracebackhide__ = True
    with (
        run.session() as case,
        case.serve(run.binding, run.deployment, run.mode, run.suite.pool) as p,
    ):
        rng, tokens = random.Random(run.case_id), run.binding.token_ids
        shared = random_tokens(rng, tokens, shared_prefix_length(p.units))
        junction = junction_checkpoint(len(shared), p.units, run.mode.drops_unit)
        salt = fresh_salt("siblings")
        for index in range(NUM_SIBLINGS):
            prompt = shared + random_tokens(rng, tokens, sibling_tail_length(p.units))
            turn = planned_turn(
                p, "sibling", PlannedTurn(index, len(prompt), len(shared))
            )
            # The first two need not hit; the bound stays the shared prefix.
            turn.expected = junction if index >= 2 else 0
            case.add(turn)
            play_turn(p, turn, prompt, salt)
        finish_turns(p, case.turns)
        if any(turn.problems for turn in case.turns):
            case.add(
                problem=WORKLOAD.failure(
                    f"the junction checkpoint of the shared {len(shared)}-token "
                    f"prefix is {junction}"
                )
            )
    assert case.record is not None
    return case.record


WORKLOAD = Workload(
    "shared-prefix",
    "siblings reach their junction checkpoint",
    "v1/core/kv_cache_manager.py KVCacheManager.get_computed_blocks "
    "(shared_prefix_boundary: the longest single-group hit) and "
    "v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split "
    "(a chunk stops at the block-floored junction)",
    play=play,
)

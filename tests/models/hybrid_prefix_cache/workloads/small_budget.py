# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reference conversation under a small prefill budget: hits and outputs equal
the default budget's, and a branch resumes at a block boundary only the small
budget's chunks wrote (vLLM #51113 named a block by a state written short of it)."""

import random
from collections.abc import Sequence

from tests.models.hybrid_prefix_cache.harness.cases import run_case
from tests.models.hybrid_prefix_cache.harness.compare import (
    Found,
    Turn,
    compare,
    take_each,
)
from tests.models.hybrid_prefix_cache.harness.conversation import (
    planned_turn,
    play_turn,
    random_tokens,
    reference_conversation,
    run_conversations,
)
from tests.models.hybrid_prefix_cache.harness.deployment import Units, with_serve_args
from tests.models.hybrid_prefix_cache.harness.paths import PathNoise, pairs_noise
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import (
    FIRST_PROMPT_TAIL,
    PlannedTurn,
)
from tests.models.hybrid_prefix_cache.harness.workload import Workload, WorkloadRun


def small_budgets(units: Units) -> tuple[int, ...]:
    """Prefill budgets below the default: half a block (chunks end inside
    blocks) and a block and a half (every chunk is cut back to a block)."""
    return (units.block // 2, units.block + units.block // 2)


def served_budget(units: Units) -> int:
    """A real server's budget: a block and a half, whose chunks
    Scheduler._mamba_block_aligned_split cuts back to a block."""
    return small_budgets(units)[-1]


# A branch off the small-budget conversation's first prompt: it shares this
# many blocks of it, then its own text.
BRANCH_SHARED_BLOCKS = 2.5


def branch_lengths(units: Units) -> tuple[int, int]:
    """The branch's shared prefix, ending inside a block short of the first prompt's
    own checkpoint, and its length (the reference tail past that)."""
    shared = int(BRANCH_SHARED_BLOCKS * units.block)
    return shared, shared + FIRST_PROMPT_TAIL


def branch_checkpoint(shared: int, units: Units, drops_unit: bool) -> int:
    """The last block boundary a branch off a prompt prefilled under
    :func:`served_budget` shares, less the drafter's unit: each chunk ends on a
    block, whose state, retained, MambaManager.cache_blocks names by its hash."""
    checkpoint = shared // units.block * units.block
    return max(checkpoint - (units.hit if drops_unit else 0), 0)


def small_budget_args(units: Units) -> tuple[str, ...]:
    """A retention of one block (config/cache.py prefix_cache_retention_interval): the
    default 0 keeps only prompts' own checkpoints."""
    return (
        *("--max-num-batched-tokens", str(served_budget(units))),
        *("--prefix-cache-retention-interval", str(units.block)),
    )


def budget_problems(
    turns: Sequence[Turn],
    defaults: Sequence[Turn],
    budget: int,
    logprob_atol: float | None,
    exact: bool = False,
) -> tuple[PathNoise | None, list[Found]]:
    """Each turn under ``budget`` held to the same turn under the default budget:
    the same prompt and hit, and outputs exactly where ``exact``
    (Binding.chunk_invariant; the recomputes too), else within the noise of the
    two budgets' recomputes. Returns that noise and what each turn found."""
    found = [Found() for _ in turns]
    if len(turns) != len(defaults):
        found[-1] += _problem(
            f"{len(turns)} turns under a budget of {budget}, {len(defaults)} "
            f"under the default"
        )
    pairs = [
        (i, turn.recompute, default.recompute)
        for i, (turn, default) in enumerate(zip(turns, defaults))
        if turn.recompute is not None and default.recompute is not None
    ]
    if exact:
        noise, tolerance = None, logprob_atol
        names = (f"recompute at budget {budget}", "recompute at the default budget")
        for i, small, default in pairs:
            why, seen = compare(turns[i].name, small, default, names, tolerance, True)
            found[i] += seen
            if why:
                found[i] += _problem(
                    f"{turns[i].name}: the cold recompute under a budget of "
                    f"{budget} differs from the one under the default budget, "
                    f"{why}: where a prefill's chunks end changes its arithmetic"
                )
    else:
        noise = pairs_noise([(small, default) for _, small, default in pairs])
        tolerance = None if noise is None else noise.held_to(logprob_atol)
    names = (f"hit at budget {budget}", "hit at the default budget")
    for i, (turn, default) in enumerate(zip(turns, defaults)):
        if turn.prompt != default.prompt:
            found[i] += _problem(
                f"{turn.name}: its prompt is not the default budget's (an "
                f"earlier output parted from it)"
            )
            continue
        if turn.restored != default.restored:
            found[i] += _problem(
                f"{turn.name}: cached {turn.restored} under a budget of "
                f"{budget}, {default.restored} under the default"
            )
        if turn.output is None or default.output is None:
            continue
        why, seen = compare(
            turn.name, turn.output, default.output, names, tolerance, exact
        )
        found[i] += seen
        if why:
            held = "exactly" if exact else f"{noise}, the two budgets' recomputes"
            found[i] += _problem(
                f"{turn.name}: the hit, {turn.restored} tokens restored, differs "
                f"from the same hit under the default budget, {why} ({held})"
            )
    return noise, found


def _problem(why: str) -> Found:
    return Found((why,))


def play(run: WorkloadRun) -> CaseRecord:
    """The reference conversation on servers that schedule :func:`served_budget`
    tokens a step and retain states a block apart, held turn by turn to the cell's
    reference case (played here first if the session has none), then a branch off
    its first prompt (:func:`branch_checkpoint`)."""
    __tracebackhide__ = True
    suite, case_id, binding = run.suite, run.case_id, run.binding
    deployment, mode = run.deployment, run.mode
    default_id = case_id.removesuffix(f"-{WORKLOAD.name}")
    default = next(
        (r for r in reversed(suite.records) if r.case_id == default_id and r.turns),
        None,
    )
    if default is None:
        default = run_case(suite, default_id, binding, deployment, mode)
    assert default.units is not None
    budget = served_budget(default.units)
    served = with_serve_args(deployment, small_budget_args(default.units))
    with run.session() as case, case.serve(binding, served, mode, suite.pool) as play:
        turns = case.turns
        if not default.ok:
            case.add(
                problem=f"the default budget's case {default_id} failed, so "
                f"nothing here compares with it: {default.failures()[0]}"
            )
        if play.units != default.units:
            case.add(
                problem=f"a budget of {budget} resolves {play.units}, the default "
                f"{default.units}"
            )
        # The default case's seed: the same prompts, as long as each turn's
        # output is the same.
        conversation = reference_conversation(play.units, default_id)
        run_conversations(play, [conversation], turns)
        noise, found = budget_problems(
            turns, default.turns, budget, binding.logprob_atol, binding.chunk_invariant
        )
        take_each(turns, found)
        play.noise = play.noise or noise
        # A branch off the first prompt, under its salt: it resumes at a
        # block boundary whose state only the small budget's chunks wrote.
        first = turns[0]
        shared, length = branch_lengths(play.units)
        rng = random.Random(f"{case_id}-branch")
        prompt = first.prompt[:shared]
        prompt += random_tokens(rng, binding.token_ids, length - shared)
        branch = planned_turn(play, "branch", PlannedTurn(0, length, shared))
        branch.expected = branch_checkpoint(shared, play.units, mode.drops_unit)
        case.add(branch)
        play_turn(play, branch, prompt, first.salt)
        if not case.ok:
            case.add(
                problem=WORKLOAD.failure(
                    f"a budget of {budget} tokens a step against the default of "
                    f"{default_id}"
                )
            )
    assert case.record is not None
    return case.record


WORKLOAD = Workload(
    "small-budget",
    "under a small budget, hits and outputs equal those under the default budget",
    "v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split "
    "(every chunk ends at or before last_cache_position)",
    play=play,
    own_servers=True,
)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reference conversation under a small prefill budget: hits and outputs equal
the default budget's, and a branch resumes at a block boundary only the small
budget's chunks wrote (vLLM #51113 named a block by a state written short of it)."""

import random
from collections.abc import Sequence
from dataclasses import replace

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import compare, conversation, paths, rules


def small_budgets(units: harness.Units) -> tuple[int, ...]:
    """Prefill budgets below the default: half a block (chunks end inside
    blocks) and a block and a half (every chunk is cut back to a block)."""
    return (units.block // 2, units.block + units.block // 2)


def served_budget(units: harness.Units) -> int:
    """A real server's budget: a block and a half, whose chunks
    Scheduler._mamba_block_aligned_split cuts back to a block."""
    return small_budgets(units)[-1]


# A branch off the small-budget conversation's first prompt: it shares this
# many blocks of it, then its own text.
BRANCH_SHARED_BLOCKS = 2.5


def branch_lengths(units: harness.Units) -> tuple[int, int]:
    """The branch's shared prefix, ending inside a block short of the first prompt's
    own checkpoint, and its length (the reference tail past that)."""
    shared = int(BRANCH_SHARED_BLOCKS * units.block)
    return shared, shared + rules.FIRST_PROMPT_TAIL


def branch_checkpoint(shared: int, units: harness.Units, drops_unit: bool) -> int:
    """The last block boundary a branch off a prompt prefilled under
    :func:`served_budget` shares, less the drafter's unit: each chunk ends on a
    block, whose state, retained, MambaManager.cache_blocks names by its hash."""
    checkpoint = shared // units.block * units.block
    return max(checkpoint - (units.hit if drops_unit else 0), 0)


def small_budget_args(units: harness.Units) -> tuple[str, ...]:
    """A retention of one block (config/cache.py prefix_cache_retention_interval): the
    default 0 keeps only prompts' own checkpoints."""
    budget = ("--max-num-batched-tokens", str(served_budget(units)))
    return (*budget, "--prefix-cache-retention-interval", str(units.block))


def budget_problems(
    turns: Sequence[compare.Turn],
    defaults: Sequence[compare.Turn],
    budget: int,
    logprob_atol: float | None,
    exact: bool = False,
) -> tuple[paths.PathNoise | None, list[compare.Found]]:
    """Each turn under ``budget`` held to the same turn under the default budget:
    the same prompt and hit, and outputs exactly where ``exact``
    (Binding.chunk_invariant; the recomputes too), else within the noise of the
    two budgets' recomputes. Returns that noise and what each turn found."""
    found = [compare.Found() for _ in turns]
    if len(turns) != len(defaults):
        found[-1] += _problem(
            f"{len(turns)} turns under a budget of {budget}, {len(defaults)} "
            f"under the default"
        )
    pairs = [
        (i, turn.name, turn.recompute, default.recompute)
        for i, (turn, default) in enumerate(zip(turns, defaults))
        if turn.recompute is not None and default.recompute is not None
    ]
    if exact:
        noise, tolerance = None, logprob_atol
        names = (f"recompute at budget {budget}", "recompute at the default budget")
        for i, name, small, default in pairs:
            why, seen = compare.compare(name, small, default, names, tolerance, True)
            found[i] += seen
            if why:
                found[i] += _problem(
                    f"{name}: the cold recompute under a budget of "
                    f"{budget} differs from the one under the default budget, "
                    f"{why}: where a prefill's chunks end changes its arithmetic"
                )
    else:
        noise = paths.pairs_noise([(small, default) for *_, small, default in pairs])
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
        why, seen = compare.compare(
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


def _problem(why: str) -> compare.Found:
    return compare.Found((why,))


def play(run: harness.WorkloadRun) -> harness.CaseRecord:
    """Held turn by turn to the cell's default-budget case (played here first if the
    session has none), then a branch off the first prompt."""
    __tracebackhide__ = True
    case_id, binding, mode = run.case_id, run.binding, run.mode
    default_id = case_id.removesuffix(f"-{WORKLOAD.name}")
    played = [r for r in run.suite.records if r.case_id == default_id and r.turns]
    if played:
        default = played[-1]
    else:
        default = harness.run_case(
            harness.WorkloadRun(run.suite, default_id, binding, run.deployment, mode)
        )
    assert default.units is not None
    budget = served_budget(default.units)
    served = harness.with_serve_args(run.deployment, small_budget_args(default.units))
    with run.session() as case, case.serve(replace(run, deployment=served)) as p:
        turns = case.turns
        if not default.ok:
            case.add(
                problem=f"the default budget's case {default_id} failed, so "
                f"nothing here compares with it: {default.failures()[0]}"
            )
        if p.units != default.units:
            case.add(
                problem=f"a budget of {budget} resolves {p.units}, the default "
                f"{default.units}"
            )
        # The default case's seed: the same prompts, as long as each turn's
        # output is the same.
        reference = conversation.reference_conversation(p.units, default_id)
        for _ in conversation.play_waves(p, [reference], turns):
            pass
        conversation.finish_turns(p, turns)
        noise, found = budget_problems(
            turns, default.turns, budget, binding.logprob_atol, binding.chunk_invariant
        )
        compare.take_each(turns, found)
        p.noise = p.noise or noise
        # A branch off the first prompt, under its salt: it resumes at a
        # block boundary whose state only the small budget's chunks wrote.
        first = turns[0]
        shared, length = branch_lengths(p.units)
        rng = random.Random(f"{case_id}-branch")
        prompt = first.prompt[:shared]
        prompt += conversation.random_tokens(rng, binding.token_ids, length - shared)
        planned = rules.PlannedTurn(0, length, shared)
        branch = conversation.planned_turn(p, "branch", planned)
        branch.expected = branch_checkpoint(shared, p.units, mode.drops_unit)
        case.add(branch)
        conversation.play_turn(p, branch, prompt, first.salt)
        if not case.ok:
            case.add(
                problem=WORKLOAD.failure(
                    f"a budget of {budget} tokens a step against the default of "
                    f"{default_id}"
                )
            )
    assert case.record is not None
    return case.record


WORKLOAD = harness.Workload(
    "small-budget",
    "under a small budget, hits and outputs equal those under the default budget",
    "v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split "
    "(every chunk ends at or before last_cache_position)",
    play=play,
    own_servers=True,
)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The oracle: where a hybrid model's checkpoints fall (the expected hit and
the largest possible hit of every turn of a conversation), and the check of
one turn's hit and recompute (:func:`check_turn`). Pure: no server, no
clock."""

from dataclasses import dataclass, field

from tests.models.hybrid_prefix_cache.harness.deployment import Units
from tests.models.utils import check_logprobs_close

# The conversation: the first prompt spans FIRST_PROMPT_BLOCKS blocks plus an
# unaligned tail; every later turn appends TURN_TOKENS tokens (the previous
# output, then random token ids); the last turn resends the last prompt.
NUM_TURNS = 3
FIRST_PROMPT_BLOCKS = 3
FIRST_PROMPT_TAIL = 37
TURN_TOKENS = 777
NUM_LOGPROBS = 5


def prompt_end_checkpoint(prompt_len: int, unit: int, drops_unit: bool) -> int:
    """Where vLLM saves the Mamba state at the end of a ``prompt_len``-token
    prefill, which is also the deepest hit a later request can resume at.

    From v1/kv_cache_interface.py, get_mamba_prefill_checkpoint_position
    (``unit`` is the hit unit, vLLM's cache_hit_alignment_tokens): without
    an EAGLE-style drafter, the last unit boundary strictly inside the prompt
    (the last token is recomputed for its logits); with one, the last unit
    boundary within the prompt, one unit lower (the lookup in
    v1/core/kv_cache_coordinator.py reads that unit as the drafter's proof
    and drops it).
    """
    limit = prompt_len if drops_unit else prompt_len - 1
    checkpoint = limit // unit * unit
    if drops_unit:
        checkpoint -= unit
    return max(checkpoint, 0)


def expected_cached(prev_len: int, unit: int, drops_unit: bool) -> int:
    """The hit a turn must reach: the prompt-end checkpoint of the previous
    prompt of ``prev_len`` tokens (0 on the first turn)."""
    if prev_len <= 0:
        return 0
    return prompt_end_checkpoint(prev_len, unit, drops_unit)


def expected_resend(prompt_len: int, unit: int, drops_unit: bool) -> int:
    """The hit of an exact resend of a ``prompt_len``-token prompt: its own
    prompt-end checkpoint. With DSpark and unit 128, 7449 tokens hit 7296."""
    return prompt_end_checkpoint(prompt_len, unit, drops_unit)


def hit_bound(prev_len: int, prompt_len: int, unit: int) -> int:
    """The largest hit that can be real: the last unit boundary within both
    what this salt stored before (the previous prompt) and the current
    prompt minus its last token."""
    return min(prev_len, prompt_len - 1) // unit * unit


def impossible_hit(cached: int, prev_len: int, prompt_len: int, unit: int) -> str:
    """Why ``cached`` cannot be a real hit, or "" if it can.

    A hit lands on a ``unit`` boundary, cannot reach past what this salt's
    earlier requests stored (the previous prompt), and always leaves at
    least the last prompt token to compute.
    """
    if cached % unit:
        return f"cached {cached} is not a multiple of the hit unit {unit}"
    if cached > prev_len:
        return f"cached {cached} exceeds the previous prompt's {prev_len} tokens"
    if cached >= prompt_len:
        return f"cached {cached} leaves nothing of the {prompt_len}-token prompt"
    return ""


@dataclass(frozen=True)
class PlannedTurn:
    """One request of a conversation, as sent: its prompt length, the
    length of the previous prompt of the same salt, and whether it resends
    that previous prompt exactly."""

    index: int
    prompt_len: int
    prev_len: int
    resend: bool = False


def plan_turns(first_len: int) -> list[PlannedTurn]:
    """The requests of a conversation whose first prompt has ``first_len``
    tokens: NUM_TURNS turns, each TURN_TOKENS longer than the one before,
    then an exact resend of the last prompt."""
    turns, prev_len = [], 0
    for index in range(NUM_TURNS):
        prompt_len = first_len + index * TURN_TOKENS
        turns.append(PlannedTurn(index, prompt_len, prev_len))
        prev_len = prompt_len
    turns.append(PlannedTurn(NUM_TURNS, prev_len, prev_len, resend=True))
    return turns


def seen_lengths(prev_len: int, prompt_len: int, backoff: int) -> tuple[int, int]:
    """The previous and the current prompt's lengths as an instance that
    sees every prompt ``backoff`` tokens short has them (see
    :attr:`Deployment.cache_backoff`)."""
    return max(prev_len - backoff, 0), prompt_len - backoff


def expectation(
    turn: PlannedTurn, unit: int, drops_unit: bool, backoff: int = 0
) -> tuple[int, int]:
    """(expected hit, largest possible hit) of ``turn``, on an instance that
    sees every prompt ``backoff`` tokens short."""
    prev_len, prompt_len = seen_lengths(turn.prev_len, turn.prompt_len, backoff)
    return (
        expected_cached(prev_len, unit, drops_unit),
        hit_bound(prev_len, prompt_len, unit),
    )


@dataclass(frozen=True)
class Sample:
    """One completion: its greedy tokens, logprobs and prompt usage."""

    token_ids: list[int]
    text: str
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    prompt_tokens: int
    cached_tokens: int
    kv_transfer_params: dict | None = None

    def as_tokens_text_logprobs(self) -> tuple:
        return (self.token_ids, self.text, self.top_logprobs)


@dataclass
class Turn:
    conversation: str
    index: int
    prompt_len: int
    prev_len: int
    expected: int
    bound: int = 0
    resend: bool = False
    # Trailing tokens the caching instance does not see (P/D prefiller).
    backoff: int = 0
    output: Sample | None = None
    recompute: Sample | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    # As played, for the record and a failing case's reproducer.
    prompt: list[int] = field(default_factory=list, repr=False)
    salt: str = ""

    @property
    def name(self) -> str:
        what = "resend" if self.resend else f"turn {self.index}"
        return f"{self.conversation} {what}".strip()

    @property
    def max_logprob_diff(self) -> float | None:
        if self.output is None or self.recompute is None:
            return None
        if self.output.token_ids != self.recompute.token_ids:
            return None
        pairs = zip(self.output.token_logprobs, self.recompute.token_logprobs)
        return max((abs(a - b) for a, b in pairs), default=0.0)


def _top(sample: Sample, index: int) -> str:
    ranked = sorted(sample.top_logprobs[index].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{token}:{logprob:.4f}" for token, logprob in ranked)


def first_divergence(hit: Sample, recompute: Sample) -> str:
    """Where the greedy tokens of a hit and its recompute part, with both
    sides' top-k there; "" if they agree."""
    for i, (a, b) in enumerate(zip(hit.token_ids, recompute.token_ids)):
        if a != b:
            return (
                f"first diverging token at index {i}: the hit chose {a} "
                f"(top-{NUM_LOGPROBS}: {_top(hit, i)}), the recompute chose {b} "
                f"(top-{NUM_LOGPROBS}: {_top(recompute, i)})"
            )
    if len(hit.token_ids) != len(recompute.token_ids):
        return (
            f"the hit has {len(hit.token_ids)} tokens, the recompute "
            f"{len(recompute.token_ids)}"
        )
    return ""


def check_turn(
    turn: Turn,
    units: Units,
    logprob_atol: float | None,
    compare_logprobs: bool = True,
) -> None:
    """Record in ``turn.problems`` every way this turn is wrong, and in
    ``turn.notices`` what is legitimate but unexpected."""
    out, rec = turn.output, turn.recompute
    assert out is not None and rec is not None
    name = turn.name
    prev_seen, prompt_seen = seen_lengths(turn.prev_len, turn.prompt_len, turn.backoff)
    for sample, what in ((out, "hit"), (rec, "recompute")):
        if sample.prompt_tokens != turn.prompt_len:
            turn.problems.append(
                f"{name}: the {what} reports {sample.prompt_tokens} prompt "
                f"tokens, sent {turn.prompt_len}"
            )
    if rec.cached_tokens != 0:
        turn.problems.append(
            f"{name}: the recompute under a fresh cache_salt reported "
            f"{rec.cached_tokens} cached tokens, expected 0 (is cache_salt "
            f"ignored?)"
        )
    if out.cached_tokens < turn.expected:
        vacuous = " (no hit at all)" if out.cached_tokens == 0 else ""
        turn.problems.append(
            f"{name}: cached {out.cached_tokens} < expected checkpoint "
            f"{turn.expected} of the previous {turn.prev_len}-token prompt "
            f"(hit unit {units.hit}): a checkpoint was lost{vacuous}"
        )
    why = impossible_hit(out.cached_tokens, prev_seen, prompt_seen, units.hit)
    if why:
        turn.problems.append(
            f"{name}: impossible hit, over-reported: {why} (bound {turn.bound})"
        )
    elif out.cached_tokens > turn.expected:
        turn.notices.append(
            f"{name}: cached {out.cached_tokens} is above the expected "
            f"{turn.expected} but within the bound {turn.bound}"
        )
    if not compare_logprobs:
        return
    # Where a tolerance was measured, any token difference is wrong. Where
    # none was (near-tied logits, and a hit and a miss that run different
    # GEMM shapes on GPUs, vLLM #33123), a divergence is legitimate as long
    # as check_logprobs_close accepts it, as upstream's test holds it.
    divergence = first_divergence(out, rec)
    if divergence and logprob_atol is not None:
        turn.problems.append(f"{name}: output differs from the recompute: {divergence}")
    elif divergence:
        turn.notices.append(f"{name}: {divergence} (check_logprobs_close decides)")
    try:
        check_logprobs_close(
            outputs_0_lst=[rec.as_tokens_text_logprobs()],
            outputs_1_lst=[out.as_tokens_text_logprobs()],
            name_0=f"{name} recompute",
            name_1=f"{name} cache hit",
        )
    except AssertionError as e:
        turn.problems.append(
            f"{name}: output differs from the recompute beyond "
            f"check_logprobs_close: {e}"
        )
        return
    diff = turn.max_logprob_diff
    if logprob_atol is not None and diff is not None and diff > logprob_atol:
        turn.problems.append(
            f"{name}: sampled logprobs differ from the recompute by {diff:.3g} "
            f"> {logprob_atol:g}, with the same tokens: the restored state is "
            f"wrong"
        )

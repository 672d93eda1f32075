# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How a turn is judged: its hit against vLLM's rules (rules.py), and its
outputs against the request that took its numerical path
(:func:`check_turn`); a case's comparisons across two paths against the
noise its cold controls measured (:func:`check_paths`). Pure: no server,
no clock."""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tests.models.hybrid_prefix_cache.harness.deployment import Units
from tests.models.hybrid_prefix_cache.harness.rules import (
    impossible_hit,
    seen_lengths,
)
from tests.models.utils import check_logprobs_close

NUM_LOGPROBS = 5


# Where no construction makes two paths compute alike (a GPU P/D decoder's
# last prompt token, a GPU hit resumed inside a block, a batch on a binding
# without batch_invariant_env), a comparison across them is held to this many
# times the largest gap of the case's cold controls (:func:`path_noise`):
# bf16 noise comes in powers of two, and 4 is two binades. The CPU tier holds
# no comparison to it; findings/path-noise-margin.md has the records.
PATH_NOISE_MARGIN = 4
# A heavy-tailed noise needs enough pairs for its largest gap to bound it: at
# least as many as the reference conversation has turns with its resend
# (conversation.measure_path_noise adds them); findings/path-noise-margin.md.
PATH_NOISE_MIN_PAIRS = 4


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
    # Under P/D, the decoder's own prefix-cache hit for its leg (its
    # prefix_cache_hits delta), where the harness read it.
    decoder_hit: int | None = None

    def as_tokens_text_logprobs(self) -> tuple:
        return (self.token_ids, self.text, self.top_logprobs)

    def shifted(self, tokens: int) -> "Sample":
        """This sample without its first ``tokens`` generated tokens."""
        return self._sliced(slice(tokens, None))

    def head(self, tokens: int) -> "Sample":
        """This sample's first ``tokens`` generated tokens."""
        return self._sliced(slice(None, tokens))

    def _sliced(self, part: slice) -> "Sample":
        return replace(
            self,
            token_ids=self.token_ids[part],
            text="",
            token_logprobs=self.token_logprobs[part],
            top_logprobs=self.top_logprobs[part],
        )


@dataclass(frozen=True)
class Comparison:
    """Two samples of a turn compared: ``what`` names the pair, ``gap`` is
    their largest sampled-logprob difference up to where they part
    (:func:`logprob_gap`), ``tolerance`` what it was held to (None: only
    check_logprobs_close), ``same_path`` whether both took one numerical
    path (then any token difference fails)."""

    what: str
    gap: float
    tolerance: float | None
    same_path: bool
    divergence: str = ""

    @property
    def judged(self) -> str:
        """How, for the record: exactly, within the binding's same-path
        tolerance, within a measured path noise, or by check_logprobs_close."""
        if self.tolerance is None:
            return "check_logprobs_close"
        if not self.same_path:
            return "measured noise"
        return "exact" if self.tolerance == 0 else "same-path tolerance"


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
    # A cold request of the same prompt (fresh salt) sent as the hit was:
    # under P/D through the same prefiller, transfer and decoder, the hit's
    # same-path control; batched, in the same wave of requests as the hit
    # (then the recompute runs alone, after the wave).
    twin: Sample | None = None
    # Under P/D, a cold control of the decode-against-prefill noise: the
    # decoder alone on the prompt and the recompute's first token, whose
    # first logprob comes from the prefill path where the recompute's second
    # came from the decode path.
    control: Sample | None = None
    # More of them, where a case has fewer than PATH_NOISE_MIN_PAIRS cold
    # control pairs: the i-th on the prompt and the recompute's first i + 2
    # tokens.
    more_controls: list[Sample] = field(default_factory=list)
    # Where the P/D instances are one configuration, the transfer's exact
    # counterparts of the recompute (harness.transfer): the relay through
    # the pair, and the prompt served whole by the prefiller alone.
    relay: Sample | None = None
    prefiller_alone: Sample | None = None
    batched: bool = False
    # Batched on a server that computes each request as alone
    # (Binding.batch_invariant_env): the hit is on its recompute's path.
    invariant: bool = False
    # Where the binding is exact on block boundaries only
    # (Binding.exact_on_blocks): the hit, or an earlier request of its salt
    # that computed the state it restored, resumed inside a block, where a
    # state was stored and reloaded that its recompute kept in the kernel;
    # held to the case's measured noise (check_paths), not bit for bit.
    mid_block: bool = False
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    # As played, for the record and a failing case's reproducer.
    prompt: list[int] = field(default_factory=list, repr=False)
    salt: str = ""

    @property
    def name(self) -> str:
        what = "resend" if self.resend else f"turn {self.index}"
        return f"{self.conversation} {what}".strip()

    @property
    def restored(self) -> int:
        """The tokens the hit restored from the prefix cache."""
        return 0 if self.output is None else self.output.cached_tokens

    @property
    def max_logprob_diff(self) -> float | None:
        """The hit's sampled-logprob gap to its recompute, where both chose
        the same tokens (None where they did not, or one is missing)."""
        if self.output is None or self.recompute is None:
            return None
        if self.output.token_ids != self.recompute.token_ids:
            return None
        return logprob_gap(self.output, self.recompute)[0]


def _top(sample: Sample, index: int) -> str:
    ranked = sorted(sample.top_logprobs[index].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{token}:{logprob:.4f}" for token, logprob in ranked)


def _parting(a: Sample, b: Sample) -> int:
    """The index of the first generated token where ``a`` and ``b`` differ
    (their common length if they never do)."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            return i
    return min(len(a.token_ids), len(b.token_ids))


def first_divergence(
    hit: Sample, recompute: Sample, names: tuple[str, str] = ("hit", "recompute")
) -> str:
    """Where the greedy tokens of two samples (by default a hit and its
    recompute) part, with both sides' top-k there; "" if they agree."""
    a_name, b_name = names
    i = _parting(hit, recompute)
    if i < min(len(hit.token_ids), len(recompute.token_ids)):
        a, b = hit.token_ids[i], recompute.token_ids[i]
        return (
            f"first diverging token at index {i}: the {a_name} chose {a} "
            f"(top-{NUM_LOGPROBS}: {_top(hit, i)}), the {b_name} chose {b} "
            f"(top-{NUM_LOGPROBS}: {_top(recompute, i)})"
        )
    if len(hit.token_ids) != len(recompute.token_ids):
        return (
            f"the {a_name} has {len(hit.token_ids)} tokens, the {b_name} "
            f"{len(recompute.token_ids)}"
        )
    return ""


def logprob_gap(a: Sample, b: Sample) -> tuple[float, int | None]:
    """The largest difference between the sampled tokens' logprobs of ``a``
    and ``b`` while both chose the same tokens after the same context, and
    the index where their tokens part (None if they never do). Where they
    part, check_logprobs_close and :func:`near_tie` judge."""
    part = _parting(a, b)
    gaps = [abs(x - y) for x, y in zip(a.token_logprobs[:part], b.token_logprobs)]
    parted = part < min(len(a.token_ids), len(b.token_ids))
    return max(gaps, default=0.0), part if parted else None


def near_tie(a: Sample, b: Sample, index: int, tolerance: float) -> bool:
    """Whether path noise within ``tolerance`` can explain where ``a`` and
    ``b`` part at ``index``: the token each side chose there moves by no
    more than ``tolerance`` to the other side, as the sampled tokens' path
    noise is measured (the same token's logprob on the two paths). Where
    the other side does not rank that token, it sits at or below the other
    side's lowest ranked logprob, so the move is at least the difference to
    that; a parting is beyond the noise only where a move provably is."""
    top_a, top_b = a.top_logprobs[index], b.top_logprobs[index]
    for token, mine, other in (
        (a.token_ids[index], top_a, top_b),
        (b.token_ids[index], top_b, top_a),
    ):
        here = mine.get(token)
        if here is None:
            return False
        there = other.get(token)
        moved = abs(here - there) if there is not None else here - min(other.values())
        if moved > tolerance:
            return False
    return True


@dataclass(frozen=True)
class PathNoise:
    """The path noise of a case: the largest gap among its cold controls
    (pairs of requests that restored nothing and take the two paths that
    its cross-path comparisons take), how many pairs it was measured on,
    and the tolerance it gives (``margin`` times it)."""

    floor: float
    pairs: int
    margin: float = PATH_NOISE_MARGIN

    @property
    def tolerance(self) -> float:
        return self.margin * self.floor

    def held_to(self, logprob_atol: float | None) -> float | None:
        """What a comparison across the two paths is held to: the larger of
        ``logprob_atol`` and this noise's tolerance (None where
        ``logprob_atol`` is: check_logprobs_close alone)."""
        return None if logprob_atol is None else max(logprob_atol, self.tolerance)

    def __str__(self) -> str:
        return (
            f"path noise {self.floor:.3g} (largest gap over {self.pairs} cold "
            f"control pairs of this case) x margin {self.margin:g} = tolerance "
            f"{self.tolerance:.3g}"
        )


def cold_pairs(turn: Turn) -> list[tuple[Sample, Sample]]:
    """The cold control pairs of ``turn``: two samples that restored
    nothing from a prefix cache and differ only in their numerical path.

    Batched, the batched cold twin against the recompute alone, and the hit
    against the recompute where the hit restored nothing. Under P/D, the
    recompute from its second token on against the control: the same
    context, one token computed in the decode path against the prefill
    path, as a P/D decoder computes the last prompt token against the
    decoder alone (no transfer on either side); and so on for each of its
    ``more_controls``, one token further each.
    """
    rec = turn.recompute
    if rec is None:
        return []
    if turn.batched:
        if turn.invariant:
            return []
        pairs = [] if turn.twin is None else [(turn.twin, rec)]
        if turn.output is not None and turn.restored == 0:
            pairs.append((turn.output, rec))
        return pairs
    if turn.control is None:
        return []
    controls = [turn.control, *turn.more_controls]
    return [(rec.shifted(shift), c) for shift, c in enumerate(controls, start=1)]


def control_shifts(turns: Sequence[Turn]) -> list[tuple[Turn, int]]:
    """The further controls that a case of ``turns`` needs to reach
    PATH_NOISE_MIN_PAIRS cold control pairs: (the turn, how many tokens of
    its recompute the control's prompt takes), taken round the turns that
    have a P/D control, the last first, one token further each round, and
    leaving at least one of the recompute's tokens to compare. None where
    the case has enough pairs or no such turn."""
    missing = PATH_NOISE_MIN_PAIRS - sum(len(cold_pairs(turn)) for turn in turns)
    eligible = [
        (turn, len(turn.recompute.token_ids))
        for turn in reversed(turns)
        if turn.recompute is not None and turn.control is not None
    ]
    shifts: list[tuple[Turn, int]] = []
    further = 0
    while len(shifts) < missing:
        round_ = [
            (turn, shift)
            for turn, tokens in eligible
            if (shift := 2 + len(turn.more_controls) + further) < tokens
        ]
        if not round_:
            break
        shifts += round_[: missing - len(shifts)]
        further += 1
    return shifts


def pairs_noise(pairs: Sequence[tuple[Sample, Sample]]) -> PathNoise | None:
    """The path noise that cold control ``pairs`` show: their largest
    sampled-logprob gap; None where there are none."""
    if not pairs:
        return None
    return PathNoise(max(logprob_gap(a, b)[0] for a, b in pairs), len(pairs))


def path_noise(turns: Sequence[Turn]) -> PathNoise | None:
    """The path noise of a case's ``turns``, measured on their cold
    controls; None where the case has none (every comparison of a request
    played alone is on one path)."""
    return pairs_noise([pair for turn in turns for pair in cold_pairs(turn)])


def compare(
    turn: Turn,
    a: Sample,
    b: Sample,
    names: tuple[str, str],
    tolerance: float | None,
    same_path: bool,
) -> str:
    """Compare ``a`` with ``b`` (named by ``names``) under ``tolerance``;
    record the comparison on ``turn`` and return why it fails ("": it does
    not). A divergence fails on one path, and across paths unless it
    is a near tie within the tolerance (:func:`near_tie`: the measured noise
    decides, not check_logprobs_close's fixed top-k, which a path noise as
    large as a top-k's spread would fail). None: check_logprobs_close alone
    decides (GPUs, where no tolerance is measured)."""
    gap, part = logprob_gap(a, b)
    divergence = first_divergence(a, b, names)
    turn.comparisons.append(
        Comparison(f"{names[0]} vs {names[1]}", gap, tolerance, same_path, divergence)
    )
    if tolerance is None:
        try:
            check_logprobs_close(
                outputs_0_lst=[b.as_tokens_text_logprobs()],
                outputs_1_lst=[a.as_tokens_text_logprobs()],
                name_0=f"{turn.name} {names[1]}",
                name_1=f"{turn.name} {names[0]}",
            )
        except AssertionError as e:
            return f"beyond check_logprobs_close: {e}"
        if divergence:
            turn.notices.append(f"{turn.name}: {divergence} (check_logprobs_close)")
        return ""
    if divergence:
        if same_path:
            return f"on the same path: {divergence}"
        if part is None or not near_tie(a, b, part, tolerance):
            return f"not a near tie within {tolerance:.3g}: {divergence}"
        turn.notices.append(
            f"{turn.name}: near tie within the path tolerance {tolerance:.3g}: "
            f"{divergence}"
        )
    if gap > tolerance:
        return f"sampled logprobs differ by {gap:.3g} > {tolerance:.3g}"
    return ""


def _resend_problems(turn: Turn, units: Units, drops_unit: bool) -> list[str]:
    """A resend hits exactly the rule's checkpoint, as upstream's Kimi-K3
    test asserts: anything else fails, naming the rule."""
    cached = turn.restored
    if cached == turn.expected:
        return []
    _, seen = seen_lengths(turn.prev_len, turn.prompt_len, turn.backoff)
    return [
        f"{turn.name}: cached {cached} != {turn.expected}, the checkpoint of "
        f"the resent {seen}-token prompt by vLLM's rule (v1/kv_cache_interface"
        f".py get_mamba_prefill_checkpoint_position, hit unit {units.hit}, "
        f"drafter drops a unit: {drops_unit})"
    ]


def check_turn(
    turn: Turn,
    units: Units,
    logprob_atol: float | None,
    compare_logprobs: bool = True,
    drops_unit: bool = False,
) -> None:
    """Record in ``turn.problems`` every way this turn is wrong, and in
    ``turn.notices`` what is legitimate but unexpected: its hit against the
    rule, its recompute's salt, and its hit against the request that took
    the same numerical path (the cold P/D twin; the recompute, where both
    ran alone on one server), exactly where ``logprob_atol`` is 0. The
    comparisons across paths wait for the case's path noise
    (:func:`check_paths`)."""
    out, rec = turn.output, turn.recompute
    assert out is not None and rec is not None
    name = turn.name
    prev_seen, prompt_seen = seen_lengths(turn.prev_len, turn.prompt_len, turn.backoff)
    for sample, what in ((out, "hit"), (rec, "recompute"), (turn.twin, "cold twin")):
        if sample is not None and sample.prompt_tokens != turn.prompt_len:
            turn.problems.append(
                f"{name}: the {what} reports {sample.prompt_tokens} prompt "
                f"tokens, sent {turn.prompt_len}"
            )
    for sample, what in ((out, "hit"), (rec, "recompute"), (turn.twin, "cold twin")):
        if sample is not None and not all(map(math.isfinite, sample.token_logprobs)):
            turn.problems.append(
                f"{name}: the {what} sampled tokens with non-finite logprobs "
                f"{sample.token_logprobs}: the model computed NaN or inf"
            )
    for sample, what in ((rec, "recompute"), (turn.twin, "cold twin")):
        if sample is not None and sample.cached_tokens != 0:
            turn.problems.append(
                f"{name}: the {what} under a fresh cache_salt reported "
                f"{sample.cached_tokens} cached tokens, expected 0 (is "
                f"cache_salt ignored?)"
            )
    why = impossible_hit(out.cached_tokens, prev_seen, prompt_seen, units.hit)
    if why:
        turn.problems.append(
            f"{name}: impossible hit, over-reported: {why} (bound {turn.bound})"
        )
    elif turn.resend:
        turn.problems += _resend_problems(turn, units, drops_unit)
    elif out.cached_tokens < turn.expected:
        vacuous = " (no hit at all)" if out.cached_tokens == 0 else ""
        turn.problems.append(
            f"{name}: cached {out.cached_tokens} < expected checkpoint "
            f"{turn.expected} of the previous {turn.prev_len}-token prompt "
            f"(hit unit {units.hit}): a checkpoint was lost{vacuous}"
        )
    elif out.cached_tokens > turn.expected:
        turn.notices.append(
            f"{name}: cached {out.cached_tokens} is above the expected "
            f"{turn.expected} but within the bound {turn.bound}"
        )
    # The cold P/D twin takes the hit's path whatever the TP sizes; a
    # recompute does where the hit ran alone on the one server, or batched
    # on one that computes each request as alone. Another batched hit, and
    # one that resumed mid-block where only block boundaries are exact, have
    # no request on their path (check_paths).
    if (turn.batched and not turn.invariant) or turn.mid_block:
        return
    if turn.twin is not None:
        reference, other = turn.twin, "cold twin"
    elif not compare_logprobs:
        return
    elif turn.invariant:
        reference, other = rec, "recompute alone (batch-invariant server)"
    else:
        reference, other = rec, "recompute"
    why = compare(turn, out, reference, ("hit", other), logprob_atol, True)
    if not why:
        return
    if turn.invariant:
        turn.problems.append(_batch_problem(turn, why))
    elif turn.restored:
        turn.problems.append(
            f"{name}: the hit, {turn.restored} tokens restored from the prefix "
            f"cache, differs from its {other} on the same path, {why}: the "
            f"restored state is wrong"
        )
    else:
        turn.problems.append(
            f"{name}: restored nothing, yet differs from its {other} on the "
            f"same path, {why}: the path is not deterministic"
        )


def _batch_problem(turn: Turn, why: str) -> str:
    """Why a hit batched on a server that computes each request as alone
    fails against its recompute alone."""
    if turn.restored:
        return (
            f"{turn.name}: the batched hit, {turn.restored} tokens restored "
            f"from the prefix cache, differs from its recompute alone on a "
            f"server that computes each request as alone, {why}: the state "
            f"restored in a shared batch is wrong"
        )
    return (
        f"{turn.name}: restored nothing, yet the batched request differs from "
        f"its recompute alone on a server that computes each request as "
        f"alone, {why}: the state it carried between prefill steps in a "
        f"shared batch is wrong, or its arithmetic depends on its batch"
    )


def check_paths(
    turns: Sequence[Turn], logprob_atol: float | None, compare_logprobs: bool = True
) -> PathNoise | None:
    """Hold every comparison across two numerical paths of a case to the
    path noise of its cold controls (:func:`path_noise`): batched, each hit
    against its batched cold twin; a hit that resumed mid-block where only
    block boundaries are exact (:attr:`Turn.mid_block`), against the request
    of its path; under P/D, each cold twin, decoded from the transferred
    state, against the decoder's recompute alone (the transfer check). Where
    ``logprob_atol`` is None, check_logprobs_close alone decides. Returns
    the path noise, for the record."""
    noise = path_noise(turns)
    if noise is None or not compare_logprobs:
        return noise
    tolerance = noise.held_to(logprob_atol)
    for turn in turns:
        if turn.recompute is None:
            continue  # a resend's cold first request
        if turn.batched and turn.output is not None and turn.twin is not None:
            names = ("hit", "batched cold twin")
            why = compare(turn, turn.output, turn.twin, names, tolerance, False)
            if why and turn.restored:
                turn.problems.append(
                    f"{turn.name}: the batched hit, {turn.restored} tokens "
                    f"restored from the prefix cache, differs from its batched "
                    f"cold twin, {why} ({noise}): the restored state is wrong"
                )
            elif why:
                turn.problems.append(
                    f"{turn.name}: restored nothing, yet differs from its batched "
                    f"cold twin, {why} ({noise}): path noise beyond what this "
                    f"case's cold controls showed"
                )
        elif turn.mid_block and turn.output is not None:
            other = "cold twin" if turn.twin is not None else "recompute"
            reference = turn.twin if turn.twin is not None else turn.recompute
            names = ("hit", f"{other} (mid-block: measured noise)")
            why = compare(turn, turn.output, reference, names, tolerance, False)
            if why:
                turn.problems.append(
                    f"{turn.name}: the hit, {turn.restored} tokens restored from "
                    f"the prefix cache mid-block, differs from its {other}, {why} "
                    f"({noise}): the restored state is wrong"
                )
        if turn.twin is not None and not turn.batched and turn.relay is None:
            names = ("cold twin", "decoder alone")
            why = compare(turn, turn.twin, turn.recompute, names, tolerance, False)
            if why:
                turn.problems.append(
                    f"{turn.name}: the decoder's output from the transferred KV "
                    f"and state (cold twin) differs from its own recompute, "
                    f"{why} ({noise}): the transferred state is wrong"
                )
    return noise

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How a turn is judged, purely: its hit by vLLM's rules (rules.py), its outputs against
the request on its own path (:func:`check_turn`); across paths: paths.py."""

import math
from collections.abc import Sequence
from dataclasses import FrozenInstanceError, dataclass, field, replace

from tests.models.hybrid_prefix_cache.harness.deployment import Units
from tests.models.hybrid_prefix_cache.harness.problems import Problem
from tests.models.hybrid_prefix_cache.harness.rules import impossible_hit, seen_lengths
from tests.models.utils import check_logprobs_close

NUM_LOGPROBS = 5
Names = tuple[str, str]  # what messages call two compared samples


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    text: str
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    prompt_tokens: int
    cached_tokens: int
    kv_transfer_params: dict | None = None
    # under P/D, the decoder's own prefix_cache_hits delta, where read
    decoder_hit: int | None = None

    def shifted(self, tokens: int) -> "Sample":
        return self._sliced(slice(tokens, None))

    def head(self, tokens: int) -> "Sample":
        return self._sliced(slice(None, tokens))

    def _sliced(self, part: slice) -> "Sample":
        lists = ("token_ids", "token_logprobs", "top_logprobs")
        return replace(self, text="", **{k: getattr(self, k)[part] for k in lists})


@dataclass(frozen=True)
class Comparison:
    """Two samples' :func:`logprob_gap`; ``tolerance`` None: check_logprobs_close."""

    what: str
    gap: float
    tolerance: float | None
    same_path: bool
    divergence: str = ""

    @property
    def judged(self) -> str:
        if self.tolerance is None:
            return "check_logprobs_close"
        if not self.same_path:
            return "measured noise"
        return "exact" if self.tolerance == 0 else "same-path tolerance"


@dataclass(frozen=True)
class Found:
    """What a check found on a turn, for the turn to take (:meth:`Turn.take`)."""

    problems: tuple[str, ...] = ()
    notices: tuple[str, ...] = ()
    comparisons: tuple[Comparison, ...] = ()

    def __add__(self, other: "Found") -> "Found":
        return Found(
            self.problems + other.problems,
            self.notices + other.notices,
            self.comparisons + other.comparisons,
        )


@dataclass
class Turn:
    conversation: str
    index: int
    prompt_len: int
    prev_len: int
    expected: int
    bound: int = 0
    resend: bool = False
    backoff: int = 0  # trailing tokens the caching instance doesn't see (P/D prefiller)
    output: Sample | None = None
    recompute: Sample | None = None
    # a cold request sent as the hit was: through P/D, or in the same wave
    twin: Sample | None = None
    # decoder alone on the prompt and the recompute's first token (more
    # controls: its first i + 2): the decode-against-prefill noise
    control: Sample | None = None
    more_controls: list[Sample] = field(default_factory=list)
    # the transfer's exact counterparts (paths.check_transfer)
    relay: Sample | None = None
    prefiller_alone: Sample | None = None
    batched: bool = False
    invariant: bool = False  # batched, batch-invariant server: on its recompute's path
    # batched at the servers' own threads: its prefill step is held to the
    # same prompt's alone, under a salt played alone (paths.check_prefill_steps)
    prefill_step: bool = False
    alone: Sample | None = None
    # resumed (or its salt did) mid-block, not exact there (Binding.exact_on_blocks)
    mid_block: bool = False
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    # as played, for the record and the reproducer
    prompt: list[int] = field(default_factory=list, repr=False)
    salt: str = ""
    # set by played(): the record's copy, which nothing writes again
    done: bool = field(default=False, repr=False, compare=False)

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("done"):
            raise FrozenInstanceError(f"{self.name} was played: its record is final")
        super().__setattr__(name, value)

    def take(self, found: Found) -> None:
        self.problems += found.problems
        self.notices += found.notices
        self.comparisons += found.comparisons

    def played(self) -> "Turn":
        """The record's copy, final: a problem added later is refused."""
        lists = ("more_controls", "problems", "notices", "comparisons", "prompt")
        return replace(self, done=True, **{k: tuple(getattr(self, k)) for k in lists})

    @property
    def name(self) -> str:
        what = "resend" if self.resend else f"turn {self.index}"
        return f"{self.conversation} {what}".strip()

    @property
    def restored(self) -> int:
        return 0 if self.output is None else self.output.cached_tokens

    @property
    def max_logprob_diff(self) -> float | None:
        """The hit's logprob gap to its recompute, where the tokens agree."""
        out, rec = self.output, self.recompute
        if out is None or rec is None or out.token_ids != rec.token_ids:
            return None
        return logprob_gap(out, rec)[0]


def take_each(turns: Sequence[Turn], found: Sequence[Found]) -> None:
    for turn, seen in zip(turns, found, strict=True):
        turn.take(seen)


def _top(sample: Sample, index: int) -> str:
    ranked = sorted(sample.top_logprobs[index].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{token}:{logprob:.4f}" for token, logprob in ranked)


def first_divergence(
    hit: Sample, recompute: Sample, names: Names = ("hit", "recompute")
) -> str:
    """Where two samples' tokens part, with both top-k there; "" if never."""
    i = logprob_gap(hit, recompute)[1]
    if i is not None:
        return (
            f"first diverging token at index {i}: the {names[0]} chose "
            f"{hit.token_ids[i]} (top-{NUM_LOGPROBS}: {_top(hit, i)}), the {names[1]} "
            f"chose {recompute.token_ids[i]} (top-{NUM_LOGPROBS}: {_top(recompute, i)})"
        )
    if len(hit.token_ids) != len(recompute.token_ids):
        return (
            f"the {names[0]} has {len(hit.token_ids)} tokens, the {names[1]} "
            f"{len(recompute.token_ids)}"
        )
    return ""


def logprob_gap(a: Sample, b: Sample) -> tuple[float, int | None]:
    """(largest sampled-logprob gap before the tokens part, where they part)"""
    pairs = enumerate(zip(a.token_ids, b.token_ids))
    part = next((i for i, (x, y) in pairs if x != y), None)
    end = min(len(a.token_ids), len(b.token_ids)) if part is None else part
    gaps = [abs(x - y) for x, y in zip(a.token_logprobs[:end], b.token_logprobs)]
    return max(gaps, default=0.0), part


def near_tie(a: Sample, b: Sample, index: int, tolerance: float) -> bool:
    """Whether each chosen token at ``index`` moves by at most ``tolerance`` (an
    unranked one by at least the gap to the other side's lowest ranked logprob)."""
    for x, y in ((a, b), (b, a)):
        mine, other = x.top_logprobs[index], y.top_logprobs[index]
        here, there = mine.get(x.token_ids[index]), other.get(x.token_ids[index])
        if here is None:
            return False
        moved = abs(here - there) if there is not None else here - min(other.values())
        if moved > tolerance:
            return False
    return True


def compare(
    name: str, a: Sample, b: Sample, names: Names, atol: float | None, same_path: bool
) -> tuple[str, Found]:
    """Why ``a`` fails against ``b`` ("" if not), and what it found; across paths a
    parting may be a :func:`near_tie`, too wide for check_logprobs_close's top-k."""
    gap, part = logprob_gap(a, b)
    divergence = first_divergence(a, b, names)
    what = f"{names[0]} vs {names[1]}"
    seen = Found(comparisons=(Comparison(what, gap, atol, same_path, divergence),))
    if atol is None:
        try:
            check_logprobs_close(
                outputs_0_lst=[(b.token_ids, b.text, b.top_logprobs)],
                outputs_1_lst=[(a.token_ids, a.text, a.top_logprobs)],
                name_0=f"{name} {names[1]}",
                name_1=f"{name} {names[0]}",
            )
        except AssertionError as e:
            return f"beyond check_logprobs_close: {e}", seen
        if divergence:
            seen += Found(notices=(f"{name}: {divergence} (check_logprobs_close)",))
        return "", seen
    if divergence:
        if same_path:
            return f"on the same path: {divergence}", seen
        if part is None or not near_tie(a, b, part, atol):
            return f"not a near tie within {atol:.3g}: {divergence}", seen
        notice = f"{name}: near tie within the path tolerance {atol:.3g}: {divergence}"
        seen += Found(notices=(notice,))
    if gap > atol:
        return f"sampled logprobs differ by {gap:.3g} > {atol:.3g}", seen
    return "", seen


def check_turn(
    turn: Turn,
    units: Units,
    logprob_atol: float | None,
    compare_logprobs: bool = True,
    drops_unit: bool = False,
) -> Found:
    """The turn's hit by the rule, its salts, its output on its path (else paths.py)."""
    out, rec, name = turn.output, turn.recompute, turn.name
    assert out is not None and rec is not None
    cached = out.cached_tokens
    sent = ((out, "hit"), (rec, "recompute"), (turn.twin, "cold twin"))
    problems: list[str] = []
    notices: list[str] = []
    for sample, what in sent:
        if sample is not None and sample.prompt_tokens != turn.prompt_len:
            problems.append(
                f"{name}: the {what} reports {sample.prompt_tokens} prompt "
                f"tokens, sent {turn.prompt_len}"
            )
    for sample, what in sent:
        if sample is not None and not all(map(math.isfinite, sample.token_logprobs)):
            problems.append(
                f"{name}: the {what} sampled tokens with non-finite logprobs "
                f"{sample.token_logprobs}: the model computed NaN or inf"
            )
    for sample, what in sent[1:]:
        if sample is not None and sample.cached_tokens != 0:
            problems.append(
                f"{name}: the {what} under a fresh cache_salt reported "
                f"{sample.cached_tokens} cached tokens, expected 0 (is "
                f"cache_salt ignored?)"
            )
    prev_seen, prompt_seen = seen_lengths(turn.prev_len, turn.prompt_len, turn.backoff)
    if why := impossible_hit(cached, prev_seen, prompt_seen, units.hit):
        problems.append(
            f"{name}: impossible hit, over-reported: {why} (bound {turn.bound})"
        )
    elif turn.resend and cached != turn.expected:
        # a resend hits exactly the checkpoint, as upstream's Kimi-K3 test has
        text = (
            f"{name}: cached {cached} != {turn.expected}, the checkpoint of the "
            f"resent {prompt_seen}-token prompt by vLLM's rule (v1/"
            f"kv_cache_interface.py get_mamba_prefill_checkpoint_position, hit "
            f"unit {units.hit}, drafter drops a unit: {drops_unit})"
        )
        numbers = dict(cached=cached, expected=turn.expected, seen=prompt_seen)
        problems.append(Problem(text, "resend-missed", name, **numbers))
    elif cached < turn.expected:
        vacuous = " (no hit at all)" if cached == 0 else ""
        text = (
            f"{name}: cached {cached} < expected checkpoint {turn.expected} of the "
            f"previous {turn.prev_len}-token prompt (hit unit {units.hit}): a "
            f"checkpoint was lost{vacuous}"
        )
        numbers = dict(cached=cached, expected=turn.expected, previous=turn.prev_len)
        problems.append(Problem(text, "lost-checkpoint", name, **numbers))
    elif cached > turn.expected:
        notices.append(
            f"{name}: cached {cached} is above the expected {turn.expected} but "
            f"within the bound {turn.bound}"
        )
    found = Found(tuple(problems), tuple(notices))
    # no request on this hit's path: left to paths.check_paths
    if (turn.batched and not turn.invariant) or turn.mid_block:
        return found
    if turn.twin is not None:
        reference, other = turn.twin, "cold twin"
    elif not compare_logprobs:
        return found
    elif turn.invariant:
        reference, other = rec, "recompute alone (batch-invariant server)"
    else:
        reference, other = rec, "recompute"
    why, seen = compare(name, out, reference, ("hit", other), logprob_atol, True)
    found += seen
    if not why:
        return found
    if turn.invariant and cached:
        problem = (
            f"{name}: the batched hit, {cached} tokens restored from the prefix cache, "
            f"differs from its recompute alone on a server that computes each request "
            f"as alone, {why}: the state restored in a shared batch is wrong"
        )
    elif turn.invariant:
        problem = (
            f"{name}: restored nothing, yet the batched request differs from its "
            f"recompute alone on a server that computes each request as alone, "
            f"{why}: the state it carried between prefill steps in a shared batch "
            f"is wrong, or its arithmetic depends on its batch"
        )
    elif cached:
        text = (
            f"{name}: the hit, {cached} tokens restored from the prefix cache, differs "
            f"from its {other} on the same path, {why}: the restored state is wrong"
        )
        problem = Problem(text, "hit-apart", name, restored=cached, control=other)
    else:
        problem = (
            f"{name}: restored nothing, yet differs from its {other} on the same "
            f"path, {why}: the path is not deterministic"
        )
    return found + Found((problem,))

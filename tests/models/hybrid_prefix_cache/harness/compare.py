# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How a turn is judged: its hit against vLLM's rules (rules.py), its outputs
against the request on its numerical path (:func:`check_turn`). Pure; the
cross-path comparisons are in paths.py."""

import math
from collections.abc import Sequence
from dataclasses import FrozenInstanceError, dataclass, field, replace

from tests.models.hybrid_prefix_cache.harness.deployment import Units
from tests.models.hybrid_prefix_cache.harness.problems import Problem
from tests.models.hybrid_prefix_cache.harness.rules import (
    impossible_hit,
    seen_lengths,
)
from tests.models.utils import check_logprobs_close

NUM_LOGPROBS = 5


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
    # under P/D, the decoder's own prefix_cache_hits delta, where read
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
    """Two samples compared: their :func:`logprob_gap`, the ``tolerance`` held
    to (None: check_logprobs_close), and whether on one path (``same_path``)."""

    what: str
    gap: float
    tolerance: float | None
    same_path: bool
    divergence: str = ""

    @property
    def judged(self) -> str:
        """How it was judged, for the record."""
        if self.tolerance is None:
            return "check_logprobs_close"
        if not self.same_path:
            return "measured noise"
        return "exact" if self.tolerance == 0 else "same-path tolerance"


@dataclass(frozen=True)
class Found:
    """What a check found on a turn, returned for the turn to take
    (:meth:`Turn.take`): its problems, notices and the comparisons it made."""

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
    # trailing tokens the caching instance does not see (P/D prefiller)
    backoff: int = 0
    output: Sample | None = None
    recompute: Sample | None = None
    # a cold request sent as the hit was: through P/D, or in the same wave
    twin: Sample | None = None
    # decoder alone on the prompt and the recompute's first token (more
    # controls: its first i + 2): the decode-against-prefill noise
    control: Sample | None = None
    more_controls: list[Sample] = field(default_factory=list)
    # the transfer's exact counterparts (harness.transfer)
    relay: Sample | None = None
    prefiller_alone: Sample | None = None
    batched: bool = False
    # batched on a batch-invariant server: on its recompute's path
    invariant: bool = False
    # batched at the servers' own threads: its prefill step is held to the
    # same prompt's alone, under a salt played alone (harness/restores.py)
    prefill_step: bool = False
    alone: Sample | None = None
    # resumed (or its salt did) inside a block, where only block ends are
    # exact (Binding.exact_on_blocks): held to measured noise
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
        """Record what a check of this turn found (the checks return it)."""
        self.problems += found.problems
        self.notices += found.notices
        self.comparisons += found.comparisons

    def played(self) -> "Turn":
        """The turn as its record keeps it: a copy whose fields and lists no
        check can change any more (a problem added later is refused)."""
        sequences = ("more_controls", "problems", "notices", "comparisons", "prompt")
        return replace(
            self, **{name: tuple(getattr(self, name)) for name in sequences}, done=True
        )

    @property
    def name(self) -> str:
        what = "resend" if self.resend else f"turn {self.index}"
        return f"{self.conversation} {what}".strip()

    @property
    def restored(self) -> int:
        """Tokens restored from the prefix cache."""
        return 0 if self.output is None else self.output.cached_tokens

    @property
    def max_logprob_diff(self) -> float | None:
        """The hit's logprob gap to its recompute, where the tokens agree."""
        if self.output is None or self.recompute is None:
            return None
        if self.output.token_ids != self.recompute.token_ids:
            return None
        return logprob_gap(self.output, self.recompute)[0]


def take_each(turns: Sequence[Turn], found: Sequence[Found]) -> None:
    """Each of ``turns`` takes what a check of them all found for it."""
    for turn, seen in zip(turns, found, strict=True):
        turn.take(seen)


def _top(sample: Sample, index: int) -> str:
    ranked = sorted(sample.top_logprobs[index].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{token}:{logprob:.4f}" for token, logprob in ranked)


def _parting(a: Sample, b: Sample) -> int:
    """The first index where the tokens differ, else the common length."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            return i
    return min(len(a.token_ids), len(b.token_ids))


def first_divergence(
    hit: Sample, recompute: Sample, names: tuple[str, str] = ("hit", "recompute")
) -> str:
    """Where two samples' tokens part, with both top-k there; "" if never."""
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
    """(largest sampled-logprob gap before the tokens part, where they part or
    None)."""
    part = _parting(a, b)
    gaps = [abs(x - y) for x, y in zip(a.token_logprobs[:part], b.token_logprobs)]
    parted = part < min(len(a.token_ids), len(b.token_ids))
    return max(gaps, default=0.0), part if parted else None


def near_tie(a: Sample, b: Sample, index: int, tolerance: float) -> bool:
    """Whether noise within ``tolerance`` explains a parting at ``index``: each
    chosen token moves by at most that (an unranked one by at least the gap to
    the other side's lowest ranked logprob)."""
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


def compare(
    name: str,
    a: Sample,
    b: Sample,
    names: tuple[str, str],
    tolerance: float | None,
    same_path: bool,
) -> tuple[str, Found]:
    """``a`` against ``b`` on the turn ``name``: why it fails ("" if it does
    not), and the comparison and notices found. Across paths a divergence may
    be a :func:`near_tie` (check_logprobs_close's fixed top-k would fail noise
    that wide); None: check_logprobs_close."""
    gap, part = logprob_gap(a, b)
    divergence = first_divergence(a, b, names)
    what = f"{names[0]} vs {names[1]}"
    seen = Found(comparisons=(Comparison(what, gap, tolerance, same_path, divergence),))
    if tolerance is None:
        try:
            check_logprobs_close(
                outputs_0_lst=[b.as_tokens_text_logprobs()],
                outputs_1_lst=[a.as_tokens_text_logprobs()],
                name_0=f"{name} {names[1]}",
                name_1=f"{name} {names[0]}",
            )
        except AssertionError as e:
            return f"beyond check_logprobs_close: {e}", seen
        if divergence:
            notice = f"{name}: {divergence} (check_logprobs_close)"
            seen += Found(notices=(notice,))
        return "", seen
    if divergence:
        if same_path:
            return f"on the same path: {divergence}", seen
        if part is None or not near_tie(a, b, part, tolerance):
            return f"not a near tie within {tolerance:.3g}: {divergence}", seen
        notice = (
            f"{name}: near tie within the path tolerance {tolerance:.3g}: {divergence}"
        )
        seen += Found(notices=(notice,))
    if gap > tolerance:
        return f"sampled logprobs differ by {gap:.3g} > {tolerance:.3g}", seen
    return "", seen


def _resend_problems(turn: Turn, units: Units, drops_unit: bool) -> list[str]:
    """A resend hits exactly the checkpoint, as upstream's Kimi-K3 test has."""
    cached = turn.restored
    if cached == turn.expected:
        return []
    _, seen = seen_lengths(turn.prev_len, turn.prompt_len, turn.backoff)
    return [
        Problem(
            f"{turn.name}: cached {cached} != {turn.expected}, the checkpoint of "
            f"the resent {seen}-token prompt by vLLM's rule (v1/kv_cache_interface"
            f".py get_mamba_prefill_checkpoint_position, hit unit {units.hit}, "
            f"drafter drops a unit: {drops_unit})",
            "resend-missed",
            turn.name,
            cached=cached,
            expected=turn.expected,
            seen=seen,
        )
    ]


def check_turn(
    turn: Turn,
    units: Units,
    logprob_atol: float | None,
    compare_logprobs: bool = True,
    drops_unit: bool = False,
) -> Found:
    """The turn's problems and notices: its hit against the rule, its salts,
    and its output against the request on its path. Cross-path comparisons
    wait for the path noise (paths.check_paths)."""
    out, rec = turn.output, turn.recompute
    assert out is not None and rec is not None
    name = turn.name
    problems: list[str] = []
    notices: list[str] = []
    prev_seen, prompt_seen = seen_lengths(turn.prev_len, turn.prompt_len, turn.backoff)
    for sample, what in ((out, "hit"), (rec, "recompute"), (turn.twin, "cold twin")):
        if sample is not None and sample.prompt_tokens != turn.prompt_len:
            problems.append(
                f"{name}: the {what} reports {sample.prompt_tokens} prompt "
                f"tokens, sent {turn.prompt_len}"
            )
    for sample, what in ((out, "hit"), (rec, "recompute"), (turn.twin, "cold twin")):
        if sample is not None and not all(map(math.isfinite, sample.token_logprobs)):
            problems.append(
                f"{name}: the {what} sampled tokens with non-finite logprobs "
                f"{sample.token_logprobs}: the model computed NaN or inf"
            )
    for sample, what in ((rec, "recompute"), (turn.twin, "cold twin")):
        if sample is not None and sample.cached_tokens != 0:
            problems.append(
                f"{name}: the {what} under a fresh cache_salt reported "
                f"{sample.cached_tokens} cached tokens, expected 0 (is "
                f"cache_salt ignored?)"
            )
    why = impossible_hit(out.cached_tokens, prev_seen, prompt_seen, units.hit)
    if why:
        problems.append(
            f"{name}: impossible hit, over-reported: {why} (bound {turn.bound})"
        )
    elif turn.resend:
        problems += _resend_problems(turn, units, drops_unit)
    elif out.cached_tokens < turn.expected:
        vacuous = " (no hit at all)" if out.cached_tokens == 0 else ""
        problems.append(
            Problem(
                f"{name}: cached {out.cached_tokens} < expected checkpoint "
                f"{turn.expected} of the previous {turn.prev_len}-token prompt "
                f"(hit unit {units.hit}): a checkpoint was lost{vacuous}",
                "lost-checkpoint",
                name,
                cached=out.cached_tokens,
                expected=turn.expected,
                previous=turn.prev_len,
            )
        )
    elif out.cached_tokens > turn.expected:
        notices.append(
            f"{name}: cached {out.cached_tokens} is above the expected "
            f"{turn.expected} but within the bound {turn.bound}"
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
    if turn.invariant:
        return found + Found((_batch_problem(turn, why),))
    if turn.restored:
        apart = Problem(
            f"{name}: the hit, {turn.restored} tokens restored from the "
            f"prefix cache, differs from its {other} on the same path, {why}: "
            f"the restored state is wrong",
            "hit-apart",
            name,
            restored=turn.restored,
            control=other,
        )
        return found + Found((apart,))
    return found + Found(
        (
            f"{name}: restored nothing, yet differs from its {other} on the "
            f"same path, {why}: the path is not deterministic",
        )
    )


def _batch_problem(turn: Turn, why: str) -> str:
    """Why a batch-invariant hit fails against its recompute alone."""
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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A case's comparisons across two numerical paths: held to the path noise its cold
controls measure (:func:`check_paths`), or exactly where both compute alike: the P/D
transfer (:func:`check_transfer`), batched restores (:func:`check_prefill_steps`)."""

from collections.abc import Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness import compare
from tests.models.hybrid_prefix_cache.harness.compare import Found, Sample, Turn
from tests.models.hybrid_prefix_cache.harness.problems import Problem

# Cross-path comparisons (GPU and Kimi bindings only) are held to this many
# times the cold controls' largest gap: two bf16 binades. Over at least
# MIN_PAIRS pairs, for a heavy tail. See findings/path-noise-margin.md.
PATH_NOISE_MARGIN = 4
PATH_NOISE_MIN_PAIRS = 4


@dataclass(frozen=True)
class PathNoise:
    """A case's path noise: the largest gap among its cold control pairs."""

    floor: float
    pairs: int
    margin: float = PATH_NOISE_MARGIN

    @property
    def tolerance(self) -> float:
        return self.margin * self.floor

    def held_to(self, logprob_atol: float | None) -> float | None:
        return None if logprob_atol is None else max(logprob_atol, self.tolerance)

    def __str__(self) -> str:
        return (
            f"path noise {self.floor:.3g} (largest gap over {self.pairs} cold "
            f"control pairs of this case) x margin {self.margin:g} = tolerance "
            f"{self.tolerance:.3g}"
        )


def cold_pairs(turn: Turn) -> list[tuple[Sample, Sample]]:
    """Pairs that restored nothing and differ only in numerical path: batched twin
    and cold hit vs recompute; under P/D, shifted recompute vs each control."""
    rec = turn.recompute
    if rec is None or (turn.batched and turn.invariant):
        return []
    if turn.batched:
        cold = (turn.twin, turn.output if turn.restored == 0 else None)
        return [(sample, rec) for sample in cold if sample is not None]
    controls = [] if turn.control is None else [turn.control, *turn.more_controls]
    return [(rec.shifted(shift), c) for shift, c in enumerate(controls, start=1)]


def control_shifts(turns: Sequence[Turn]) -> list[tuple[Turn, int]]:
    """(turn, recompute tokens in the prompt) of the controls still needed for
    PATH_NOISE_MIN_PAIRS, round the turns with a control, last first."""
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
    if not pairs:
        return None
    return PathNoise(max(compare.logprob_gap(a, b)[0] for a, b in pairs), len(pairs))


def path_noise(turns: Sequence[Turn]) -> PathNoise | None:
    return pairs_noise([pair for turn in turns for pair in cold_pairs(turn)])


def check_paths(
    turns: Sequence[Turn], logprob_atol: float | None, compare_logprobs: bool = True
) -> tuple[PathNoise | None, list[Found]]:
    """The case's :func:`path_noise`, and what each of ``turns`` found held to it:
    batched hit vs twin, mid-block hit, P/D twin vs decoder alone."""
    noise = path_noise(turns)
    if noise is None or not compare_logprobs:
        return noise, [Found() for _ in turns]
    tolerance = noise.held_to(logprob_atol)
    return noise, [_across_paths(turn, noise, tolerance) for turn in turns]


def _across_paths(turn: Turn, noise: PathNoise, tolerance: float | None) -> Found:
    name, out, twin, rec = turn.name, turn.output, turn.twin, turn.recompute
    found = Found()
    problems: list[str] = []
    if rec is None:
        return found  # a resend's cold first request
    if turn.batched and out is not None and twin is not None:
        names = ("hit", "batched cold twin")
        why, found = compare.compare(name, out, twin, names, tolerance, False)
        if why and turn.restored:
            problems.append(
                f"{name}: the batched hit, {turn.restored} tokens restored from "
                f"the prefix cache, differs from its batched cold twin, {why} "
                f"({noise}): the restored state is wrong"
            )
        elif why:
            problems.append(
                f"{name}: restored nothing, yet differs from its batched cold "
                f"twin, {why} ({noise}): path noise beyond what this case's cold "
                f"controls showed"
            )
    elif turn.mid_block and out is not None:
        other = "cold twin" if twin is not None else "recompute"
        names = ("hit", f"{other} (mid-block: measured noise)")
        why, found = compare.compare(name, out, twin or rec, names, tolerance, False)
        if why:
            problems.append(
                f"{name}: the hit, {turn.restored} tokens restored from the "
                f"prefix cache mid-block, differs from its {other}, {why} "
                f"({noise}): the restored state is wrong"
            )
    if twin is not None and not turn.batched and turn.relay is None:
        names = ("cold twin", "decoder alone")
        why, seen = compare.compare(name, twin, rec, names, tolerance, False)
        found += seen
        if why:
            problems.append(
                f"{name}: the decoder's output from the transferred KV and state "
                f"(cold twin) differs from its own recompute, {why} ({noise}): "
                f"the transferred state is wrong"
            )
    return found + Found(tuple(problems))


def relay_prompt(turn: Turn) -> list[int]:
    assert turn.recompute is not None
    return [*turn.prompt, *turn.recompute.token_ids[: turn.backoff]]


def check_transfer(turn: Turn, logprob_atol: float | None) -> Found:
    """The P/D transfer, exact where both instances are one config: the relay held to
    the recompute a token on, the recompute to the prefiller alone (no decoder code)."""
    rec, name, found = turn.recompute, turn.name, Found()
    problems: list[str] = []
    assert rec is not None
    if turn.prefiller_alone is not None:
        names = ("decoder alone", "prefiller alone")
        why, seen = compare.compare(
            name, rec, turn.prefiller_alone, names, logprob_atol, True
        )
        found += seen
        if why:
            problems.append(
                f"{name}: the decoder alone differs from the prefiller serving the "
                f"same request whole, one configuration, {why}: the decoder "
                f"computes wrongly"
            )
    if turn.relay is not None:
        later = rec.shifted(turn.backoff)
        relay = turn.relay.head(len(later.token_ids))
        names = ("transfer relay", "decoder alone one token on")
        why, seen = compare.compare(name, relay, later, names, logprob_atol, True)
        found += seen
        if why:
            problems.append(
                f"{name}: the decoder, decoding the recompute's first token from "
                f"the prefiller's transferred KV and state, differs from the "
                f"decoder alone, which computed the same prompt in the same "
                f"chunks, {why}: the transferred state is wrong"
            )
    return found + Found(tuple(problems))


ALONE = "same prompt alone (prefill step)"

# Batched restores at the servers' own thread count (Play.prefill_step). Both resume
# from one checkpoint and compute the same tokens in one step: only the batch differs
# (a recompute chunks otherwise: findings/batch-noise-cpu.md). vLLM's CPU kernels
# compute prefill rows alike in any batch: attention splits the KV only for one-token
# query tiles (csrc/cpu/cpu_attn_impl.hpp, split_kv_q_token_num_threshold), the GEMM
# takes brgemm above 4 rows (csrc/cpu/sgl-kernels/gemm.h, can_use_brgemm). Later
# tokens' decode kernels differ batched: the concurrent cases judge those.


def check_prefill_steps(
    turns: Sequence[Turn], compare_logprobs: bool = True
) -> list[Found]:
    """Batched hits' prefill steps, exact to ``Turn.alone``'s; judging none fails."""
    found = [Found() for _ in turns]
    batched = [
        i for i, t in enumerate(turns) if t.prefill_step and t.batched and t.restored
    ]
    if not compare_logprobs or not batched:
        return found
    judged = 0
    for i in batched:
        turn, alone = turns[i], turns[i].alone
        assert turn.output is not None
        if alone is None or alone.cached_tokens != turn.restored:
            hit = None if alone is None else alone.cached_tokens
            notice = (
                f"{turn.name}: alone, the same prompt hit {hit} tokens, batched "
                f"{turn.restored}: not held on its prefill step"
            )
            found[i] += Found(notices=(notice,))
            continue
        judged += 1
        # the prefill step computes the first token
        hit, names = turn.output.head(1), ("hit", ALONE)
        why, found[i] = compare.compare(turn.name, hit, alone.head(1), names, 0.0, True)
        if why:
            text = (
                f"{turn.name}: the batched hit, {turn.restored} tokens restored "
                f"from the prefix cache, differs in its prefill step from the "
                f"same prompt alone on the same checkpoint, {why}: the state "
                f"restored in a shared batch, or the prefill from it, is wrong"
            )
            numbers = dict(restored=turn.restored, control=ALONE)
            found[i] += Found((Problem(text, "hit-apart", turn.name, **numbers),))
    if not judged:
        no_hit = (
            f"{turns[batched[-1]].name}: no batched hit hit what its prompt alone "
            f"did: the case judged no restore in a batch"
        )
        found[batched[-1]] += Found((no_hit,))
    return found

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A case's comparisons across two numerical paths, held to the path noise its
cold controls measure (:func:`check_paths`). Pure."""

from collections.abc import Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness.compare import (
    Found,
    Sample,
    Turn,
    compare,
    logprob_gap,
)

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
        """The larger of ``logprob_atol`` and the tolerance (None stays None)."""
        return None if logprob_atol is None else max(logprob_atol, self.tolerance)

    def __str__(self) -> str:
        return (
            f"path noise {self.floor:.3g} (largest gap over {self.pairs} cold "
            f"control pairs of this case) x margin {self.margin:g} = tolerance "
            f"{self.tolerance:.3g}"
        )


def cold_pairs(turn: Turn) -> list[tuple[Sample, Sample]]:
    """Pairs that restored nothing and differ only in numerical path: batched,
    twin (and a cold hit) against the recompute; under P/D, the recompute
    shifted against each control."""
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
    """The largest gap of ``pairs``; None without pairs."""
    if not pairs:
        return None
    return PathNoise(max(logprob_gap(a, b)[0] for a, b in pairs), len(pairs))


def path_noise(turns: Sequence[Turn]) -> PathNoise | None:
    """The path noise of ``turns``' cold controls; None without any."""
    return pairs_noise([pair for turn in turns for pair in cold_pairs(turn)])


def check_paths(
    turns: Sequence[Turn], logprob_atol: float | None, compare_logprobs: bool = True
) -> tuple[PathNoise | None, list[Found]]:
    """A case's cross-path comparisons (batched hit vs twin, mid-block hit,
    P/D twin vs decoder alone) held to :func:`path_noise`: that noise, and
    what each of ``turns`` found, in order."""
    noise = path_noise(turns)
    found = [Found() for _ in turns]
    if noise is None or not compare_logprobs:
        return noise, found
    tolerance = noise.held_to(logprob_atol)
    for i, turn in enumerate(turns):
        if turn.recompute is None:
            continue  # a resend's cold first request
        name, problems = turn.name, []
        if turn.batched and turn.output is not None and turn.twin is not None:
            names = ("hit", "batched cold twin")
            why, seen = compare(name, turn.output, turn.twin, names, tolerance, False)
            found[i] += seen
            if why and turn.restored:
                problems.append(
                    f"{name}: the batched hit, {turn.restored} tokens "
                    f"restored from the prefix cache, differs from its batched "
                    f"cold twin, {why} ({noise}): the restored state is wrong"
                )
            elif why:
                problems.append(
                    f"{name}: restored nothing, yet differs from its batched "
                    f"cold twin, {why} ({noise}): path noise beyond what this "
                    f"case's cold controls showed"
                )
        elif turn.mid_block and turn.output is not None:
            other = "cold twin" if turn.twin is not None else "recompute"
            reference = turn.twin if turn.twin is not None else turn.recompute
            names = ("hit", f"{other} (mid-block: measured noise)")
            why, seen = compare(name, turn.output, reference, names, tolerance, False)
            found[i] += seen
            if why:
                problems.append(
                    f"{name}: the hit, {turn.restored} tokens restored from "
                    f"the prefix cache mid-block, differs from its {other}, {why} "
                    f"({noise}): the restored state is wrong"
                )
        if turn.twin is not None and not turn.batched and turn.relay is None:
            names = ("cold twin", "decoder alone")
            why, seen = compare(
                name, turn.twin, turn.recompute, names, tolerance, False
            )
            found[i] += seen
            if why:
                problems.append(
                    f"{name}: the decoder's output from the transferred KV "
                    f"and state (cold twin) differs from its own recompute, "
                    f"{why} ({noise}): the transferred state is wrong"
                )
        found[i] += Found(tuple(problems))
    return noise, found

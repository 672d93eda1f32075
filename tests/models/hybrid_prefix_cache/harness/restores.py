# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Batched restores at the servers' own thread count (``Play.prefill_step``): each
hit's prefill step, its first sampled logprob, held to its recompute alone's within
the noise its wave's batched cold twins show there (:func:`check_prefill_steps`).

The first logprob is computed in the step that ends the prompt's prefill, from the
restored state. Later tokens are decode steps, where a batch and a request alone
take different kernels (findings/batch-noise-cpu.md); the concurrent cases judge
those. Pure."""

from collections.abc import Sequence

from tests.models.hybrid_prefix_cache.harness.compare import Sample, Turn, compare
from tests.models.hybrid_prefix_cache.harness.paths import PathNoise, pairs_noise

# What the tolerance is measured over, for the turn table and the record.
TWINS = "batched cold twins' prefill steps against their recomputes alone"


def prefill_step(sample: Sample) -> Sample:
    """The part of ``sample`` computed in its prefill step: its first token."""
    return sample.head(1)


def prefill_step_pairs(turns: Sequence[Turn]) -> list[tuple[Sample, Sample]]:
    """Each batched cold twin's prefill step against its recompute alone's."""
    return [
        (prefill_step(turn.twin), prefill_step(turn.recompute))
        for turn in turns
        if turn.prefill_step and turn.twin is not None and turn.recompute is not None
    ]


def prefill_step_noise(turns: Sequence[Turn]) -> PathNoise | None:
    """The largest gap of :func:`prefill_step_pairs`; None without a pair."""
    noise = pairs_noise(prefill_step_pairs(turns))
    return None if noise is None else PathNoise(noise.floor, noise.pairs, over=TWINS)


def check_prefill_steps(
    turns: Sequence[Turn], logprob_atol: float | None, compare_logprobs: bool = True
) -> PathNoise | None:
    """Hold each batched hit's prefill step to its recompute alone's within
    :func:`prefill_step_noise`, which the restore under test cannot move (the
    twins restore nothing); return that noise."""
    noise = prefill_step_noise(turns)
    judged = [
        turn
        for turn in turns
        if turn.prefill_step and turn.output is not None and turn.recompute is not None
    ]
    if not compare_logprobs or not judged:
        return noise
    if noise is None:
        for turn in judged:
            turn.problems.append(
                f"{turn.name}: no batched cold twin measured the prefill step's "
                f"noise: the batched hit cannot be judged"
            )
        return None
    tolerance = noise.held_to(logprob_atol)
    for turn in judged:
        assert turn.output is not None and turn.recompute is not None
        names = ("hit", "recompute alone (prefill step)")
        hit, alone = prefill_step(turn.output), prefill_step(turn.recompute)
        why = compare(turn, hit, alone, names, tolerance, False)
        if not why:
            continue
        what = (
            f"the batched hit, {turn.restored} tokens restored from the prefix cache,"
            if turn.restored
            else "restored nothing, yet the batched request"
        )
        turn.problems.append(
            f"{turn.name}: {what} differs from its recompute alone in its prefill "
            f"step, {why} ({noise}): the state restored in a shared batch, or "
            f"the prefill from it, is wrong"
        )
    return noise

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the batched restores' judgement (harness/restores.py): each
batched hit's prefill step against its recompute alone's, within the noise its
wave's batched cold twins show there, with turns replayed from measured runs.
Pure: no server."""

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    Deployment,
    Mode,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.compare import Turn, check_turn
from tests.models.hybrid_prefix_cache.harness.conversation import Play
from tests.models.hybrid_prefix_cache.harness.paths import (
    PATH_NOISE_MARGIN,
    check_paths,
    cold_pairs,
)
from tests.models.hybrid_prefix_cache.harness.restores import (
    TWINS,
    check_prefill_steps,
    prefill_step_noise,
)
from tests.models.hybrid_prefix_cache.harness.rules import (
    TURN_TOKENS,
    expected_cached,
)
from tests.models.hybrid_prefix_cache.replayed_turns import (
    RUNNER_UP,
    sample,
    turn,
)

pytestmark = pytest.mark.skip_global_cleanup

# plain-partial's seven sweep shapes at once on an Intel Xeon with AMX, two
# threads, in-process (findings/batch-noise-cpu.md): every batched hit's and
# twin's prefill step equal to its recompute alone's, their decode tokens up
# to 0.057 apart. The restored state x0.99 in batches moved the hits' by:
PLANTED_PREFILL_STEP_GAPS = [
    *(0.0046, 0.048, 0.015, 0.0067, 0.0046, 0.053, 0.0046),
    *(0.047, 0.002, 0.0072, 0.0012, 0.00023, 0.043, 0.0059),
    *(0.0024, 0.011, 0.051, 0.0011, 0.048, 0.043, 0.051),
]
DECODE_NOISE = 0.057
FIRST_LEN = 769  # plus1 at block 256


def wave_turns(hit_gaps, twin_gap: float = 0.0, twin_decode: float = 0.0):
    """Batched turns 1, 2 and the resend of one conversation per three hit
    gaps: each hit's prefill step ``hit_gaps`` from its recompute alone's and
    its decode DECODE_NOISE away; each twin's prefill step ``twin_gap`` away."""
    turns, gaps = [], iter(hit_gaps)
    for conversation in range(len(hit_gaps) // 3):
        prev = FIRST_LEN
        for index in (1, 2, 3):
            resend = index == 3
            prompt_len = prev if resend else prev + TURN_TOKENS
            cached = expected_cached(prev, 256, False)
            hit = sample(DECODE_NOISE, cached=cached, prompt_len=prompt_len, at=1)
            hit.token_logprobs[0] += next(gaps)
            twin = sample(twin_decode, prompt_len=prompt_len, at=1)
            twin.token_logprobs[0] += twin_gap
            played = turn(
                index,
                prev,
                prompt_len,
                256,
                hit,
                sample(prompt_len=prompt_len),
                twin=twin,
                batched=True,
                prefill_step=True,
                resend=resend,
                conversation=f"c{conversation}",
            )
            turns.append(played)
            prev = prompt_len
    return turns


def judge(turns: list[Turn]):
    for t in turns:
        check_turn(t, Units(block=256, hit=256), 0.0)
    assert check_paths(turns, 0.0) is None
    noise = check_prefill_steps(turns, 0.0)
    return noise, [p for t in turns for p in t.problems]


def test_clean_batched_restores_pass_exactly_whatever_their_decode():
    turns = wave_turns([0.0] * 21)
    noise, problems = judge(turns)
    assert problems == []
    assert (noise.floor, noise.pairs, noise.tolerance) == (0.0, 21, 0.0)
    assert noise.over == TWINS and TWINS in str(noise)
    # Only the prefill step is compared, across paths (batch against alone).
    assert {(c.judged, c.gap) for t in turns for c in t.comparisons} == {
        ("measured noise", 0.0)
    }


def test_every_planted_batched_restore_fails():
    turns = wave_turns(PLANTED_PREFILL_STEP_GAPS)
    _, problems = judge(turns)
    assert len(problems) == len(PLANTED_PREFILL_STEP_GAPS)
    assert all("restored in a shared batch" in p for p in problems)
    assert all("in its prefill step" in p for p in problems)


def test_the_twins_prefill_steps_set_the_tolerance():
    twin_gap = 1e-3
    tolerance = PATH_NOISE_MARGIN * twin_gap
    inside = wave_turns([tolerance * 0.9] * 3, twin_gap=twin_gap)
    assert judge(inside)[1] == []
    outside = wave_turns([tolerance * 1.1] * 3, twin_gap=twin_gap)
    noise, problems = judge(outside)
    assert noise.tolerance == pytest.approx(tolerance) and len(problems) == 3
    # A twin's decode noise widens nothing: only its prefill step is a control.
    decoding = wave_turns([1e-4] * 3, twin_decode=0.05)
    assert prefill_step_noise(decoding).floor == 0.0
    assert len(judge(decoding)[1]) == 3


def test_a_prefill_step_that_parts_on_a_token_fails():
    turns = wave_turns([0.0] * 3)
    hit = turns[0].output
    hit.token_ids[0] = RUNNER_UP
    hit.top_logprobs[0] = {RUNNER_UP: hit.token_logprobs[0], 11: -9.0}
    problems = judge(turns)[1]
    assert len(problems) == 1 and "first diverging token at index 0" in problems[0]


def test_without_twins_a_batched_restore_is_not_judged_silently():
    turns = wave_turns([0.0] * 3)
    for t in turns:
        t.twin = None
    noise, problems = judge(turns)
    assert noise is None and len(problems) == 3
    assert all("cannot be judged" in p for p in problems)


def test_prefill_step_turns_are_no_path_noise_control():
    turns = wave_turns([0.0] * 3, twin_gap=0.01, twin_decode=0.05)
    assert [cold_pairs(t) for t in turns] == [[], [], []]


def test_a_prefill_step_play_is_not_batch_invariant():
    """Its servers are the cell's: the binding's batch-invariant environment is
    not theirs, so its hits are never held to their recompute alone whole."""
    binding = Binding("m", (), (2, 10), batch_invariant_env={"OMP_NUM_THREADS": "1"})
    units = Units(block=256, hit=256)
    play = Play([], binding, Deployment(), Mode(), units, 0.0, batched=True)
    assert play.invariant
    restores = Play([], binding, Deployment(), Mode(), units, 0.0, True, True)
    assert restores.prefill_step and not restores.invariant

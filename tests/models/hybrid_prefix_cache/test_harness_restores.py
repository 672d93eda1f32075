# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the batched restores' judgement (paths.check_prefill_steps): each
batched hit's prefill step against the same prompt's alone, on the same
checkpoint, exactly, with turns replayed from measured runs. Pure: no server."""

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    Deployment,
    Mode,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.compare import Turn, check_turn, take_each
from tests.models.hybrid_prefix_cache.harness.conversation import Play
from tests.models.hybrid_prefix_cache.harness.paths import (
    ALONE,
    check_prefill_steps,
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
# threads, in-process (findings/batch-noise-cpu.md): every batched hit's
# prefill step equal to the same prompt's alone, their decode tokens up to
# 0.057 apart. The restored state x0.99 in batches moved the hits' by:
PLANTED_PREFILL_STEP_GAPS = [
    *(0.0046, 0.048, 0.015, 0.0067, 0.0046, 0.053, 0.0046),
    *(0.047, 0.002, 0.0072, 0.0012, 0.00023, 0.043, 0.0059),
    *(0.0024, 0.011, 0.051, 0.0011, 0.048, 0.043, 0.051),
]
DECODE_NOISE = 0.057
FIRST_LEN = 769  # plus1 at block 256


def wave_turns(hit_gaps, alone_hit_shift: int = 0):
    """Batched turns 1, 2 and the resend of one conversation per three hit
    gaps: each hit's prefill step ``hit_gaps`` from its alone counterpart's and
    its decode DECODE_NOISE away; the alone one hit ``alone_hit_shift`` more."""
    turns, gaps = [], iter(hit_gaps)
    for conversation in range(len(hit_gaps) // 3):
        prev = FIRST_LEN
        for index in (1, 2, 3):
            resend = index == 3
            prompt_len = prev if resend else prev + TURN_TOKENS
            cached = expected_cached(prev, 256, False)
            hit = sample(DECODE_NOISE, cached=cached, prompt_len=prompt_len, at=1)
            hit.token_logprobs[0] += next(gaps)
            alone_cached = cached + alone_hit_shift
            alone = sample(cached=alone_cached, prompt_len=prompt_len)
            played = turn(
                index,
                prev,
                prompt_len,
                256,
                hit,
                sample(prompt_len=prompt_len),
                alone=alone,
                batched=True,
                prefill_step=True,
                resend=resend,
                conversation=f"c{conversation}",
            )
            turns.append(played)
            prev = prompt_len
    return turns


def judge(turns: list[Turn]) -> list[str]:
    for t in turns:
        t.take(check_turn(t, Units(block=256, hit=256), 0.0))
    take_each(turns, check_prefill_steps(turns))
    return [p for t in turns for p in t.problems]


def test_clean_batched_restores_pass_exactly_whatever_their_decode():
    turns = wave_turns([0.0] * 21)
    assert judge(turns) == []
    # Only the prefill step is compared, on one path (the same chunks).
    assert {(c.what, c.judged, c.gap) for t in turns for c in t.comparisons} == {
        (f"hit vs {ALONE}", "exact", 0.0)
    }


def test_every_planted_batched_restore_fails():
    turns = wave_turns(PLANTED_PREFILL_STEP_GAPS)
    problems = judge(turns)
    assert len(problems) == len(PLANTED_PREFILL_STEP_GAPS)
    assert {(p.kind, p.numbers["control"]) for p in problems} == {("hit-apart", ALONE)}
    assert all("in its prefill step" in p for p in problems)


def test_a_prefill_step_that_parts_on_a_token_fails():
    turns = wave_turns([0.0] * 3)
    hit = turns[0].output
    hit.token_ids[0] = RUNNER_UP
    hit.top_logprobs[0] = {RUNNER_UP: hit.token_logprobs[0], 11: -9.0}
    problems = judge(turns)
    assert len(problems) == 1 and "first diverging token at index 0" in problems[0]


def test_a_hit_on_another_checkpoint_is_not_held_and_none_held_fails():
    """Alone on another checkpoint the chunks differ: a notice, not a
    comparison; a case that held no hit so fails rather than passing."""
    turns = wave_turns([0.05] * 3, alone_hit_shift=-256)
    problems = judge(turns)
    assert len(problems) == 1 and "judged no restore in a batch" in problems[0]
    assert sum("not held on its prefill step" in n for t in turns for n in t.notices)
    missing = wave_turns([0.0] * 3)
    for t in missing:
        t.alone = None
    assert len(judge(missing)) == 1


def test_cold_and_unbatched_turns_are_left_to_their_recompute():
    turns = wave_turns([0.05] * 3)
    for t in turns:
        t.batched = False
    problems = judge(turns)
    assert problems and all("recompute" in p for p in problems)
    assert not any(ALONE in c.what for t in turns for c in t.comparisons)


def test_a_prefill_step_play_is_not_batch_invariant():
    """Its servers are the cell's: the binding's batch-invariant environment is
    not theirs, so its hits are never held to their recompute alone whole."""
    binding = Binding("m", (), (2, 10), batch_invariant_env={"OMP_NUM_THREADS": "1"})
    units = Units(block=256, hit=256)
    play = Play([], binding, Deployment(), Mode(), units, 0.0, batched=True)
    assert play.invariant
    restores = Play([], binding, Deployment(), Mode(), units, 0.0, True, True)
    assert restores.prefill_step and not restores.invariant

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the oracle's like-with-like comparisons (compare.check_turn
and paths.check_paths), with turns replayed from measured records: exact
where a hit and its control take one numerical path, the case's own cold
controls where the paths differ, and messages that say which state is
wrong, if any. Pure: no server."""

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    Units,
)
from tests.models.hybrid_prefix_cache.harness.compare import (
    Sample,
    Turn,
    check_turn,
    compare,
    logprob_gap,
    take_each,
)
from tests.models.hybrid_prefix_cache.harness.paths import (
    PATH_NOISE_MARGIN,
    PATH_NOISE_MIN_PAIRS,
    check_paths,
    cold_pairs,
    control_shifts,
    path_noise,
)
from tests.models.hybrid_prefix_cache.harness.rules import (
    TURN_TOKENS,
    expected_cached,
)
from tests.models.hybrid_prefix_cache.replayed_turns import (
    RUNNER_UP,
    TOKENS,
    sample,
    turn,
)

pytestmark = pytest.mark.skip_global_cleanup


def play(turns: list[Turn], unit: int, atol: float | None = 0.0):
    for t in turns:
        t.take(check_turn(t, Units(block=unit, hit=unit), atol, drops_unit=False))
    noise, found = check_paths(turns, atol)
    take_each(turns, found)
    return noise, [p for t in turns for p in t.problems]


# pd-block on an Intel Xeon with AMX-BF16 (the measurement, the tiny
# model before its weights were made loud): hits of 0, 768 and 1536 tokens
# equal their cold P/D twins bit for bit; the twins differ from the decoder
# alone by 0.0186, 5.8e-5 and 8.4e-5. The controls (decode against prefill
# path on the decoder alone) are this machine's pd-block controls of the same
# kind, 2^-7 and below.
INTEL_PD = [(0, 0.0186, 2**-7), (768, 5.8e-5, 2**-8), (1536, 8.4e-5, 3.1e-5)]


def intel_pd_turns(hit_gap: float = 0.0, twin_gap_scale: float = 1.0) -> list[Turn]:
    turns, prev = [], 0
    for index, (cached, twin_gap, control_gap) in enumerate(INTEL_PD):
        prompt_len = 805 + index * TURN_TOKENS
        twin = sample(twin_gap * twin_gap_scale, prompt_len=prompt_len)
        rec = sample(prompt_len=prompt_len)
        # The control's first token is the recompute's second.
        control = sample(control_gap, prompt_len=prompt_len + 1, shift=1)
        hit = sample(
            twin_gap * twin_gap_scale + (hit_gap if cached else 0.0),
            cached=cached,
            prompt_len=prompt_len,
        )
        turns.append(
            turn(
                index,
                prev,
                prompt_len,
                256,
                hit,
                rec,
                twin=twin,
                control=control,
                backoff=1,
            )
        )
        prev = prompt_len
    return turns


def test_intel_pd_turns_pass():
    noise, problems = play(intel_pd_turns(), 256)
    assert problems == []
    assert noise.floor == 2**-7 and noise.pairs == 3
    assert noise.tolerance == PATH_NOISE_MARGIN * 2**-7


def test_a_pd_hit_apart_from_its_cold_twin_fails_naming_the_restored_state():
    _, problems = play(intel_pd_turns(hit_gap=2**-20), 256)
    assert len(problems) == 2  # the two turns that restored something
    assert all(
        "on the same path" in p and "restored state is wrong" in p for p in problems
    )
    assert "turn 1" in problems[0] and "768 tokens restored" in problems[0]


def test_a_transfer_beyond_the_path_noise_fails_naming_the_transferred_state():
    _, problems = play(intel_pd_turns(twin_gap_scale=4.0), 256)
    # 4 x 0.0186 = 0.074 > 4 x 2^-7 = 0.031 on turn 0 only.
    assert len(problems) == 1 and "turn 0" in problems[0]
    assert "transferred state is wrong" in problems[0]
    assert "restored state" not in problems[0]


def shifts_of(turns: list[Turn]) -> list[tuple[int, int]]:
    return [(t.index, shift) for t, shift in control_shifts(turns)]


def test_a_case_short_of_cold_pairs_takes_further_controls_last_turn_first():
    assert PATH_NOISE_MIN_PAIRS == 4
    # One P/D turn (an abort's retry, a resend): three more, each one token
    # further into its recompute.
    assert shifts_of(intel_pd_turns()[:1]) == [(0, 2), (0, 3), (0, 4)]
    # Two turns: one more each, the last turn first.
    assert shifts_of(intel_pd_turns()[:2]) == [(1, 2), (0, 2)]
    assert shifts_of(intel_pd_turns()) == [(2, 2)]


def test_a_further_control_pairs_with_its_recompute_that_many_tokens_on():
    (one,) = intel_pd_turns()[:1]
    for _, shift in control_shifts([one]):
        one.more_controls.append(sample(prompt_len=805 + shift, shift=shift))
    pairs = cold_pairs(one)
    assert len(pairs) == PATH_NOISE_MIN_PAIRS
    for shift, (rec, control) in enumerate(pairs, start=1):
        assert rec.token_ids == TOKENS[shift:] == control.token_ids
    # Its controls are counted: none more is asked for.
    assert control_shifts([one]) == []


def test_enough_pairs_or_no_control_take_no_further_controls():
    # Batched turns have their twins as pairs; a plain turn has no control.
    assert control_shifts(intel_batched_turns()) == []
    assert control_shifts([turn(0, 0, 805, 256, sample(), sample())]) == []


def test_further_controls_leave_a_token_of_the_recompute_to_compare():
    short = sample(tokens=TOKENS[:3])
    (one,) = intel_pd_turns()[:1]
    one.recompute = short
    assert shifts_of([one]) == [(0, 2)]


def test_a_cold_turn_apart_on_one_path_is_not_called_a_restored_state():
    t = turn(0, 0, 805, 256, sample(2**-7), sample())
    t.take(check_turn(t, Units(block=256, hit=256), 0.0))
    assert len(t.problems) == 1
    assert "restored nothing" in t.problems[0] and "not deterministic" in t.problems[0]
    assert "restored state" not in t.problems[0]


# plain-partial-concurrent on the Intel machine, 7 conversations at once
# (the measurement): each batched hit against its batched cold twin
# was exact in 18 of 21 pairs, the others 2.4e-5, 7.6e-6 and 3.9e-3; batched
# requests against the recompute alone (turn 0 included) differed by 2^-7.
INTEL_BATCHED_HIT_GAPS = [0.0] * 18 + [2.4e-5, 7.6e-6, 3.9e-3]


def intel_batched_turns(restored_error: float = 0.0) -> list[Turn]:
    turns, gaps = [], iter(INTEL_BATCHED_HIT_GAPS)
    for conversation in range(7):
        prev = 0
        for index in range(4):
            prompt_len = 421 + index * TURN_TOKENS
            cached = expected_cached(prev, 64, False)
            gap = (next(gaps) + restored_error) if cached else 0.0
            alone = 2**-7 if index % 2 else 2**-8
            turns.append(
                turn(
                    index,
                    prev,
                    prompt_len,
                    64,
                    sample(gap, cached=cached, prompt_len=prompt_len),
                    sample(alone, prompt_len=prompt_len),
                    twin=sample(prompt_len=prompt_len),
                    batched=True,
                    conversation=f"c{conversation}",
                )
            )
            prev = prompt_len
    return turns


def test_intel_batched_turns_pass():
    turns = intel_batched_turns()
    noise, problems = play(turns, 64)
    assert problems == []
    assert noise.floor == 2**-7
    assert {c.judged for t in turns for c in t.comparisons} == {"measured noise"}


def test_a_batched_hit_beyond_the_path_noise_fails_naming_the_restored_state():
    _, problems = play(intel_batched_turns(restored_error=0.1), 64)
    assert len(problems) == 21
    assert all("batched hit" in p and "restored state is wrong" in p for p in problems)


def invariant_turns(restored_error: float = 0.0, cold_error: float = 0.0):
    """Two conversations batched on a server that computes each request as
    alone: no twin, each hit against its recompute alone."""
    turns = []
    for conversation in range(2):
        prev = 0
        for index in range(3):
            prompt_len = 421 + index * TURN_TOKENS
            cached = expected_cached(prev, 64, False)
            gap = restored_error if cached else cold_error
            hit = sample(gap, cached=cached, prompt_len=prompt_len)
            rec = sample(prompt_len=prompt_len)
            t = turn(index, prev, prompt_len, 64, hit, rec, batched=True)
            t.conversation, t.invariant = f"c{conversation}", True
            turns.append(t)
            prev = prompt_len
    return turns


def test_batched_hits_on_an_invariant_server_are_exact_and_measure_no_noise():
    turns = invariant_turns()
    noise, problems = play(turns, 64)
    assert problems == [] and noise is None
    assert all(cold_pairs(t) == [] for t in turns)
    assert {c.what for t in turns for c in t.comparisons} == {
        "hit vs recompute alone (batch-invariant server)"
    }
    assert {c.judged for t in turns for c in t.comparisons} == {"exact"}


def test_a_batched_restore_a_rounding_step_off_fails_naming_the_batch():
    _, problems = play(invariant_turns(restored_error=2**-12), 64)
    assert len(problems) == 4
    assert all("restored in a shared batch is wrong" in p for p in problems)
    _, problems = play(invariant_turns(cold_error=2**-12), 64)
    assert len(problems) == 2
    assert all("carried between prefill steps in a shared batch" in p for p in problems)


def test_a_near_tie_across_paths_passes_and_one_beyond_the_noise_fails():
    """Where the recompute takes the runner-up, each side ranks the other's
    token within the path tolerance: a near tie (shown, not failed)."""
    near = Sample(
        [11, RUNNER_UP],
        "",
        [-0.5, -0.25],
        [{11: -0.5, RUNNER_UP: -1.0}, {RUNNER_UP: -0.25, 12: -0.26}],
        10,
        128,
    )
    rec = Sample(
        [11, 12],
        "",
        [-0.5, -0.25],
        [{11: -0.5, RUNNER_UP: -1.0}, {12: -0.25, RUNNER_UP: -0.255}],
        10,
        0,
    )
    alone = Sample([11, 12], "", [-0.5, -0.25 + 2**-7], rec.top_logprobs, 10, 0)
    t = turn(1, 129, 10, 128, near, alone, twin=rec, batched=True)
    t.expected, t.bound = 0, 0
    noise, found = check_paths([t], 0.0)
    take_each([t], found)
    problems = t.problems
    assert noise.floor == 2**-7
    assert problems == [] and any("near tie" in n for n in t.notices)
    # The same divergence on one path fails.
    same = turn(1, 129, 10, 128, near, rec)
    same.expected = 0
    same.take(check_turn(same, Units(block=128, hit=128), 0.0))
    assert any("on the same path: first diverging token" in p for p in same.problems)
    # And across paths when the runner-up sits beyond the tolerance.
    far = Sample(
        near.token_ids,
        "",
        near.token_logprobs,
        [near.top_logprobs[0], {RUNNER_UP: -0.25, 12: -0.9}],
        10,
        128,
    )
    t2 = turn(1, 129, 10, 128, far, alone, twin=rec, batched=True)
    take_each([t2], check_paths([t2], 0.0)[1])
    assert any("not a near tie" in p for p in t2.problems)


# Two P/D cold twins that part from the decoder alone, on an AMD EPYC with
# AVX512-BF16 (2026-12-02, the shared-prefix siblings): where the tokens part,
# each side's top-k there (twin, decoder alone) and the path tolerance of the
# case's own cold controls. In partial mode the decoder's choice is not in
# the twin's top-5, so check_logprobs_close fails it, but neither choice need
# move more than the tolerance; in block mode the decoder's choice provably
# moves 1.25 where the tolerance is 0.585.
AMD_PD_PARTINGS = {
    "within": (
        {1185: -1.4022, 1224: -2.2147, 860: -3.2147, 1640: -3.2772, 1999: -3.4022},
        {567: -1.6782, 1185: -1.9282, 1224: -2.9282, 1971: -3.0532, 1999: -3.1782},
        4 * 0.591,
    ),
    "beyond": (
        {1607: -3.1213, 1032: -3.2463, 149: -3.2463, 1973: -3.2463, 391: -3.3088},
        {1973: -1.9985, 149: -2.1235, 1567: -2.9985, 256: -3.2485, 1607: -3.3110},
        4 * 0.146,
    ),
}


def parting_turn(twin_top: dict, alone_top: dict) -> Turn:
    """A cold P/D turn whose twin and decoder alone agree on their first
    token and part at the second, with ``twin_top`` and ``alone_top`` there."""
    first = {11: -0.5, RUNNER_UP: -1.0}

    def chose(top: dict) -> Sample:
        best = max(top, key=top.get)
        return Sample([11, best], "", [-0.5, top[best]], [first, top], 805, 0)

    return turn(0, 0, 805, 256, chose(twin_top), chose(alone_top), twin=chose(twin_top))


@pytest.mark.parametrize("parting", AMD_PD_PARTINGS)
def test_a_pd_parting_is_judged_by_the_measured_noise(parting):
    """The transfer check judges a parting by how far each chosen token
    moves between the two paths, against the case's measured tolerance (the
    same token's logprob on both, as the noise is measured), not by
    check_logprobs_close's fixed top-k."""
    twin_top, alone_top, tolerance = AMD_PD_PARTINGS[parting]
    t = parting_turn(twin_top, alone_top)
    names = ("cold twin", "decoder alone")
    why, seen = compare(t.name, t.twin, t.recompute, names, tolerance, False)
    if parting == "within":
        assert why == "" and any("near tie" in n for n in seen.notices)
    else:
        assert why.startswith("not a near tie within 0.584")
    # The same parting with no measured tolerance: check_logprobs_close
    # decides, and the decoder's choice is not in the twin's top-5 or the
    # twin's ranked well below.
    t = parting_turn(twin_top, alone_top)
    why, _ = compare(t.name, t.twin, t.recompute, names, None, False)
    assert why.startswith("beyond check_logprobs_close") == (parting == "within")


def test_logprob_gap_stops_where_the_tokens_part():
    a, b = sample(), sample(0.25, tokens=[11, 12, 77, 14, 15, 16, 17, 18], at=2)
    gap, part = logprob_gap(a, b)
    # Before index 2 the sampled tokens agree exactly; from it on, they
    # follow different contexts.
    assert part == 2 and gap == 0.0
    assert logprob_gap(a, a) == (0.0, None)


def test_no_path_noise_where_every_request_ran_alone():
    assert path_noise([turn(0, 0, 805, 256, sample(), sample())]) is None

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the oracle's like-with-like comparisons (harness.check_turn
and harness.check_paths), with turns replayed from measured records: exact
where a hit and its control take one numerical path, the case's own cold
controls where the paths differ, and messages that say which state is
wrong, if any. Pure: no server."""

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    PATH_NOISE_MARGIN,
    PATH_NOISE_MIN_PAIRS,
    TURN_TOKENS,
    Sample,
    Turn,
    Units,
    branch_checkpoint,
    branch_lengths,
    check_paths,
    check_turn,
    cold_pairs,
    compare,
    control_shifts,
    expected_cached,
    expected_resend,
    hit_bound,
    logprob_gap,
    path_noise,
)

pytestmark = pytest.mark.skip_global_cleanup

TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]
BASE = [-0.5, -0.25, -1.0, -0.75, -0.5, -2.0, -0.125, -1.5]
RUNNER_UP = 99  # every position's second choice, 0.5 below the first


def sample(
    gap: float = 0.0,
    cached: int = 0,
    prompt_len: int = 805,
    tokens: list[int] = TOKENS,
    at: int = 0,
    shift: int = 0,
) -> Sample:
    """A greedy sample of ``tokens`` (from index ``shift`` on) whose
    logprobs sit ``gap`` away from BASE from index ``at`` on, each position
    with a runner-up 0.5 below in its top-k."""
    tokens = tokens[shift:]
    logprobs = [lp + (gap if i >= at else 0.0) for i, lp in enumerate(BASE[shift:])]
    return Sample(
        token_ids=list(tokens),
        text="",
        token_logprobs=logprobs,
        top_logprobs=[
            {token: lp, RUNNER_UP: lp - 0.5} for token, lp in zip(tokens, logprobs)
        ],
        prompt_tokens=prompt_len,
        cached_tokens=cached,
    )


def turn(
    index: int,
    prev_len: int,
    prompt_len: int,
    unit: int,
    hit: Sample,
    recompute: Sample,
    **fields,
) -> Turn:
    resend = fields.pop("resend", False)
    drops = fields.pop("drops_unit", False)
    backoff = fields.pop("backoff", 0)
    seen_prev, seen = max(prev_len - backoff, 0), prompt_len - backoff
    played = Turn(
        fields.pop("conversation", ""),
        index,
        prompt_len,
        prev_len,
        expected_cached(seen_prev, unit, drops),
        bound=hit_bound(seen_prev, seen, unit),
        resend=resend,
        backoff=backoff,
        output=hit,
        recompute=recompute,
        **fields,
    )
    return played


def lost_checkpoint_turn(
    shape: str,
    index: int,
    prev_len: int,
    unit: int,
    hit: int = 0,
    block: int | None = None,
    drops_unit: bool = False,
) -> Turn:
    """A turn of sweep ``shape`` that hit ``hit`` (nothing by default) where
    the previous ``prev_len``-token prompt left a deeper checkpoint, checked
    by the oracle at block ``block`` (the hit unit by default)."""
    prompt_len = prev_len + TURN_TOKENS
    played = turn(
        index,
        prev_len,
        prompt_len,
        unit,
        sample(cached=hit, prompt_len=prompt_len),
        sample(prompt_len=prompt_len),
        conversation=shape,
        drops_unit=drops_unit,
    )
    check_turn(played, Units(block=block or unit, hit=unit), 0.0)
    return played


def lost_resend_turn(
    prompt_len: int,
    unit: int,
    backoff: int = 0,
    hit: int = 0,
    drops_unit: bool = False,
) -> Turn:
    """An exact resend of ``prompt_len`` tokens that hit ``hit`` (nothing by
    default) where its own checkpoint is (of the prompt less ``backoff``,
    which the P/D prefiller sees; one unit lower where the drafter
    ``drops_unit``), checked by the oracle."""
    played = turn(
        1,
        prompt_len,
        prompt_len,
        unit,
        sample(cached=hit, prompt_len=prompt_len),
        sample(prompt_len=prompt_len),
        resend=True,
        backoff=backoff,
        drops_unit=drops_unit,
    )
    check_turn(played, Units(block=unit, hit=unit), 0.0)
    return played


def restored_apart_turn(
    shape: str,
    index: int,
    prev_len: int,
    prompt_len: int,
    unit: int,
    gap: float,
    block: int | None = None,
    pd: bool = False,
) -> Turn:
    """A turn of sweep ``shape`` that hit its checkpoint and whose logprobs
    sit ``gap`` from the request on its own path: its recompute (played
    alone), or under P/D (``pd``: the prefiller sees the prompt one token
    short) its cold twin through the same pair; checked by the oracle."""
    backoff = 1 if pd else 0
    cached = expected_cached(max(prev_len - backoff, 0), unit, False)
    twin = {"twin": sample(prompt_len=prompt_len)} if pd else {}
    played = turn(
        index,
        prev_len,
        prompt_len,
        unit,
        sample(gap, cached=cached, prompt_len=prompt_len),
        sample(prompt_len=prompt_len),
        backoff=backoff,
        conversation=shape,
        **twin,
    )
    check_turn(played, Units(block=block or unit, hit=unit), 0.0)
    return played


def branch_apart_turn(
    units: Units, gap: float, pd: bool = False, parts_at: int | None = None
) -> Turn:
    """A small-budget case's branch that resumed at its block checkpoint
    (harness.branch_checkpoint) and whose logprobs sit ``gap`` from its
    recompute on the same server, or under P/D (``pd``) from its cold twin
    through the same pair, or (``parts_at``) that takes the runner-up there;
    checked by the oracle."""
    shared, length = branch_lengths(units)
    cached = branch_checkpoint(shared, units, False)
    hit = sample(gap, cached=cached, prompt_len=length)
    if parts_at is not None:
        hit.token_ids[parts_at] = RUNNER_UP
        lp = hit.token_logprobs[parts_at]
        hit.top_logprobs[parts_at] = {RUNNER_UP: lp, TOKENS[parts_at]: lp - gap}
    twin = {"twin": sample(prompt_len=length), "backoff": 1} if pd else {}
    played = turn(
        0,
        shared,
        length,
        units.hit,
        hit,
        sample(prompt_len=length),
        conversation="branch",
        **twin,
    )
    played.expected = cached
    check_turn(played, units, 0.0)
    return played


def play(turns: list[Turn], unit: int, atol: float | None = 0.0):
    for t in turns:
        check_turn(t, Units(block=unit, hit=unit), atol, drops_unit=False)
    noise = check_paths(turns, atol)
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
    check_turn(t, Units(block=256, hit=256), 0.0)
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
    noise, problems = check_paths([t], 0.0), t.problems
    assert noise.floor == 2**-7
    assert problems == [] and any("near tie" in n for n in t.notices)
    # The same divergence on one path fails.
    same = turn(1, 129, 10, 128, near, rec)
    same.expected = 0
    check_turn(same, Units(block=128, hit=128), 0.0)
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
    check_paths([t2], 0.0)
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
    why = compare(
        t, t.twin, t.recompute, ("cold twin", "decoder alone"), tolerance, False
    )
    if parting == "within":
        assert why == "" and any("near tie" in n for n in t.notices)
    else:
        assert why.startswith("not a near tie within 0.584")
    # The same parting with no measured tolerance: check_logprobs_close
    # decides, and the decoder's choice is not in the twin's top-5 or the
    # twin's ranked well below.
    t = parting_turn(twin_top, alone_top)
    why = compare(t, t.twin, t.recompute, ("cold twin", "decoder alone"), None, False)
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


@pytest.mark.parametrize(
    ("cached", "ok"),
    [(7296, True), (7424, False), (7168, False)],
    ids=["rule", "one-unit-above", "one-unit-below"],
)
def test_a_dspark_resend_hits_exactly_the_rule(cached, ok):
    """7449 tokens with DSpark at unit 128 under vLLM 0.32.0's rule (the
    drafter drops a unit): 7296, as upstream's Kimi-K3 test asserts."""
    assert expected_resend(7449, 128, True) == 7296
    t = turn(
        1,
        7449,
        7449,
        128,
        sample(cached=cached, prompt_len=7449),
        sample(prompt_len=7449),
        resend=True,
        drops_unit=True,
    )
    check_turn(t, Units(block=6144, hit=128), None, drops_unit=True)
    assert (t.problems == []) is ok
    if not ok:
        assert "get_mamba_prefill_checkpoint_position" in t.problems[0]
        assert f"cached {cached} != 7296" in t.problems[0]


def test_a_growing_turn_above_the_rule_is_a_notice():
    t = turn(
        1, 896, 1673, 128, sample(cached=896, prompt_len=1673), sample(prompt_len=1673)
    )
    check_turn(t, Units(block=128, hit=128), 0.0)
    assert t.problems == [] and "above the expected 768" in t.notices[0]


def mid_block_turn(hit_gap: float, control_gap: float) -> Turn:
    """A partial hit at 272 of a block of 80 (a GPU under the derived
    budget): its state was stored and reloaded inside a block, where its
    recompute kept it, so it is held to the noise of cold decode-against-
    prefill pairs (the recompute from its second token against a control)."""
    played = turn(
        1,
        277,
        1054,
        16,
        sample(hit_gap, cached=272, prompt_len=1054),
        sample(prompt_len=1054),
        mid_block=True,
    )
    played.control = sample(control_gap, prompt_len=1055, shift=1)
    played.more_controls = [
        sample(control_gap, prompt_len=1055 + i, shift=i) for i in (2, 3, 4)
    ]
    return played


def test_a_mid_block_hit_is_held_to_the_measured_noise():
    """Not bit for bit: within the case's tolerance it passes, and its
    comparison says it used the measured noise."""
    played = mid_block_turn(hit_gap=0.03, control_gap=0.01)
    check_turn(played, Units(block=80, hit=16), 0.0)
    assert played.problems == [] and played.comparisons == []
    noise = check_paths([played], 0.0)
    assert noise is not None and noise.floor == pytest.approx(0.01)
    (comparison,) = played.comparisons
    assert comparison.what == "hit vs recompute (mid-block: measured noise)"
    assert not comparison.same_path and comparison.tolerance == noise.tolerance
    assert played.problems == []


def test_a_mid_block_hit_beyond_the_noise_names_the_restored_state():
    played = mid_block_turn(hit_gap=0.2, control_gap=0.01)
    check_turn(played, Units(block=80, hit=16), 0.0)
    check_paths([played], 0.0)
    (problem,) = played.problems
    assert "restored from the prefix cache mid-block" in problem
    assert "the restored state is wrong" in problem


def test_a_hit_on_a_block_stays_exact_where_only_blocks_are():
    """A hit on a block boundary is on its recompute's path: any gap fails."""
    hit = sample(1e-3, cached=240, prompt_len=1018)
    played = turn(1, 241, 1018, 16, hit, sample(prompt_len=1018))
    check_turn(played, Units(block=80, hit=16), 0.0)
    (problem,) = played.problems
    assert "on the same path" in problem and "restored state is wrong" in problem

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the oracle's checks of one hit (compare.check_turn): where
the rule puts it, and how a hit on a block or inside one is compared with
its recompute. Pure: no server."""

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    Units,
)
from tests.models.hybrid_prefix_cache.harness.compare import (
    Turn,
    check_turn,
    take_each,
)
from tests.models.hybrid_prefix_cache.harness.paths import (
    check_paths,
)
from tests.models.hybrid_prefix_cache.harness.rules import (
    expected_resend,
)
from tests.models.hybrid_prefix_cache.replayed_turns import sample, turn

pytestmark = pytest.mark.skip_global_cleanup


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
    t.take(check_turn(t, Units(block=6144, hit=128), None, drops_unit=True))
    assert (t.problems == []) is ok
    if not ok:
        assert "get_mamba_prefill_checkpoint_position" in t.problems[0]
        assert f"cached {cached} != 7296" in t.problems[0]


def test_a_growing_turn_above_the_rule_is_a_notice():
    t = turn(
        1, 896, 1673, 128, sample(cached=896, prompt_len=1673), sample(prompt_len=1673)
    )
    t.take(check_turn(t, Units(block=128, hit=128), 0.0))
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
    played.take(check_turn(played, Units(block=80, hit=16), 0.0))
    assert played.problems == [] and played.comparisons == []
    noise, found = check_paths([played], 0.0)
    take_each([played], found)
    assert noise is not None and noise.floor == pytest.approx(0.01)
    (comparison,) = played.comparisons
    assert comparison.what == "hit vs recompute (mid-block: measured noise)"
    assert not comparison.same_path and comparison.tolerance == noise.tolerance
    assert played.problems == []


def test_a_mid_block_hit_beyond_the_noise_names_the_restored_state():
    played = mid_block_turn(hit_gap=0.2, control_gap=0.01)
    played.take(check_turn(played, Units(block=80, hit=16), 0.0))
    take_each([played], check_paths([played], 0.0)[1])
    (problem,) = played.problems
    assert "restored from the prefix cache mid-block" in problem
    assert "the restored state is wrong" in problem


def test_a_hit_on_a_block_stays_exact_where_only_blocks_are():
    """A hit on a block boundary is on its recompute's path: any gap fails."""
    hit = sample(1e-3, cached=240, prompt_len=1018)
    played = turn(1, 241, 1018, 16, hit, sample(prompt_len=1018))
    played.take(check_turn(played, Units(block=80, hit=16), 0.0))
    (problem,) = played.problems
    assert "on the same path" in problem and "restored state is wrong" in problem

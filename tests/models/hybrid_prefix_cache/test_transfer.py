# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the P/D transfer's exact check (harness.paths check_transfer): the
relay through the pair against the decoder alone one token on, and the
decoder alone against the prefiller alone, each bit for bit, with messages
that name the transfer or the decoder. Pure: no server."""

from dataclasses import replace

import pytest

from tests.models.hybrid_prefix_cache.harness.compare import Sample, Turn, take_each
from tests.models.hybrid_prefix_cache.harness.paths import (
    check_paths,
    check_transfer,
    relay_prompt,
)

pytestmark = pytest.mark.skip_global_cleanup

PROMPT = list(range(100, 110))
TOKENS = [11, 12, 13, 14, 15, 16]
BASE = [-0.5, -0.25, -1.0, -0.75, -0.5, -2.0]


def sample(gap: float = 0.0, cached: int = 0, shift: int = 0) -> Sample:
    """A greedy sample of TOKENS from index ``shift`` on, ``gap`` off BASE,
    each position with a runner-up 0.5 below."""
    logprobs = [lp + gap for lp in BASE[shift:]]
    return Sample(
        token_ids=TOKENS[shift:],
        text="",
        token_logprobs=logprobs,
        top_logprobs=[{t: lp, 99: lp - 0.5} for t, lp in zip(TOKENS[shift:], logprobs)],
        prompt_tokens=len(PROMPT),
        cached_tokens=cached,
    )


def _relay(recompute: Sample, gap: float = 0.0) -> Sample:
    """What the pair answers to the recompute's prompt and first token: the
    recompute from its second token on, ``gap`` off, and one token more."""
    later = recompute.shifted(1)
    return replace(
        later,
        token_ids=[*later.token_ids, 7],
        token_logprobs=[lp + gap for lp in later.token_logprobs] + [-1.0],
        top_logprobs=[
            {t: lp + gap for t, lp in top.items()} for top in later.top_logprobs
        ]
        + [{7: -1.0}],
    )


def _pd_turn(relay_gap: float = 0.0, prefiller_gap: float = 0.0):
    rec = sample()
    played = Turn("", 1, len(PROMPT), 4, 0, backoff=1, prompt=PROMPT)
    played.output, played.recompute = sample(cached=4), rec
    played.twin = sample()
    played.relay = _relay(rec, relay_gap)
    played.prefiller_alone = sample(gap=prefiller_gap)
    return played


def test_the_relay_prompt_is_the_prompt_and_the_recompute_first_token():
    assert relay_prompt(_pd_turn()) == [*PROMPT, sample().token_ids[0]]


def test_an_exact_transfer_passes_and_is_recorded_as_exact():
    played = _pd_turn()
    played.take(check_transfer(played, 0.0))
    assert played.problems == []
    whats = {c.what: c for c in played.comparisons}
    relay = whats["transfer relay vs decoder alone one token on"]
    assert (relay.gap, relay.tolerance, relay.same_path) == (0.0, 0.0, True)
    assert whats["decoder alone vs prefiller alone"].gap == 0.0


def test_a_relay_off_by_rounding_fails_naming_the_transferred_state():
    played = _pd_turn(relay_gap=2**-8)
    played.take(check_transfer(played, 0.0))
    assert len(played.problems) == 1
    assert "the transferred state is wrong" in played.problems[0]


def test_a_decoder_apart_from_the_prefiller_fails_naming_the_decoder():
    played = _pd_turn(prefiller_gap=0.1)
    played.take(check_transfer(played, 0.0))
    assert len(played.problems) == 1
    assert "the decoder computes wrongly" in played.problems[0]


def test_where_a_relay_exists_no_twin_is_held_to_measured_noise():
    played = _pd_turn()
    played.twin = sample(gap=0.5)  # across paths: the relay judges the transfer
    take_each([played], check_paths([played], 0.0)[1])
    assert played.problems == []
    played.relay = None
    played.control = sample(shift=1)
    take_each([played], check_paths([played], 0.0)[1])
    assert "the transferred state is wrong" in played.problems[0]

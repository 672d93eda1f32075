# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The P/D transfer judged exactly where both instances are one configuration:
the relay differs from the recompute only in where its state came from, and
the prefiller alone runs no decoder code. No tolerance from suspect controls."""

from tests.models.hybrid_prefix_cache.harness.compare import Found, Turn, compare


def relay_prompt(turn: Turn) -> list[int]:
    """The turn's prompt plus the recompute's first ``turn.backoff`` tokens."""
    assert turn.recompute is not None
    return [*turn.prompt, *turn.recompute.token_ids[: turn.backoff]]


def check_transfer(turn: Turn, logprob_atol: float | None) -> Found:
    """The relay held to the recompute one token on, and the recompute to the
    prefiller alone."""
    rec = turn.recompute
    assert rec is not None
    found = Found()
    if turn.prefiller_alone is not None:
        names = ("decoder alone", "prefiller alone")
        why, seen = compare(
            turn.name, rec, turn.prefiller_alone, names, logprob_atol, True
        )
        found += seen
        if why:
            problem = (
                f"{turn.name}: the decoder alone differs from the prefiller "
                f"serving the same request whole, one configuration, {why}: "
                f"the decoder computes wrongly"
            )
            found += Found((problem,))
    if turn.relay is not None:
        later = rec.shifted(turn.backoff)
        relay = turn.relay.head(len(later.token_ids))
        names = ("transfer relay", "decoder alone one token on")
        why, seen = compare(turn.name, relay, later, names, logprob_atol, True)
        found += seen
        if why:
            problem = (
                f"{turn.name}: the decoder, decoding the recompute's first "
                f"token from the prefiller's transferred KV and state, differs "
                f"from the decoder alone, which computed the same prompt in "
                f"the same chunks, {why}: the transferred state is wrong"
            )
            found += Found((problem,))
    return found

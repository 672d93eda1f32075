# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The P/D transfer judged exactly where both instances are one configuration:
the relay differs from the recompute only in where its state came from, and
the prefiller alone runs no decoder code. No tolerance from suspect controls."""

from tests.models.hybrid_prefix_cache.harness.compare import Found, Turn, compare


def relay_prompt(turn: Turn) -> list[int]:
    assert turn.recompute is not None
    return [*turn.prompt, *turn.recompute.token_ids[: turn.backoff]]


def check_transfer(turn: Turn, logprob_atol: float | None) -> Found:
    """The relay held to the recompute one token on, and the recompute to the
    prefiller alone."""
    rec, name, found = turn.recompute, turn.name, Found()
    problems: list[str] = []
    assert rec is not None
    if turn.prefiller_alone is not None:
        names = ("decoder alone", "prefiller alone")
        why, seen = compare(name, rec, turn.prefiller_alone, names, logprob_atol, True)
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
        why, seen = compare(name, relay, later, names, logprob_atol, True)
        found += seen
        if why:
            problems.append(
                f"{name}: the decoder, decoding the recompute's first token from "
                f"the prefiller's transferred KV and state, differs from the "
                f"decoder alone, which computed the same prompt in the same "
                f"chunks, {why}: the transferred state is wrong"
            )
    return found + Found(tuple(problems))

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The P/D transfer judged exactly, by construction. Pure: no server.

Where the prefiller and the decoder are one configuration
(:attr:`Deployment.same_instances`), a turn's recompute on the decoder
alone has two exact counterparts:

- **the relay**: the recompute's prompt and its first token, through the
  pair under a fresh salt. The prefiller computes exactly the recompute's
  prompt (the pair's last token is the prefiller's backoff,
  rules.PD_PREFILL_BACKOFF, from NIXL's truncation), cut into the same
  chunks. The decoder then decodes the recompute's first token from the
  transferred KV and state, where the decoder alone decoded it from the
  state it computed. Only where that state came from differs, so the relay
  equals the recompute from its second token on, bit for bit.
- **the prefiller alone**: the turn's prompt served whole by the prefiller.
  No decoder code touches it, so it equals the recompute bit for bit. A
  decoder that decodes wrongly for every request, the recompute included,
  shows here.

Neither comparison takes a tolerance from controls that the suspect code
also runs.
"""

from tests.models.hybrid_prefix_cache.harness.compare import Turn, compare


def relay_prompt(turn: Turn) -> list[int]:
    """The relay's prompt: the turn's prompt and as many of its recompute's
    first tokens as the prefiller does not compute (``turn.backoff``)."""
    assert turn.recompute is not None
    return [*turn.prompt, *turn.recompute.token_ids[: turn.backoff]]


def check_transfer(turn: Turn, logprob_atol: float | None) -> None:
    """Hold ``turn``'s relay to its recompute one token on, and its recompute
    to the prefiller alone, both on one path (exactly where
    ``logprob_atol`` is 0); record every way they differ in
    ``turn.problems``."""
    rec = turn.recompute
    assert rec is not None
    if turn.prefiller_alone is not None:
        names = ("decoder alone", "prefiller alone")
        why = compare(turn, rec, turn.prefiller_alone, names, logprob_atol, True)
        if why:
            turn.problems.append(
                f"{turn.name}: the decoder alone differs from the prefiller "
                f"serving the same request whole, one configuration, {why}: "
                f"the decoder computes wrongly"
            )
    if turn.relay is not None:
        later = rec.shifted(turn.backoff)
        relay = turn.relay.head(len(later.token_ids))
        names = ("transfer relay", "decoder alone one token on")
        why = compare(turn, relay, later, names, logprob_atol, True)
        if why:
            turn.problems.append(
                f"{turn.name}: the decoder, decoding the recompute's first "
                f"token from the prefiller's transferred KV and state, differs "
                f"from the decoder alone, which computed the same prompt in "
                f"the same chunks, {why}: the transferred state is wrong"
            )

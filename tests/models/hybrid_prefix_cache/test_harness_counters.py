# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the counter rule (harness.reconcile): the /metrics deltas a
server's completions imply, the requests each server is sent, and what a
P/D decoder transfers. No server, any platform."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import (
    Deployment,
    Drafting,
    Instance,
    Mode,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.reconcile import (
    EXTERNAL_HITS,
    EXTERNAL_QUERIES,
    PREFIX_HITS,
    PREFIX_QUERIES,
    Ledger,
    counter_problems,
    expected_requests,
    ledger_entry,
)

# One server's completions and counter deltas, by role (ledger_entry).
P = 1198  # prompt tokens of each completion below


def _moved(queries=0.0, hits=0.0, ext_queries=0.0, ext_hits=0.0) -> dict:
    return {
        PREFIX_QUERIES: queries,
        PREFIX_HITS: hits,
        EXTERNAL_QUERIES: ext_queries,
        EXTERNAL_HITS: ext_hits,
    }


@pytest.mark.parametrize(
    ("entries", "moved", "caching", "connector"),
    [
        # A plain server: a cold request and a hit of 1152.
        ([(P, 0, None), (P, 1152, None)], _moved(2 * P, 1152), True, False),
        # Offload after a reset: usage counts the offload tier's hit, which
        # only the external counter takes.
        (
            [(P, 1152, None), (P, 0, None)],
            _moved(2 * P, 0, 2 * P, 1152),
            True,
            True,
        ),
        # A P/D prefiller: it sees each prompt one token short.
        (
            [(P, 1152, {"do_remote_decode": True})],
            _moved(P - 1, 1152, P - 1 - 1152, 0),
            True,
            True,
        ),
        # A P/D decoder: its usage echoes the prefiller's hit; it held all
        # but the last token, 384 from its own cache and the rest by NIXL,
        # and its recompute alone held nothing.
        (
            [(P, 1152, {"do_remote_prefill": True}), (P, 0, None)],
            _moved(2 * P, 384, 2 * P - 384, P - 1 - 384),
            True,
            True,
        ),
        # A decoder without prefix caching: no local lookup is counted.
        (
            [(P, 1152, {"do_remote_prefill": True})],
            _moved(0, 0, P, P - 1),
            False,
            True,
        ),
    ],
    ids=["plain", "offload", "pd-prefill", "pd-decode", "pd-decode-no-caching"],
)
def test_counter_rule(entries, moved, caching, connector):
    ledger = Ledger()
    for prompt, cached, params in entries:
        ledger = ledger + ledger_entry(prompt, cached, params)
    assert counter_problems("s", moved, ledger, caching, connector) == []
    # One token more of anything is a disagreement.
    for key in moved:
        wrong = {**moved, key: moved[key] + 1}
        if key == EXTERNAL_QUERIES and not connector:
            continue
        assert counter_problems("s", wrong, ledger, caching, connector), key


def test_counter_rule_catches_over_reported_usage():
    ledger = ledger_entry(P, 1152 + 64, None)
    problems = counter_problems("serve", _moved(P, 1152), ledger, True, False)
    assert len(problems) == 1 and "usage and the server's own counters" in problems[0]


def _routed(
    recompute: bool = True,
    twin: bool = False,
    control: bool = False,
    more: int = 0,
    relay: bool = False,
    alone: bool = False,
):
    sent = object()
    return SimpleNamespace(
        recompute=sent if recompute else None,
        twin=sent if twin else None,
        control=sent if control else None,
        more_controls=[sent] * more,
        relay=sent if relay else None,
        prefiller_alone=sent if relay else None,
        alone=sent if alone else None,
    )


def test_expected_requests_route_the_recompute_to_the_decoder():
    turns = [_routed() for _ in range(4)]
    cold = [_routed(recompute=False), *turns[:1]]
    assert expected_requests(1, turns) == [8]
    assert expected_requests(2, turns) == [4, 8]
    assert expected_requests(2, cold) == [2, 3]
    # Batched: the control goes to the one server too.
    assert expected_requests(1, [_routed(control=True)] * 4) == [12]
    # P/D: the cold twin through both, recompute and control to the decoder.
    assert expected_requests(2, [_routed(twin=True, control=True)] * 4) == [8, 16]
    # A P/D case of one turn, its path noise measured on further controls:
    # each goes to the decoder alone.
    assert expected_requests(2, [_routed(twin=True, control=True, more=3)]) == [2, 7]
    # P/D of one configuration: the relay through both, the prompt served
    # whole by the prefiller alone, and no control.
    assert expected_requests(2, [_routed(twin=True, relay=True)] * 4) == [16, 16]
    # Batched restores: each prompt alone too, through the deployment.
    assert expected_requests(1, [_routed(alone=True)] * 4) == [12]


def test_decoder_transfers_what_its_own_cache_does_not_hold():
    # The decoder loads 768 of a 769-token prompt (PD_PREFILL_BACKOFF 1).
    assert harness.reconcile.decoder_pulls(769, 512) == 256
    assert harness.reconcile.decoder_pulls(769, 768) == 0
    assert harness.reconcile.decoder_problems(769, 0, 1, 0) == []
    assert harness.reconcile.decoder_problems(769, 512, 1, 512) == []
    assert harness.reconcile.decoder_problems(769, 768, 0, 512) == []
    (why,) = harness.reconcile.decoder_problems(769, 768, 1, 512)
    assert "moved by 1, expected 0" in why
    (why,) = harness.reconcile.decoder_problems(769, 512, 0, 512)
    assert "moved by 0, expected 1" in why
    (why,) = harness.reconcile.decoder_problems(769, 769, 0, 512)
    assert "beyond the 768 it loads" in why


def test_a_resends_decoder_hits_by_the_rule_of_its_role():
    pd = Deployment(decode=Instance(), prefill=Instance())
    block, partial = Units(block=128, hit=128), Units(block=128, hit=64)
    # A drafter that drops a unit (only its rule is read).
    dspark = SimpleNamespace(drafting=lambda instance: Drafting(drops_unit=True))
    # The prefiller's part of 385 tokens ends on a block: the decoder loaded
    # three whole blocks, and the prompt's checkpoint is their end.
    assert harness.reconcile.decoder_resend_hit(385, block, Mode(), pd) == 384
    assert (
        harness.reconcile.decoder_resend_hit(
            385, partial, Mode(prefix_match_unit=64), pd
        )
        == 384
    )
    # A prompt on a block: the decoder loaded 383 tokens, two whole blocks,
    # and holds no state at the partial checkpoint 320.
    assert (
        harness.reconcile.decoder_resend_hit(
            384, partial, Mode(prefix_match_unit=64), pd
        )
        == 256
    )
    # A drafter's proof unit: the checkpoint 320 of 385, then its block 256.
    assert harness.reconcile.decoder_resend_hit(385, partial, dspark, pd) == 256
    # A decoder without a prefix cache, or whose cache is reset, hits 0.
    nocache = replace(pd, decode=Instance(prefix_caching=False))
    assert harness.reconcile.decoder_resend_hit(385, block, Mode(), nocache) == 0
    offload = replace(pd, offload=True)
    assert harness.reconcile.decoder_resend_hit(385, block, Mode(), offload) == 0

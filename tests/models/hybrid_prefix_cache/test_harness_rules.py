# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of what the harness expects of vLLM, rule by rule: hits and
their bounds, resends, what a drafter changes, checkpoints, a
conversation's turns and the sweep's shapes. No server, any platform."""

import random
from types import SimpleNamespace
from typing import get_args

import pytest

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import (
    Deployment,
    Drafting,
    Instance,
    Mode,
    Units,
    holds_for,
    kv_connector,
)
from tests.models.hybrid_prefix_cache.harness.conversation import (
    shape_length,
)
from tests.models.hybrid_prefix_cache.harness.rules import (
    TURN_TOKENS,
    decode_checkpoint,
    drafting,
    expectation,
    expected_cached,
    expected_resend,
    hit_bound,
    impossible_hit,
    plan_turns,
    prompt_end_checkpoint,
)
from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod


@pytest.mark.parametrize(
    ("prev_len", "unit", "drops_unit", "expected"),
    [
        (0, 128, False, 0),  # first turn: nothing stored yet
        (1, 128, False, 0),
        (127, 128, False, 0),
        (128, 128, False, 0),  # the last token is recomputed
        (129, 128, False, 128),
        (421, 128, False, 384),
        (421, 64, False, 384),
        (421, 16, False, 416),
        (1198, 128, False, 1152),
        (1198, 16, False, 1184),
        (256, 128, False, 128),  # an exact multiple keeps one unit back
        # An EAGLE-style drafter: the last unit boundary within the prompt,
        # one unit lower.
        (421, 128, True, 256),
        (129, 128, True, 0),
        (128, 128, True, 0),  # ... never below zero
        (256, 128, True, 128),  # an exact multiple: no second unit back
        (7040, 128, False, 6912),
        (7296, 128, False, 7168),
    ],
)
def test_expected_cached(prev_len: int, unit: int, drops_unit: bool, expected: int):
    assert expected_cached(prev_len, unit, drops_unit) == expected


@pytest.mark.parametrize(
    ("prompt_len", "drops_unit", "expected"),
    [
        # Upstream's DSpark resends with unit 128.
        (7040, True, 6912),
        (7296, True, 7168),
        (7449, True, 7296),
        # Without a drafter that drops a unit (none, or n-gram).
        (7040, False, 6912),
        (7296, False, 7168),
        (7449, False, 7424),
    ],
)
def test_expected_resend(prompt_len: int, drops_unit: bool, expected: int):
    assert expected_resend(prompt_len, 128, drops_unit) == expected
    resend = plan_turns(prompt_len - 2 * TURN_TOKENS)[-1]
    assert resend.resend and resend.prompt_len == prompt_len
    assert expectation(resend, 128, drops_unit)[0] == expected


def _flat_literal(tp) -> list[str]:
    return [
        leaf
        for arg in get_args(tp)
        for leaf in (_flat_literal(arg) if get_args(arg) else [arg])
    ]


def test_drafting_asks_vllm(monkeypatch):
    """What a drafter changes is the vLLM under test's own
    SpeculativeConfig.use_eagle_block_drop on the declared config: whatever
    that method says (here replaced), the rule follows; the declared fields
    reach it, and a field vLLM does not have is refused."""
    seen = []

    def rule(config):
        seen.append((config.method, config.disable_eagle_block_drop))
        return False

    monkeypatch.setattr(SpeculativeConfig, "use_eagle_block_drop", rule)
    assert drafting({"method": "eagle3"}) == Drafting()
    off = {"method": "dspark", "disable_eagle_block_drop": True}
    assert not Mode(spec=off).drops_unit
    assert sorted(set(seen)) == [("dspark", True), ("eagle3", False)]
    assert not Mode().drops_unit
    with pytest.raises(ValueError, match="no field not_a_field"):
        Mode(spec={"method": "eagle", "not_a_field": 1}).drops_unit  # noqa: B018
    with pytest.raises(ValueError, match="method"):
        Mode(spec={"model": "some/draft"})


NIXL = kv_connector("NixlConnector")
# A connector that declares no lookahead hashes in any release.
EXAMPLE = kv_connector("ExampleConnector", {"shared_storage_path": "/tmp"})


def test_drafting_of_the_installed_vllm():
    """The release under test's answers for EAGLE-style and other
    drafters, as each release's code gives them: 0.32 drops a unit for
    every EAGLE-style method; 0.33 no longer for DSpark and DFlash
    (SpeculativeConfig.needs_eagle_block_drop), and hashes lookahead tokens
    instead of dropping where no KV connector is on (the VllmConfig.
    num_hash_lookahead_tokens property); 0.34 also behind a connector that
    declares them (VllmConfig._resolve_num_hash_lookahead_tokens,
    KVConnectorBase_V1.supports_lookahead_block_hashes)."""
    dspark, eagle3 = {"method": "dspark"}, {"method": "eagle3"}
    assert Mode(spec=dspark).drops_unit is holds_for("<0.33")
    assert drafting({"method": "ngram"}, kv_config=NIXL) == Drafting()
    off = {"method": "eagle3", "disable_eagle_block_drop": True}
    assert drafting(off) == Drafting()
    for method in _flat_literal(SpeculativeMethod):
        eagle = SpeculativeConfig.use_eagle(SimpleNamespace(method=method))
        if not eagle:
            assert drafting({"method": method}) == Drafting(), method
    dropped, hashed = Drafting(drops_unit=True), Drafting(lookahead=1)
    assert drafting(eagle3, kv_config=EXAMPLE) == dropped
    if holds_for("<0.33"):
        assert drafting(eagle3) == dropped
        assert drafting(eagle3, kv_config=NIXL) == dropped
    elif holds_for("<0.34"):
        assert drafting(eagle3) == hashed
        assert drafting(eagle3, kv_config=NIXL) == dropped
    else:
        assert drafting(eagle3) == hashed
        assert drafting(eagle3, kv_config=NIXL) == hashed
        assert drafting(eagle3, kv_config=EXAMPLE) == dropped
    # Without prefix caching, the drop stays (nothing is hashed).
    if holds_for("<0.34"):
        assert drafting(eagle3, prefix_caching=False) == dropped


@pytest.mark.parametrize(
    ("prompt_len", "lookahead", "expected"),
    [(421, 1, 384), (385, 1, 384), (384, 1, 256), (386, 2, 384), (385, 2, 256)],
)
def test_lookahead_checkpoint(prompt_len: int, lookahead: int, expected: int):
    """With lookahead hashes the prompt-end checkpoint leaves the last
    max(1, lookahead) tokens (v1/kv_cache_interface.py
    get_mamba_prefill_checkpoint_position) and drops no unit."""
    assert prompt_end_checkpoint(prompt_len, 128, False, lookahead) == expected


@pytest.mark.parametrize(
    ("prompt_len", "interval", "expected"),
    [
        (510, None, 512),  # 510 + 7 decoded passes 512
        (510, 128, 512),  # an interval of one block keeps every block
        (510, 0, 0),  # vLLM's default keeps only the replay boundaries
        (504, 128, 0),  # 504 + 7 = 511 stops short of 512
        (505, 128, 512),
        (510, 256, 512),
        (382, 256, 0),  # 384 is no multiple of the interval
    ],
)
def test_decode_checkpoint(prompt_len: int, interval: int | None, expected: int):
    assert decode_checkpoint(prompt_len, 7, 128, interval) == expected


def test_plan_turns():
    plan = plan_turns(421)
    assert [(t.prompt_len, t.prev_len, t.resend) for t in plan] == [
        (421, 0, False),
        (1198, 421, False),
        (1975, 1198, False),
        (1975, 1975, True),
    ]


def test_a_grown_prompt_takes_the_output_then_random_tokens():
    rng = random.Random(0)
    grown = harness.conversation.grown_prompt(rng, (2, 10), [1, 1], [7, 8])
    assert len(grown) == 2 + harness.rules.TURN_TOKENS
    assert grown[:4] == [1, 1, 7, 8] and all(2 <= t < 10 for t in grown[4:])
    long = list(range(harness.rules.TURN_TOKENS + 5))
    assert (
        harness.conversation.grown_prompt(rng, (2, 10), [], long)
        == long[: harness.rules.TURN_TOKENS]
    )


def test_pd_prefiller_sees_one_token_less():
    """A P/D prefiller's prompt is one token short (vLLM's NIXL
    _prefill_backoff): a previous prompt of 385 tokens leaves its
    checkpoint at 256 there, not 384."""
    assert Deployment(prefill=Instance()).cache_backoff == 1
    assert Deployment().cache_backoff == 0
    turn = plan_turns(385)[1]
    assert expectation(turn, 128, False) == (384, 384)
    assert expectation(turn, 128, False, backoff=1) == (256, 384)


@pytest.mark.parametrize(
    ("cached", "prev_len", "prompt_len", "unit", "why"),
    [
        (384, 421, 1198, 128, ""),
        (0, 0, 421, 128, ""),
        (400, 421, 1198, 128, "not a multiple"),
        (512, 421, 1198, 128, "exceeds the previous prompt"),
        (128, 0, 421, 128, "exceeds the previous prompt"),
        (1152, 1152, 1152, 128, "leaves nothing"),
    ],
)
def test_impossible_hit(cached, prev_len, prompt_len, unit, why):
    got = impossible_hit(cached, prev_len, prompt_len, unit)
    assert (why in got) if why else got == ""


@pytest.mark.parametrize(
    ("prev_len", "prompt_len", "unit", "bound"),
    [
        (0, 421, 128, 0),
        (421, 1198, 128, 384),
        (896, 1673, 128, 896),  # a whole unit-aligned previous prompt
        (1198, 1198, 64, 1152),  # a resend keeps its last token to compute
        (1152, 1152, 64, 1088),
    ],
)
def test_hit_bound(prev_len, prompt_len, unit, bound):
    assert hit_bound(prev_len, prompt_len, unit) == bound
    assert not impossible_hit(bound, prev_len, prompt_len, unit)
    assert impossible_hit(bound + unit, prev_len, prompt_len, unit)


@pytest.mark.parametrize(
    ("shape", "hit", "block", "length"),
    [
        ("exact", 128, 128, 384),
        ("plus1", 128, 128, 385),
        ("tail37", 64, 128, 421),
        ("half-plus1", 64, 128, 417),
        ("unit-minus1", 64, 128, 447),
        ("inblock-exact", 64, 128, 448),
        ("inblock-plus1", 64, 128, 449),
        ("inblock-plus1", 128, 128, None),
    ],
)
def test_shape_length(shape, hit, block, length):
    assert shape_length(shape, Units(block=block, hit=hit)) == length

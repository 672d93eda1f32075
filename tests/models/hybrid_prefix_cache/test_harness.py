# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the harness's pure helpers; no server, any platform."""

import random
from dataclasses import replace
from types import SimpleNamespace
from typing import get_args

import pytest

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import (
    CASE_TURNS,
    EXTERNAL_HITS,
    EXTERNAL_QUERIES,
    PREFIX_HITS,
    PREFIX_QUERIES,
    REPORT_DIR_ENV,
    SERVERS_MARK,
    SHAPES,
    TURN_TOKENS,
    Binding,
    CaseRecord,
    Deployment,
    Drafting,
    Instance,
    Known,
    Ledger,
    Matrix,
    Mode,
    Sample,
    ServerError,
    ServerPool,
    Suite,
    Turn,
    Units,
    case_seconds,
    counter_problems,
    decode_checkpoint,
    device_ranges,
    drafting,
    expect_known,
    expectation,
    expected_cached,
    expected_requests,
    expected_resend,
    first_divergence,
    group_by_servers,
    hit_bound,
    holds_for,
    impossible_hit,
    kv_connector,
    ledger_entry,
    matrix_modes,
    plan_turns,
    prompt_end_checkpoint,
    run_case,
    select_known,
    server_args,
    server_specs,
    servers_mark,
    shape_length,
    shard_by_cost,
)
from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod


def kimi_cell(case_id: str):
    """(deployment, mode) of a Kimi-K3 matrix cell, from its module."""
    from tests.models.kimi_k3 import test_prefix_cache as kimi

    return kimi.MATRIX.served(case_id)


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


# Real B200 turn tables, from the PR this project started from: per case,
# the hit unit and (prompt, cached) of its three growing turns. That PR ran
# vLLM 0.32, whose rule drops a unit for DSpark (B200_DROPS_UNIT).
B200_TURNS = {
    # PMU 128; block 2944 under DCP2, so the first prompt is 3 * 2944 + 37.
    "dcp2-offload-partial": (128, [(8869, 0), (9646, 8832), (10423, 9600)]),
    # PMU 128, DSpark; block 6144, so the first prompt is 3 * 6144 + 37.
    "pd-offload-partial-dspark": (128, [(18469, 0), (19246, 18304), (20023, 19072)]),
}
B200_DROPS_UNIT = {"dcp2-offload-partial": False, "pd-offload-partial-dspark": True}


def _b200_table(case_id: str, drops_unit: bool) -> list[tuple[int, int]]:
    """(prompt, expected hit) of the case's first turns, from the harness's
    own plan of the conversation and its deployment (the P/D prefiller sees
    each prompt one token short), under the drop rule ``drops_unit``."""
    unit, seen = B200_TURNS[case_id]
    deployment, _ = kimi_cell(case_id)
    plan = plan_turns(seen[0][0])
    return [
        (turn.prompt_len, expectation(turn, unit, drops_unit, backoff)[0])
        for turn in plan[: len(seen)]
        for backoff in [deployment.cache_backoff]
    ]


@pytest.mark.parametrize("case_id", B200_TURNS)
def test_b200_turn_tables(case_id: str):
    """The expectation functions reproduce what B200 served under the rule
    of the vLLM it ran; under the installed vLLM's rule, the table is
    printed, and equals B200's where the rule is the same."""
    _, mode = kimi_cell(case_id)
    assert _b200_table(case_id, B200_DROPS_UNIT[case_id]) == B200_TURNS[case_id][1]
    installed = _b200_table(case_id, mode.drops_unit)
    print(f"{case_id} under the installed vLLM's rule: {installed}")
    if mode.drops_unit == B200_DROPS_UNIT[case_id]:
        assert installed == B200_TURNS[case_id][1]
    else:
        assert all(a >= b for (_, a), (_, b) in zip(installed, B200_TURNS[case_id][1]))


def test_b200_plain_block_checkpoint():
    """On main without the fix, plain-block served 0 at its second turn
    where 17280 was expected: block mode with a 5760-token hit unit."""
    plan = plan_turns(3 * 5760 + 37)
    assert expectation(plan[1], 5760, drops_unit=False)[0] == 17280


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


def test_pd_prefiller_sees_one_token_less():
    """A P/D prefiller's prompt is one token short (vLLM's NIXL
    _prefill_backoff): a previous prompt of 385 tokens leaves its
    checkpoint at 256 there, not 384."""
    assert Deployment(prefill=Instance()).cache_backoff == 1
    assert Deployment().cache_backoff == 0
    turn = plan_turns(385)[1]
    assert expectation(turn, 128, False) == (384, 384)
    assert expectation(turn, 128, False, backoff=1) == (256, 384)


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
):
    sent = object()
    return SimpleNamespace(
        recompute=sent if recompute else None,
        twin=sent if twin else None,
        control=sent if control else None,
        more_controls=[sent] * more,
        relay=sent if relay else None,
        prefiller_alone=sent if relay else None,
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


def test_mode_args():
    assert Mode().args() == []
    assert Mode(prefix_match_unit=64).args() == ["--prefix-match-unit", "64"]
    spec = Mode(spec={"method": "ngram", "num_speculative_tokens": 2}).args()
    assert spec == [
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 2}',
    ]


def test_instance_args_and_devices():
    assert Instance().args() == ["--enable-prefix-caching"]
    decoder = Instance(
        dp=2,
        expert_parallel=True,
        kv_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        prefix_caching=False,
    )
    assert decoder.args() == [
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--kv-transfer-config",
        '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
        "--no-enable-prefix-caching",
    ]
    dcp = Instance(tp=2, dcp=2)
    assert dcp.args()[:4] == [
        "--tensor-parallel-size",
        "2",
        "--decode-context-parallel-size",
        "2",
    ]
    assert Deployment(decode=decoder, prefill=dcp).num_devices == 4
    assert Deployment(decode=decoder, prefill=dcp).instances == (dcp, decoder)


def test_server_args_order():
    binding = Binding(model="m", base_args=("--a",), token_ids=(2, 10))
    args = server_args(binding, Instance(), Mode(prefix_match_unit=16))
    assert args == ["--a", "--enable-prefix-caching", "--prefix-match-unit", "16"]
    # No prefix match unit for an instance that does not cache prefixes.
    args = server_args(
        binding, Instance(prefix_caching=False), Mode(prefix_match_unit=16)
    )
    assert args == ["--a", "--no-enable-prefix-caching"]


def test_units_from_cache_config():
    labels = {"block_size": "128", "mamba_block_size": "48", "prefix_match_unit": ""}
    assert Units.from_cache_config(labels, Mode()) == Units(block=384, hit=384)
    labels["prefix_match_unit"] = "16"
    assert Units.from_cache_config(labels, Mode(prefix_match_unit=16)) == Units(
        block=384, hit=16
    )
    with pytest.raises(AssertionError, match="prefix_match_unit"):
        Units.from_cache_config(labels, Mode(prefix_match_unit=64))


def test_device_ranges_are_disjoint_and_contiguous():
    pd = Deployment(decode=Instance(dp=2), prefill=Instance(tp=2))
    assert device_ranges(pd) == [range(0, 2), range(2, 4)]
    assert device_ranges(Deployment(decode=Instance(tp=2))) == [range(0, 2)]


def test_server_specs():
    binding = Binding(model="m", base_args=(), token_ids=(2, 10), env={"A": "1"})
    (plain,) = server_specs(binding, Deployment(), Mode())
    assert (plain.name, plain.env, plain.side_channel_port) == (
        "serve",
        (("A", "1"),),
        False,
    )
    (offload,) = server_specs(binding, Deployment(offload=True), Mode())
    assert dict(offload.env) == {"A": "1", "VLLM_SERVER_DEV_MODE": "1"}
    own = Instance(env={"B": "2"}, serve_args=("--x",))
    pd = Deployment(prefill=Instance(tp=2), decode=own)
    prefill, decode = server_specs(binding, pd, Mode())
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert dict(prefill.env)["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert dict(decode.env)["CUDA_VISIBLE_DEVICES"] == "2"
    assert dict(decode.env)["B"] == "2" and decode.args[-1] == "--x"
    assert dict(prefill.env)["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
    assert prefill.side_channel_port and decode.side_channel_port
    # Equal deployments give equal specs: what server reuse keys on.
    assert server_specs(binding, pd, Mode()) == (prefill, decode)
    assert server_specs(binding, pd, Mode(prefix_match_unit=16)) != (prefill, decode)
    cpu = Binding(model="m", base_args=(), token_ids=(2, 10), visible_devices_env=None)
    assert all(
        "CUDA_VISIBLE_DEVICES" not in dict(spec.env)
        for spec in server_specs(cpu, pd, Mode())
    )


def test_a_servers_own_pythonpath_goes_first():
    inherited = {"PYTHONPATH": "/overlay:/checkout", "A": "1", "B": "1"}
    env = harness.layered_env(inherited, {"PYTHONPATH": "/hook", "B": "2"})
    assert env == {"PYTHONPATH": "/hook:/overlay:/checkout", "A": "1", "B": "2"}
    assert harness.layered_env({}, {"PYTHONPATH": "/hook"}) == {"PYTHONPATH": "/hook"}
    assert harness.layered_env(inherited, {"B": "2"})["PYTHONPATH"] == (
        "/overlay:/checkout"
    )


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


def _sample(tokens, logprobs):
    return Sample(
        token_ids=tokens,
        text="",
        token_logprobs=logprobs,
        top_logprobs=[{t: lp} for t, lp in zip(tokens, logprobs)],
        prompt_tokens=10,
        cached_tokens=0,
    )


def test_first_divergence():
    a = _sample([5, 6, 7], [-0.1, -0.2, -0.3])
    assert first_divergence(a, a) == ""
    b = _sample([5, 9, 7], [-0.1, -0.5, -0.3])
    message = first_divergence(a, b)
    assert "index 1" in message and "6:-0.2000" in message and "9:-0.5000" in message


def test_expect_known():
    bug = Known("xfail", "a bug", evidence="kernel_x")
    with pytest.raises(pytest.xfail.Exception, match="a bug"), expect_known("c", bug):
        raise AssertionError("... kernel_x failed ...")
    with (
        pytest.raises(AssertionError, match="without 'kernel_x'"),
        expect_known("c", bug),
    ):
        raise AssertionError("something else")
    with pytest.raises(pytest.fail.Exception, match="XPASS"), expect_known("c", bug):
        pass
    refused = Known("unsupported", "not on CPU", evidence="no streams")
    with (
        pytest.raises(pytest.skip.Exception, match="not on CPU"),
        expect_known("c", refused),
    ):
        raise AssertionError("server log: no streams here")
    with expect_known("c", None):
        pass
    with pytest.raises(ValueError):
        Known("maybe", "r", "e")
    with pytest.raises(ValueError, match="config time"):
        Known("xfail", "r", "e", at_config=True)


def _record(problem: str | None, units: Units | None) -> CaseRecord:
    """A case's record, failing with ``problem`` unless it is None."""
    return CaseRecord("c", units=units, problems=[] if problem is None else [problem])


def test_expect_known_by_geometry():
    """An entry with a geometry holds only where the servers reported it;
    a listed case fails by its record's problems or by an exception."""
    at256 = Known("xfail", "lost", evidence="cached 0 <", geometry=(256, 256))
    big, small = Units(block=256, hit=256), Units(block=128, hit=128)
    with pytest.raises(pytest.xfail.Exception), expect_known("c", (at256,)) as run:
        run.record = _record("turn 1: cached 0 < expected checkpoint 512", big)
    assert run.record.verdict == "known xfail"
    with expect_known("c", (at256,)) as run:
        # Not listed at this geometry: the record is the caller's to assert.
        run.record = _record("turn 1: cached 0 < expected checkpoint 256", small)
    assert run.record.verdict == "" and not run.record.ok
    with (
        pytest.raises(AssertionError, match="update the table"),
        expect_known("c", (at256,)) as run,
    ):
        run.record = _record("turn 1: lost", big)
    assert run.record.verdict == "FAIL: stale table"
    refused = Known("unsupported", "no", evidence="streams", geometry=(256, 256))
    with pytest.raises(pytest.skip.Exception), expect_known("c", (refused,)) as run:
        run.record = _record(None, big)
        raise AssertionError("no streams")
    assert run.record.verdict == "known refusal"
    with pytest.raises(AssertionError, match="no streams"), expect_known("c", ()):
        raise AssertionError("no streams")
    with (
        pytest.raises(pytest.fail.Exception, match="XPASS"),
        expect_known("c", (at256,)) as run,
    ):
        run.record = _record(None, big)
    assert run.record.verdict == "FAIL: XPASS"
    with expect_known("c", (at256,)) as run:
        run.record = _record(None, small)
    with pytest.raises(ValueError, match="several"):
        select_known((at256, at256), big)
    assert select_known((at256,), None) is None


def test_record_explains_its_problems():
    record = _record(None, Units(block=256, hit=64))
    assert record.ok
    turn = Turn("conv", 2, 900, 700, 512, bound=640)
    turn.problems.append("turn 2: cached 0 < expected checkpoint 512")
    record.turns.append(turn)
    assert not record.ok
    text = record.explain()
    assert text.startswith("c: 1 problem(s)\nturn 2: cached 0 < expected")
    assert "== c: hit unit 64, block 256" in text and "FAIL" in text


def test_cpu_concurrent_cases_play_the_shapes_that_pass_alone():
    """A concurrent case plays the sweep shapes that pass on their own at
    the geometry its servers resolve to, and expects them all to pass."""
    from tests.models.hybrid_prefix_cache.cpu_known import MATRIX

    at256, at128 = Units(block=256, hit=256), Units(block=128, hit=128)
    block = "plain-block-concurrent"
    assert MATRIX.concurrent_shapes(block, at256) == ("plus1", "tail37")
    shapes = MATRIX.concurrent_shapes(block, at128)
    assert "exact" in shapes and "unit-minus1" not in shapes
    assert MATRIX.known_for(block) == ()
    partial = "plain-partial-concurrent"
    for units in (at256, at128, None):
        assert len(MATRIX.concurrent_shapes(partial, units)) == 7
    assert MATRIX.known_for(partial) == ()
    assert MATRIX.concurrent_shapes("plain-block", at256) == ()


def test_cpu_shared_failures_name_a_case_that_confirms_them():
    """A cell that skips because another confirms its failure names a case
    that runs on this machine, expects the same failure and confirms it
    itself; and each mechanism is confirmed somewhere."""
    from tests.models.hybrid_prefix_cache import cpu_binding as cpu
    from tests.models.hybrid_prefix_cache import cpu_known

    matrix = cpu_known.MATRIX
    runnable = {c for c in matrix.cases if cpu_known.core_shortage(c) is None}
    shared = {
        case_id: known
        for case_id in matrix.cases
        for known in matrix.known_for(case_id)
        if known.confirmed_by is not None
    }
    assert {k.confirmed_by for k in shared.values()} == {
        "plain-block-ngram",
        "offload-block",
        "dp2-ep-block",
    }
    for case_id, known in shared.items():
        confirmer = known.confirmed_by
        assert confirmer in runnable, (case_id, confirmer)
        expected = replace(known, confirmed_by=None)
        assert expected in matrix.known_for(confirmer), (case_id, confirmer)
    refused_at_config = [
        case_id
        for case_id in matrix.cases
        if any(k.at_config for k in matrix.known_for(case_id))
    ]
    assert sorted(refused_at_config) == sorted(
        f"{d}-{m}" for d in ("dcp2", "dcp2-offload") for m in cpu.MODES
    )


def test_compares_logprobs_only_across_equal_tp():
    assert Deployment().compares_logprobs
    assert Deployment(prefill=Instance()).compares_logprobs
    assert not Deployment(
        decode=Instance(dp=2), prefill=Instance(tp=2)
    ).compares_logprobs


class _Item:
    def __init__(self, name, key=None, seconds=None):
        self.name = name
        self.marks = [] if key is None else [servers_mark(key, seconds).mark]

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)


def test_group_by_servers():
    items = [
        _Item("a", "plain-block"),
        _Item("b", "plain-partial"),
        _Item("c"),
        _Item("d", "pd-block"),
        _Item("e", "plain-partial"),
        _Item("f", "plain-block"),
    ]
    group_by_servers(items)
    assert [i.name for i in items] == ["a", "f", "b", "e", "c", "d"]


def test_shard_by_cost():
    """Whole server groups, most costly first, to the job with the least
    cost so far; every job computes the same split; an item without a cost
    leaves the split to pytest-shard."""
    items = [
        _Item("pd", "pd", 400),
        _Item("a", "plain", 200),
        _Item("a-resend", "plain", 40),
        _Item("b", "offload", 200),
        _Item("c", "dcp", 200),
    ]
    jobs = [[i.name for i in shard_by_cost(items, j, 2)] for j in range(2)]
    assert jobs == [["pd", "c"], ["a", "a-resend", "b"]]
    assert [[i.name for i in shard_by_cost(items, j, 3)] for j in range(3)] == [
        ["pd"],
        ["a", "a-resend"],
        ["b", "c"],
    ]
    assert shard_by_cost([*items, _Item("free", "x")], 0, 2) is None
    assert case_seconds(2, 4) == 2 * case_seconds(1, 4)
    assert case_seconds(1, 2, start=False) < case_seconds(1, 2)


def test_matrix_builds_cases_known_failures_and_params():
    """The one matrix builder of both tiers: cells, the sweep's cases where
    asked, known failures by case or cell, and marked params."""
    deployments = {"plain": Deployment(), "tp2": Deployment(decode=Instance(tp=2))}
    modes = {"block": Mode(), "partial": Mode(prefix_match_unit=64)}
    bug = Known("xfail", "a bug", evidence="kernel_x")
    lost = Known("xfail", "lost", evidence="cached 0", geometry=(256, 256))
    known = {"tp2-block": (bug,), "plain-partial": (bug,), "plain-partial-exact": ()}
    known["plain-partial-plus1"] = (lost,)
    matrix = Matrix(deployments, modes, known, sweep=("plain-partial",))
    sweep = [f"plain-partial-{shape}" for shape in SHAPES] + [
        "plain-partial-concurrent"
    ]
    assert list(matrix.cases) == [
        "plain-block",
        "plain-partial",
        *sweep,
        "tp2-block",
        "tp2-partial",
    ]
    assert matrix.cases["plain-partial-concurrent"].concurrent
    assert matrix.served("tp2-partial") == (deployments["tp2"], modes["partial"])
    # A case's own entries, else its cell's.
    assert matrix.known_for("plain-partial-tail37") == (bug,)
    assert matrix.known_for("plain-partial-exact") == ()
    assert matrix.known_for("tp2-partial") == ()
    # Shapes with an entry that applies here are left out: plus1 at 256
    # only, the cell's bug everywhere.
    concurrent = "plain-partial-concurrent"
    at256, at128 = Units(block=256, hit=256), Units(block=128, hit=128)
    assert matrix.concurrent_shapes(concurrent, at256) == ("exact",)
    assert matrix.concurrent_shapes(concurrent, at128) == ("exact", "plus1")
    assert matrix.concurrent_shapes("plain-partial", at128) == ()
    with pytest.raises(ValueError, match="name no case"):
        Matrix(deployments, modes, {"plain-block-exact": (bug,)})
    # A workload runs on its cells' servers, right after each cell.
    loads = Matrix(deployments, modes, workloads={"aligned": ("tp2-block",)})
    assert list(loads.cases) == [
        "plain-block",
        "plain-partial",
        "tp2-block",
        "tp2-block-aligned",
        "tp2-partial",
    ]
    assert loads.cases["tp2-block-aligned"].workload == "aligned"
    assert loads.served("tp2-block-aligned") == loads.served("tp2-block")
    with pytest.raises(ValueError, match="workloads name no cell"):
        Matrix(deployments, modes, workloads={"aligned": ("dcp2-block",)})
    # A workload with servers of its own comes after its cell's sweep, and
    # is marked with its own servers key and the cost of their start.
    own = Matrix(
        deployments,
        modes,
        sweep=("plain-block",),
        workloads={"small-budget": ("plain-block",), "aligned": ("plain-block",)},
    )
    order = list(own.cases)
    assert order.index("plain-block-aligned") == 1
    assert order.index("plain-block-small-budget") == order.index("plain-partial") - 1
    assert order.index("plain-block-concurrent") < order.index(
        "plain-block-small-budget"
    )
    assert own.servers_key("plain-block-small-budget") == "plain-block-small-budget"
    assert own.servers_key("plain-block-aligned") == "plain-block"
    marks = {p.id: p.marks[0] for p in own.params() if p.id.startswith("plain-block")}
    assert marks["plain-block-small-budget"].args == ("plain-block-small-budget",)
    assert marks["plain-block-small-budget"].kwargs["seconds"] == case_seconds(
        1, CASE_TURNS, True
    )
    assert marks["plain-block-aligned"].kwargs["seconds"] == case_seconds(
        1, CASE_TURNS, False
    )
    # A concurrent case shares its cell's servers, or where its binding
    # serves batches alike starts its own, after the cell's sweep.
    assert own.servers_key("plain-block-concurrent") == "plain-block"
    batches = replace(own, batch_servers=True)
    assert batches.servers_key("plain-block-concurrent") == "plain-block-concurrent"
    (mark,) = next(
        p for p in batches.params() if p.id == "plain-block-concurrent"
    ).marks
    assert mark.kwargs["seconds"] == case_seconds(1, CASE_TURNS, True)
    # A P/D resend costs its two requests on its cell's running servers.
    pd = {"pd": Deployment(decode=Instance(), prefill=Instance())}
    resends = Matrix(pd, modes, workloads={"pd-resend": ("pd-block",)})
    assert resends.cases["pd-block-pd-resend"].turns == 2
    (mark,) = next(p for p in resends.params() if p.id == "pd-block-pd-resend").marks
    assert mark.kwargs["seconds"] == case_seconds(2, 2, False)
    params = {
        p.id: p
        for p in matrix.params(
            device_marks=lambda n: [pytest.mark.skipif(False, reason=str(n))],
            skip=lambda case_id: "no" if case_id.startswith("tp2") else None,
        )
    }
    assert list(params) == list(matrix.cases)
    assert params["plain-partial-exact"].values == ("plain-partial-exact",)
    marks = {m.name: m for m in params["tp2-block"].marks}
    assert marks[SERVERS_MARK].args == ("tp2-block",)
    assert marks["skipif"].kwargs == {"reason": "2"}
    assert marks["skip"].kwargs == {"reason": "no"}
    exact = [m.name for m in params["plain-partial-exact"].marks]
    assert exact == [SERVERS_MARK]
    assert params["plain-partial-exact"].marks[0].args == ("plain-partial",)
    # A cell's first case starts its servers; its sweep's reuse them.
    seconds = {i: p.marks[0].kwargs["seconds"] for i, p in params.items()}
    assert seconds["plain-partial"] == case_seconds(1, CASE_TURNS)
    assert seconds["plain-partial-exact"] == case_seconds(1, CASE_TURNS, start=False)


class _RefusingPool(ServerPool):
    """A pool whose servers refuse to start, as a server that exits during
    startup does (ServerError, with the whole log)."""

    def acquire(self, binding, deployment, mode):
        raise ServerError("the serve server exited with code 1", "log: no streams")


def test_a_refusal_at_start_is_judged_and_summarized(tmp_path, monkeypatch):
    """A case whose servers refuse to start is judged by its known entry
    (the evidence may be in the server's log) and lands in the suite's
    records with the summary's verdict; unlisted, the error propagates."""
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))
    suite = Suite(pool=_RefusingPool())
    binding = Binding(model="m", base_args=(), token_ids=(10, 20), env={})
    refused = Known("unsupported", "not on CPU", evidence="no streams")
    with pytest.raises(pytest.skip.Exception, match="not on CPU"):
        run_case(suite, "c", binding, Deployment(), Mode(), known=(refused,))
    with pytest.raises(ServerError, match="exited with code 1"):
        run_case(suite, "d", binding, Deployment(), Mode())
    outcomes = [(r.case_id, r.outcome, r.verdict) for r in suite.records]
    assert outcomes == [
        ("c", "error: ServerError", "known refusal"),
        ("d", "error: ServerError", ""),
    ]


def test_matrix_modes():
    """The four modes of both tiers, with their ids."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    modes = matrix_modes(64, "ngram", spec)
    assert modes == {
        "block": Mode(),
        "partial": Mode(prefix_match_unit=64),
        "block-ngram": Mode(spec=spec),
        "partial-ngram": Mode(prefix_match_unit=64, spec=spec),
    }
    assert [m.spec for m in modes.values()] == [None, None, spec, spec]


def test_records_and_suites_print_in_one_line():
    """What pytest shows of a failed ``assert record.ok`` and of the
    fixture: one line each, not every sample of every turn."""
    record = _record("turn 1: lost", Units(block=256, hit=256))
    record.turns.append(Turn("conv", 1, 900, 700, 512, bound=640, prompt=[5] * 900))
    record.outcome = "FAIL"
    assert repr(record) == "CaseRecord('c': FAIL, 1 turns)"
    suite = Suite()
    suite.records.append(record)
    assert repr(suite) == "Suite(1 case records, 0 server starts)"


# --- workloads ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "hit", "drops", "junction"),
    [
        # Two and a half blocks shared: the junction floors to two blocks,
        # one lower where the drafter drops a unit, whatever the hit unit.
        (256, 256, False, 512),
        (256, 64, False, 512),
        (6144, 128, True, 6144),
        (5760, 5760, False, 11520),
    ],
)
def test_junction_checkpoint(block, hit, drops, junction):
    units = harness.Units(block=block, hit=hit)
    shared = harness.shared_prefix_length(units)
    assert shared % block == block // 2
    assert harness.junction_checkpoint(shared, units, drops) == junction
    assert harness.sibling_tail_length(units) > block


def test_abort_problems_bound_what_the_steps_wrote():
    units = harness.Units(block=256, hit=64)
    assert harness.abort_problems(512, 256, 256, 2341, units) == []
    (why,) = harness.abort_problems(768, 256, 256, 2341, units)
    assert "a published boundary was never written" in why
    (why,) = harness.abort_problems(100, 256, 0, 2341, units)
    assert "not a multiple of the hit unit" in why


def test_overlap_problems_bound_the_steps_before_the_retrys():
    units = harness.Units(block=256, hit=64)
    assert harness.overlap_problems(2304, 2304, 2341, units) == []
    (why,) = harness.overlap_problems(2304, 2048, 2341, units)
    assert "a state its own step publishes" in why
    (why,) = harness.overlap_problems(100, 2048, 2341, units)
    assert "not a multiple of the hit unit" in why


def test_decoder_transfers_what_its_own_cache_does_not_hold():
    # The decoder loads 768 of a 769-token prompt (PD_PREFILL_BACKOFF 1).
    assert harness.decoder_pulls(769, 512) == 256
    assert harness.decoder_pulls(769, 768) == 0
    assert harness.decoder_problems(769, 0, 1, 0) == []
    assert harness.decoder_problems(769, 512, 1, 512) == []
    assert harness.decoder_problems(769, 768, 0, 512) == []
    (why,) = harness.decoder_problems(769, 768, 1, 512)
    assert "moved by 1, expected 0" in why
    (why,) = harness.decoder_problems(769, 512, 0, 512)
    assert "moved by 0, expected 1" in why
    (why,) = harness.decoder_problems(769, 769, 0, 512)
    assert "beyond the 768 it loads" in why


def test_a_resends_decoder_hits_by_the_rule_of_its_role():
    pd = Deployment(decode=Instance(), prefill=Instance())
    block, partial = Units(block=128, hit=128), Units(block=128, hit=64)
    # A drafter that drops a unit (only its rule is read).
    dspark = SimpleNamespace(drafting=lambda instance: Drafting(drops_unit=True))
    # The prefiller's part of 385 tokens ends on a block: the decoder loaded
    # three whole blocks, and the prompt's checkpoint is their end.
    assert harness.decoder_resend_hit(385, block, Mode(), pd) == 384
    assert (
        harness.decoder_resend_hit(385, partial, Mode(prefix_match_unit=64), pd) == 384
    )
    # A prompt on a block: the decoder loaded 383 tokens, two whole blocks,
    # and holds no state at the partial checkpoint 320.
    assert (
        harness.decoder_resend_hit(384, partial, Mode(prefix_match_unit=64), pd) == 256
    )
    # A drafter's proof unit: the checkpoint 320 of 385, then its block 256.
    assert harness.decoder_resend_hit(385, partial, dspark, pd) == 256
    # A decoder without a prefix cache, or whose cache is reset, hits 0.
    nocache = replace(pd, decode=Instance(prefix_caching=False))
    assert harness.decoder_resend_hit(385, block, Mode(), nocache) == 0
    offload = replace(pd, offload=True)
    assert harness.decoder_resend_hit(385, block, Mode(), offload) == 0


def test_eviction_problems_take_the_least_group():
    assert harness.eviction_problems(512, (768, 512, 512)) == []
    (why,) = harness.eviction_problems(768, (768, 512, 768))
    assert "the least that every group still holds" in why


def test_a_grown_prompt_takes_the_output_then_random_tokens():
    rng = random.Random(0)
    grown = harness.grown_prompt(rng, (2, 10), [1, 1], [7, 8])
    assert len(grown) == 2 + harness.TURN_TOKENS
    assert grown[:4] == [1, 1, 7, 8] and all(2 <= t < 10 for t in grown[4:])
    long = list(range(harness.TURN_TOKENS + 5))
    assert harness.grown_prompt(rng, (2, 10), [], long) == long[: harness.TURN_TOKENS]


def test_an_eviction_servers_pool_and_pressure():
    units = harness.Units(block=256, hit=64)
    assert harness.eviction_filler(units) == 256 + harness.FIRST_PROMPT_TAIL
    # The conversation's second turn and its output.
    assert harness.eviction_max_len(805, 8) == 805 + harness.TURN_TOKENS + 8
    # Later arguments win: laid over the base --max-model-len and pool.
    assert harness.eviction_args(1590, 123456) == (
        "--max-model-len",
        "1590",
        "--kv-cache-memory-bytes",
        "123456",
    )
    assert harness.WORKLOADS["eviction"].own_servers


def test_abort_length_spans_two_steps():
    units = harness.Units(block=256, hit=256)
    assert harness.abort_length(units, 2048) > 2048 + 256
    assert harness.abort_length(units, 128) > 3 * 256
    assert harness.small_budgets(units) == (128, 384)


def test_a_real_servers_abort_lands_and_its_retry_resumes_from_the_checkpoint():
    units = harness.Units(block=256, hit=64)
    # The checkpoint ends the first chunk of a 2048-token budget.
    length = harness.abort_retry_length(units, 2048)
    assert length == 2048 + harness.FIRST_PROMPT_TAIL
    assert harness.prompt_end_checkpoint(length, units.hit, False) == 2048
    # The aborted request and the retry each counted at admission; only the
    # retry's first token.
    assert harness.abort_landing(2 * length, 1, length) == "mid-prefill"
    assert harness.abort_landing(length, 1, length) == "before admission"
    assert harness.abort_landing(2 * length, 2, length) == "after the prefill"
    # Under P/D the retry's cold twin is counted too.
    assert harness.abort_landing(3 * length, 2, length, answered=2) == "mid-prefill"
    assert harness.abort_landing(2 * length, 2, length, 2) == "before admission"
    assert harness.abort_landing(3 * length, 3, length, 2) == "after the prefill"
    assert harness.abort_checkpoint("before admission", length, units, False) == 0
    for landed in ("mid-prefill", "after the prefill", "answered"):
        assert harness.abort_checkpoint(landed, length, units, False) == 2048
    assert harness.abort_checkpoint("mid-prefill", length, units, True) == 1984
    # Counted at admission, with nothing held, and no completion answered.
    entry = harness.aborted_entry(length)
    assert (entry.requests, entry.queries, entry.held) == (0, length, 0)


def test_small_budget_servers_and_branch():
    units = harness.Units(block=256, hit=64)
    assert harness.served_budget(units) == 384
    assert harness.small_budget_args(units) == (
        "--max-num-batched-tokens",
        "384",
        "--prefix-cache-retention-interval",
        "256",
    )
    # The branch shares two and a half blocks and resumes at the block.
    assert harness.branch_lengths(units) == (640, 677)
    assert harness.branch_checkpoint(640, units, False) == 512
    assert harness.branch_checkpoint(640, units, True) == 448
    plain = Deployment(decode=Instance(serve_args=("-O0",)))
    served = harness.with_serve_args(plain, ("--a", "1"))
    assert served.decode.serve_args == ("-O0", "--a", "1")
    assert served.prefill is None and plain.decode.serve_args == ("-O0",)
    pd = Deployment(prefill=Instance(), decode=Instance())
    served = harness.with_serve_args(pd, ("--b",))
    assert served.prefill.serve_args == served.decode.serve_args == ("--b",)
    pinned = harness.with_serve_env(pd, {"OMP_NUM_THREADS": "1"})
    assert pinned.prefill.env == pinned.decode.env == {"OMP_NUM_THREADS": "1"}
    assert pd.decode.env == {}


def _budget_turn(index: int, hit: Sample, recompute: Sample | None) -> Turn:
    return Turn("", index, 805, 0, 0, output=hit, recompute=recompute, prompt=[index])


def test_budget_problems_hold_turns_to_the_default():
    def sample(cached: int, shift: float = 0.0) -> Sample:
        return Sample([1, 2], "", [-1.0 + shift, -2.0], [{}, {}], 805, cached)

    defaults = [_budget_turn(0, sample(0), sample(0))]
    defaults.append(_budget_turn(1, sample(768), sample(0)))
    # Equal hits and outputs, and recomputes 1e-3 apart: a tolerance of 4e-3.
    small = [_budget_turn(0, sample(0), sample(0, 1e-3))]
    small.append(_budget_turn(1, sample(768, 3e-3), sample(0)))
    noise = harness.budget_problems(small, defaults, 384, 0.0)
    assert noise is not None and noise.pairs == 2
    assert noise.tolerance == pytest.approx(4e-3)
    assert not [p for turn in small for p in turn.problems]
    # Another hit, an output beyond the noise, another prompt.
    small = [_budget_turn(0, sample(0), sample(0, 1e-3))]
    small.append(_budget_turn(1, sample(512, 9e-3), sample(0)))
    harness.budget_problems(small, defaults, 384, 0.0)
    (hit, apart) = small[1].problems
    assert "cached 512 under a budget of 384, 768 under the default" in hit
    assert "differs from the same hit under the default budget" in apart
    small = [
        _budget_turn(0, sample(0), sample(0)),
        _budget_turn(1, sample(768), sample(0)),
    ]
    small[1].prompt = [7]
    harness.budget_problems(small, defaults, 384, 0.0)
    assert "its prompt is not the default budget's" in small[1].problems[0]


def test_budget_problems_where_chunk_ends_do_not_matter_are_exact():
    def sample(cached: int, shift: float = 0.0) -> Sample:
        return Sample([1, 2], "", [-1.0 + shift, -2.0], [{}, {}], 805, cached)

    defaults = [_budget_turn(0, sample(0), sample(0))]
    defaults.append(_budget_turn(1, sample(768), sample(0)))
    small = [_budget_turn(0, sample(0), sample(0))]
    small.append(_budget_turn(1, sample(768), sample(0)))
    assert harness.budget_problems(small, defaults, 384, 0.0, exact=True) is None
    assert not [p for turn in small for p in turn.problems]
    # A recompute and a hit a rounding step off: no noise widens either.
    small = [_budget_turn(0, sample(0), sample(0, 2**-12))]
    small.append(_budget_turn(1, sample(768, 2**-12), sample(0)))
    harness.budget_problems(small, defaults, 384, 0.0, exact=True)
    assert (
        "where a prefill's chunks end changes its arithmetic" in (small[0].problems[0])
    )
    assert (
        "differs from the same hit under the default budget" in (small[1].problems[0])
    )
    assert small[1].problems[0].endswith("(exactly)")
    # Not exact and no recomputes to measure noise on: check_logprobs_close
    # decides, as before there was an exact mode.
    bare = [_budget_turn(0, sample(0), None), _budget_turn(1, sample(768), None)]
    assert harness.budget_problems(bare, defaults, 384, 0.0) is None
    assert {c.judged for turn in bare for c in turn.comparisons} == {
        "check_logprobs_close"
    }


def test_a_known_bug_stops_its_case_once_its_evidence_shows():
    bug = Known("xfail", "a bug", evidence="turn 1: cached 0", in_record=True)
    record = CaseRecord("plain-block-exact")
    seen = harness.evidence_seen(bug, record)
    turns = [Turn("exact", 0, 768, 0, 0), Turn("exact", 1, 1545, 768, 512)]
    assert seen is not None and not seen(turns)
    turns[1].problems.append("exact turn 1: cached 0 < expected checkpoint 512")
    assert seen(turns)
    assert "stopped after exact turn 1" in record.notices[0]
    # A crash, a refusal, no entry: every turn is played.
    crash = Known("xfail", "a crash", evidence="Traceback")
    assert harness.evidence_seen(crash, record) is None
    refusal = Known("unsupported", "refused", evidence="x", in_record=True)
    assert harness.evidence_seen(refusal, record) is None
    assert harness.evidence_seen(None, record) is None


def test_every_workload_says_its_property_and_rule():
    assert set(harness.WORKLOADS) == {
        "shared-prefix",
        "abort-retry",
        "eviction",
        "small-budget",
        "aligned",
        "pd-resend",
        "async",
        "sync",
    }
    for workload in harness.WORKLOADS.values():
        assert workload.holds and ".py" in workload.rule, workload

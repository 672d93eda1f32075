# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the harness's pure helpers; no server, any platform."""

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    Deployment,
    Instance,
    Known,
    Mode,
    Sample,
    Units,
    device_ranges,
    expect_known,
    expected_cached,
    first_divergence,
    group_by_servers,
    hit_bound,
    impossible_hit,
    server_args,
    server_specs,
    servers_mark,
    shape_length,
)


@pytest.mark.parametrize(
    ("prev_len", "unit", "spec", "expected"),
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
        (421, 128, True, 256),  # spec decode: one unit lower
        (129, 128, True, 0),  # ... never below zero
        (256, 128, True, 0),
        (7040, 128, False, 6912),
        (7296, 128, False, 7168),
    ],
)
def test_expected_cached(prev_len: int, unit: int, spec: bool, expected: int):
    assert expected_cached(prev_len, unit, spec) == expected


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


def test_compares_logprobs_only_across_equal_tp():
    assert Deployment().compares_logprobs
    assert Deployment(prefill=Instance()).compares_logprobs
    assert not Deployment(
        decode=Instance(dp=2), prefill=Instance(tp=2)
    ).compares_logprobs


class _Item:
    def __init__(self, name, key=None):
        self.name = name
        self.marks = [] if key is None else [servers_mark(key).mark]

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

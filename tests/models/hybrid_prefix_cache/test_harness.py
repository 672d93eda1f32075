# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the harness's pure helpers; no server, any platform."""

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    Deployment,
    Instance,
    Mode,
    Units,
    device_ranges,
    expected_cached,
    impossible_hit,
    instance_env,
    server_args,
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


def test_instance_env():
    binding = Binding(model="m", base_args=(), token_ids=(2, 10), env={"A": "1"})
    assert instance_env(binding, Deployment(), range(0, 1)) == {"A": "1"}
    offload = instance_env(binding, Deployment(offload=True), range(0, 1))
    assert offload == {"A": "1", "VLLM_SERVER_DEV_MODE": "1"}
    pd = Deployment(prefill=Instance(tp=2))
    env = instance_env(binding, pd, range(2, 4))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0
    cpu = Binding(model="m", base_args=(), token_ids=(2, 10), visible_devices_env=None)
    assert "CUDA_VISIBLE_DEVICES" not in instance_env(cpu, pd, range(2, 4))


def test_compares_logprobs_only_across_equal_tp():
    assert Deployment().compares_logprobs
    assert Deployment(prefill=Instance()).compares_logprobs
    assert not Deployment(
        decode=Instance(dp=2), prefill=Instance(tp=2)
    ).compares_logprobs

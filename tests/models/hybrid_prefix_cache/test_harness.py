# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the harness's deployments and matrix: server arguments,
specs and devices, the matrix builder and its modes, and how its tests are
grouped and sharded. No server, any platform."""

from dataclasses import replace

import pytest

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    Deployment,
    Instance,
    Known,
    Matrix,
    Mode,
    Units,
    case_seconds,
    finding,
    matrix_modes,
    server_args,
    server_specs,
    servers_mark,
)
from tests.models.hybrid_prefix_cache.harness.conversation import (
    SHAPES,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    device_ranges,
)
from tests.models.hybrid_prefix_cache.harness.matrix import (
    CASE_TURNS,
    SERVERS_MARK,
    group_by_servers,
    shard_by_cost,
)
from tests.models.hybrid_prefix_cache.workloads import catalog

WORKLOADS = catalog()


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
    env = harness.servers.layered_env(inherited, {"PYTHONPATH": "/hook", "B": "2"})
    assert env == {"PYTHONPATH": "/hook:/overlay:/checkout", "A": "1", "B": "2"}
    assert harness.servers.layered_env({}, {"PYTHONPATH": "/hook"}) == {
        "PYTHONPATH": "/hook"
    }
    assert harness.servers.layered_env(inherited, {"B": "2"})["PYTHONPATH"] == (
        "/overlay:/checkout"
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
        "plain-partial-concurrent",
        "plain-partial-batched-restores",
    ]
    assert list(matrix.cases) == [
        "plain-block",
        "plain-partial",
        *sweep,
        "tp2-block",
        "tp2-partial",
    ]
    assert matrix.cases["plain-partial-concurrent"].concurrent
    restores = matrix.cases["plain-partial-batched-restores"]
    assert restores.restores and restores.at_once and not restores.concurrent
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
    assert matrix.concurrent_shapes(restores.case_id, at256) == ("exact",)
    assert matrix.concurrent_shapes("plain-partial", at128) == ()
    with pytest.raises(ValueError, match="name no case"):
        Matrix(deployments, modes, {"plain-block-exact": (bug,)})
    # A workload runs on its cells' servers, right after each cell.
    loads = Matrix(
        deployments, modes, catalog=WORKLOADS, workloads={"aligned": ("tp2-block",)}
    )
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
        Matrix(
            deployments,
            modes,
            catalog=WORKLOADS,
            workloads={"aligned": ("dcp2-block",)},
        )
    # The scheduler tier's entries sit in the same table, by cell and
    # workload, served there or not; each judges only its own tier.
    replayed = Known("xfail", "lost", found=finding("scheduler-hit", "t1", hit=0))
    both = {"tp2-block-aligned": (replayed,), "tp2-block": (bug,)}
    one = Matrix(deployments, modes, both, catalog=WORKLOADS)
    assert one.replayed_known("tp2-block") == {"aligned": replayed}
    assert one.replayed_known("plain-block") == {}
    assert one.known_for("tp2-block") == (bug,)
    with pytest.raises(ValueError, match="name no case"):
        Matrix(deployments, modes, {"tp2-x": (replayed,)}, catalog=WORKLOADS)
    # A served case's entry on a workload the cell does not serve is dead.
    with pytest.raises(ValueError, match="name no case"):
        Matrix(deployments, modes, {"tp2-block-aligned": (bug,)}, catalog=WORKLOADS)
    # A workload with servers of its own comes after its cell's sweep, and
    # is marked with its own servers key and the cost of their start.
    own = Matrix(
        deployments,
        modes,
        sweep=("plain-block",),
        workloads={"small-budget": ("plain-block",), "aligned": ("plain-block",)},
        catalog=WORKLOADS,
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
    # The batched restores run at the threads users run: the cell's servers.
    assert batches.servers_key("plain-block-batched-restores") == "plain-block"
    (mark,) = next(
        p for p in batches.params() if p.id == "plain-block-batched-restores"
    ).marks
    assert mark.kwargs["seconds"] == case_seconds(1, CASE_TURNS, False)
    # A P/D resend costs its two requests on its cell's running servers.
    pd = {"pd": Deployment(decode=Instance(), prefill=Instance())}
    resends = Matrix(
        pd, modes, catalog=WORKLOADS, workloads={"pd-resend": ("pd-block",)}
    )
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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What can be verified of the Kimi-K3 prefix-cache matrix without a GPU.

``test_prefix_cache.py`` needs SM100 or MI355 GPUs. This module checks, on
any machine, that it collects exactly the intended cases with the intended
marks, that every server command line it generates is accepted by the
installed vLLM's own ``vllm serve`` parser, that its KV-transfer configs
build vLLM's config class, and that every P/D deployment gets disjoint,
contiguous devices.
"""

import contextlib
import dataclasses
import io
import json
import os
import socket
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from tests.models.hybrid_prefix_cache import seeded_load
from tests.models.hybrid_prefix_cache.harness import (
    Deployment,
    Matrix,
    Mode,
    case_seconds,
    holds_for,
    server_args,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    device_ranges,
)
from tests.models.hybrid_prefix_cache.harness.matrix import (
    SERVERS_MARK,
)
from tests.models.hybrid_prefix_cache.harness.rules import (
    expected_resend,
    release_under_test,
)
from tests.models.kimi_k3 import prefix_cache_binding as kimi
from tests.models.kimi_k3.prefix_cache_collected import collected_ids
from tests.models.kimi_k3.prefix_cache_mooncake import mooncake_master
from tests.utils import multi_gpu_marks
from vllm.config import KVTransferConfig, SpeculativeConfig
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

# Nothing here sets up vLLM's distributed state or a device in-process: skip
# the global cleanup after each test (tests/conftest.py).
pytestmark = pytest.mark.skip_global_cleanup

MODULE = Path(kimi.__file__).with_name("test_prefix_cache.py")
MAX_GPUS = 4

DEPLOYMENT_GPUS = {
    "plain": 1,
    "offload": 1,
    "dcp2": 2,
    "dcp2-offload": 2,
    "pd": 2,
    "pd-tp2-dep2": 4,
    "pd-offload": 2,
}
MODE_NAMES = ("block", "partial", "block-dspark", "partial-dspark")
STRICT_XFAILS = {
    "dcp2-block-dspark",
    "dcp2-partial-dspark",
    "dcp2-offload-block-dspark",
    "dcp2-offload-partial-dspark",
}
CELLS = [(d, m) for d in DEPLOYMENT_GPUS for m in MODE_NAMES]
MATRIX_IDS = [f"{d}-{m}" for d, m in CELLS]


# The matrix with SM100's known failures, whatever this machine is.
SM100 = Matrix(
    kimi.DEPLOYMENTS, kimi.MODES, kimi.KNOWN["sm100"], catalog=kimi.MATRIX.catalog
)
# The params test_prefix_cache.py runs, marked as it marks them.
PARAMS = kimi.MATRIX.params(device_marks=lambda n: multi_gpu_marks(num_gpus=n))


def _cells(workloads: bool = False):
    """(case id, deployment, mode, marks) of every matrix cell, or of every
    workload case (``workloads``)."""
    for param in PARAMS:
        (case_id,) = param.values
        if (kimi.MATRIX.cases[case_id].workload is not None) != workloads:
            continue
        deployment, mode = kimi.MATRIX.served(case_id)
        yield param.id, deployment, mode, param.marks


@pytest.fixture(scope="module")
def serve_parser():
    """The installed ``vllm serve`` parser, built once (argparse is reusable)."""
    parser = FlexibleArgumentParser(description="vllm serve, as installed")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    return ServeSubcommand().subparser_init(subparsers)


def parse_serve_args(parser, args: list[str]):
    """Parse ``args`` as the installed ``vllm serve`` would.

    Returns (namespace, "") or (None, why), where ``why`` names the flag
    the parser rejects: unknown flags, or the parser's own error message
    (which includes the config class's validation of JSON values).
    """
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace, unknown = parser.parse_known_args(["--model", kimi.MODEL, *args])
    except SystemExit:
        message = stderr.getvalue()
        return None, message[message.find("error:") :].strip() or message
    if unknown:
        return None, f"unknown flags {unknown}"
    return namespace, ""


def _instances():
    """(where, args) of every server the module can start."""
    for case_id, deployment, mode, _ in _cells():
        for index, instance in enumerate(deployment.instances):
            role = "decode" if index == len(deployment.instances) - 1 else "prefill"
            yield f"{case_id}/{role}", server_args(kimi.BINDING, instance, mode)
    resend_mode = kimi.MODES[kimi.RESEND_MODE]
    plain = kimi.DEPLOYMENTS["plain"].decode
    yield "resend", server_args(kimi.BINDING, plain, resend_mode)
    mooncake = kimi.MOONCAKE_DEPLOYMENT.decode
    yield "mooncake", server_args(kimi.BINDING, mooncake, resend_mode)


def test_collection_ids():
    """Collection yields exactly the matrix, the resends (right after the
    matrix case whose servers they reuse) and Mooncake."""
    nodes = collected_ids([str(MODULE)])
    names = [node.split("::", 1)[1] for node in nodes]
    expected = []
    for case_id in MATRIX_IDS:
        expected.append(f"test_prefix_cache[{case_id}]")
        expected += [
            f"test_prefix_cache[{case_id}-{workload}]"
            for workload, cells in kimi.WORKLOADS.items()
            if case_id in cells
        ]
        if case_id == f"plain-{kimi.RESEND_MODE}":
            expected += [
                "test_exact_resend[resend-7040]",
                "test_exact_resend[resend-7296]",
            ]
    assert names == [*expected, "test_mooncake_store_resend"]


def test_matrix_marks():
    cells = list(_cells())
    assert [case_id for case_id, *_ in cells] == MATRIX_IDS
    for (dep_name, mode_name), (case_id, deployment, mode, marks) in zip(CELLS, cells):
        assert deployment is kimi.DEPLOYMENTS[dep_name], case_id
        assert mode is kimi.MODES[mode_name], case_id
        gpus = DEPLOYMENT_GPUS[dep_name]
        assert deployment.num_devices == gpus, case_id
        distributed = [m for m in marks if m.name == "distributed"]
        if gpus > 1:
            assert [m.kwargs for m in distributed] == [{"num_gpus": gpus}], case_id
            assert any(m.name == "skipif" for m in marks), case_id
        else:
            assert not distributed, case_id
        # Known failures are judged by the case session, not by an xfail mark
        # that any failure would satisfy.
        assert not [m for m in marks if m.name == "xfail"], case_id
        entries = SM100.known_for(case_id)
        if case_id in STRICT_XFAILS and holds_for(DCP_SPEC_BROKEN):
            ((entry,),) = (entries,)
            assert entry.kind == "xfail", case_id
            assert "#59392" in entry.reason and entry.evidence, case_id
        else:
            assert entries == (), case_id
    # MI355's own: none seen yet; the scheduler tier's hold on every platform.
    assert all(k.replayed for ks in kimi.KNOWN["mi355"].values() for k in ks)


# The releases whose FlashInfer MLA DCP decode breaks on DSpark's ragged
# batches (vLLM #59392): upstream's test lists the dcp2*-dspark cells as
# failing in 0.32.0 and 0.33.0, and not in 0.34.0, which repairs
# mla/flashinfer_mla.py.
DCP_SPEC_BROKEN = "<0.34"


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0", "0.34.0"])
def test_dcp_dspark_cells_by_release(release: str):
    """The 4 dcp2*-dspark cells are strict xfails (#59392) where the bug
    holds and expected passes where it is fixed, which then also run the
    aligned workload; the other cells are unaffected."""
    version = Version(release)
    broken = holds_for(DCP_SPEC_BROKEN, version)
    for case_id in MATRIX_IDS:
        entries = kimi.KNOWN["sm100"].get(case_id, ())
        held = [k for k in entries if k.holds(version)]
        if case_id in STRICT_XFAILS and broken:
            ((entry,),) = (held,)
            assert entry.kind == "xfail" and "#59392" in entry.reason, case_id
        else:
            assert held == [], (release, case_id)
    if release == str(release_under_test().base_version):
        aligned = set(kimi.WORKLOADS["aligned"])
        for case_id in STRICT_XFAILS:
            offload = case_id.startswith("dcp2-offload")
            assert (offload and not broken) == (case_id in aligned), case_id


def test_workload_cases_reuse_their_cells_servers():
    """Each workload case runs on its cell's servers, with the cell's device
    marks, and costs less than their start (the reasons beside
    kimi.WORKLOADS); none is where the cell is known to crash."""
    cells = {case_id: marks for case_id, _, _, marks in _cells()}
    cases = list(_cells(workloads=True))
    assert cases, "the Kimi-K3 matrix runs no workload case"
    for case_id, deployment, mode, marks in cases:
        case = kimi.MATRIX.cases[case_id]
        assert case.workload in kimi.MATRIX.catalog, case_id
        assert (deployment, mode) == kimi.MATRIX.served(case.cell), case_id
        assert [m.name for m in marks] == [m.name for m in cells[case.cell]], case_id
        (servers,) = [m for m in marks if m.name == SERVERS_MARK]
        (cell_servers,) = [m for m in cells[case.cell] if m.name == SERVERS_MARK]
        assert servers.args == cell_servers.args, case_id
        servers_count = len(deployment.instances)
        start = case_seconds(servers_count, 0) - case_seconds(servers_count, 0, False)
        assert servers.kwargs["seconds"] < start, case_id
        assert SM100.known_for(case.cell) == (), case_id
    lost = holds_for(kimi.HOST_LOSS_RELEASES)
    assert ("dcp2-offload-partial" in kimi.WORKLOADS["aligned"]) is not lost


def test_module_skip_reason_off_sm100():
    if kimi.PLATFORM is not None:
        pytest.skip(f"this machine is {kimi.PLATFORM}: the module runs here")
    skip = kimi.PLATFORM_SKIP.mark
    assert skip.name == "skipif" and skip.args == (True,)
    assert "SM100" in skip.kwargs["reason"]


INSTANCES = list(_instances())


@pytest.mark.parametrize(
    ("where", "args"), INSTANCES, ids=[where for where, _ in INSTANCES]
)
def test_serve_args_accepted_by_installed_vllm(serve_parser, where, args):
    namespace, why = parse_serve_args(serve_parser, args)
    assert namespace is not None, f"{where}: the installed vllm serve rejects {why}"
    if "--kv-transfer-config" in args:
        # The parser itself validated the JSON into vLLM's config class.
        assert isinstance(namespace.kv_transfer_config, KVTransferConfig), where
    if "--speculative-config" in args:
        fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        unknown = set(namespace.speculative_config) - fields
        assert not unknown, f"{where}: SpeculativeConfig has no fields {unknown}"


def test_rejected_serve_args_names_the_flag(serve_parser):
    """The check above fails, naming the flag, on a flag vLLM lacks."""
    args = server_args(kimi.BINDING, Deployment().decode, Mode())
    assert parse_serve_args(serve_parser, args)[1] == ""
    _, why = parse_serve_args(serve_parser, [*args, "--no-such-flag-4711"])
    assert why == "unknown flags ['--no-such-flag-4711']"
    bad_role = json.dumps({**kimi.NIXL, "kv_role": "kv_everything"})
    _, why = parse_serve_args(serve_parser, [*args, "--kv-transfer-config", bad_role])
    assert "--kv-transfer-config" in why and "kv_role" in why


@pytest.mark.parametrize("name", ["NIXL", "OFFLOAD", "NIXL_OFFLOAD", "MOONCAKE_STORE"])
def test_kv_transfer_configs_build(name):
    config = getattr(kimi, name)
    built = KVTransferConfig(**json.loads(json.dumps(config)))
    assert built.kv_connector == config["kv_connector"]
    assert built.kv_role == config["kv_role"]


def test_speculative_configs_are_json():
    for mode in kimi.MODES.values():
        if mode.spec is None:
            continue
        args = mode.args()
        spec = json.loads(args[args.index("--speculative-config") + 1])
        assert spec == kimi.DSPARK
        assert spec["model"] == kimi.DRAFT


@pytest.mark.parametrize("name", [n for n in kimi.DEPLOYMENTS if n.startswith("pd")])
def test_pd_devices_disjoint_contiguous(name):
    deployment = kimi.DEPLOYMENTS[name]
    ranges = device_ranges(deployment)
    devices = [d for r in ranges for d in r]
    assert devices == list(range(deployment.num_devices))
    assert len(devices) <= MAX_GPUS
    assert [len(r) for r in ranges] == [i.num_devices for i in deployment.instances]


# Upstream's DSpark resends (unit 128), as its own test asserts them in each
# release: where vLLM drops the drafter's unit (0.32) and where it keeps it
# (0.33). The installed vLLM's rule picks the column.
@pytest.mark.parametrize(
    ("prompt_len", "dropped", "kept"),
    [(7040, 6912, 6912), (7296, 7168, 7168), (kimi.MOONCAKE_RESEND_LENGTH, 7296, 7424)],
)
def test_resend_checkpoints(prompt_len, dropped, kept):
    mode = kimi.MODES[kimi.RESEND_MODE]
    expected = dropped if mode.drops_unit else kept
    got = expected_resend(prompt_len, mode.prefix_match_unit, mode.drops_unit)
    print(f"resend of {prompt_len}: drops a unit {mode.drops_unit}, hit {got}")
    assert got == expected


def test_mooncake_settings_follow_upstream():
    """The store runs as upstream's test runs it on B200."""
    extra = kimi.MOONCAKE_STORE["kv_connector_extra_config"]
    assert extra["enable_cross_layers_blocks"] is False
    assert kimi.MOONCAKE_LEASE_TTL_MS == 60_000
    assert {"MC_MAX_MR_SIZE": str(4 << 30)} == kimi.MOONCAKE_ENV


# A stand-in for the mooncake_master binary (this machine has none): it
# listens on the --port it is given until killed, as the master does.
FAKE_MASTER = """#!{python}
import socket, sys, time
port = int(next(a for a in sys.argv if a.startswith("--port=")).split("=")[1])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen()
while True:
    time.sleep(1)
"""


def test_mooncake_servers_stop_before_their_master(tmp_path, monkeypatch):
    """The Mooncake case's servers (held by the session's pool) are stopped
    while the master still answers, not left to the session's end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "mooncake_master"
    fake.write_text(FAKE_MASTER.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    events = []

    class Pool:
        def close(self) -> None:
            port = int(master_address.rsplit(":", 1)[1])
            with socket.socket() as sock:
                alive = sock.connect_ex(("127.0.0.1", port)) == 0
            events.append(("servers stopped", alive))

    with mooncake_master(tmp_path, Pool()) as config:
        master_address = json.loads(Path(config).read_text())["master_server_address"]
        events.append(("case ran", True))
    assert events == [("case ran", True), ("servers stopped", True)]
    # And the master is gone once the context exits.
    port = int(master_address.rsplit(":", 1)[1])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("case_id", MATRIX_IDS)
def test_cells_compare_exactly_where_their_block_is_stated(case_id: str):
    """Each cell whose block KIMI_BLOCKS states schedules one block a step
    on every instance and holds a hit to its recompute bit for bit (a hit
    inside a block, to measured noise); the others keep vLLM's default
    budget and check_logprobs_close."""
    binding, deployment, mode = kimi.served(case_id)
    blocks = {kimi.stated_block(i, mode) for i in deployment.instances}
    stated = [b for b in blocks if not isinstance(b, str)]
    budgets = {
        _flag(server_args(binding, i, mode), "--max-num-batched-tokens")
        for i in deployment.instances
    }
    if len(blocks) == 1 and stated:
        assert budgets == {str(stated[0])}, case_id
        assert binding.logprob_atol == 0.0 and binding.exact_on_blocks, case_id
    else:
        assert budgets == {None}, case_id
        assert binding.logprob_atol is None and not binding.exact_on_blocks


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_served_with_the_seeded_load_format():
    """The matrix serves the suite's seeded weights (a wrong state shows,
    test_seeded_load.py), with the plugin's folder on the servers' path;
    upstream's dummy weights are one variable away."""
    assert _flag(list(kimi.BASE_ARGS), "--load-format") == kimi.LOAD_FORMAT
    if kimi.LOAD_FORMAT == seeded_load.LOAD_FORMAT:
        assert kimi.BINDING.env == seeded_load.ENV

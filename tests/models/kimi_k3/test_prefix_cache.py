# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi-K3 prefix-cache reuse in every deployment and mode.

Kimi-K3 interleaves Kimi Delta Attention with MLA layers, so a prefix is
reused only at a saved recurrent-state checkpoint. Every deployment (plain,
CPU offload, DCP, P/D over NIXL and their combinations) runs every mode
(block, partial, each with and without DSpark) through the shared harness in
``tests/models/hybrid_prefix_cache/harness/``; this module only binds it.

Needs the SM100 family (B200/GB200) or MI355 (gfx950); up to 4 GPUs.
``KIMI_K3_PREFIX_CACHE_MODEL`` and ``KIMI_K3_PREFIX_CACHE_DRAFT`` point the
model and the DSpark draft at local copies on machines without hub access.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache import seeded_load
from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    CaseRecord,
    Deployment,
    Drafting,
    Instance,
    Known,
    Matrix,
    Mode,
    ServerPool,
    Suite,
    case_seconds,
    cpu_offload,
    exact_budget,
    holds_for,
    kv_connector,
    matrix_modes,
    multi_connector,
    run_resend,
    servers_mark,
    with_serve_args,
)
from tests.utils import multi_gpu_marks
from vllm.platforms import current_platform
from vllm.utils.network_utils import get_open_port

# The suite's pytest plugin (the session's server pool, the grouping of tests
# that share servers, the summary), loaded by this module rather than by a
# conftest.py: one in models/kimi_k3/ would load the whole harness into every
# upstream step that collects that folder (0.33.0's
# kimi-k3-specialized-decode-amd runs models/kimi_k3/amd_specialized_decode),
# without being among its triggers.
pytest_plugins = ("tests.models.hybrid_prefix_cache.harness.plugin",)

# The official Kimi-K3 config cut to 8 layers, without weights, where
# upstream's test takes it from 0.34.0 on.
MODEL = os.environ.get("KIMI_K3_PREFIX_CACHE_MODEL", "vllm-project/Kimi-K3-8L-dummy")
# The recipe's DSpark draft, its target_layer_ids remapped to the 8 layers.
DRAFT = os.environ.get(
    "KIMI_K3_PREFIX_CACHE_DRAFT", "vllm-project/Kimi-K3-DSpark-for-8L-dummy"
)

PARTIAL_UNIT = 128
GiB = 1 << 30
STARTUP_TIMEOUT = 1200.0

# The suite's seeded weights (seeded_load/: no checkpoint, and a wrong
# restored state shows in the recompute comparison); upstream's test serves
# vLLM's dummy weights, under which it does not (test_sensitivity.py):
# KIMI_K3_PREFIX_CACHE_LOAD_FORMAT=dummy serves those.
LOAD_FORMAT = os.environ.get(
    "KIMI_K3_PREFIX_CACHE_LOAD_FORMAT", seeded_load.LOAD_FORMAT
)
BASE_ARGS = (
    "--trust-remote-code",
    "--language-model-only",
    "--load-format",
    LOAD_FORMAT,
    "--no-enable-flashinfer-autotune",
    "--enable-prompt-tokens-details",
    # The default max_num_seqs runs one GPU out of memory in warmup.
    "--max-num-seqs",
    "8",
)

DSPARK = {
    "method": "dspark",
    "model": DRAFT,
    "num_speculative_tokens": 7,
    "draft_sample_method": "probabilistic",
    "rejection_sample_method": "block",
}

NIXL = kv_connector("NixlConnector")
# SimpleCPUOffloadConnector as the Kimi-K3 recipe configures it.
OFFLOAD = cpu_offload(32 * GiB)
NIXL_OFFLOAD = multi_connector(NIXL, OFFLOAD)
MOONCAKE_STORE = kv_connector(
    "MooncakeStoreConnector",
    {"load_async": True, "lookup_async": True, "enable_cross_layers_blocks": False},
    kv_load_failure_policy="recompute",
)
# The store's transfer engine, as upstream's test runs it on B200: RDMA on
# the NIC named by MOONCAKE_DEVICE_NAME, 4 GiB of registered memory per
# region, 4GB/1GB segments, and a 60 s lease so that a resend finds its
# objects still held.
MOONCAKE_DEVICE = os.environ.get("MOONCAKE_DEVICE_NAME", "mlx5_12")
# The transfer protocol, as upstream's test reads it (its MI355 mirror sets
# tcp).
MOONCAKE_PROTOCOL = os.environ.get("MOONCAKE_PROTOCOL", "rdma")
MOONCAKE_LEASE_TTL_MS = 60_000
MOONCAKE_ENV = {"MC_MAX_MR_SIZE": str(4 * GiB)}

MODES = matrix_modes(PARTIAL_UNIT, "dspark", DSPARK)

# What DSpark changes in the prefix cache, by release, as upstream's Kimi-K3
# test states it: 0.32 drops the trailing hit unit (its _expected_cached); from
# 0.33 "DSpark keeps the trailing hash unit, unlike EAGLE", and hashes no
# lookahead tokens (config/speculative.py needs_eagle_block_drop). The
# scheduler tier holds vLLM's own answer (harness.drafting) to it.
DRAFTER_RULES = {"<0.33": Drafting(drops_unit=True), ">=0.33": Drafting()}


def drafter_rule() -> Drafting:
    """The stated rule of :data:`DRAFTER_RULES` for the vLLM under test."""
    (rule,) = [r for releases, r in DRAFTER_RULES.items() if holds_for(releases)]
    return rule


DEPLOYMENTS = {
    "plain": Deployment(),
    "offload": Deployment(decode=Instance(kv_config=OFFLOAD), offload=True),
    "dcp2": Deployment(decode=Instance(tp=2, dcp=2)),
    "dcp2-offload": Deployment(
        decode=Instance(tp=2, dcp=2, kv_config=OFFLOAD), offload=True
    ),
    "pd": Deployment(prefill=Instance(kv_config=NIXL), decode=Instance(kv_config=NIXL)),
    # NIXL rejects prefix caching on a hybrid decoder whose TP differs from
    # the prefiller's, so only the prefiller caches.
    "pd-tp2-dep2": Deployment(
        prefill=Instance(tp=2, kv_config=NIXL),
        decode=Instance(
            dp=2, expert_parallel=True, kv_config=NIXL, prefix_caching=False
        ),
    ),
    "pd-offload": Deployment(
        prefill=Instance(kv_config=NIXL_OFFLOAD),
        decode=Instance(kv_config=NIXL_OFFLOAD),
        offload=True,
    ),
}

# Cells that cannot pass, per platform, by "<deployment>-<mode>" (the same
# table as the CPU tier's: entries per case, each with evidence). Each runs
# and must fail with its evidence (harness.expect_known): a fix shows as a
# strict XPASS, and a failure for another reason as a stale table.
_DCP_SPEC = Known(
    "xfail",
    "FlashInfer MLA DCP decode breaks on ragged spec batches (vLLM #59392): "
    "with DSpark drafts under DCP, the cute-dsl decode that the DCP branch of "
    "v1/attention/backends/mla/flashinfer_mla.py (FlashInferMLAImpl."
    "forward_mqa) selects rejects its per-request causal_seqlens_kv_global, "
    "and the engine dies",
    # FlashInfer's own error, as the PR this suite started from saw it on
    # GB200 ("causal_seqlens_kv_global must have shape (9,), got (2,)"), less
    # the shapes, which follow the batch. It reaches expect_known in the
    # failing server's log (harness.failure_text), wherever the crash
    # surfaces: a refused request, a dead server's metrics, its exit.
    evidence="causal_seqlens_kv_global must have shape",
    # 0.34.0 repairs the ragged DCP decode (mla/flashinfer_mla.py), and
    # upstream's test no longer lists these cells.
    releases="<0.34",
)
KNOWN: dict[str, dict[str, tuple[Known, ...]]] = {
    "sm100": {
        f"{deployment}-{mode}": (_DCP_SPEC,)
        for deployment in ("dcp2", "dcp2-offload")
        for mode in ("block-dspark", "partial-dspark")
    },
    # Empty: no case has been seen failing on MI355 yet. Add entries here
    # as they are found, each with its reason and evidence.
    "mi355": {},
}

# Exact resends: 7040 tokens is a PMU multiple but not block-aligned; 7296
# is an exact PMU multiple.
RESEND_LENGTHS = (7040, 7296)
RESEND_MODE = "partial-dspark"
# Its checkpoint lies beyond the store's normal save boundary (block 6144):
# 7296 plus the drafter's proof block at 7424 where vLLM drops a unit for
# DSpark (0.32), the Mamba state at 7424 where it does not (0.33).
MOONCAKE_RESEND_LENGTH = 7449


def _platform() -> str | None:
    if current_platform.is_cuda() and current_platform.is_device_capability_family(100):
        return "sm100"
    if current_platform.is_rocm() and _rocm_mx():
        return "mi355"
    return None


def _rocm_mx() -> bool:
    """Whether this ROCm GPU runs Kimi-K3's MX kernels: from 0.34 as
    upstream's test asks it (Platform.supports_mx), before as gfx950."""
    if hasattr(current_platform, "supports_mx"):
        return current_platform.supports_mx()
    from vllm.platforms.rocm import on_gfx950

    return on_gfx950()


PLATFORM = _platform()

pytestmark = pytest.mark.skipif(
    PLATFORM is None,
    reason=(
        "Kimi-K3 kernels need an SM100-family NVIDIA GPU or an MI355 (gfx950); "
        f"this is {current_platform.device_name!r}"
    ),
)

# cache_config.block_size of a Kimi-K3 instance on B200 by (TP size, whether
# it drafts with DSpark); in Mamba "align" mode the Mamba (KDA) block equals
# it (Platform._align_hybrid_block_size), and under DCP the MLA block holds
# block * dcp tokens (resolve_dcp_kv_block_size). _align_hybrid_block_size
# picks the smallest block whose MLA page (one latent head whatever the TP or
# DCP size) holds the per-rank KDA state, and that state's shape depends only
# on the TP size and the drafter's token count (KimiLinearForCausalLM.
# get_mamba_state_shape_from_config, MambaStateShapeCalculator.
# kda_state_shape): not on the prefix match unit, the connector or DCP.
# Seen on B200:
KIMI_BLOCKS = {
    # The plain-block turn table: first prompt 17317 = 3 * 5760 + 37, and
    # turn 1 expected 17280.
    (1, False): 5760,
    # Upstream's test comments (tests/models/kimi_k3/test_prefix_cache.py in
    # the 0.32.0 sdist: "Blocks=6144, PMU=128") and the pd-offload-partial-
    # dspark turn table: first prompt 18469 = 3 * 6144 + 37.
    (1, True): 6144,
    # The dcp2-offload-partial turn table (TP2, DCP2): first prompt
    # 8869 = 3 * 2944 + 37. Also the TP2 prefiller of pd-tp2-dep2 (TP2
    # without DCP), whose block was not seen itself but has the same inputs.
    (2, False): 2944,
}


def stated_block(instance: Instance, mode: Mode) -> int | str:
    """The stated block of ``instance`` in ``mode``, or why there is none."""
    dspark = mode.spec is not None
    block = KIMI_BLOCKS.get((instance.tp, dspark))
    if block is not None:
        return block
    what = f"TP{instance.tp}" + (f" with DCP{instance.dcp}" if instance.dcp > 1 else "")
    return (
        f"no B200 geometry for a Kimi-K3 instance at {what}"
        f"{' drafting with DSpark' if dspark else ''}: its cache block (the "
        f"smallest whose MLA page holds the per-rank KDA state) was never "
        f"observed; a B200 turn table of such a cell gives it (first prompt = "
        f"3 * block + 37): add it to KIMI_BLOCKS"
    )


BINDING = Binding(
    model=MODEL,
    base_args=BASE_ARGS,
    # Any id of the tokenizer's ordinary range; generated weights do not care.
    token_ids=(1000, 100_000),
    env=dict(seeded_load.ENV) if LOAD_FORMAT == seeded_load.LOAD_FORMAT else {},
    startup_timeout=STARTUP_TIMEOUT,
    # Exact by construction where the cell's servers schedule one block a
    # step (served): a hit on a block boundary and its recompute are cut into
    # the same chunks; a hit inside a block is held to measured noise.
    logprob_atol=0.0,
    visible_devices_env=current_platform.device_control_env_var,
    exact_on_blocks=True,
)


def served(case_id: str) -> tuple[Binding, Deployment, Mode]:
    """The binding, deployment and mode of ``case_id`` as served
    (:func:`exact`)."""
    deployment, mode = MATRIX.served(case_id)
    return (*exact(deployment, mode), mode)


def exact(deployment: Deployment, mode: Mode) -> tuple[Binding, Deployment]:
    """``deployment`` with every instance scheduling one block a step
    (harness.exact_budget of its stated block), where its block is stated;
    elsewhere at vLLM's default budget, and then held by
    check_logprobs_close alone (a hit and its recompute are cut into other
    chunks: vLLM #33123)."""
    blocks = {stated_block(instance, mode) for instance in deployment.instances}
    block = blocks.pop() if len(blocks) == 1 else "instances of other blocks"
    if isinstance(block, str):
        return replace(BINDING, logprob_atol=None, exact_on_blocks=False), deployment
    budget = ("--max-num-batched-tokens", str(exact_budget(block)))
    return BINDING, with_serve_args(deployment, budget)


# The workloads beside the conversation, on each cell's running servers, where
# a case costs less than the cell's server start. By the 4xB200 step's
# measurement (harness.matrix: a start of 80 s per server, a turn with its
# recompute 27 s, settling 15 s), each of these takes 2 x 27 + 15 = 69 s per
# server:
# - a first prompt that ends on a block and the next turn, which resumes from
#   its checkpoint (vLLM #44599 and #51094: a state restored at an aligned
#   boundary had consumed the last prompt token), where no tier on B200 sent
#   one (offload and P/D);
# - on the P/D cells, an exact resend of a prompt whose part the prefiller
#   sees ends on a block (vLLM #53514: a resend fully cached on the prefiller
#   gave an HTTP 500 and a dead engine), its cold request and the resend,
#   with the decoder's own hit held to the rule of its role
#   (harness.decoder_resend_hit: the prompt's checkpoint on pd, nothing on
#   pd-tp2-dep2, whose decoder keeps no prefix cache, nor on pd-offload,
#   whose device caches are reset before every turn; vLLM #42547).
# The siblings of a shared prefix (four turns, 123 s) do not fit, nor any
# other workload, and the scheduler tier replays each for every cell instead
# (test_scheduler_workloads.py). Left out:
# - dcp2-offload-partial, where the scheduler tier finds its checkpoint lost
#   on the host (HOST_LOSS_RELEASES, test_scheduler_workloads.KNOWN); it
#   joins, listed with its evidence, once a B200 run has shown how it fails
#   there;
# - the cells whose engine dies on its first decode (KNOWN["sm100"], vLLM
#   #59392, where it holds): a case after the crash would start their
#   servers again.
HOST_LOSS_RELEASES = "<0.34"
PD_DEPLOYMENTS = ("pd", "pd-tp2-dep2", "pd-offload")


def _crashes(cell: str) -> bool:
    return any(known.holds() for known in KNOWN["sm100"].get(cell, ()))


def _aligned_cells() -> tuple[str, ...]:
    lost = ("dcp2-offload-partial",) if holds_for(HOST_LOSS_RELEASES) else ()
    return tuple(
        cell
        for deployment in ("offload", "dcp2-offload", *PD_DEPLOYMENTS)
        for mode in MODES
        if not _crashes(cell := f"{deployment}-{mode}") and cell not in lost
    )


WORKLOADS = {
    "aligned": _aligned_cells(),
    "pd-resend": tuple(
        f"{deployment}-{mode}" for deployment in PD_DEPLOYMENTS for mode in MODES
    ),
}
MATRIX = Matrix(
    DEPLOYMENTS,
    MODES,
    KNOWN[PLATFORM or "sm100"],
    workloads=WORKLOADS,
    workload_turns={"aligned": 2},
)
PARAMS = MATRIX.params(device_marks=lambda n: multi_gpu_marks(num_gpus=n))


@pytest.mark.parametrize("case_id", PARAMS)
def test_prefix_cache(hybrid_suite: Suite, case_id: str) -> None:
    binding, deployment, mode = served(case_id)
    record = MATRIX.run(hybrid_suite, case_id, binding, deployment, mode)
    check_stated_block(record, deployment, mode)
    assert record.ok, record.explain()


def check_stated_block(record: CaseRecord, deployment: Deployment, mode: Mode):
    """The block a cell's servers report must be the one KIMI_BLOCKS states
    for them, which its budget and the scheduler tier's replay take."""
    stated = stated_block(deployment.instances[0], mode)
    if record.units is None or isinstance(stated, str):
        return
    assert record.units.block == stated, (
        f"{record.case_id}: the servers report block {record.units.block}, "
        f"KIMI_BLOCKS states {stated}: update KIMI_BLOCKS"
    )


# The resends need the servers of the matrix's plain cell in RESEND_MODE, so
# they run right after it, on the same servers (a cold request and the resend
# each).
@servers_mark(f"plain-{RESEND_MODE}", case_seconds(1, 2, start=False))
@pytest.mark.parametrize("prompt_len", RESEND_LENGTHS, ids=lambda n: f"resend-{n}")
def test_exact_resend(request, hybrid_suite: Suite, prompt_len: int) -> None:
    case_id = f"plain-{RESEND_MODE}-{request.node.callspec.id}"
    binding, plain, mode = served(f"plain-{RESEND_MODE}")
    record = run_resend(hybrid_suite, case_id, binding, plain, mode, prompt_len)
    assert record.ok, record.explain()


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"mooncake_master did not listen on {port} in {timeout} s")


@contextlib.contextmanager
def mooncake_master(folder: Path, pool: ServerPool) -> Iterator[str]:
    """A real ``mooncake_master`` on a free port, and a client config for it
    in ``folder``. On exit, the servers in ``pool`` (the store's clients)
    are stopped before the master: the pool would otherwise keep them
    running against a dead master until the session ends.

    install-kv-connectors.sh installs Mooncake in the step that runs this
    module, so a missing master fails the case rather than skipping it.
    """
    master = shutil.which("mooncake_master")
    if master is None:
        pytest.fail(
            "mooncake_master is not on PATH: run "
            ".buildkite/scripts/install-kv-connectors.sh first",
            pytrace=False,
        )
    port, metrics_port = get_open_port(), get_open_port()
    log_path = folder / "mooncake_master.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                master,
                f"--port={port}",
                f"--metrics_port={metrics_port}",
                "--enable_metric_reporting=false",
                f"--default_kv_lease_ttl={MOONCAKE_LEASE_TTL_MS}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        try:
            _wait_for_port(port, proc, timeout=60)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{log_path.read_text(errors='replace')}") from None
        config = folder / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": f"127.0.0.1:{port}",
                    "protocol": MOONCAKE_PROTOCOL,
                    "device_name": MOONCAKE_DEVICE,
                    "global_segment_size": "4GB",
                    "local_buffer_size": "1GB",
                }
            )
        )
        yield str(config)
    finally:
        try:
            pool.close()
        finally:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def mooncake_config(tmp_path: Path, hybrid_suite: Suite) -> Iterator[str]:
    with mooncake_master(tmp_path, hybrid_suite.pool) as config:
        yield config


# The device prefix cache is reset before the resend, so the hit must come
# from the store.
MOONCAKE_DEPLOYMENT = Deployment(
    decode=Instance(kv_config=MOONCAKE_STORE), offload=True
)


@servers_mark("mooncake-store", case_seconds(1, 2))
def test_mooncake_store_resend(hybrid_suite: Suite, mooncake_config: str) -> None:
    mode = MODES[RESEND_MODE]
    binding, deployment = exact(MOONCAKE_DEPLOYMENT, mode)
    store = {**MOONCAKE_ENV, "MOONCAKE_CONFIG_PATH": mooncake_config}
    binding = replace(binding, env={**binding.env, **store})
    record = run_resend(
        hybrid_suite,
        f"mooncake-{RESEND_MODE}-resend-{MOONCAKE_RESEND_LENGTH}",
        binding,
        deployment,
        mode,
        MOONCAKE_RESEND_LENGTH,
    )
    assert record.ok, record.explain()

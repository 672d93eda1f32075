# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Kimi-K3 binding of the hybrid prefix-cache harness: model, deployments, modes,
known failures, stated B200 geometry, and the matrix of test_prefix_cache.py."""

import os
from dataclasses import replace

import pytest

from tests.models.hybrid_prefix_cache import harness, seeded_load
from tests.models.hybrid_prefix_cache.harness import Deployment, Instance, Known, Mode
from tests.models.hybrid_prefix_cache.workloads import aligned, pd_resend
from vllm.platforms import current_platform

# The official Kimi-K3 config cut to 8 layers, no weights (upstream's from 0.34.0).
MODEL = os.environ.get("KIMI_K3_PREFIX_CACHE_MODEL", "vllm-project/Kimi-K3-8L-dummy")
# The recipe's DSpark draft, its target_layer_ids remapped to the 8 layers.
DRAFT = os.environ.get(
    "KIMI_K3_PREFIX_CACHE_DRAFT", "vllm-project/Kimi-K3-DSpark-for-8L-dummy"
)

GiB = 1 << 30

# Seeded weights: a wrong restored state shows, where vLLM's dummy ones hide it
# (dev/diagnose/test_sensitivity.py). KIMI_K3_PREFIX_CACHE_LOAD_FORMAT=dummy for those.
LOAD_FORMAT = os.environ.get(
    "KIMI_K3_PREFIX_CACHE_LOAD_FORMAT", seeded_load.LOAD_FORMAT
)
BASE_ARGS = (
    *("--trust-remote-code", "--language-model-only", "--load-format", LOAD_FORMAT),
    *("--no-enable-flashinfer-autotune", "--enable-prompt-tokens-details"),
    # The default max_num_seqs runs one GPU out of memory in warmup.
    *("--max-num-seqs", "8"),
)

DSPARK = {
    "method": "dspark",
    "model": DRAFT,
    "num_speculative_tokens": 7,
    "draft_sample_method": "probabilistic",
    "rejection_sample_method": "block",
}

NIXL = harness.kv_connector("NixlConnector")
OFFLOAD = harness.cpu_offload(32 * GiB)
NIXL_OFFLOAD = harness.multi_connector(NIXL, OFFLOAD)
MOONCAKE_STORE = harness.kv_connector(
    "MooncakeStoreConnector",
    {"load_async": True, "lookup_async": True, "enable_cross_layers_blocks": False},
    kv_load_failure_policy="recompute",
)
# As upstream's B200 test: RDMA on this NIC, 4 GiB MRs, a lease outliving a resend.
MOONCAKE_DEVICE = os.environ.get("MOONCAKE_DEVICE_NAME", "mlx5_12")
# As upstream's test reads it (its MI355 mirror sets tcp).
MOONCAKE_PROTOCOL = os.environ.get("MOONCAKE_PROTOCOL", "rdma")
MOONCAKE_LEASE_TTL_MS = 60_000
MOONCAKE_ENV = {"MC_MAX_MR_SIZE": str(4 * GiB)}

MODES = harness.matrix_modes(partial_unit=128, drafter="dspark", spec=DSPARK)

# DSpark by release, as upstream's Kimi-K3 test states it: 0.32 drops the trailing
# hit unit; 0.33 keeps it (config/speculative.py needs_eagle_block_drop).
DRAFTER_RULES = {
    "<0.33": harness.Drafting(drops_unit=True),
    ">=0.33": harness.Drafting(),
}


def drafter_rule() -> harness.Drafting:
    (rule,) = [r for when, r in DRAFTER_RULES.items() if harness.holds_for(when)]
    return rule


DEPLOYMENTS = {
    "plain": Deployment(),
    "offload": Deployment(decode=Instance(kv_config=OFFLOAD), offload=True),
    "dcp2": Deployment(decode=Instance(tp=2, dcp=2)),
    "dcp2-offload": Deployment(
        decode=Instance(tp=2, dcp=2, kv_config=OFFLOAD), offload=True
    ),
    "pd": Deployment(prefill=Instance(kv_config=NIXL), decode=Instance(kv_config=NIXL)),
    # NIXL refuses caching on a hybrid decoder of other TP: the prefiller caches.
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

# Cells that cannot pass, per platform, by "<deployment>-<mode>": each must fail with
# its evidence (harness/session.py), so a fix shows as a strict XPASS.
_DCP_SPEC = Known(
    "xfail",
    "FlashInfer MLA DCP decode breaks on ragged spec batches (vLLM #59392): with "
    "DSpark drafts under DCP, the cute-dsl decode that the DCP branch of "
    "v1/attention/backends/mla/flashinfer_mla.py (FlashInferMLAImpl.forward_mqa) "
    "selects rejects its per-request causal_seqlens_kv_global, and the engine dies",
    # FlashInfer's error on GB200 less the shapes, in the failing server's log.
    evidence="causal_seqlens_kv_global must have shape",
    # 0.34.0 repairs it (mla/flashinfer_mla.py); upstream's test drops these cells.
    releases="<0.34",
)
HOST_LOSS_RELEASES = "<0.34"
# What vLLM's scheduler, replayed at the B200 geometry on any machine, does not
# do of a workload (Known.replayed): the scheduler tier's, on every platform.
_HOST_LOSS = Known(
    "xfail",
    "DCP2 with CPU offload in partial mode: after a first prompt that ends exactly "
    "on a block (three blocks), the next turn, its device cache reset, restores "
    "nothing from the host where the prompt's checkpoint one hit unit inside its "
    "last block should be; the same prompt's checkpoint is restored without DCP "
    "(offload-partial) and after an unaligned prompt (the reference turns, as on "
    "B200). The offload scheduler's store of that state under DCP "
    "(offloading/scheduler.py) is where to look",
    found=harness.finding("scheduler-hit", "exact turn 1", hit=0),
    # 0.34.0's scheduler restores it (a strict XPASS there).
    releases=HOST_LOSS_RELEASES,
)
_REPLAYED = {"dcp2-offload-partial-aligned": (_HOST_LOSS,)}
KNOWN: dict[str, dict[str, tuple[Known, ...]]] = {
    "sm100": {
        "dcp2-block-dspark": (_DCP_SPEC,),
        "dcp2-partial-dspark": (_DCP_SPEC,),
        "dcp2-offload-block-dspark": (_DCP_SPEC,),
        "dcp2-offload-partial-dspark": (_DCP_SPEC,),
        **_REPLAYED,
    },
    # Nothing seen failing on MI355 yet; add entries with their evidence.
    "mi355": dict(_REPLAYED),
}

# Exact resends: 7040 is a PMU multiple, not block-aligned; 7296 an exact one.
RESEND_LENGTHS = (7040, 7296)
RESEND_MODE = "partial-dspark"
# Past the store's save boundary (block 6144): 7296 plus the drafter's proof block
# at 7424 (0.32, a unit dropped for DSpark), or the Mamba state at 7424 (0.33).
MOONCAKE_RESEND_LENGTH = 7449


def _platform() -> str | None:
    if current_platform.is_cuda() and current_platform.is_device_capability_family(100):
        return "sm100"
    if not current_platform.is_rocm():
        return None
    # An MI355 runs MX: Platform.supports_mx (0.34+), else gfx950.
    if hasattr(current_platform, "supports_mx"):
        return "mi355" if current_platform.supports_mx() else None
    from vllm.platforms.rocm import on_gfx950

    return "mi355" if on_gfx950() else None


PLATFORM = _platform()
PLATFORM_SKIP = pytest.mark.skipif(
    PLATFORM is None,
    reason="Kimi-K3 kernels need an SM100-family NVIDIA GPU or an MI355 (gfx950); "
    f"this is {current_platform.device_name!r}",
)

# cache_config.block_size on B200 by (TP size, drafts with DSpark), from
# Platform._align_hybrid_block_size, resolve_dcp_kv_block_size and
# KimiLinearForCausalLM.get_mamba_state_shape_from_config: findings/kimi-k3-geometry.md.
KIMI_BLOCKS = {
    # B200 plain-block turn table: first prompt 17317 = 3 * 5760 + 37.
    (1, False): 5760,
    # B200 pd-offload-partial-dspark table (18469 = 3 * 6144 + 37); upstream's too.
    (1, True): 6144,
    # B200 dcp2-offload-partial table (8869 = 3 * 2944 + 37); pd-tp2-dep2's TP2 too.
    (2, False): 2944,
}


def stated_block(instance: Instance, mode: Mode) -> int | str:
    """The stated block of ``instance`` in ``mode``, or why there is none."""
    dspark = mode.spec is not None
    if (block := KIMI_BLOCKS.get((instance.tp, dspark))) is not None:
        return block
    what = f"TP{instance.tp}" + (f" with DCP{instance.dcp}" if instance.dcp > 1 else "")
    return (
        f"no B200 geometry for a Kimi-K3 instance at {what}"
        f"{' drafting with DSpark' if dspark else ''}: its cache block (the smallest "
        "whose MLA page holds the per-rank KDA state) was never observed; a B200 "
        "turn table of such a cell gives it (first prompt = 3 * block + 37): add it "
        "to KIMI_BLOCKS"
    )


BINDING = harness.Binding(
    model=MODEL,
    base_args=BASE_ARGS,
    # Any id of the tokenizer's ordinary range; generated weights do not care.
    token_ids=(1000, 100_000),
    env=dict(seeded_load.ENV) if LOAD_FORMAT == seeded_load.LOAD_FORMAT else {},
    startup_timeout=1200.0,
    # Exact at one block a step (served): a boundary hit and its recompute share
    # chunks; a hit inside a block is held to measured noise.
    logprob_atol=0.0,
    visible_devices_env=current_platform.device_control_env_var,
    exact_on_blocks=True,
)


def served(case_id: str) -> tuple[harness.Binding, Deployment, Mode]:
    deployment, mode = MATRIX.served(case_id)
    return (*exact(deployment, mode), mode)


def exact(deployment: Deployment, mode: Mode) -> tuple[harness.Binding, Deployment]:
    """``deployment`` scheduling one block a step (harness.exact_budget) where its
    block is stated; else at vLLM's default budget, held by check_logprobs_close
    alone (a hit and its recompute are cut into other chunks: vLLM #33123)."""
    blocks = {stated_block(instance, mode) for instance in deployment.instances}
    block = blocks.pop() if len(blocks) == 1 else "instances of other blocks"
    if isinstance(block, str):
        return replace(BINDING, logprob_atol=None, exact_on_blocks=False), deployment
    budget = ("--max-num-batched-tokens", str(harness.exact_budget(block)))
    return BINDING, harness.with_serve_args(deployment, budget)


# Workloads on each cell's running servers, where a case costs less than a start;
# what each holds and why others are left out: findings/b200-case-costs.md.
PD_DEPLOYMENTS = ("pd", "pd-tp2-dep2", "pd-offload")


def _listed(key: str) -> bool:
    """Whether a known failure of the cell or case ``key`` holds here."""
    return any(known.holds() for known in KNOWN["sm100"].get(key, ()))


WORKLOADS = {
    # Not served where the cell crashes, or where vLLM's scheduler already loses
    # the workload (_REPLAYED).
    "aligned": tuple(
        f"{deployment}-{mode}"
        for deployment in ("offload", "dcp2-offload", *PD_DEPLOYMENTS)
        for mode in MODES
        if not _listed(f"{deployment}-{mode}")
        and not _listed(f"{deployment}-{mode}-aligned")
    ),
    "pd-resend": tuple(
        f"{deployment}-{mode}" for deployment in PD_DEPLOYMENTS for mode in MODES
    ),
}
MATRIX = harness.Matrix(
    DEPLOYMENTS,
    MODES,
    KNOWN[PLATFORM or "sm100"],
    workloads=WORKLOADS,
    # The workloads it runs: catalog() would bring in the scheduler tier.
    catalog={w.name: w for w in (aligned.WORKLOAD, pd_resend.WORKLOAD)},
    workload_turns={"aligned": 2},
)

# The device cache is reset before the resend, so the hit must come from the store.
MOONCAKE_DEPLOYMENT = Deployment(
    decode=Instance(kv_config=MOONCAKE_STORE), offload=True
)

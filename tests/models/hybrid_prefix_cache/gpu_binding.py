# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU tier's binding: the tiny hybrid model with its MTP layer on any one
CUDA GPU, its deployments, modes, known failures and matrix; exact by
construction (findings/gpu-tier-h200-0.26.md)."""

import importlib.util
import json
import os
from collections.abc import Iterable
from dataclasses import replace

import pytest

from tests.models.hybrid_prefix_cache import harness, seeded_load
from tests.models.hybrid_prefix_cache.harness import Deployment, Instance, Known
from tests.models.hybrid_prefix_cache.harness.problems import finding
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid
from tests.models.hybrid_prefix_cache.workloads import aligned, pd_resend
from vllm.platforms import current_platform

GPU_ONLY = pytest.mark.skipif(
    not current_platform.is_cuda(),
    reason="the GPU tier needs a CUDA GPU and vLLM built for it; this process runs on "
    f"{current_platform.device_name!r}",
)

BASE_ARGS = (
    "--enable-prompt-tokens-details",
    *("--max-model-len", "4096"),
    *("--max-num-seqs", "8"),
    # Up to 16 servers share the GPU (dev/gpu/run_tier.sh): explicit KV cache size, as
    # v1/worker/gpu_worker.py determine_available_memory counts what neighbours take.
    *("--gpu-memory-utilization", "0.06"),
    *("--kv-cache-memory-bytes", "2G"),
    "--enforce-eager",  # the checks need no graphs or compile; starts are shorter
)
# vLLM's "auto" GDN prefill on SM90 is FlashInfer's (0.34) or needs the CuTe DSL (0.26)
# (gdn/qwen_gdn_linear_attn.py _resolve_gdn_prefill_backend); without either, Triton.
TRITON_GDN = ("--additional-config", json.dumps({"gdn_prefill_backend": "triton"}))
# 0.34's sampler imports FlashInfer unless told not to; it assumes the package
# (v1/sample/ops/topk_topp_sampler.py flashinfer_sampler_supported).
NO_FLASHINFER_SAMPLER = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
# Partial mode's exact construction (findings/restored-state-sensitivity.md): the GDN
# kernel carries its state in float32 across chunks, so a hit on the chunk grid,
# restored from a float32 cache, resumes where a fresh prefill passes. vLLM raises
# --block-size to a multiple of itself holding the state (platforms/interface.py
# Platform._align_hybrid_block_size).
FLOAT32_SSM = ("--mamba-ssm-cache-dtype", "float32")
# unset: the written weights; dummy (hides a wrong state); hybrid_seeded (seeded_load/)
LOAD_FORMAT_ENV = "HYBRID_PC_GPU_LOAD_FORMAT"

MTP = {"method": "mtp", "num_speculative_tokens": 2}
GEOMETRY_UNIT = 0  # the partial unit until the servers resolve one (served_mode)
MODES = harness.matrix_modes(GEOMETRY_UNIT, "mtp", MTP)

NIXL = harness.kv_connector("NixlConnector")
OFFLOAD = harness.cpu_offload(1 << 30)
NIXL_OFFLOAD = harness.multi_connector(NIXL, OFFLOAD)
PD_OFFLOAD = Instance(kv_config=NIXL_OFFLOAD)  # either side of pd-offload

DEPLOYMENTS = {
    "plain": Deployment(),
    "offload": Deployment(decode=Instance(kv_config=OFFLOAD), offload=True),
    # Both instances share the one GPU (Binding.visible_devices_env None).
    "pd": Deployment(prefill=Instance(kv_config=NIXL), decode=Instance(kv_config=NIXL)),
    "pd-offload": Deployment(prefill=PD_OFFLOAD, decode=PD_OFFLOAD, offload=True),
}

# Seen on an H200 with vLLM 0.26.0 (findings/gpu-tier-h200-0.26.md).
_HOST_FULL_BLOCKS = Known(
    "xfail",
    "SimpleCPUOffloadConnector stores whole blocks only: a partial mode's checkpoint "
    "inside a block never reaches the host, and a turn whose device cache was reset "
    "resumes at the block before it; 0.32's offload manager takes a Mamba group's "
    "partial tail (v1/simple_kv_offload/manager.py), 0.26's has none",
    found=finding("lost-checkpoint", "turn 1", cached=240, expected=272, previous=277),
    geometry=(80, 16),
    releases="<0.32",
)
_PD_SPEC_BLOCKS = Known(
    "xfail",
    "NIXL's decoder with prefix caching and an MTP drafter: its Mamba group holds the "
    "speculative blocks beside the state's, and the worker asserts one local block "
    "per state when it reads the transfer (nixl/base_worker.py _apply_prefix_caching "
    "in 0.26; gone in 0.32); the decoder's engine dies on its first request",
    evidence="SSM can only have one local block",
    releases="<0.32",
)
_HOST_KEEPS_THE_PROOF = Known(
    "xfail",
    "CPU offload with an MTP drafter: a turn whose device cache was reset resumes "
    "from the host one unit past the prompt's checkpoint, the drafter's proof unit "
    "that the local lookup drops (0.26's offload scheduler looks up the host blocks "
    "without the drop; 0.32's applies it, as the scheduler tier replays); the outputs "
    "equal the recompute's",
    found=finding("resend-missed", "resend", cached=1760, expected=1680),
    geometry=(80, 80),
    releases="<0.32",
)
_PD_RESEND_DIES = Known(
    "xfail",
    "P/D: an exact resend whose part the prefiller sees is all in its cache kills the "
    "prefiller's engine (v1/core/sched/scheduler.py schedule asserts "
    "num_new_tokens > 0, vLLM #53514); fixed by 0.32, whose CPU tier plays it",
    evidence="assert num_new_tokens > 0",
    releases="<0.32",
)
_DECODER_OWN_TOKEN = Known(
    "xfail",
    "P/D after a first prompt on a block: the next hit differs from its cold twin "
    "through the same pair, where the same cell with its device caches reset "
    "(pd-offload-block-aligned) and the reference shape are exact: the decoder's own "
    "prefix cache holds the block it completed by computing the prompt's last token "
    "in the decode path, and the hit reads that token's KV where the twin reads the "
    "prefiller's (the CPU tier lists the same symptom, "
    "cpu_known._aligned_apart_at_128)",
    found=finding("hit-apart", "exact turn 1", restored=160, control="cold twin"),
    geometry=(80, 80),
)


def _decoder_own_token(geometry: tuple[int, int], restored: int) -> Known:
    """The same symptom at ``geometry``, whose turn 1 restores ``restored`` (0.34.0 on
    an H100: findings/gpu-tier-0.34.md)."""
    found = finding("hit-apart", "exact turn 1", restored=restored, control="cold twin")
    return replace(_DECODER_OWN_TOKEN, found=found, geometry=geometry)


_DRAFTER_CHECKPOINT_MISSING = Known(
    "xfail",
    "partial mode with an MTP drafter: the drafter's lookup drops a unit below the "
    "prompt's checkpoint, where 0.26 saved no state (0.32 saves it there, "
    "v1/kv_cache_interface.py get_mamba_prefill_checkpoint_position; 0.26 has none), "
    "so the hit falls back to the last block's state; the outputs equal the "
    "recompute's",
    found=finding("lost-checkpoint", "turn 1", cached=240, expected=256, previous=277),
    geometry=(80, 16),
    releases="<0.32",
)
KNOWN: dict = {
    "offload-partial": (_HOST_FULL_BLOCKS,),
    "plain-partial-mtp": (_DRAFTER_CHECKPOINT_MISSING,),
    # The drafter's rule puts the checkpoint a unit lower, as in plain-partial-mtp.
    "offload-partial-mtp": (
        replace(_HOST_FULL_BLOCKS, found=_DRAFTER_CHECKPOINT_MISSING.found),
    ),
    "offload-block-mtp": (_HOST_KEEPS_THE_PROOF,),
    "pd-offload-partial": (_HOST_FULL_BLOCKS,),
    "pd-block-pd-resend": (_PD_RESEND_DIES,),
    "pd-partial-pd-resend": (_PD_RESEND_DIES,),
    "pd-block-aligned": (_DECODER_OWN_TOKEN, _decoder_own_token((128, 128), 256)),
    # Partial mode is now exact, and the P/D drafter's cells pass from 0.32,
    # so these aligned workloads run and show the same symptom.
    "pd-partial-aligned": (_decoder_own_token((192, 64), 512),),
    "pd-block-mtp-aligned": (_decoder_own_token((128, 128), 256),),
    "pd-partial-mtp-aligned": (_decoder_own_token((192, 64), 512),),
    **{
        f"{d}-{m}": (_PD_SPEC_BLOCKS,)
        for d in ("pd", "pd-offload")
        for m in ("block-mtp", "partial-mtp")
    },
}


def _workload_cells(deployments: Iterable[str]) -> tuple[str, ...]:
    """Not where a known failure holds: the workload would show it again."""
    cells = (f"{d}-{m}" for d in deployments for m in MODES)
    return tuple(c for c in cells if not any(k.holds() for k in KNOWN.get(c, ())))


# aligned: vLLM #57605 (a chunk ending on a block gave NaN with MTP drafts)
WORKLOADS = {
    "aligned": _workload_cells(DEPLOYMENTS),
    "pd-resend": _workload_cells(("pd", "pd-offload")),
}
MATRIX = harness.Matrix(
    DEPLOYMENTS,
    MODES,
    KNOWN,
    workloads=WORKLOADS,
    workload_turns={"aligned": 2},
    # Not catalog(): the others size their servers through the scheduler tier.
    catalog={w.name: w for w in (aligned.WORKLOAD, pd_resend.WORKLOAD)},
)


def gpu_binding(model: TinyHybrid, exact: bool = True) -> harness.Binding:
    """Exact on a hit's own path where ``exact`` (budget from :func:`served`),
    else check_logprobs_close alone."""
    args = list(BASE_ARGS)
    missing = {p for p in ("flashinfer", "cutlass") if not importlib.util.find_spec(p)}
    if missing:
        args += TRITON_GDN
    env = {"HF_HUB_OFFLINE": "1"}
    if "flashinfer" in missing:
        env.update(NO_FLASHINFER_SAMPLER)
    load_format = os.environ.get(LOAD_FORMAT_ENV)
    if load_format:
        args += ["--load-format", load_format]
    if load_format == seeded_load.LOAD_FORMAT:
        env.update(seeded_load.ENV)
    return harness.Binding(
        model=str(model.path),
        base_args=tuple(args),
        token_ids=(model.first_word_id, model.vocab_size),
        env=env,
        startup_timeout=900.0,
        logprob_atol=0.0 if exact else None,
        visible_devices_env=None,
        concurrent_start=True,
        exact_on_blocks=exact,
        # one config in two processes on one GPU: the P/D relay was exact at every
        # turn (H200 0.26.0, H100 0.34.0, a run each), a 1% plant on it failed
        # (findings/gpu-tier-0.34.md)
        exact_across_instances=exact,
    )


def served_mode(mode: harness.Mode, units: harness.Units) -> harness.Mode:
    """``mode`` with the resolved geometry's partial unit."""
    if mode.prefix_match_unit != GEOMETRY_UNIT:
        return mode
    return replace(mode, prefix_match_unit=harness.rules.partial_unit(units.block))


def gdn_chunk() -> int:
    """The tokens the GDN kernel carries its state across in float32."""
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    return FLA_CHUNK_SIZE


def served(
    case_id: str, units: harness.Units, binding: harness.Binding
) -> tuple[harness.Binding, Deployment, harness.Mode]:
    """``case_id`` as served: block mode in the model's dtype under rules.exact_budget
    at ``units``; partial on the GDN chunk's grid, float32 SSM cache, default budget."""
    deployment, mode = MATRIX.served(case_id)
    if mode.prefix_match_unit is None:
        budget = ("--max-num-batched-tokens", str(harness.exact_budget(units.block)))
        return binding, harness.with_serve_args(deployment, budget), mode
    chunk = gdn_chunk()
    args = (*FLOAT32_SSM, "--block-size", str(chunk))
    return (
        replace(binding, exact_grid=chunk),
        harness.with_serve_args(deployment, args),
        replace(mode, prefix_match_unit=chunk),
    )

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduler-side objects from a stated geometry, for a deployment whose model
cannot be loaded here (Kimi-K3): :func:`stated_engine`."""

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.scheduler.engine import (
    Engine,
    build_config,
    finish_engine,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec, MLAAttentionSpec


@dataclass(frozen=True)
class StatedGeometry:
    """A deployment's cache geometry where its model cannot be loaded here.

    ``block`` is ``cache_config.block_size`` and, in Mamba "align" mode, also
    the Mamba block (``Platform._align_hybrid_block_size`` sets
    ``mamba_block_size = block_size``); attention blocks hold ``block * dcp``
    tokens under DCP (``resolve_dcp_kv_block_size``). ``kda_checkpoint``
    is the alignment of the Mamba layers' internal prompt checkpoint (16 for
    FlashKDA, None for the Triton prefill: ``kda_prefill_checkpoint_alignment``).
    """

    block: int
    kda_checkpoint: int | None = None


# The geometry of the stand-in layers: a Kimi-K3-like stack of MLA and KDA
# layers (three KDA layers to one MLA layer), whose page sizes only need to be
# unifiable (the Mamba page is padded to the attention page, as
# _align_hybrid_block_size does).
MLA_HEAD_SIZE = 576
KDA_STATE = ((3, 256), (1, 128, 128))
STATED_LAYERS = ("kda", "kda", "kda", "mla") * 2


def stated_engine(
    model: str,
    geometry: StatedGeometry,
    instance: harness.Instance,
    mode: harness.Mode,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    async_scheduling: bool,
    num_blocks: int,
) -> Engine:
    """Scheduler-side objects for ``instance`` in ``mode`` with a stated
    ``geometry``, where the model itself is not available.

    ``model`` is any local hybrid checkpoint: the scheduler reads only its
    max_model_len and that it is a plain text model. The cache, parallel,
    scheduling and KV-transfer settings are the instance's and the mode's.
    An EAGLE-style drafter whose checkpoint is not here is given by its
    method and token count only: vLLM validates the config of a drafter that
    needs no checkpoint (n-gram) with the same token count, and the method is
    then set to the mode's. The scheduler, the KV cache manager and the
    connectors read only the method (``use_eagle``, ``use_eagle_block_drop``,
    ``use_dspark``), ``disable_eagle_block_drop``, the token count and the
    draft's ``sample_from_anchor`` (taken as the default, True).
    """
    spec = dict(mode.spec) if mode.spec is not None else None
    stand_in_spec = None
    if spec is not None and spec["method"] not in ("ngram",):
        stand_in_spec = {
            "method": "ngram",
            "num_speculative_tokens": spec["num_speculative_tokens"],
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 1,
        }
    caching = instance.prefix_caching
    args = EngineArgs(
        model=model,
        # The stand-in's context may be as long as the stated model's, and
        # its attention is MLA-like (one KV head), so that vLLM accepts DCP.
        hf_overrides={
            "max_position_embeddings": max_model_len,
            "num_key_value_heads": 1,
        },
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        block_size=geometry.block,
        mamba_block_size=geometry.block if caching else None,
        enable_prefix_caching=caching,
        prefix_match_unit=mode.prefix_match_unit if caching else None,
        tensor_parallel_size=instance.tp,
        data_parallel_size=instance.dp,
        enable_expert_parallel=instance.expert_parallel,
        decode_context_parallel_size=instance.dcp,
        kv_transfer_config=instance.kv_config,
        speculative_config=stand_in_spec or spec,
        enforce_eager=True,
    )
    vllm_config = build_config(args)
    if stand_in_spec is not None:
        speculative = vllm_config.speculative_config
        assert speculative is not None
        speculative.method = spec["method"]
        speculative.disable_eagle_block_drop = spec.get(
            "disable_eagle_block_drop", False
        )
        speculative.draft_model_config = SimpleNamespace(
            hf_config=SimpleNamespace(), model=spec.get("model", "")
        )
        # DSpark drafts in parallel (SpeculativeConfig.max_num_new_slots_for_
        # drafting documents its K - 1 extra slots).
        speculative.parallel_drafting = spec["method"] == "dspark"
    cache_config = vllm_config.cache_config
    if caching:
        cache_config.mamba_cache_mode = "align"
        cache_config.mamba_block_size = geometry.block
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    dtype = torch.bfloat16
    num_spec = vllm_config.num_speculative_tokens

    def mla(drafter: bool) -> MLAAttentionSpec:
        return MLAAttentionSpec(
            block_size=geometry.block,
            num_kv_heads=1,
            head_size=MLA_HEAD_SIZE,
            dtype=dtype,
            non_causal_multi_token_decode=drafter,
        )

    page = mla(False).page_size_bytes
    kda = MambaSpec(
        shapes=KDA_STATE,
        dtypes=(dtype, torch.float32),
        block_size=geometry.block if caching else max_model_len,
        page_size_padded=page,
        mamba_cache_mode=cache_config.mamba_cache_mode,
        num_speculative_blocks=num_spec,
        num_prefill_checkpoint_blocks=int(geometry.kda_checkpoint is not None),
        prefill_checkpoint_alignment=geometry.kda_checkpoint,
    )
    layer_specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}": kda if kind == "kda" else mla(False)
        for i, kind in enumerate(STATED_LAYERS)
    }
    if spec is not None and spec["method"] == "dspark":
        # The DSpark drafter's own MLA layer, registered after the target's.
        layer_specs[f"model.layers.{len(STATED_LAYERS)}"] = mla(True)
    engine = finish_engine(
        vllm_config,
        layer_specs,
        memory=page * num_blocks,
        layouts=["LBNHC"],
        async_scheduling=async_scheduling,
    )
    return engine

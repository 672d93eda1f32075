# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Scheduler-side objects from a stated geometry, for a deployment whose model
cannot be loaded here (Kimi-K3): :func:`stated_engine`."""

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.scheduler import engine
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec, MLAAttentionSpec


@dataclass(frozen=True)
class StatedGeometry:
    """``block``: also the align-mode Mamba block (Platform._align_hybrid_block_size);
    ``kda_checkpoint``: kda_prefill_checkpoint_alignment (None: Triton)."""

    block: int
    kda_checkpoint: int | None = None


# Kimi-K3-like stand-in layers, three KDA to one MLA; pages need only unify.
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
    scheduling_policy: str = "fcfs",
) -> engine.Engine:
    """``model`` is any local hybrid checkpoint. A drafter without a checkpoint is
    validated as n-gram, then given the mode's method: the scheduler reads only
    the method, block-drop flag and token count."""
    spec = dict(mode.spec) if mode.spec is not None else None
    stand_in_spec = None
    if spec is not None and spec["method"] != "ngram":
        stand_in_spec = dict(method="ngram", prompt_lookup_min=1, prompt_lookup_max=1)
        stand_in_spec["num_speculative_tokens"] = spec["num_speculative_tokens"]
    caching = instance.prefix_caching
    args = EngineArgs(
        model=model,
        # the stated model's context; one KV head, so vLLM accepts DCP
        hf_overrides=dict(max_position_embeddings=max_model_len, num_key_value_heads=1),
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
        scheduling_policy=scheduling_policy,
        enforce_eager=True,
    )
    vllm_config = engine.build_config(args)
    if stand_in_spec is not None:
        drafting = vllm_config.speculative_config
        assert drafting is not None
        drafting.method = spec["method"]
        drafting.disable_eagle_block_drop = spec.get("disable_eagle_block_drop", False)
        drafting.draft_model_config = SimpleNamespace(
            hf_config=SimpleNamespace(), model=spec.get("model", "")
        )
        # SpeculativeConfig.max_num_new_slots_for_drafting: K - 1 extra slots
        drafting.parallel_drafting = spec["method"] == "dspark"
    cache_config = vllm_config.cache_config
    if caching:
        cache_config.mamba_cache_mode = "align"
        cache_config.mamba_block_size = geometry.block
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    dtype = torch.bfloat16

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
        num_speculative_blocks=vllm_config.num_speculative_tokens,
        num_prefill_checkpoint_blocks=int(geometry.kda_checkpoint is not None),
        prefill_checkpoint_alignment=geometry.kda_checkpoint,
    )
    layer_specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}": kda if kind == "kda" else mla(False)
        for i, kind in enumerate(STATED_LAYERS)
    }
    if spec is not None and spec["method"] == "dspark":
        # DSpark's own MLA layer, after the target's
        layer_specs[f"model.layers.{len(STATED_LAYERS)}"] = mla(True)
    return engine.finish_engine(vllm_config, layer_specs, page * num_blocks, ["LBNHC"])

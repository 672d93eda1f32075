# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine of ``vllm serve`` on this (CPU) platform, from exactly the
arguments and environment a server is started with (:func:`cpu_engine`)."""

import functools
from collections.abc import Mapping, Sequence

from tests.models.hybrid_prefix_cache.scheduler import engine
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec
from vllm.v1.worker.utils import customize_attention_spec


@functools.cache
def _serve_parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm serve, as installed")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    return ServeSubcommand().subparser_init(subparsers)


def engine_args(model: str, args: Sequence[str]) -> EngineArgs:
    """``args`` parsed by the installed ``vllm serve``, as engine arguments."""
    namespace = _serve_parser().parse_args(["--model", model, *args])
    return AsyncEngineArgs.from_cli_args(namespace)


class StandInAttention(AttentionLayerBase):
    """An attention layer as the block-size hook and spec collection see it: its
    backend (Attention.__init__), a spec read after the hook (get_kv_cache_spec)."""

    def __init__(self, backend: type[AttentionBackend]) -> None:
        self.backend = backend

    def get_attn_backend(self) -> type[AttentionBackend]:
        return self.backend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        model_config = vllm_config.model_config
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            head_size=model_config.get_head_size(),
            dtype=model_config.dtype,
        )


def cpu_engine(
    model: str, args: Sequence[str], env: Mapping[str, str] | None = None
) -> engine.Engine:
    """Block sizes from the hook the executor calls after loading (platforms/cpu.py
    CpuPlatform.update_block_size_for_backend), layer specs as
    GPUModelRunner.get_kv_cache_spec collects them."""
    with engine.environment(env or {}):
        vllm_config = engine.build_config(engine_args(model, args))
        model_config = vllm_config.model_config
        cache = vllm_config.cache_config
        layer_types = model_config.hf_config.layer_types
        names = [f"model.layers.{i}" for i in range(len(layer_types))]
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                model_config.get_head_size(), model_config.dtype, cache.cache_dtype
            )
            # Attention only (Platform._find_non_ssm_backends): CPU Mamba
            # layers export no get_mamba_prefill_checkpoint_alignment.
            attention = {
                name: StandInAttention(backend)
                for name, kind in zip(names, layer_types)
                if kind != "linear_attention"
            }
            vllm_config.compilation_config.static_forward_context.update(attention)
            current_platform.update_block_size_for_backend(vllm_config)
            from vllm.model_executor.models import ModelRegistry

            model_cls, _ = ModelRegistry.resolve_model_cls(
                model_config.architecture, model_config=model_config
            )
            mamba = MambaSpec(
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
                block_size=cache.mamba_block_size,
                page_size_padded=cache.mamba_page_size_padded,
                mamba_cache_mode=cache.mamba_cache_mode,
                num_speculative_blocks=vllm_config.num_speculative_tokens,
            )
            layer_specs: dict[str, KVCacheSpec] = dict.fromkeys(names, mamba)
            for name, layer in attention.items():
                spec = layer.get_kv_cache_spec(vllm_config)
                layer_specs[name] = customize_attention_spec(backend, spec)
        layouts = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
        memory = cache.kv_cache_memory_bytes
        assert memory is not None, "the CPU tier sizes its KV cache explicitly"
        return engine.finish_engine(vllm_config, layer_specs, memory, layouts)

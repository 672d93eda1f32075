# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine of ``vllm serve`` on this (CPU) platform, from exactly the
arguments and environment a server is started with (:func:`cpu_engine`)."""

from collections.abc import Mapping, Sequence

from tests.models.hybrid_prefix_cache.scheduler.engine import (
    Engine,
    environment,
    finish_engine,
)
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec


def _serve_parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm serve, as installed")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    return ServeSubcommand().subparser_init(subparsers)


_PARSER = None


def engine_args(model: str, args: Sequence[str]) -> EngineArgs:
    """``args`` parsed by the installed ``vllm serve``, as engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    global _PARSER
    if _PARSER is None:
        _PARSER = _serve_parser()
    namespace = _PARSER.parse_args(["--model", model, *args])
    return AsyncEngineArgs.from_cli_args(namespace)


def cpu_engine(
    model: str, args: Sequence[str], env: Mapping[str, str] | None = None
) -> Engine:
    """The scheduler-side objects of ``vllm serve model *args`` on this (CPU)
    platform.

    The config is what the API server resolves; the block sizes are then
    aligned as the worker does once the model is loaded
    (``Platform.update_block_size_for_backend``, which on CPU aligns a hybrid
    model's attention page with its Mamba page), and every layer's KV cache
    spec is the one its layer class reports (``MambaBase.get_kv_cache_spec``,
    the attention backend's ``customize_spec``). Memory for the KV cache is
    ``--kv-cache-memory-bytes``, as the CPU worker takes it.
    """
    with environment(env or {}):
        vllm_config = engine_args(model, args).create_engine_config()
        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                model_config.get_head_size(),
                model_config.dtype,
                cache_config.cache_dtype,
            )
            if model_config.is_hybrid:
                current_platform._align_hybrid_block_size(vllm_config, backend)
            from vllm.model_executor.models import ModelRegistry

            model_cls, _ = ModelRegistry.resolve_model_cls(
                model_config.architecture, model_config=model_config
            )
            attention = backend.customize_spec(
                FullAttentionSpec(
                    block_size=cache_config.block_size,
                    num_kv_heads=model_config.get_num_kv_heads(parallel),
                    head_size=model_config.get_head_size(),
                    dtype=model_config.dtype,
                )
            )
            mamba = MambaSpec(
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
                block_size=cache_config.mamba_block_size,
                page_size_padded=cache_config.mamba_page_size_padded,
                mamba_cache_mode=cache_config.mamba_cache_mode,
                num_speculative_blocks=vllm_config.num_speculative_tokens,
            )
        layer_types = model_config.hf_config.layer_types
        layer_specs = {
            f"model.layers.{i}": mamba if kind == "linear_attention" else attention
            for i, kind in enumerate(layer_types)
        }
        layouts = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
        memory = cache_config.kv_cache_memory_bytes
        assert memory is not None, "the CPU tier sizes its KV cache explicitly"
        return finish_engine(
            vllm_config,
            layer_specs,
            memory,
            layouts,
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
        )

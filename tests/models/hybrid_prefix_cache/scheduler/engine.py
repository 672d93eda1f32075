# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An instance's scheduler-side objects and the geometry they resolve, built
as the engine core builds them."""

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from unittest.mock import patch

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.structured_output import StructuredOutputManager

try:
    # 0.33: v1/core/kv_cache_planning.py groups layers across workers
    from vllm.v1.core import kv_cache_planning
except ImportError:
    kv_cache_planning = None  # vLLM 0.32: v1/core/kv_cache_utils.py alone

_RUNNER_NEEDS_TRITON: bool | None = None


def build_config(args: EngineArgs) -> VllmConfig:
    """``args.create_engine_config()``, with Triton declared present where the CPU
    runner refuses without it (nothing here runs a model); the refusal is kept."""
    global _RUNNER_NEEDS_TRITON
    if not _RUNNER_NEEDS_TRITON:
        try:
            config = args.create_engine_config()
        except Exception as e:
            # The CPU runner's refusal without Triton (0.34: platforms/cpu.py
            # CpuPlatform.check_and_update_config; 0.33 warned).
            if not (isinstance(e, RuntimeError) and "requires Triton" in str(e)):
                raise
            _RUNNER_NEEDS_TRITON = True
        else:
            _RUNNER_NEEDS_TRITON = False
            return config
    import vllm.triton_utils as triton_utils

    with patch.object(triton_utils, "HAS_TRITON", True):
        return args.create_engine_config()


def runner_needs_triton() -> bool | None:
    """Whether :func:`build_config` met the Triton refusal (None: not yet)."""
    return _RUNNER_NEEDS_TRITON


@dataclass(frozen=True)
class Geometry:
    """Where a hit can land: ``hit_unit`` is ``cache_hit_alignment_tokens``,
    ``scheduler_block`` the lcm of the groups' effective (DCP-scaled) blocks."""

    attention_block: int
    mamba_block: int
    hit_unit: int
    scheduler_block: int


@dataclass
class Engine:
    """One instance's config, scheduler KV cache config and block sizes
    (v1/engine/core.py EngineCore.__init__)."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    scheduler_block: int
    hash_block: int
    hit_unit: int
    # AsyncScheduler: vLLM's default where the executor supports it
    async_scheduling: bool

    @property
    def geometry(self) -> Geometry:
        cache = self.vllm_config.cache_config
        mamba = cache.mamba_block_size or cache.block_size
        return Geometry(cache.block_size, mamba, self.hit_unit, self.scheduler_block)

    @property
    def block_bytes(self) -> int:
        """Bytes a block: the CPU worker sizes its pool from --kv-cache-memory-bytes."""
        cache = self.vllm_config.cache_config
        return cache.kv_cache_memory_bytes // self.kv_cache_config.num_blocks

    def scheduler(self) -> Scheduler:
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        return cls(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=self.scheduler_block,
            hash_block_size=self.hash_block,
            log_stats=True,
        )


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` for a block, restoring only its keys as they were."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def finish_engine(
    vllm_config: VllmConfig,
    layer_specs: dict[str, KVCacheSpec],
    memory: int,
    layouts: list[str],
) -> Engine:
    """v1/engine/core.py EngineCore._initialize_kv_caches on the workers' layer specs
    (not tests/v1/core/utils.py's helper: the checkout's tests/ may be another
    release): layout, groups, then the scheduler block, hash block and hit unit."""
    cache_config = vllm_config.cache_config
    async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
    register_all_kvcache_specs(vllm_config)
    resolve_kv_cache_layout(vllm_config, [layouts], list(layer_specs.values()))
    ranks = vllm_config.parallel_config.world_size
    specs, memories = [layer_specs] * ranks, [memory] * ranks
    if kv_cache_planning is None:
        configs = kv_cache_utils.get_kv_cache_configs(vllm_config, specs, memories)
    else:
        groups = kv_cache_planning.get_global_kv_cache_groups(vllm_config, specs)
        vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
        configs = kv_cache_planning.get_kv_cache_configs(
            vllm_config, specs, memories, groups
        )
    kv_cache_config = kv_cache_utils.generate_scheduler_kv_cache_config(configs)
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    cache_config.block_size = min(
        group.kv_cache_spec.block_size
        for group in kv_cache_config.kv_cache_groups
        if group.kv_cache_spec.prefix_cacheable
    )
    block, hash_block = kv_cache_utils.resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    hit_unit = kv_cache_utils.resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block, hash_block
    )
    kv_cache_config.hash_block_size = hash_block
    kv_cache_config.cache_hit_alignment_tokens = hit_unit
    return Engine(
        vllm_config, kv_cache_config, block, hash_block, hit_unit, async_scheduling
    )

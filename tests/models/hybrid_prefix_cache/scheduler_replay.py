# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Replay the harness's conversations through vLLM's own scheduler, in-process.

The end-to-end tiers check a server's hits against the harness's reading of
vLLM (:func:`harness.expectation`, :func:`harness.counter_problems`). This
module asks vLLM itself, in seconds and without a device: every instance of a
deployment is a real ``Scheduler`` (``AsyncScheduler`` where the server
schedules asynchronously) over a real ``KVCacheManager``, built from the
instance's real ``VllmConfig`` and a ``KVCacheConfig`` that vLLM's own
``get_kv_cache_configs`` groups, with the instance's real KV connector on its
scheduler side (NIXL, the CPU offload connector, the MultiConnector of both).
Only the workers are stood in for (:class:`StandInWorker`): they "generate"
deterministic tokens, reject every draft, and complete every KV transfer the
connectors' metadata asks for in the step that asked.

A turn is played as the harness plays it (:func:`harness.play_turn`): the
device prefix caches are reset before it under offload, the P/D prefill leg
goes to the prefiller with the harness's transfer parameters and its answer's
parameters to the decoder, and the recompute under a fresh salt goes to the
decoder alone. Each server keeps the harness's usage ledger
(:func:`harness.ledger_entry`) and the deltas of the four prefix-cache
counters that its ``SchedulerStats`` would have moved (as
``v1/metrics/loggers.py`` PrometheusStatLogger.record does).

The geometry is vLLM's: for the CPU tier, :func:`cpu_engine` resolves the
tiny model's serve arguments into a ``VllmConfig`` and aligns the attention
and Mamba blocks the way the worker does after loading the model; for a tier
whose model is not here (Kimi-K3), :func:`stated_engine` builds the
scheduler-side objects from a stated geometry.
"""

import contextlib
import json
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.models.hybrid_prefix_cache import harness
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadMetadata,
    SimpleCPUOffloadWorkerMetadata,
)
from vllm.v1.structured_output import StructuredOutputManager


@dataclass(frozen=True)
class Geometry:
    """Where a hit can land, as the engine resolves it.

    ``attention_block`` is ``cache_config.block_size`` (tokens per attention
    block on one rank), ``mamba_block`` the Mamba groups' block, ``hit_unit``
    the finest boundary a hit lands on (``cache_hit_alignment_tokens``) and
    ``scheduler_block`` the lcm of the groups' effective blocks (attention
    blocks are ``dcp`` times larger under decode context parallelism).
    """

    attention_block: int
    mamba_block: int
    hit_unit: int
    scheduler_block: int

    @property
    def labels(self) -> dict[str, str]:
        """The ``vllm:cache_config_info`` labels the harness reads
        (:meth:`harness.Units.from_cache_config`)."""
        return {
            "block_size": str(self.attention_block),
            "mamba_block_size": str(self.mamba_block),
        }


@dataclass
class Engine:
    """One instance's scheduler-side objects: its ``VllmConfig``, the
    ``KVCacheConfig`` its scheduler gets, and the block sizes the engine core
    resolves for it (``v1/engine/core.py``, EngineCore.__init__)."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    scheduler_block: int
    hash_block: int
    hit_unit: int
    # Whether the server schedules asynchronously (AsyncScheduler, a batch
    # queue of two): vLLM's default where the executor supports it.
    async_scheduling: bool

    @property
    def geometry(self) -> Geometry:
        cache = self.vllm_config.cache_config
        return Geometry(
            attention_block=cache.block_size,
            mamba_block=cache.mamba_block_size or cache.block_size,
            hit_unit=self.hit_unit,
            scheduler_block=self.scheduler_block,
        )

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
    """Set ``env`` for a block (the instance's environment, which vLLM's
    config reads), restoring what was there."""
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


def _finish_engine(
    vllm_config: VllmConfig,
    layer_specs: dict[str, KVCacheSpec],
    memory: int,
    layouts: list[str],
    async_scheduling: bool,
) -> Engine:
    """What ``EngineCore._initialize_kv_caches`` does with the workers' layer
    specs: resolve the KV cache layout, group the layers
    (``get_kv_cache_configs``, one worker per rank), adopt the groups' block
    size, and resolve the scheduler block, the hash block and the hit unit."""
    cache_config = vllm_config.cache_config
    register_all_kvcache_specs(vllm_config)
    resolve_kv_cache_layout(vllm_config, [layouts], list(layer_specs.values()))
    ranks = vllm_config.parallel_config.world_size
    kv_cache_configs = get_kv_cache_configs(
        vllm_config, [layer_specs] * ranks, [memory] * ranks
    )
    kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    cache_config.block_size = min(
        group.kv_cache_spec.block_size
        for group in kv_cache_config.kv_cache_groups
        if group.kv_cache_spec.prefix_cacheable
    )
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    hit_unit = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, scheduler_block, hash_block
    )
    kv_cache_config.hash_block_size = hash_block
    kv_cache_config.cache_hit_alignment_tokens = hit_unit
    return Engine(
        vllm_config,
        kv_cache_config,
        scheduler_block,
        hash_block,
        hit_unit,
        async_scheduling,
    )


# --- the CPU tier: the tiny model's own configuration ------------------------


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
        return _finish_engine(
            vllm_config,
            layer_specs,
            memory,
            layouts,
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
        )


# --- a stated geometry (a model that is not here) ----------------------------


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
    vllm_config = args.create_engine_config()
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
    engine = _finish_engine(
        vllm_config,
        layer_specs,
        memory=page * num_blocks,
        layouts=["LBNHC"],
        async_scheduling=async_scheduling,
    )
    return engine


# --- the stand-in workers ----------------------------------------------------


@dataclass
class Completion:
    """What a completion's response carries that the harness reads."""

    request_id: str
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    kv_transfer_params: dict | None = None
    finished: bool = False


class StandInWorker:
    """The workers of one server, as far as its scheduler can tell.

    Every sampled token is a deterministic function of the sequence so far
    (a hit and its recompute generate alike, as greedy decoding does), every
    draft is rejected (each decode step adds exactly one token, as without a
    drafter), and every KV transfer a connector's metadata asks for completes
    within the step that asked: NIXL reads (the reading decoder reports the
    request received, and the prefiller that served it reports it sent in
    its next step), CPU offload loads and stores (a store is acknowledged by
    every rank, as ``SimpleCPUOffloadWorkerMetadata`` aggregates them).
    """

    def __init__(
        self, scheduler: Scheduler, token_ids: tuple[int, int], world_size: int
    ) -> None:
        self.scheduler = scheduler
        self.token_ids = token_ids
        self.world_size = world_size
        # Requests of this server whose KV a peer finished reading.
        self.pending_sends: set[str] = set()
        self.peers: dict[str, StandInWorker] = {}

    def token(self, request: Request) -> int:
        low, high = self.token_ids
        tail = request.all_token_ids[-8:]
        mix = sum((i + 1) * t for i, t in enumerate(tail)) + len(request.all_token_ids)
        return low + mix % (high - low)

    def execute(self, output) -> ModelRunnerOutput:
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            sampled.append([] if request.is_prefill_chunk else [self.token(request)])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=self.transfers(output.kv_connector_metadata),
        )

    def drafts(self, output) -> DraftTokenIds | None:
        """K drafts per request that sampled a token (a synchronous
        scheduler takes them after the step, ``EngineCore.post_step``)."""
        num_spec = self.scheduler.num_spec_tokens
        if not num_spec:
            return None
        requests = self.scheduler.requests
        req_ids = [
            req_id
            for req_id in output.num_scheduled_tokens
            if req_id in requests
            and not requests[req_id].is_finished()
            and not requests[req_id].is_prefill_chunk
        ]
        low = self.token_ids[0]
        return DraftTokenIds(req_ids, [[low] * num_spec for _ in req_ids])

    def transfers(self, metadata) -> KVConnectorOutput | None:
        if metadata is None:
            return None
        received: set[str] = set()
        parts = (
            metadata.metadata
            if isinstance(metadata, MultiKVConnectorMetadata)
            else (metadata,)
        )
        worker_meta = [self._transfer(part, received) for part in parts]
        if isinstance(metadata, MultiKVConnectorMetadata):
            combined = (
                MultiKVConnectorWorkerMetadata(tuple(worker_meta))
                if any(m is not None for m in worker_meta)
                else None
            )
        else:
            combined = worker_meta[0]
        sent, self.pending_sends = self.pending_sends, set()
        return KVConnectorOutput(
            finished_sending=sent or None,
            finished_recving=received or None,
            kv_connector_worker_meta=combined,
        )

    def _transfer(self, metadata, received: set[str]):
        if isinstance(metadata, NixlConnectorMetadata):
            for req_id, meta in metadata.reqs_to_recv.items():
                if meta.awaiting_kvs:
                    received.add(req_id)
                if meta.remote is not None:
                    peer = self.peers.get(meta.remote.engine_id)
                    assert peer is not None, f"no prefiller {meta.remote.engine_id}"
                    peer.pending_sends.add(meta.remote.request_id)
            return None
        if isinstance(metadata, SimpleCPUOffloadMetadata):
            if metadata.load_event >= 0:
                received.update(
                    metadata.load_event_to_reqs.get(metadata.load_event, ())
                )
            if metadata.store_event >= 0:
                return SimpleCPUOffloadWorkerMetadata(
                    {metadata.store_event: self.world_size}
                )
            return None
        raise NotImplementedError(f"no stand-in worker for {type(metadata).__name__}")


# --- servers ------------------------------------------------------------------

COUNTERS = (
    harness.PREFIX_QUERIES,
    harness.PREFIX_HITS,
    harness.EXTERNAL_QUERIES,
    harness.EXTERNAL_HITS,
)


class EngineLoop:
    """One engine core: its scheduler, stand-in workers and busy loop, run
    as ``EngineCore.step`` (one batch in flight) or
    ``EngineCore.step_with_batch_queue`` (asynchronous scheduling) runs it."""

    def __init__(self, engine: Engine, token_ids: tuple[int, int]) -> None:
        self.scheduler = engine.scheduler()
        world_size = engine.vllm_config.parallel_config.world_size
        self.worker = StandInWorker(self.scheduler, token_ids, world_size)
        self.depth = engine.vllm_config.max_concurrent_batches
        self.queue: list[tuple] = []

    def step(self, record) -> bool:
        """One engine step; False when the engine has nothing to do."""
        scheduler = self.scheduler
        if self.depth == 1:
            if not scheduler.has_requests():
                return False
            output = scheduler.schedule()
            result = self.worker.execute(output)
            record(scheduler.update_from_output(output, result))
            if output.total_num_scheduled_tokens > 0 and (
                drafts := self.worker.drafts(output)
            ):
                scheduler.update_draft_token_ids(drafts)
            return True
        if scheduler.has_requests():
            output = scheduler.schedule()
            self.queue.insert(0, (output, self.worker.execute(output)))
            if len(self.queue) < self.depth and (
                output.total_num_scheduled_tokens > 0 or scheduler.has_requests()
            ):
                return True
        elif not self.queue:
            return False
        output, result = self.queue.pop()
        record(scheduler.update_from_output(output, result))
        return True


class ReplayServer:
    """One ``vllm serve`` instance: an engine loop per data-parallel rank
    (new requests go round-robin, as ``DPLBAsyncMPClient`` routes them when
    every engine is idle), the usage ledger of its completions and the
    deltas of its prefix-cache counters."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        instance: harness.Instance,
        token_ids: tuple[int, int],
    ) -> None:
        self.name = name
        self.engine = engine
        self.instance = instance
        self.loops = [EngineLoop(engine, token_ids) for _ in range(instance.dp)]
        self.hasher = get_request_block_hasher(engine.hash_block, sha256)
        self.completions: dict[str, Completion] = {}
        self.ledger = harness.Ledger()
        self.moved: dict[str, float | None] = dict.fromkeys(COUNTERS, 0.0)
        self.requests = 0

    @property
    def engine_id(self) -> str | None:
        config = self.engine.vllm_config.kv_transfer_config
        return None if config is None else config.engine_id

    @property
    def scheduler(self) -> Scheduler:
        """The first engine's scheduler (the only one without DP)."""
        return self.loops[0].scheduler

    def _record(self, outputs) -> None:
        """What the API server takes from an engine step's outputs: the
        counters' increments (``PrometheusStatLogger.record``) and each
        completion's tokens, usage and transfer parameters."""
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None:
                self.moved[harness.PREFIX_QUERIES] += stats.prefix_cache_stats.queries
                self.moved[harness.PREFIX_HITS] += stats.prefix_cache_stats.hits
                connector = stats.connector_prefix_cache_stats
                if connector is not None:
                    self.moved[harness.EXTERNAL_QUERIES] += connector.queries
                    self.moved[harness.EXTERNAL_HITS] += connector.hits
            for out in eco.outputs:
                completion = self.completions.get(out.request_id)
                if completion is None:
                    continue
                completion.token_ids += out.new_token_ids
                if out.prefill_stats is not None and completion.cached_tokens is None:
                    completion.cached_tokens = out.prefill_stats.num_cached_tokens
                if out.finish_reason is not None:
                    completion.finished = True
                    completion.kv_transfer_params = out.kv_transfer_params

    def step(self) -> bool:
        stepped = False
        for loop in self.loops:
            stepped = loop.step(self._record) or stepped
        return stepped

    def drain(self, limit: int = 100_000) -> None:
        """Step until every engine is idle (transfers included)."""
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError(f"{self.name}: the engine did not settle")

    def submit(
        self,
        prompt: Sequence[int],
        salt: str,
        max_tokens: int,
        kv_transfer_params: Mapping | None = None,
    ) -> Completion:
        """Add a completion request as the API server would: greedy, with
        logprobs, the cache salt, and the transfer parameters as the client
        sent them (a JSON copy) in ``extra_args``."""
        loop = self.loops[self.requests % len(self.loops)]
        self.requests += 1
        request_id = f"{self.name}-{self.requests}"
        extra = None
        if kv_transfer_params is not None:
            extra = {"kv_transfer_params": json.loads(json.dumps(kv_transfer_params))}
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=harness.NUM_LOGPROBS,
            extra_args=extra,
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            cache_salt=salt,
            block_hasher=self.hasher,
        )
        completion = Completion(request_id, list(prompt), prompt_tokens=len(prompt))
        self.completions[request_id] = completion
        loop.scheduler.add_request(request)
        return completion

    def settle(self, completion: Completion, sent: Mapping | None) -> None:
        """Book a finished completion in the ledger as its response reports
        it: usage's cached tokens are the prefill's local plus external hit,
        except on a P/D decoder, which reports the prefiller's
        (``remote_prefill_cached_tokens``: ``v1/engine/output_processor.py``,
        RequestState.from_new_request)."""
        assert completion.finished, f"{completion.request_id} did not finish"
        params = sent or {}
        remote = params.get("remote_prefill_cached_tokens")
        if params.get("do_remote_prefill") and isinstance(remote, int):
            completion.cached_tokens = remote
        assert completion.cached_tokens is not None, completion.request_id
        self.ledger += harness.ledger_entry(
            completion.prompt_tokens, completion.cached_tokens, sent
        )

    def complete(
        self,
        prompt: Sequence[int],
        salt: str,
        max_tokens: int = harness.MAX_TOKENS,
        kv_transfer_params: Mapping | None = None,
    ) -> Completion:
        completion = self.submit(prompt, salt, max_tokens, kv_transfer_params)
        while not completion.finished:
            assert self.step(), f"{completion.request_id} stalled"
        self.settle(completion, kv_transfer_params)
        return completion

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache?reset_external=false`` once the engines
        have settled (the harness retries until it succeeds)."""
        self.drain()
        for loop in self.loops:
            assert loop.scheduler.reset_prefix_cache(reset_connector=False), (
                f"{self.name}: the prefix cache reset failed with nothing running"
            )

    def counter_problems(self) -> list[str]:
        """:func:`harness.counter_problems` for this server."""
        return harness.counter_problems(
            self.name,
            self.moved,
            self.ledger,
            prefix_caching=self.instance.prefix_caching,
            connector=self.instance.kv_config is not None,
        )


def servers_for(
    engines: Sequence[Engine],
    deployment: harness.Deployment,
    token_ids: tuple[int, int],
) -> list[ReplayServer]:
    """The servers of ``deployment``, prefiller first, named as the harness
    names them, with the P/D pair's workers introduced to each other."""
    # Block hashes as every server here computes them (the default
    # --prefix-caching-hash-algo, whose NONE_HASH seed is fixed).
    init_none_hash(sha256)
    names = ("serve",) if deployment.prefill is None else ("prefill", "decode")
    servers = [
        ReplayServer(name, engine, instance, token_ids)
        for name, engine, instance in zip(names, engines, deployment.instances)
    ]
    peers = {
        server.engine_id: server.loops[0].worker
        for server in servers
        if server.engine_id is not None and len(server.loops) == 1
    }
    for server in servers:
        for loop in server.loops:
            loop.worker.peers = peers
    return servers


# --- conversations -------------------------------------------------------------


@dataclass
class TurnResult:
    """One turn as vLLM computed it: the hit of the instance that consults
    its cache (the prefiller's under P/D) and the recompute's."""

    conversation: str
    planned: harness.PlannedTurn
    hit: int
    # None where the harness sends no recompute (a resend's cold request).
    recompute_hit: int | None


def send(
    servers: Sequence[ReplayServer], prompt: list[int], salt: str
) -> tuple[Completion, int]:
    """One turn's request through the deployment, as harness.send sends it:
    the returned hit is the prefiller's under P/D."""
    if len(servers) == 1:
        completion = servers[0].complete(prompt, salt)
        assert completion.cached_tokens is not None
        return completion, completion.cached_tokens
    prefiller, decoder = servers
    prefill = prefiller.complete(
        prompt,
        salt,
        max_tokens=1,
        kv_transfer_params=harness.PREFILL_KV_TRANSFER_PARAMS,
    )
    assert prefill.kv_transfer_params, "the prefiller returned no kv_transfer_params"
    sent = prefill.kv_transfer_params
    decode = decoder.complete(prompt, salt, kv_transfer_params=sent)
    # The prefiller frees the transferred blocks once the decoder read them.
    prefiller.drain()
    assert prefill.cached_tokens is not None
    return decode, prefill.cached_tokens


def play_conversations(
    servers: Sequence[ReplayServer],
    deployment: harness.Deployment,
    conversations: Sequence[harness.Conversation],
    token_ids: tuple[int, int],
    concurrent: bool = False,
) -> list[TurnResult]:
    """Play ``conversations`` turn by turn as harness.run_conversations and
    harness.play_turn do: each prompt is the previous one, its output's
    first TURN_TOKENS tokens and random fill (the last turn resends); under
    offload the device prefix caches are reset before every turn; each turn
    is followed by its recompute under a fresh salt on the decoder.
    Concurrently, every conversation's turn is admitted at once and each
    recompute as soon as its turn finished."""
    results: list[TurnResult] = []
    states = []
    for conv in conversations:
        rng = random.Random(conv.seed)
        prompt = harness.random_tokens(rng, token_ids, conv.first_len)
        states.append([conv, rng, f"conversation-{conv.seed}", prompt])
    plans = [harness.plan_turns(conv.first_len) for conv in conversations]
    for index in range(harness.NUM_TURNS + 1):
        outputs: list[list[int]] = []
        if concurrent:
            assert len(servers) == 1 and not deployment.offload, (
                "concurrent conversations run on one server without offload"
            )
            outputs = _play_batch(servers[0], states, plans, index, results)
        else:
            for state, plan in zip(states, plans):
                conv, _, salt, prompt = state
                planned = plan[index]
                assert planned.prompt_len == len(prompt), "the plan and the prompt"
                if deployment.offload:
                    for server in servers:
                        server.reset_prefix_cache()
                output, hit = send(servers, prompt, salt)
                recompute = servers[-1].complete(prompt, f"recompute-{salt}-{index}")
                assert recompute.cached_tokens is not None
                results.append(
                    TurnResult(conv.label, planned, hit, recompute.cached_tokens)
                )
                outputs.append(output.token_ids)
        for state, plan, output in zip(states, plans, outputs):
            conv, rng, salt, prompt = state
            if index + 1 >= len(plan) or plan[index + 1].resend:
                continue
            appended = output[: harness.TURN_TOKENS]
            fill = harness.random_tokens(
                rng, token_ids, harness.TURN_TOKENS - len(appended)
            )
            state[3] = prompt + appended + fill
    for server in servers:
        server.drain()
    return results


def _play_batch(
    server: ReplayServer,
    states: list,
    plans: list[list[harness.PlannedTurn]],
    index: int,
    results: list[TurnResult],
) -> list[list[int]]:
    turns = []
    for state, plan in zip(states, plans):
        conv, _, salt, prompt = state
        planned = plan[index]
        assert planned.prompt_len == len(prompt), "the plan and the prompt"
        turns.append(
            (
                conv,
                planned,
                salt,
                prompt,
                server.submit(prompt, salt, harness.MAX_TOKENS),
            )
        )
    recomputes: dict[int, Completion] = {}
    while not all(
        turn[4].finished and i in recomputes and recomputes[i].finished
        for i, turn in enumerate(turns)
    ):
        assert server.step(), "concurrent turns stalled"
        for i, (_, _, salt, prompt, completion) in enumerate(turns):
            if completion.finished and i not in recomputes:
                server.settle(completion, None)
                recomputes[i] = server.submit(
                    prompt, f"recompute-{salt}-{index}", harness.MAX_TOKENS
                )
    outputs = []
    for i, (conv, planned, _, _, completion) in enumerate(turns):
        server.settle(recomputes[i], None)
        assert completion.cached_tokens is not None
        assert recomputes[i].cached_tokens is not None
        results.append(
            TurnResult(
                conv.label,
                planned,
                completion.cached_tokens,
                recomputes[i].cached_tokens,
            )
        )
        outputs.append(completion.token_ids)
    return outputs


def play_resend(
    servers: Sequence[ReplayServer],
    deployment: harness.Deployment,
    prompt_len: int,
    seed: str,
    token_ids: tuple[int, int],
) -> list[TurnResult]:
    """harness.run_resend: a cold request, then (after the offload reset)
    the same prompt again and its recompute under a fresh salt."""
    prompt = harness.random_tokens(random.Random(seed), token_ids, prompt_len)
    salt = f"resend-{seed}"
    results = []
    _, cold = send(servers, prompt, salt)
    results.append(TurnResult("", harness.PlannedTurn(0, prompt_len, 0), cold, None))
    if deployment.offload:
        for server in servers:
            server.reset_prefix_cache()
    _, hit = send(servers, prompt, salt)
    recompute = servers[-1].complete(prompt, f"recompute-{seed}")
    assert recompute.cached_tokens is not None
    results.append(
        TurnResult(
            "",
            harness.PlannedTurn(1, prompt_len, prompt_len, resend=True),
            hit,
            recompute.cached_tokens,
        )
    )
    for server in servers:
        server.drain()
    return results


def units_of(engine: Engine, mode: harness.Mode) -> harness.Units:
    """The harness's reading of ``engine``'s cache_config_info labels."""
    labels = engine.geometry.labels
    if mode.prefix_match_unit is not None:
        labels["prefix_match_unit"] = str(
            engine.vllm_config.cache_config.prefix_match_unit
        )
    return harness.Units.from_cache_config(labels, mode)


def cpu_geometry(model_path: str | Path, mode: harness.Mode) -> Geometry:
    """The attention block, Mamba block and hit unit of the CPU tier's plain
    deployment serving ``model_path`` in ``mode``, as its engine resolves
    them (:func:`cpu_engine`)."""
    from tests.models.hybrid_prefix_cache import cpu_binding as cpu
    from tests.models.hybrid_prefix_cache.tiny_hybrid import (
        FIRST_WORD_ID,
        VOCAB_SIZE,
        TinyHybrid,
    )

    binding = cpu.cpu_binding(TinyHybrid(Path(model_path), FIRST_WORD_ID, VOCAB_SIZE))
    instance = cpu.DEPLOYMENTS["plain"].decode
    args = harness.server_args(binding, instance, mode)
    return cpu_engine(binding.model, args, {**binding.env, **instance.env}).geometry

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Replayed servers: an engine core's loop (:class:`EngineLoop`), one ``vllm serve``
instance (:class:`ReplayServer`) with its usage ledger and counter deltas, and a
deployment's servers (:func:`servers_for`)."""

import json
from collections.abc import Callable, Mapping, Sequence

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import reconcile
from tests.models.hybrid_prefix_cache.harness.deployment import Deployment, Instance
from tests.models.hybrid_prefix_cache.scheduler.engine import Engine
from tests.models.hybrid_prefix_cache.scheduler.workers import Completion, StandInWorker
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

# Engine steps within which a completion must finish: a prefill of the
# longest prompt here in chunks of the smallest budget, and its decode.
STEP_LIMIT = 10_000
# The prefix-cache counters, local then external: the scheduler's stats move them.
COUNTERS = reconcile.COUNTERS[:4]


class EngineLoop:
    """One engine core's scheduler, stand-in workers and busy loop, run as
    ``EngineCore.step`` or (asynchronous scheduling) ``step_with_batch_queue``."""

    def __init__(self, engine: Engine, token_ids: tuple[int, int]) -> None:
        self.scheduler = engine.scheduler()
        world_size = engine.vllm_config.parallel_config.world_size
        self.worker = StandInWorker(self.scheduler, token_ids, world_size)
        self.depth = engine.vllm_config.max_concurrent_batches
        self.queue: list[tuple] = []
        # Called with the scheduler and each step's output as it is scheduled.
        self.watchers: list[Callable[[Scheduler, SchedulerOutput], None]] = []

    def step(self, record) -> bool:
        """One engine step; False when the engine has nothing to do."""
        scheduler = self.scheduler
        if scheduler.has_requests():
            output = scheduler.schedule()
            for watch in self.watchers:
                watch(scheduler, output)
            self.queue.insert(0, (output, self.worker.execute(output)))
            if len(self.queue) < self.depth and (
                output.total_num_scheduled_tokens > 0 or scheduler.has_requests()
            ):
                return True
        elif not self.queue:
            return False
        output, result = self.queue.pop()
        record(scheduler.update_from_output(output, result))
        drafts = self.worker.drafts(output) if self.depth == 1 else None
        if output.total_num_scheduled_tokens > 0 and drafts:
            scheduler.update_draft_token_ids(drafts)
        return True


class ReplayServer:
    """One ``vllm serve`` instance: an engine loop per DP rank (round-robin, as
    ``DPLBAsyncMPClient`` routes to idle engines), its ledger and counters."""

    def __init__(
        self, name: str, engine: Engine, instance: Instance, token_ids: tuple[int, int]
    ) -> None:
        self.name, self.engine, self.instance = name, engine, instance
        self.loops = [EngineLoop(engine, token_ids) for _ in range(instance.dp)]
        # As v1/engine/core.py EngineCore.__init__ makes it; 0.33 adds
        # VllmConfig.num_hash_lookahead_tokens
        lookahead = getattr(engine.vllm_config, "num_hash_lookahead_tokens", 0)
        self.hasher = get_request_block_hasher(
            engine.hash_block, sha256, *((lookahead,) if lookahead else ())
        )
        self.completions: dict[str, Completion] = {}
        self.routed: dict[str, EngineLoop] = {}
        self.ledger = reconcile.Ledger()
        self.moved: dict[str, float | None] = dict.fromkeys(COUNTERS, 0.0)
        self.requests = 0

    @property
    def scheduler(self) -> Scheduler:
        """The first engine's scheduler (the only one without DP)."""
        return self.loops[0].scheduler

    def _record(self, outputs) -> None:
        """What the API server takes from a step's outputs: counter increments
        (``PrometheusStatLogger.record``), completions' tokens, usage and params."""
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None:
                self.moved[reconcile.PREFIX_QUERIES] += stats.prefix_cache_stats.queries
                self.moved[reconcile.PREFIX_HITS] += stats.prefix_cache_stats.hits
                connector = stats.connector_prefix_cache_stats
                if connector is not None:
                    self.moved[reconcile.EXTERNAL_QUERIES] += connector.queries
                    self.moved[reconcile.EXTERNAL_HITS] += connector.hits
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
        # A list, not a generator: every engine steps.
        return any([loop.step(self._record) for loop in self.loops])

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
        priority: int = 0,
    ) -> Completion:
        """Add a greedy completion request as the API server would."""
        loop = self.loops[self.requests % len(self.loops)]
        self.requests += 1
        request_id = f"{self.name}-{self.requests}"
        extra = None
        if kv_transfer_params is not None:
            extra = {"kv_transfer_params": json.loads(json.dumps(kv_transfer_params))}
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=harness.compare.NUM_LOGPROBS,
            extra_args=extra,
        )
        request = self.request(request_id, prompt, salt, params, priority)
        completion = Completion(request_id, list(prompt), prompt_tokens=len(prompt))
        self.completions[request_id] = completion
        self.routed[request_id] = loop
        loop.scheduler.add_request(request)
        return completion

    def request(
        self,
        request_id: str,
        prompt: Sequence[int],
        salt: str,
        params: SamplingParams,
        priority: int = 0,
    ) -> Request:
        """Hashed as this server's engine core hashes it."""
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            cache_salt=salt,
            block_hasher=self.hasher,
            priority=priority,
        )

    def settle(self, completion: Completion, sent: Mapping | None) -> None:
        """Book a finished completion as its response reports it: a P/D decoder
        reports the prefiller's hit (v1/engine/output_processor.py
        RequestState.from_new_request)."""
        assert completion.finished, f"{completion.request_id} did not finish"
        params = sent or {}
        remote = params.get("remote_prefill_cached_tokens")
        if params.get("do_remote_prefill") and isinstance(remote, int):
            completion.cached_tokens = remote
        assert completion.cached_tokens is not None, completion.request_id
        self.ledger += reconcile.ledger_entry(
            completion.prompt_tokens, completion.cached_tokens, sent
        )

    def complete(
        self,
        prompt: Sequence[int],
        salt: str,
        max_tokens: int = harness.client.MAX_TOKENS,
        kv_transfer_params: Mapping | None = None,
    ) -> Completion:
        completion = self.submit(prompt, salt, max_tokens, kv_transfer_params)
        self.finish(completion)
        self.settle(completion, kv_transfer_params)
        return completion

    def finish(self, completion: Completion) -> None:
        """Step until ``completion`` finished, or fail saying what each engine holds."""
        for _ in range(STEP_LIMIT):
            if completion.finished:
                return
            assert self.step(), f"{completion.request_id} stalled"
        held = []
        for loop in self.loops:
            scheduler = loop.scheduler
            pool = scheduler.kv_cache_manager.block_pool
            held.append(
                f"{len(scheduler.running)} running, {len(scheduler.waiting)} "
                f"waiting, {pool.get_num_free_blocks()} of {pool.num_gpu_blocks} "
                f"blocks free"
            )
        raise AssertionError(
            f"{self.name}: {completion.request_id} ({completion.prompt_tokens} "
            f"prompt tokens) did not finish in {STEP_LIMIT} engine steps: "
            + "; ".join(held)
        )

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache?reset_external=false`` once the engines
        have settled (the harness retries until it succeeds)."""
        self.drain()
        for loop in self.loops:
            assert loop.scheduler.reset_prefix_cache(reset_connector=False), (
                f"{self.name}: the prefix cache reset failed with nothing running"
            )

    def counter_problems(self) -> list[str]:
        caching, connector = self.instance.prefix_caching, self.instance.kv_config
        return reconcile.counter_problems(
            self.name, self.moved, self.ledger, caching, connector is not None
        )


def servers_for(
    engines: Sequence[Engine], deployment: Deployment, token_ids: tuple[int, int]
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
    peers: dict[str, StandInWorker] = {}
    for server in servers:
        config = server.engine.vllm_config.kv_transfer_config
        if config is not None and len(server.loops) == 1:
            peers[config.engine_id] = server.loops[0].worker
    for server in servers:
        for loop in server.loops:
            loop.worker.peers = peers
    return servers

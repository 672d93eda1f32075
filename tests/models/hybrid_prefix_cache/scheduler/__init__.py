# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Replay the harness's conversations through vLLM's own scheduler, in-process.

The end-to-end tiers check a server's hits against the harness's reading of
vLLM (:func:`harness.expectation`, :func:`harness.counter_problems`). This
package asks vLLM itself, in seconds and without a device: every instance of
a deployment is a real ``Scheduler`` (``AsyncScheduler`` where the server
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

The geometry is vLLM's: for a model that is here (the CPU tier's),
:func:`cpu_engine` resolves ``vllm serve``'s arguments into a ``VllmConfig``
and aligns the attention and Mamba blocks the way the worker does after
loading the model; for a tier whose model is not here (Kimi-K3),
:func:`stated_engine` builds the scheduler-side objects from a stated
geometry. The package knows no tier: a binding hands it a model and its
arguments (``cpu_binding.resolved_geometry``, the scheduler tier's tests).

Which module owns what (each imports only the ones above it):

* ``engine``: an instance's scheduler-side objects (:class:`Engine`), the
  geometry they resolve (:class:`Geometry`) and :func:`finish_engine`, which
  groups the layers' specs as ``EngineCore._initialize_kv_caches`` does;
* ``cpu``: the engine of ``vllm serve`` on the CPU platform
  (:func:`engine_args`, :func:`cpu_engine`);
* ``stated``: the engine of a stated geometry (:class:`StatedGeometry`,
  :func:`stated_engine`);
* ``workers``: the stand-in workers (:class:`StandInWorker`) and a
  completion's response (:class:`Completion`);
* ``servers``: an engine core's loop (:class:`EngineLoop`), a server
  (:class:`ReplayServer`) and a deployment's servers (:func:`servers_for`);
* ``play``: playing conversations and resends (:func:`play_conversations`,
  :func:`play_resend`, :class:`TurnResult`) and :func:`units_of`;
* ``workloads``: the workloads beside the growing conversation that need a
  play of their own (:func:`play_siblings`, :func:`play_abort_retry`,
  :func:`play_overlapping_retry`, :func:`play_eviction` on a pool that
  :func:`sized_eviction` grows until vLLM accepts it) and each group's own
  hit (:func:`per_group_hits`).
"""

# Every public name of the package, for ``scheduler.X``; F401: these imports
# are the re-exports.
from tests.models.hybrid_prefix_cache.scheduler.cpu import (  # noqa: F401
    cpu_engine,
    engine_args,
)
from tests.models.hybrid_prefix_cache.scheduler.engine import (  # noqa: F401
    Engine,
    Geometry,
    build_config,
    environment,
    finish_engine,
    runner_needs_triton,
    runner_refusal,
)
from tests.models.hybrid_prefix_cache.scheduler.play import (  # noqa: F401
    TurnResult,
    play_conversations,
    play_resend,
    send,
    units_of,
)
from tests.models.hybrid_prefix_cache.scheduler.servers import (  # noqa: F401
    COUNTERS,
    EngineLoop,
    ReplayServer,
    servers_for,
)
from tests.models.hybrid_prefix_cache.scheduler.stated import (  # noqa: F401
    KDA_STATE,
    MLA_HEAD_SIZE,
    STATED_LAYERS,
    StatedGeometry,
    stated_engine,
)
from tests.models.hybrid_prefix_cache.scheduler.workers import (  # noqa: F401
    Completion,
    StandInWorker,
)
from tests.models.hybrid_prefix_cache.scheduler.workloads import (  # noqa: F401
    AbortRetry,
    Eviction,
    OverlappingRetry,
    Sibling,
    blocks_in_use,
    per_group_hits,
    play_abort_retry,
    play_eviction,
    play_overlapping_retry,
    play_siblings,
    sized_eviction,
)

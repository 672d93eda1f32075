# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Replay the harness's conversations through vLLM's own scheduler, in-process.

Each instance is a real ``Scheduler`` over a real ``KVCacheManager`` and KV
connector; only the workers are stood in for (:class:`StandInWorker`). Counters
move as v1/metrics/loggers.py PrometheusStatLogger.record moves them. Modules
``engine``, ``cpu``, ``stated``, ``workers``, ``servers``, ``play``, ``abort``,
``preempt``, ``judge`` and ``cell`` each import only those before them.
"""

# The package's public names; F401: these imports are the re-exports.
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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Replay the harness's conversations through vLLM's own scheduler, in-process: a real
Scheduler, KVCacheManager and KV connector per instance, stand-in workers, counters
moved as v1/metrics/loggers.py PrometheusStatLogger.record moves them."""

# The names the suite imports from the package; F401: these are re-exports.
from tests.models.hybrid_prefix_cache.scheduler.cpu import (  # noqa: F401
    cpu_engine,
    engine_args,
)
from tests.models.hybrid_prefix_cache.scheduler.engine import (  # noqa: F401
    Engine,
    Geometry,
    build_config,
    environment,
)
from tests.models.hybrid_prefix_cache.scheduler.play import (  # noqa: F401
    play_conversations,
    play_resend,
)
from tests.models.hybrid_prefix_cache.scheduler.servers import (  # noqa: F401
    ReplayServer,
    servers_for,
)
from tests.models.hybrid_prefix_cache.scheduler.stated import (  # noqa: F401
    StatedGeometry,
    stated_engine,
)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Conversations that join and leave between steps, under asynchronous and
synchronous scheduling (the scheduler tier only)."""

from tests.models.hybrid_prefix_cache.harness.cases import Workload

ASYNC = Workload(
    "async",
    "conversations that join and leave between steps hit as they do "
    "with synchronous scheduling",
    "v1/core/sched/async_scheduler.py AsyncScheduler, "
    "v1/engine/core.py EngineCore.step_with_batch_queue",
)
SYNC = Workload(
    "sync",
    "conversations that join and leave between steps hit their "
    "checkpoints with synchronous scheduling",
    "v1/core/sched/scheduler.py Scheduler, v1/engine/core.py EngineCore.step",
)

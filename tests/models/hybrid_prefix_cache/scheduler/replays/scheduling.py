# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of workloads/scheduling.py."""

from functools import partial

from tests.models.hybrid_prefix_cache.harness import conversation
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell, Setting
from tests.models.hybrid_prefix_cache.workloads import scheduling as workloads


def replay(cell: ReplayCell, scheduling: str) -> None:
    """The reference conversation and one a token past the blocks, at once on one
    server without offload (requests join and leave between steps): every turn
    hits the harness's expectation."""
    setting = Setting(async_scheduling=scheduling == "async")
    concurrent = cell.deployment.prefill is None and not cell.deployment.offload
    for kda, alignment in cell.kda_checkpoints.items():
        engines = cell.engines(setting, alignment)
        depth = engines[0].vllm_config.max_concurrent_batches
        assert (depth > 1) == setting.async_scheduling, (scheduling, depth)

        def two(units):
            length = conversation.shape_length("plus1", units)
            return [
                conversation.reference_conversation(units, f"{cell.cell_id}-reference"),
                conversation.Conversation("plus1", length, f"{cell.cell_id}-plus1"),
            ]

        _, rows, problems = cell.play_conversations(engines, two, concurrent)
        workload = workloads.ASYNC if setting.async_scheduling else workloads.SYNC
        cell.fail(workload, problems, f"{kda} depth {depth}\n" + "\n".join(rows))


ASYNC = Replay(workloads.ASYNC, partial(replay, scheduling="async"))
SYNC = Replay(workloads.SYNC, partial(replay, scheduling="sync"))

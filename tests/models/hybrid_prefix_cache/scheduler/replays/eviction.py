# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of workloads/eviction.py."""

from tests.models.hybrid_prefix_cache.harness import client, conversation
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell, Setting
from tests.models.hybrid_prefix_cache.scheduler.judge import controls
from tests.models.hybrid_prefix_cache.workloads import eviction


def replay(cell: ReplayCell) -> None:
    """A pool of EVICTION_POOL_REQUESTS requests' blocks (measured on the engine),
    a first turn, pressure, then the second turn: its local hit never exceeds the
    least every group still holds, the counters agree and the pressure did evict."""
    for kda, alignment in cell.kda_checkpoints.items():
        units, servers = cell.servers_of(cell.engines(kda=alignment))
        length = conversation.reference_conversation(units, "").first_len
        max_len = eviction.eviction_max_len(length, client.MAX_TOKENS)
        sizing = [cell.token_ids[0]] * (max_len - 1)
        used = eviction.blocks_in_use(servers[0], sizing, "size")

        def build(blocks: int, alignment=alignment, max_len=max_len):
            setting = Setting(num_blocks=blocks, max_model_len=max_len)
            return cell.servers_of(cell.engines(setting, alignment))[1]

        def replayed(servers, units=units) -> eviction.Eviction:
            return eviction.play_eviction(servers, units, cell.cell_id, cell.token_ids)

        blocks, servers, result = eviction.sized_eviction(
            build, eviction.EVICTION_POOL_REQUESTS * used + 1, replayed
        )
        problems = eviction.eviction_problems(result.local_hit, result.held)
        if result.held == result.held_before:
            problems.append(
                f"nothing was evicted: every group holds {list(result.held)} before "
                f"and after the pressure ({blocks} blocks for {used} a request)"
            )
        problems += controls(result.recompute_hit, servers)
        cell.fail(eviction.WORKLOAD, problems, f"{kda} {result}")


REPLAY = Replay(eviction.WORKLOAD, replay)

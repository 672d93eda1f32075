# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of workloads/shared_prefix.py."""

import random

from tests.models.hybrid_prefix_cache.harness.conversation import random_tokens
from tests.models.hybrid_prefix_cache.harness.rules import hit_bound
from tests.models.hybrid_prefix_cache.scheduler import judge, play
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell
from tests.models.hybrid_prefix_cache.workloads import shared_prefix


def replay(cell: ReplayCell) -> None:
    """The siblings through the cell's servers, one after another, each with its
    recompute; the device caches are never reset."""
    for kda, alignment in cell.kda_checkpoints.items():
        units, servers = cell.servers_of(cell.engines(kda=alignment))
        rng, tokens = random.Random(cell.cell_id), cell.token_ids
        shared = random_tokens(rng, tokens, shared_prefix.shared_prefix_length(units))
        tail = shared_prefix.sibling_tail_length(units)
        hits = []
        for index in range(shared_prefix.NUM_SIBLINGS):
            prompt = shared + random_tokens(rng, tokens, tail)
            _, hit, _ = play.send(servers, prompt, f"siblings-{cell.cell_id}")
            salt = f"recompute-{cell.cell_id}-{index}"
            recompute = servers[-1].complete(prompt, salt).cached_tokens
            assert recompute is not None
            hits.append((len(prompt), hit, recompute))
        for server in servers:
            server.drain()
        # A lookup through the connector goes group by group and reports no junction.
        connector = servers[0].scheduler.connector
        lookup = ""
        if connector is not None and connector.supports_divergent_local_hybrid_hits:
            lookup = (
                f"; its {type(connector).__name__} takes the per-group lookup "
                f"(get_computed_blocks_for_connector), which detects no "
                f"shared-prefix junction"
            )
        drops = cell.mode.drops_unit
        junction = shared_prefix.junction_checkpoint(len(shared), units, drops)
        problems = []
        for index, (prompt_len, hit, recompute_hit) in enumerate(hits):
            name = f"sibling {index} ({prompt_len} tokens)"
            bound = hit_bound(len(shared), prompt_len, units.hit)
            if hit > bound or hit % units.hit:
                problems.append(
                    f"{name}: cached {hit}, beyond the shared {len(shared)}-token "
                    f"prefix's bound {bound}"
                )
            if index == 0 and hit:
                problems.append(f"{name}: the first sibling cached {hit}")
            if index >= 2 and hit != junction:
                problems.append(
                    f"{name}: cached {hit}, not the junction checkpoint {junction} of "
                    f"the shared {len(shared)}-token prefix (block {units.block}, "
                    f"drafter drops a unit: {drops})" + lookup
                )
            if recompute_hit:
                problems.append(f"{name}: the recompute hit {recompute_hit}")
        problems += judge.counter_problems(servers)
        detail = f"{kda} hits {[h for _, h, _ in hits]}, junction {junction}"
        cell.fail(shared_prefix.WORKLOAD, problems, f"{detail}, hit unit {units.hit}")


REPLAY = Replay(shared_prefix.WORKLOAD, replay)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of workloads/shared_prefix.py."""

import random
from collections.abc import Sequence

from tests.models.hybrid_prefix_cache.harness.conversation import (
    random_tokens,
)
from tests.models.hybrid_prefix_cache.harness.deployment import Units
from tests.models.hybrid_prefix_cache.harness.rules import (
    hit_bound,
)
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell
from tests.models.hybrid_prefix_cache.scheduler.judge import counter_problems
from tests.models.hybrid_prefix_cache.scheduler.play import send
from tests.models.hybrid_prefix_cache.scheduler.servers import ReplayServer
from tests.models.hybrid_prefix_cache.workloads.shared_prefix import (
    NUM_SIBLINGS,
    WORKLOAD,
    junction_checkpoint,
    shared_prefix_length,
    sibling_tail_length,
)


def _junction_lookup(server: ReplayServer) -> str:
    """A lookup through the connector goes group by group
    (get_computed_blocks_for_connector) and reports no junction."""
    connector = server.scheduler.connector
    if connector is not None and connector.supports_divergent_local_hybrid_hits:
        return (
            f"; its {type(connector).__name__} takes the per-group lookup "
            f"(get_computed_blocks_for_connector), which detects no "
            f"shared-prefix junction"
        )
    return ""


def _sibling_problems(
    hits: Sequence[tuple[int, int, int]],
    shared: int,
    units: Units,
    cell: ReplayCell,
    lookup: str,
) -> list[str]:
    junction = junction_checkpoint(shared, units, cell.mode.drops_unit)
    problems = []
    for index, (prompt_len, hit, recompute_hit) in enumerate(hits):
        name = f"sibling {index} ({prompt_len} tokens)"
        bound = hit_bound(shared, prompt_len, units.hit)
        if hit > bound or hit % units.hit:
            problems.append(
                f"{name}: cached {hit}, beyond the shared {shared}-token prefix's "
                f"bound {bound}"
            )
        if index == 0 and hit:
            problems.append(f"{name}: the first sibling cached {hit}")
        if index >= 2 and hit != junction:
            problems.append(
                f"{name}: cached {hit}, not the junction checkpoint {junction} of "
                f"the shared {shared}-token prefix (block {units.block}, drafter "
                f"drops a unit: {cell.mode.drops_unit})" + lookup
            )
        if recompute_hit:
            problems.append(f"{name}: the recompute hit {recompute_hit}")
    return problems


def replay(cell: ReplayCell) -> None:
    """The siblings through the cell's replayed servers, one after another,
    each with its recompute; the device caches are never reset."""
    for kda, alignment in cell.kda_checkpoints.items():
        units, servers = cell.servers_of(cell.engines(kda=alignment))
        rng = random.Random(cell.cell_id)
        shared = random_tokens(rng, cell.token_ids, shared_prefix_length(units))
        tail = sibling_tail_length(units)
        hits = []
        for index in range(NUM_SIBLINGS):
            prompt = shared + random_tokens(rng, cell.token_ids, tail)
            _, hit, _ = send(servers, prompt, f"siblings-{cell.cell_id}")
            recompute = servers[-1].complete(
                prompt, f"recompute-{cell.cell_id}-{index}"
            )
            assert recompute.cached_tokens is not None
            hits.append((len(prompt), hit, recompute.cached_tokens))
        for server in servers:
            server.drain()
        lookup = _junction_lookup(servers[0])
        problems = _sibling_problems(hits, len(shared), units, cell, lookup)
        problems += counter_problems(servers)
        junction = junction_checkpoint(len(shared), units, cell.mode.drops_unit)
        detail = f"{kda} hits {[h for _, h, _ in hits]}, junction {junction}"
        cell.fail(WORKLOAD, problems, f"{detail}, hit unit {units.hit}")


REPLAY = Replay(WORKLOAD, replay)

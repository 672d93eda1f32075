# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of workloads/aligned.py."""

from tests.models.hybrid_prefix_cache.harness import conversation
from tests.models.hybrid_prefix_cache.harness.rules import NUM_TURNS
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell
from tests.models.hybrid_prefix_cache.workloads.aligned import WORKLOAD


def replay(cell: ReplayCell) -> None:
    """The aligned conversation of the reference's turns, and the one its matrix
    plays where that differs (Kimi-K3's: two turns, no resend): every turn hits
    the harness's expectation."""
    plans = {(NUM_TURNS, True), cell.plans.get(WORKLOAD.name, (NUM_TURNS, True))}
    for kda, alignment in cell.kda_checkpoints.items():
        for num_turns, resend in sorted(plans, reverse=True):
            engines = cell.engines(kda=alignment)
            seed = f"{cell.cell_id}-aligned"
            if (num_turns, resend) != (NUM_TURNS, True):
                seed += f"-{num_turns}-turns"

            def aligned(units, seed=seed, plan=(num_turns, resend)):
                length = conversation.shape_length("exact", units)
                return [conversation.Conversation("exact", length, seed, *plan)]

            _, rows, problems = cell.play_conversations(engines, aligned)
            plan = f"{num_turns} turns" + (" and a resend" if resend else "")
            cell.fail(WORKLOAD, problems, f"{kda} {plan}\n" + "\n".join(rows))


REPLAY = Replay(WORKLOAD, replay)

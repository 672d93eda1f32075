# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A conversation whose first prompt ends exactly on a block: every turn
hits its previous prompt's checkpoint and matches its recompute."""

from typing import TYPE_CHECKING

from tests.models.hybrid_prefix_cache.harness.cases import run_case
from tests.models.hybrid_prefix_cache.harness.conversation import (
    Conversation,
    shape_length,
)
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import NUM_TURNS
from tests.models.hybrid_prefix_cache.harness.workload import Workload, WorkloadRun

if TYPE_CHECKING:
    from tests.models.hybrid_prefix_cache.scheduler.cell import ReplayCell


def play(run: WorkloadRun) -> CaseRecord:
    """The sweep's "exact" shape, with the turns its matrix gives it."""
    __tracebackhide__ = True
    return run_case(
        run.suite,
        run.case_id,
        run.binding,
        run.deployment,
        run.mode,
        shapes=("exact",),
        known=run.known,
        num_turns=run.num_turns,
        resend=run.resend,
    )


def replay(cell: "ReplayCell") -> None:
    """The aligned conversation of the reference's turns, and the one its
    matrix plays where that differs (the Kimi-K3 matrix: two turns, no
    resend): every turn hits the harness's expectation."""
    # The scheduler tier's vLLM, which the GPU tier's release may lack.
    from tests.models.hybrid_prefix_cache.scheduler.judge import case_problems

    plans = {(NUM_TURNS, True), cell.plans.get(WORKLOAD.name, (NUM_TURNS, True))}
    for kda, alignment in cell.kda_checkpoints.items():
        for num_turns, resend in sorted(plans, reverse=True):
            engines = cell.engines(kda=alignment)
            seed = f"{cell.cell_id}-aligned"
            if (num_turns, resend) != (NUM_TURNS, True):
                seed += f"-{num_turns}-turns"

            def aligned(units, seed=seed, num_turns=num_turns, resend=resend):
                length = shape_length("exact", units)
                return [Conversation("exact", length, seed, num_turns, resend)]

            units, servers, results = cell.play_conversations(engines, aligned)
            rows, problems = case_problems(
                servers, results, units, cell.mode, cell.deployment
            )
            plan = f"{num_turns} turns" + (" and a resend" if resend else "")
            cell.fail(WORKLOAD, problems, f"{kda} {plan}\n" + "\n".join(rows))


WORKLOAD = Workload(
    "aligned",
    "a prompt that ends on a block hits its previous prompt's "
    "checkpoint and matches its recompute",
    "v1/kv_cache_interface.py get_mamba_prefill_checkpoint_position",
    play=play,
    replay=replay,
)

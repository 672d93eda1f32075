# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of workloads/small_budget.py."""

from tests.models.hybrid_prefix_cache.harness.conversation import reference_conversation
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell, Setting
from tests.models.hybrid_prefix_cache.scheduler.judge import check_geometry
from tests.models.hybrid_prefix_cache.workloads import small_budget


def replay(cell: ReplayCell) -> None:
    """The reference conversation under each of :func:`small_budgets`: its hits
    equal the default budget's turn by turn, and the harness's expectation."""
    for kda, alignment in cell.kda_checkpoints.items():
        engines = cell.engines(kda=alignment)
        units = check_geometry(engines[0], cell.mode)

        def reference(units):
            return [reference_conversation(units, cell.cell_id)]

        default, _, _ = cell.play_conversations(engines, reference)
        for budget in small_budget.small_budgets(units):
            small = cell.engines(Setting(budget), alignment)
            results, rows, wrong = cell.play_conversations(small, reference)
            problems = [
                f"turn {a.planned.index}: cached {b.hit} under a budget of "
                f"{budget}, {a.hit} under the default"
                for a, b in zip(default, results)
                if a.hit != b.hit
            ]
            problems += wrong
            detail = f"{kda} budget {budget}\n" + "\n".join(rows)
            cell.fail(small_budget.WORKLOAD, problems, detail)


REPLAY = Replay(small_budget.WORKLOAD, replay)

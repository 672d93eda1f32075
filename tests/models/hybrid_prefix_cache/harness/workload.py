# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a workload is; what its play on real servers is given: cases.WorkloadRun."""

from collections.abc import Callable
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness import cases, records


@dataclass(frozen=True)
class Workload:
    """A workload of the ``workloads`` package: its id suffix, the property it holds,
    its vLLM rule, and its ``play`` on real servers (its replay: scheduler.replays)."""

    name: str
    holds: str
    rule: str
    play: Callable[[cases.WorkloadRun], records.CaseRecord] | None = None
    own_servers: bool = False  # started after the cell's other servers
    turns: int | None = None  # its requests where it plays no cell turns (Case.turns)

    def failure(self, detail: str) -> str:
        return f"{self.name}: {self.holds} ({detail})"

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a workload is, and what its play on real servers is given."""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from tests.models.hybrid_prefix_cache.harness import cases, records, rules
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Known,
    Mode,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.session import CaseSession, case_session


class InProcess(Protocol):
    """A tier's engines built in-process from exactly its servers' arguments."""

    def units(self, mode: Mode) -> Units: ...
    def budget(self, deployment: Deployment, mode: Mode) -> int: ...
    def replay_servers(
        self, deployment: Deployment, mode: Mode, args: Sequence[str]
    ) -> tuple[Any, list]: ...


@dataclass(frozen=True)
class WorkloadRun:
    """One workload case on real servers: where it runs, its known failures,
    its matrix's turns, and the tier's in-process engines (None on B200)."""

    suite: cases.Suite
    case_id: str
    binding: Binding
    deployment: Deployment
    mode: Mode
    known: tuple[Known, ...] = ()
    num_turns: int = rules.NUM_TURNS
    resend: bool = True
    in_process: InProcess | None = None

    def session(self) -> AbstractContextManager[CaseSession]:
        return case_session(self.case_id, self.suite.records, self.known)

    def needs_in_process(self) -> InProcess:
        if self.in_process is None:
            raise ValueError(
                f"{self.case_id}: this workload sizes its servers in-process, "
                f"and this tier builds no engine in-process"
            )
        return self.in_process


@dataclass(frozen=True)
class Workload:
    """A workload of the ``workloads`` package: its id suffix, the property it holds,
    its vLLM rule, and its ``play`` on real servers (its replay: scheduler.replays)."""

    name: str
    holds: str
    rule: str
    play: Callable[[WorkloadRun], records.CaseRecord] | None = None
    own_servers: bool = False  # started after the cell's other servers
    turns: int | None = None  # its requests where it plays no cell turns (Case.turns)

    def failure(self, detail: str) -> str:
        return f"{self.name}: {self.holds} ({detail})"

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cases: a growing conversation (:func:`run_case`) or a resend (:func:`run_resend`),
each in a session on its servers judged by its known failures (harness/session.py);
what a workload is (:class:`Workload`) and what its play gets (:class:`WorkloadRun`)."""

import random
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pytest

from tests.models.hybrid_prefix_cache.harness import conversation, deployment, rules
from tests.models.hybrid_prefix_cache.harness.client import send_checked
from tests.models.hybrid_prefix_cache.harness.compare import Found, Turn
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Known,
    Mode,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.known import evidence_shown
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.servers import ServerPool
from tests.models.hybrid_prefix_cache.harness.session import CaseSession, case_session


@dataclass
class Suite:
    """What a session's cases share: the pool of reused servers, every case's record."""

    pool: ServerPool = field(default_factory=ServerPool)
    records: list[CaseRecord] = field(default_factory=list)

    def __repr__(self) -> str:
        records, starts = len(self.records), self.pool.starts
        return f"Suite({records} case records, {starts} server starts)"

    def close(self) -> None:
        self.pool.close()


class InProcess(Protocol):
    """A tier's engines built in-process from exactly its servers' arguments."""

    def units(self, mode: Mode) -> Units: ...
    def budget(self, deployment: Deployment, mode: Mode) -> int: ...
    def replay_servers(
        self, deployment: Deployment, mode: Mode, args: Sequence[str]
    ) -> tuple[Any, list]: ...


@dataclass(frozen=True)
class WorkloadRun:
    """One case on real servers, a cell's or its workload's: where it runs, its known
    failures, its matrix's turns, and the tier's in-process engines (None on B200)."""

    suite: Suite
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
    play: Callable[[WorkloadRun], CaseRecord] | None = None
    own_servers: bool = False  # started after the cell's other servers
    turns: int | None = None  # its requests where it plays no cell turns (Case.turns)

    def failure(self, detail: str) -> str:
        return f"{self.name}: {self.holds} ({detail})"


def run_case(
    run: WorkloadRun,
    shapes: Sequence[str] = (),
    concurrent: bool = False,
    restores: bool = False,
) -> CaseRecord:
    """Check the reference conversation, or one per sweep shape the servers have,
    at once under ``batch_invariant_env`` (``concurrent``) or at the servers' own
    threads held on the hits' prefill steps (``restores``). A case in ``run.known``
    xfails, skips or fails here (harness/session.py)."""
    __tracebackhide__ = True
    if concurrent and (env := run.binding.batch_invariant_env) is not None:
        run = replace(run, deployment=deployment.with_serve_env(run.deployment, env))
    with run.session() as case, case.serve(run, concurrent or restores, restores) as p:
        turns = {"num_turns": run.num_turns, "resend": run.resend}
        conversations = [
            conversation.Conversation(s, length, f"{run.case_id}-{s}", **turns)
            for s in dict.fromkeys(shapes)
            if (length := conversation.shape_length(s, p.units)) is not None
        ]
        if not shapes:
            reference = conversation.reference_conversation(p.units, run.case_id)
            conversations = [replace(reference, **turns)]
        elif not conversations:
            pytest.skip(
                f"shapes {list(shapes)} need a hit unit below the block; this "
                f"server has hit unit {p.units.hit}, block {p.units.block}"
            )
        for _ in conversation.play_waves(p, conversations, case.turns):
            # The known bug's evidence confirms the case (an XPASS plays every turn).
            if evidence_shown(case.entry, [x for t in case.turns for x in t.problems]):
                case.add(
                    notice=f"stopped after {case.turns[-1].name}: the known "
                    f"failure's evidence showed ({case.entry.expects})"
                )
                break
        conversation.finish_turns(p, case.turns)
    assert case.record is not None
    return case.record


def run_resend(
    run: WorkloadRun,
    prompt_len: int | Callable[[Units], int],
    failure: Callable[[str], str] | None = None,
    resend_problems: Callable[[Turn, conversation.Play], list[str]] | None = None,
) -> CaseRecord:
    """Send one prompt cold, resend it, recompute it under a fresh salt: the resend
    hits at least its own checkpoint (:func:`expected_resend`). ``prompt_len`` may
    depend on the servers' units; ``failure`` names a property."""
    __tracebackhide__ = True
    with run.session() as case, case.serve(run) as play:
        if callable(prompt_len):
            prompt_len = prompt_len(play.units)
        rng, tokens = random.Random(run.case_id), run.binding.token_ids
        prompt = conversation.random_tokens(rng, tokens, prompt_len)
        salt = conversation.fresh_salt("resend")
        cold = Turn("", 0, prompt_len, 0, 0, prompt=prompt, salt=salt)
        case.add(cold)
        cold.output, found = send_checked(play.servers, run.binding.model, prompt, salt)
        cold.take(Found(tuple(found)))
        if cold.output.cached_tokens != 0:
            hit = f"cold request: cached {cold.output.cached_tokens}, expected 0"
            cold.take(Found((hit,)))
        planned = rules.PlannedTurn(1, prompt_len, prompt_len, True)
        resend = conversation.planned_turn(play, "", planned)
        case.add(resend)
        conversation.play_turn(play, resend, prompt, salt)
        conversation.finish_turns(play, case.turns)
        if resend_problems is not None:
            resend.take(Found(tuple(resend_problems(resend, play))))
        if failure is not None and any(turn.problems for turn in case.turns):
            case.add(problem=failure(f"a {prompt_len}-token prompt"))
    assert case.record is not None
    return case.record

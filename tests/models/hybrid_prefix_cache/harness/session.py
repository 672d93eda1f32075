# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A case in progress (:class:`CaseSession`); :func:`case_session` judges it by its
known failures, writes its record, and only then raises the outcome."""

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

from tests.models.hybrid_prefix_cache.harness import client, clock, records, window
from tests.models.hybrid_prefix_cache.harness.compare import Turn
from tests.models.hybrid_prefix_cache.harness.conversation import Play
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Known,
    Units,
    select_known,
)
from tests.models.hybrid_prefix_cache.harness.known import judge_failure, judge_pass
from tests.models.hybrid_prefix_cache.harness.paths import PathNoise
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.servers import report_folder
from tests.models.hybrid_prefix_cache.harness.window import Window

if TYPE_CHECKING:  # a later module, which runs its cases in sessions
    from tests.models.hybrid_prefix_cache.harness.cases import WorkloadRun


@dataclass(repr=False)
class CaseSession(records.CaseProblems):
    """A running case, sole writer of its state until :func:`case_session` ends it."""

    case_id: str
    test: str = ""
    known: tuple[Known, ...] = ()
    units: Units | None = None
    turns: list[Turn] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    startup_seconds: list[float] = field(default_factory=list)
    reused: bool | None = None  # None: no servers (their start failed)
    phases: clock.PhaseClock = field(default_factory=clock.PhaseClock)
    play: Play | None = None
    window: Window | None = None
    record: CaseRecord | None = None

    def __repr__(self) -> str:
        return f"CaseSession({self.case_id!r}, {len(self.turns)} turns)"

    def add(
        self, turn: Turn | None = None, problem: str = "", notice: str = ""
    ) -> None:
        """A turn as it starts (a crash leaves it recorded), a problem, a notice."""
        assert self.record is None, f"{self.case_id} has ended"
        if turn is not None:
            self.turns.append(turn)
        if problem:
            self.problems.append(problem)
        if notice:
            self.notices.append(notice)

    @contextlib.contextmanager
    def serve(
        self, run: "WorkloadRun", batched: bool = False, prefill_step: bool = False
    ) -> Iterator[Play]:
        """Open a counter window; an exception stops the servers (maybe what broke)."""
        __tracebackhide__ = True
        pool, binding, mode = run.suite.pool, run.binding, run.mode
        starts = pool.starts
        servers = pool.acquire(binding, run.deployment, mode)
        self.reused = pool.starts == starts
        if not self.reused:
            self.startup_seconds = [s.startup_seconds or 0.0 for s in servers]
        try:
            # Units of the instance that consults its cache: the prefiller under P/D.
            self.units = Units.from_cache_config(client.cache_config(servers[0]), mode)
            self.window = window.open_window(servers)
            served = (servers, binding, run.deployment, mode, self.units)
            self.play = Play(*served, binding.logprob_atol, batched, prefill_step)
            yield self.play
            self.metrics, problems = window.close_window(self.window, mode, self.turns)
            self.problems += problems
        except (Exception, KeyboardInterrupt):
            # Not on pytest's skip/xfail outcomes: those leave servers sound.
            pool.close()
            raise

    @property
    def noise(self) -> PathNoise | None:  # type: ignore[override]
        return None if self.play is None else self.play.noise

    @property
    def entry(self) -> Known | None:
        """The known failure that applies where its servers resolved."""
        return select_known(self.known, self.units)


def failure_text(case: CaseSession, error: BaseException | None) -> str:
    """What a case's failure says, searched for a known entry's evidence: the exception
    (with ServerError.log) or the problems, and every server's log (a crash's cause)."""
    if error is None:
        parts = [case.explain()]
    else:
        # A server that failed to start is in no play: only the error has its log.
        log = getattr(error, "log", "") if case.play is None else ""
        parts = [f"{type(error).__name__}: {error}{log}"]
    for server in case.play.servers if case.play is not None else ():
        path = getattr(server, "log_path", None)
        if path is not None and path.exists():
            parts.append(f"log of {path.name}:\n{path.read_text(errors='replace')}")
    return "\n".join(part for part in parts if part)


def failure_summary(case: CaseSession, error: BaseException | None) -> str:
    """A stale table's message: problems or error, then logs and record by path."""
    parts = [case.explain() if error is None else f"{type(error).__name__}: {error}"]
    holders = case.play.servers if case.play is not None else [error]
    logs = [str(p) for h in holders if (p := getattr(h, "log_path", None)) is not None]
    if logs:
        parts.append("server logs: " + ", ".join(logs))
    parts.append(f"record: {report_folder() / f'{case.case_id}.json'}")
    return "\n".join(parts)


@contextlib.contextmanager
def case_session(
    case_id: str, summary: list[CaseRecord] | None = None, known: Sequence[Known] = ()
) -> Iterator[CaseSession]:
    """Run a case, then freeze its record (``case.record``) with the verdict of the
    known failure that applies and write it. Then a listed case xfails, skips or fails
    (``harness.known``); an unlisted one raises, or its problems are the caller's."""
    __tracebackhide__ = True
    # pytest names the running test as "<node id> (<phase>)".
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    case = CaseSession(case_id, test=test, known=tuple(known))
    start = time.monotonic()
    token = clock.CLOCK.set(case.phases)
    error = None
    try:
        yield case
    except BaseException as e:
        error = e
    finally:
        clock.CLOCK.reset(token)
    # A case pytest skipped or xfailed itself, or an interrupt, is not judged.
    entry = case.entry if error is None or isinstance(error, Exception) else None
    if entry is None:
        judgment = None
    elif error is not None or not case.ok:
        text, shown = failure_text(case, error), failure_summary(case, error)
        judgment = judge_failure(case_id, entry, text, shown, case.failures())
    else:
        judgment = judge_pass(case_id, entry)
    if isinstance(error, pytest.skip.Exception):
        outcome = "skipped"
    elif isinstance(error, pytest.xfail.Exception):
        outcome = "xfail"
    elif error is not None:
        outcome = f"error: {type(error).__name__}"
    else:
        outcome = "pass" if case.ok else "FAIL"
    case.record = CaseRecord(
        case.case_id,
        test=case.test,
        units=case.units,
        turns=tuple(turn.played() for turn in case.turns),
        metrics=dict(case.metrics),
        problems=tuple(case.problems),
        notices=tuple(case.notices),
        startup_seconds=tuple(case.startup_seconds),
        reused=case.reused,
        seconds=time.monotonic() - start,
        phase_seconds=dict(case.phases.seconds),
        outcome=outcome,
        verdict="" if judgment is None else judgment.verdict,
        noise=case.noise,
        serve=records.serve_info(case.play),
    )
    records.report(case.record, summary)
    if judgment is not None:
        judgment.enact(error)
    if error is not None:
        raise error

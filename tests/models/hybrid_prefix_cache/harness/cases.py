# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cases: how one runs, on its servers (:func:`serve_case`), as a growing
conversation (:func:`run_case`) or a resend (:func:`run_resend`), and under
a known-failure entry (:func:`expect_known`)."""

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import pytest

from tests.models.hybrid_prefix_cache.harness.client import cache_config, send
from tests.models.hybrid_prefix_cache.harness.compare import Turn
from tests.models.hybrid_prefix_cache.harness.conversation import (
    Conversation,
    Play,
    finish_turns,
    fresh_salt,
    planned_turn,
    play_turn,
    random_tokens,
    reference_conversation,
    run_conversations,
    shape_length,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Known,
    Mode,
    Units,
    select_known,
    with_serve_env,
)
from tests.models.hybrid_prefix_cache.harness.known import judge_failure, judge_pass
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord, reported_case
from tests.models.hybrid_prefix_cache.harness.rules import (
    NUM_TURNS,
    PlannedTurn,
)
from tests.models.hybrid_prefix_cache.harness.servers import ServerPool
from tests.models.hybrid_prefix_cache.harness.window import close_window, open_window


@dataclass
class Suite:
    """What a session's cases share (owned by the ``hybrid_suite`` fixture or a
    benchmark): the pool of reused servers and every case's record."""

    pool: ServerPool = field(default_factory=ServerPool)
    records: list[CaseRecord] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"Suite({len(self.records)} case records, {self.pool.starts} server starts)"
        )

    def close(self) -> None:
        self.pool.close()


@dataclass
class KnownRun:
    """What :func:`expect_known` needs of the case it wraps: its record,
    which holds the geometry its servers reported and its problems."""

    record: CaseRecord | None = None


def failure_text(record: CaseRecord | None, error: BaseException | None) -> str:
    """Everything a case's failure says, searched for a known entry's evidence: the
    exception (with ServerError.log) or the record's problems, and every server's
    log, where a crash that surfaced elsewhere (a refused request) left its cause."""
    parts = [record.explain() if error is None and record else ""]
    play = record.play if record is not None else None
    if error is not None:
        # A server that failed to start is in no play: only the error has its log.
        log = getattr(error, "log", "") if play is None else ""
        parts.append(f"{type(error).__name__}: {error}{log}")
    for server in play.servers if play is not None else ():
        path = getattr(server, "log_path", None)
        if path is not None and path.exists():
            parts.append(f"log of {path.name}:\n{path.read_text(errors='replace')}")
    return "\n".join(part for part in parts if part)


@contextlib.contextmanager
def expect_known(
    case_id: str, known: Known | Sequence[Known] | None
) -> Iterator[KnownRun]:
    """Run a case under the known-failure entry that applies to it, if any.

    The body sets ``run.record``. A listed case must fail (exception or record
    problems) with the entry's evidence in :func:`failure_text`, else the table is
    stale; passing is a strict XPASS. An unlisted case's exception propagates, and
    its record is the caller's to assert. A geometry entry applies where reported.
    """
    __tracebackhide__ = True
    entries = () if known is None else (known,) if isinstance(known, Known) else known
    run = KnownRun()
    try:
        yield run
    except Exception as e:
        entry = select_known(entries, run.record.units if run.record else None)
        if entry is None:
            raise
        try:
            judge_failure(case_id, entry, failure_text(run.record, e), run.record)
        except AssertionError as stale:
            raise stale from e
    record = run.record
    entry = select_known(entries, record.units if record else None)
    if entry is None:
        return
    if record is not None and not record.ok:
        judge_failure(case_id, entry, failure_text(record, None), record)
    judge_pass(case_id, entry, record)


@contextlib.contextmanager
def serve_case(
    record: CaseRecord,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    pool: ServerPool,
) -> Iterator[Play]:
    """Get the case's servers from ``pool`` (started, or reused), record their
    geometry, and reconcile their counters at the end. A case that ends in an
    exception stops its servers: they may be what broke."""
    __tracebackhide__ = True
    starts = pool.starts
    servers = pool.acquire(binding, deployment, mode)
    record.reused = pool.starts == starts
    if not record.reused:
        record.startup_seconds = [s.startup_seconds or 0.0 for s in servers]
    try:
        # The hit unit is the one of the instance that consults its prefix
        # cache: the prefiller under P/D.
        record.units = Units.from_cache_config(cache_config(servers[0]), mode)
        window = open_window(servers)
        record.play = Play(
            servers, binding, deployment, mode, record.units, binding.logprob_atol
        )
        yield record.play
        record.metrics, problems = close_window(window, mode, record.turns)
        record.problems += problems
    except (Exception, KeyboardInterrupt):
        # Not on pytest's skip/xfail outcomes: those leave servers sound.
        pool.close()
        raise


def _conversations(
    case_id: str, play: Play, shapes: Sequence[str], num_turns: int, resend: bool
) -> list[Conversation]:
    """The reference conversation, or one per sweep shape that exists where
    the case's servers resolve (skip if none does), of ``num_turns``
    growing turns each and (``resend``) a resend."""
    if not shapes:
        reference = reference_conversation(play.units, case_id)
        return [replace(reference, num_turns=num_turns, resend=resend)]
    lengths = {shape: shape_length(shape, play.units) for shape in shapes}
    conversations = [
        Conversation(shape, length, f"{case_id}-{shape}", num_turns, resend)
        for shape, length in lengths.items()
        if length is not None
    ]
    if not conversations:
        pytest.skip(
            f"shapes {list(shapes)} need a hit unit below the block; this "
            f"server has hit unit {play.units.hit}, block {play.units.block}"
        )
    return conversations


def run_case(
    suite: Suite,
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    *,
    shapes: Sequence[str] = (),
    concurrent: bool = False,
    known: Sequence[Known] = (),
    num_turns: int = NUM_TURNS,
    resend: bool = True,
) -> CaseRecord:
    """Serve ``deployment`` in ``mode`` on ``suite``'s servers and check its
    conversations: the reference one or one per sweep shape, one after another or
    (``concurrent``, under ``batch_invariant_env``) at once, each of ``num_turns``
    turns and (``resend``) a resend. Returns the record for the test to assert on;
    a case in ``known`` xfails, skips or fails here (:func:`expect_known`).
    """
    __tracebackhide__ = True
    if concurrent and binding.batch_invariant_env is not None:
        deployment = with_serve_env(deployment, binding.batch_invariant_env)
    with (
        expect_known(case_id, known) as run,
        reported_case(case_id, suite.records) as record,
    ):
        # Set before the servers start: a refusal at start is judged on it.
        run.record = record
        with serve_case(record, binding, deployment, mode, suite.pool) as play:
            conversations = _conversations(case_id, play, shapes, num_turns, resend)
            play.batched = concurrent
            play.stop = evidence_seen(select_known(known, record.units), record)
            run_conversations(play, conversations, record.turns)
    return record


def evidence_seen(
    entry: Known | None, record: CaseRecord
) -> Callable[[Sequence[Turn]], bool] | None:
    """Where a known bug's evidence is a turn's problem (``in_record``), when the
    turns so far show it: the case is confirmed and later turns change nothing
    (an XPASS still plays them all). Says so in the record's notices."""
    if entry is None or entry.kind != "xfail" or not entry.in_record:
        return None

    def seen(turns: Sequence[Turn]) -> bool:
        if not any(entry.evidence in p for turn in turns for p in turn.problems):
            return False
        record.notices.append(
            f"stopped after {turns[-1].name}: the known failure's evidence "
            f"showed ({entry.evidence!r})"
        )
        return True

    return seen


def run_resend(
    suite: Suite,
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    prompt_len: int | Callable[[Units], int],
    failure: Callable[[str], str] | None = None,
    resend_problems: Callable[[Turn, Play], list[str]] | None = None,
) -> CaseRecord:
    """Send one prompt cold, resend it, and recompute it under a fresh salt. The
    resend hits at least the prompt's own checkpoint (:func:`expected_resend`)
    and, where given, passes ``resend_problems``; ``prompt_len`` may be a
    function of the servers' units, and ``failure`` names a property."""
    __tracebackhide__ = True
    with (
        reported_case(case_id, suite.records) as record,
        serve_case(record, binding, deployment, mode, suite.pool) as play,
    ):
        if callable(prompt_len):
            prompt_len = prompt_len(play.units)
        prompt = random_tokens(random.Random(case_id), binding.token_ids, prompt_len)
        salt = fresh_salt("resend")
        cold = Turn("", 0, prompt_len, 0, 0, prompt=prompt, salt=salt)
        record.turns.append(cold)
        cold.output = send(play.servers, binding.model, prompt, salt, cold.problems)
        if cold.output.cached_tokens != 0:
            cold.problems.append(
                f"cold request: cached {cold.output.cached_tokens}, expected 0"
            )
        resend = planned_turn(play, "", PlannedTurn(1, prompt_len, prompt_len, True))
        record.turns.append(resend)
        play_turn(play, resend, prompt, salt)
        finish_turns(play, record.turns)
        if resend_problems is not None:
            resend.problems += resend_problems(resend, play)
        if failure is not None and any(turn.problems for turn in record.turns):
            record.problems.append(failure(f"a {prompt_len}-token prompt"))
    return record

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cases: how one runs, on its servers (:func:`serve_case`), as a growing
conversation (:func:`run_case`) or a resend (:func:`run_resend`), and under
a known-failure entry (:func:`expect_known`)."""

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import pytest

from tests.models.hybrid_prefix_cache.harness.client import (
    PREFILL_KV_TRANSFER_PARAMS,
    cache_config,
    close_window,
    complete,
    give_up,
    open_window,
    poll_counters,
    read_counters,
    send,
)
from tests.models.hybrid_prefix_cache.harness.compare import Turn
from tests.models.hybrid_prefix_cache.harness.conversation import (
    Conversation,
    Play,
    finish_turns,
    fresh_salt,
    grown_prompt,
    planned_turn,
    play_turn,
    random_tokens,
    recompute_turn,
    reference_conversation,
    run_conversations,
    send_turn,
    shape_length,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Known,
    Mode,
    Units,
    select_known,
    with_serve_args,
    with_serve_env,
)
from tests.models.hybrid_prefix_cache.harness.reconcile import (
    FIRST_TOKENS,
    PREFIX_QUERIES,
    REQUESTS_DONE,
    aborted_entry,
    counter_deltas,
    decoder_resend_hit,
)
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord, reported_case
from tests.models.hybrid_prefix_cache.harness.rules import (
    NUM_TURNS,
    PD_PREFILL_BACKOFF,
    PlannedTurn,
)
from tests.models.hybrid_prefix_cache.harness.servers import ServerPool
from tests.models.hybrid_prefix_cache.harness.workloads import (
    ABORT_AFTER_FRACTION,
    ABORT_ATTEMPTS,
    NUM_SIBLINGS,
    WORKLOADS,
    EvictionPlan,
    abort_checkpoint,
    abort_landing,
    abort_retry_length,
    branch_checkpoint,
    branch_lengths,
    budget_problems,
    eviction_filler,
    eviction_problems,
    junction_checkpoint,
    served_budget,
    shared_prefix_length,
    sibling_tail_length,
    small_budget_args,
)

# What the session's summary calls a case that failed as its table says.
KNOWN_VERDICTS = {"xfail": "known xfail", "unsupported": "known refusal"}


@dataclass
class Suite:
    """What a session's cases share, owned by the plugin's session fixture
    ``hybrid_suite`` (or by a benchmark): the pool of reused servers, and
    the record of every case, for the summary."""

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
    """Everything a failure of a case says: the exception (with the log of
    the server it names, ServerError.log) or the record's problems, and the
    log of every server of the case, where a crash that surfaced elsewhere
    (a refused request, a metrics read from a dead server) left its cause.
    A known failure's evidence is looked for in all of it."""
    parts = [record.explain() if error is None and record else ""]
    play = record.play if record is not None else None
    if error is not None:
        # A server that failed to start is in no play yet: only the error
        # carries its log. Once there is a play, its servers' logs below hold
        # the failing one's.
        log = getattr(error, "log", "") if play is None else ""
        parts.append(f"{type(error).__name__}: {error}{log}")
    for server in play.servers if play is not None else ():
        path = getattr(server, "log_path", None)
        if path is not None and path.exists():
            parts.append(f"log of {path.name}:\n{path.read_text(errors='replace')}")
    return "\n".join(part for part in parts if part)


def _known_failure(
    case_id: str, entry: Known, record: CaseRecord | None, text: str
) -> None:
    """Judge a failure of a listed case: its text must show the entry's
    evidence (then xfail, or skip for a refusal); else the table is stale.
    Not hidden from tracebacks: pytest reports a skip or xfail where it was
    raised, so here rather than in contextlib."""
    if entry.evidence not in text:
        if record is not None:
            record.verdict = "FAIL: stale table"
        raise AssertionError(
            f"{case_id} is listed as {entry.kind} ({entry.reason}) and "
            f"failed, but without {entry.evidence!r}: update the table.\n{text}"
        )
    if record is not None:
        record.verdict = KNOWN_VERDICTS[entry.kind]
    if entry.kind == "unsupported":
        pytest.skip(f"{entry.reason} (confirmed: {entry.evidence!r})")
    pytest.xfail(f"{entry.reason} (seen: {entry.evidence!r})")


@contextlib.contextmanager
def expect_known(
    case_id: str, known: Known | Sequence[Known] | None
) -> Iterator[KnownRun]:
    """Run a case under the known-failure entry that applies to it, if any.

    The body sets ``run.record``. A listed case must fail, by an exception
    or by its record's problems, and the failure (message, problems, or the
    failing server's log) must contain the entry's evidence; otherwise the
    table is stale and the case fails. A listed case that passes fails as a
    strict XPASS. An unlisted case is left to the caller: its exception
    propagates, and its record, ok or not, is the caller's to assert. An
    entry with a geometry applies only where the case's servers reported it.
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
            _known_failure(case_id, entry, run.record, failure_text(run.record, e))
        except AssertionError as stale:
            raise stale from e
    record = run.record
    entry = select_known(entries, record.units if record else None)
    if entry is None:
        return
    if record is not None and not record.ok:
        _known_failure(case_id, entry, record, failure_text(record, None))
    if record is not None:
        record.verdict = "FAIL: XPASS"
    pytest.fail(
        f"[XPASS(strict)] {case_id} is listed as {entry.kind} "
        f"({entry.reason}) but passed: remove it from the table",
        pytrace=False,
    )


@contextlib.contextmanager
def serve_case(
    record: CaseRecord,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    pool: ServerPool,
) -> Iterator[Play]:
    """Get the case's servers from ``pool`` (started, or reused), record
    their checkpoint geometry, and reconcile their counters at the end. A
    case that ends in an exception, rather than in recorded problems, stops
    its servers: they may be what broke."""
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
    conversations: the reference one, or one per sweep shape in ``shapes``,
    played one after another or (``concurrent``) all at once, each of
    ``num_turns`` growing turns and (``resend``) a resend. A concurrent
    case is served with the binding's ``batch_invariant_env``, if it has one
    (servers of its own).

    Returns the case's record, whose problems the test asserts on
    (``assert record.ok, record.explain()``); a case listed in ``known``
    xfails, skips or fails here instead (:func:`expect_known`). The turn
    table is printed whether the case passes or fails.
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
    """Where a known bug's evidence is a turn's problem (``in_record``),
    when the turns played so far show it: the case is confirmed, and its
    later turns would change nothing of its verdict (a strict XPASS still
    needs every turn played, and plays them, since the evidence never
    shows). Says so in the record's notices."""
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
    workload: str | None = None,
) -> CaseRecord:
    """Send one prompt cold, resend it, and recompute it under a fresh salt,
    on ``suite``'s servers; return the record for the test to assert on.
    ``prompt_len`` may be a function of the units the servers report; a
    failure names the property of ``workload``, if given.

    The cold request and the recompute hit nothing; the resend hits at least
    the prompt's own checkpoint (:func:`expected_resend`, on the instance that
    consults its cache).
    """
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
        if workload == "pd-resend":
            resend.problems += decoder_resend_problems(
                resend, play.units, mode, deployment
            )
        if workload is not None and any(turn.problems for turn in record.turns):
            record.problems.append(
                f"{workload}: {WORKLOADS[workload].holds} (a {prompt_len}-token prompt)"
            )
    return record


def run_siblings(
    suite: Suite,
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
) -> CaseRecord:
    """NUM_SIBLINGS requests of one salt that share a system prompt ending
    inside a block and then diverge, each played as a turn (hit, then its
    recompute under a fresh salt), on ``suite``'s servers. From the third
    on, each must hit the junction's checkpoint (harness.junction_checkpoint:
    the second found the junction and cached the state there), and every one
    must match its recompute as any turn does; a failure names the
    workload's property."""
    __tracebackhide__ = True
    with (
        reported_case(case_id, suite.records) as record,
        serve_case(record, binding, deployment, mode, suite.pool) as play,
    ):
        rng = random.Random(case_id)
        tokens = binding.token_ids
        shared = random_tokens(rng, tokens, shared_prefix_length(play.units))
        junction = junction_checkpoint(len(shared), play.units, mode.drops_unit)
        salt = fresh_salt("siblings")
        for index in range(NUM_SIBLINGS):
            tail = random_tokens(rng, tokens, sibling_tail_length(play.units))
            prompt = shared + tail
            planned = PlannedTurn(index, len(prompt), len(shared))
            turn = planned_turn(play, "sibling", planned)
            # The first two need not hit; the bound stays the shared prefix.
            turn.expected = junction if index >= 2 else 0
            record.turns.append(turn)
            play_turn(play, turn, prompt, salt)
        finish_turns(play, record.turns)
        if any(turn.problems for turn in record.turns):
            record.problems.append(
                f"shared-prefix: {WORKLOADS['shared-prefix'].holds} (the junction "
                f"checkpoint of the shared {len(shared)}-token prefix is {junction})"
            )
    return record


def run_abort_retry(
    suite: Suite,
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    budget: int,
) -> CaseRecord:
    """A client gives up on a cold request mid-prefill and retries it, on
    ``suite``'s servers, whose caching instance (the prefiller under P/D)
    schedules ``budget`` tokens a step: the checkpoint of the prompt that
    instance sees ends its first chunk and the tail takes a second
    (:func:`abort_retry_length`, plus the P/D backoff it does not see). Two
    cold requests of it through the deployment first measure how long a
    request takes there (the faster: the first may warm the servers up);
    the client then gives up on the same prompt under a fresh salt on the
    caching instance (under P/D, its prefill leg) after ABORT_AFTER_FRACTION
    of that (:func:`give_up`: vLLM aborts it), and retries it at once under
    that salt through the deployment, played as a turn: the retry (under
    P/D, with its cold twin through the same pair), then its recompute
    under a fresh salt on the decoder alone. The caching instance's counters
    say where the abort landed (:func:`abort_landing`); where it was not
    mid-prefill, the next of ABORT_ATTEMPTS tries gives up earlier or later.

    Each retry must hit what the aborted steps wrote
    (:func:`abort_checkpoint`) and match its recompute as any turn does; a
    failure names the workload's property."""
    __tracebackhide__ = True
    with (
        reported_case(case_id, suite.records) as record,
        serve_case(record, binding, deployment, mode, suite.pool) as play,
    ):
        servers, model = play.servers, binding.model
        caching, pd = servers[0], len(servers) > 1
        seen = abort_retry_length(play.units, budget)
        length = seen + deployment.cache_backoff
        prompt = random_tokens(random.Random(case_id), binding.token_ids, length)
        clocks = [
            Turn("clock", index, length, 0, 0, prompt=prompt, salt=fresh_salt("clock"))
            for index in range(2)
        ]
        for clock in clocks:
            record.turns.append(clock)
            start = time.monotonic()
            clock.output = send(servers, model, prompt, clock.salt)
            clock.seconds = time.monotonic() - start
        took = min(clock.seconds for clock in clocks)
        after = ABORT_AFTER_FRACTION * took
        # Under P/D, the client gives up on the prefill leg.
        leg = {"max_tokens": 1, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
        for attempt in range(ABORT_ATTEMPTS):
            before = read_counters(caching)
            salt = fresh_salt("abort")
            answered = give_up(
                caching, model, prompt, salt, after, **(leg if pd else {})
            )
            if answered is not None:
                if pd:
                    # The prefill leg was answered: its decode leg follows,
                    # so the request went through the deployment.
                    answered = complete(
                        servers[-1],
                        model,
                        prompt,
                        salt,
                        kv_transfer_params=answered.kv_transfer_params,
                    )
                # Answered before the client gave up: a cold request.
                record.turns.append(
                    Turn("answered", attempt, length, 0, 0, output=answered)
                )
            retry = planned_turn(play, "retry", PlannedTurn(attempt, length, length))
            record.turns.append(retry)
            send_turn(play, retry, prompt, salt)
            # Counted once the stats of the retry (and its twin) are
            # exported, with the aborted request's before them.
            sent = 1 + (retry.twin is not None)
            done = (before[REQUESTS_DONE] or 0.0) + sent + (answered is not None)
            now = poll_counters(caching, REQUESTS_DONE, lambda v, d=done: v >= d)
            moved = counter_deltas(now, before)
            landed = "answered"
            if answered is None:
                queried, first_tokens = moved[PREFIX_QUERIES], moved[FIRST_TOKENS]
                landed = abort_landing(
                    queried or 0.0, first_tokens or 0.0, seen, answered=sent
                )
                if landed != "before admission":
                    caching.record(aborted_entry(seen))
            retry.expected = abort_checkpoint(landed, seen, play.units, mode.drops_unit)
            recompute_turn(play, retry)
            record.notices.append(
                f"attempt {attempt}: the client gave up after {after * 1e3:.0f} ms "
                f"(a cold request took {took * 1e3:.0f} ms): {landed}; the retry "
                f"cached {retry.restored}"
            )
            if landed == "mid-prefill":
                break
            after = after * 2 if landed == "before admission" else after / 2
        else:
            record.problems.append(
                f"abort-retry: no abort of the {seen}-token prompt landed "
                f"mid-prefill in {ABORT_ATTEMPTS} attempts (the notices say "
                f"where each did)"
            )
        finish_turns(play, record.turns)
        if not record.ok:
            record.problems.append(
                f"abort-retry: {WORKLOADS['abort-retry'].holds} (a "
                f"{length}-token prompt, its first chunk of {budget} tokens a "
                f"step ending on its checkpoint)"
            )
    return record


def run_small_budget(
    suite: Suite,
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    default_id: str,
) -> CaseRecord:
    """The reference conversation of the cell whose reference case is
    ``default_id``, played on servers of its own that schedule at most
    :func:`served_budget` tokens a step and retain the states their chunks
    write a block apart (:func:`small_budget_args`, of the units the cell's
    servers reported), and held turn by turn to that case's record (the same
    prompts, under the default budget): the same hits, and outputs exactly
    where chunk ends do not change the arithmetic
    (Binding.chunk_invariant), else within the noise of the two budgets'
    cold recomputes (:func:`budget_problems`).
    Then a branch off its first prompt must resume at the block boundary
    that the small budget's chunks wrote (:func:`branch_checkpoint`). Each
    turn is also checked as any turn is, against its recompute on its own
    servers. The default case is this session's record of it, or is
    played here first; a failure names the workload's property."""
    __tracebackhide__ = True
    default = next(
        (r for r in reversed(suite.records) if r.case_id == default_id and r.turns),
        None,
    )
    if default is None:
        default = run_case(suite, default_id, binding, deployment, mode)
    assert default.units is not None
    budget = served_budget(default.units)
    served = with_serve_args(deployment, small_budget_args(default.units))
    with (
        reported_case(case_id, suite.records) as record,
        serve_case(record, binding, served, mode, suite.pool) as play,
    ):
        if not default.ok:
            record.problems.append(
                f"the default budget's case {default_id} failed, so nothing here "
                f"compares with it: {default.failures()[0]}"
            )
        if play.units != default.units:
            record.problems.append(
                f"a budget of {budget} resolves {play.units}, the default "
                f"{default.units}"
            )
        # The default case's seed: the same prompts, as long as each turn's
        # output is the same.
        conversation = reference_conversation(play.units, default_id)
        run_conversations(play, [conversation], record.turns)
        noise = budget_problems(
            record.turns,
            default.turns,
            budget,
            binding.logprob_atol,
            binding.chunk_invariant,
        )
        play.noise = play.noise or noise
        # A branch off the first prompt, under its salt: it resumes at a
        # block boundary whose state only the small budget's chunks wrote.
        first = record.turns[0]
        shared, length = branch_lengths(play.units)
        rng = random.Random(f"{case_id}-branch")
        prompt = first.prompt[:shared]
        prompt += random_tokens(rng, binding.token_ids, length - shared)
        branch = planned_turn(play, "branch", PlannedTurn(0, length, shared))
        branch.expected = branch_checkpoint(shared, play.units, mode.drops_unit)
        record.turns.append(branch)
        play_turn(play, branch, prompt, first.salt)
        if not record.ok:
            record.problems.append(
                f"small-budget: {WORKLOADS['small-budget'].holds} (a budget of "
                f"{budget} tokens a step against the default of {default_id})"
            )
    return record


def run_eviction(
    suite: Suite,
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    plan: EvictionPlan,
) -> CaseRecord:
    """A conversation under eviction pressure, on servers of its own whose
    pool ``plan`` sizes, as vLLM's scheduler replayed it in-process on the
    same engines (:class:`EvictionPlan`): the conversation's first prompt,
    ``plan.pressure`` cold requests under other salts, then its second turn,
    played as any turn under the first prompt's salt (the hit, then its
    controls: alone, its recompute on the same server; under P/D, its cold
    twin through the same pair and the decoder alone), every request through
    the deployment (under P/D each decode leg held to the decoder's rule).
    That turn must hit what vLLM's scheduler hit in the replay (under P/D,
    on the prefiller, whose lookup is the connector's), and never more than
    the least that every group still held there (its bound), and match the
    control on its own path bit for bit; the servers' counters are
    reconciled with what they reported, as in every case. The case fails
    where the replay's pressure never reached the conversation: it would
    test nothing. A failure names the workload's property."""
    __tracebackhide__ = True
    served = with_serve_args(deployment, plan.args)
    with (
        reported_case(case_id, suite.records) as record,
        serve_case(record, binding, served, mode, suite.pool) as play,
    ):
        if plan.held == plan.held_before:
            record.problems.append(
                f"eviction: the replay's {plan.pressure} pressure requests evicted "
                f"nothing of the conversation (each group held {list(plan.held)} "
                f"before and after them)"
            )
        # The lengths of the replay (scheduler.play_eviction); the tokens
        # are the case's own.
        rng, tokens = random.Random(case_id), binding.token_ids
        first_len = reference_conversation(play.units, case_id).first_len
        prompt = random_tokens(rng, tokens, first_len)
        salt = fresh_salt("eviction")
        first = Turn("first", 0, first_len, 0, 0, prompt=prompt, salt=salt)
        record.turns.append(first)
        # Under P/D, through the pair as every turn, each decode leg held to
        # the decoder's rule (client.send).
        first.output = send(play.servers, binding.model, prompt, salt, first.problems)
        grown = grown_prompt(rng, tokens, prompt, first.output.token_ids)
        filler = eviction_filler(play.units)
        for index in range(plan.pressure):
            other = random_tokens(rng, tokens, filler)
            pressure = Turn("pressure", index, filler, 0, 0, prompt=other)
            pressure.salt = fresh_salt("pressure")
            record.turns.append(pressure)
            pressure.output = send(
                play.servers, binding.model, other, pressure.salt, pressure.problems
            )
        turn = planned_turn(play, "evicted", PlannedTurn(1, len(grown), first_len))
        # What vLLM's scheduler hit on this pool after this pressure, and
        # the least that every group held then: the hit may not exceed it.
        turn.expected, turn.bound = plan.hit, min(plan.held)
        record.turns.append(turn)
        play_turn(play, turn, grown, salt)
        assert turn.output is not None
        hits = {
            "vLLM's scheduler, replayed": plan.hit,
            turn.name: turn.output.cached_tokens,
        }
        for who, hit in hits.items():
            turn.problems += [
                f"{who}: {why}" for why in eviction_problems(hit, plan.held)
            ]
        # Under P/D the decoder's pool is under the same pressure: its own
        # hit for the decode leg is what the replay's decoder hit.
        if plan.decoder_hit is not None and turn.output.decoder_hit != plan.decoder_hit:
            turn.problems.append(
                f"{turn.name}: the decoder's own cache hit {turn.output.decoder_hit} "
                f"for its decode leg, vLLM's scheduler replayed on its engine hit "
                f"{plan.decoder_hit}"
            )
        finish_turns(play, record.turns)
        decoder = (
            ""
            if plan.decoder_hit is None
            else f" (the decoder's own cache {plan.decoder_hit})"
        )
        record.notices.append(
            f"{plan.pressure} pressure requests of {filler} tokens; replayed "
            f"in-process, each group held {list(plan.held_before)} of the next "
            f"turn before them and {list(plan.held)} after, and vLLM's "
            f"scheduler hit {plan.hit}{decoder}"
        )
        if not record.ok:
            record.problems.append(
                f"eviction: {WORKLOADS['eviction'].holds} (a pool of "
                f"{' '.join(plan.args)}, {plan.pressure} pressure requests)"
            )
    return record


def run_workload(
    suite: Suite,
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    workload: str,
    known: Sequence[Known] = (),
    num_turns: int = NUM_TURNS,
    resend: bool = True,
    budget: int | None = None,
    eviction: EvictionPlan | None = None,
) -> CaseRecord:
    """A matrix's workload case on its cell's servers (Matrix.workloads):
    the siblings of a shared prefix (:func:`run_siblings`), an exact P/D
    resend (:func:`run_resend` of :func:`pd_resend_length`), an abort
    mid-prefill and its retry on servers that schedule ``budget`` tokens a
    step (:func:`run_abort_retry`), the cell's
    reference conversation under a small prefill budget, on servers of its
    own (:func:`run_small_budget`), a conversation under eviction pressure
    on servers whose pool ``eviction`` sizes (:func:`run_eviction`), or a
    conversation of ``num_turns`` growing turns and (``resend``) a resend
    from a first prompt that ends on a block (the sweep's "exact" shape,
    :func:`run_case`). A listed case xfails, skips or fails here as in
    :func:`run_case`."""
    __tracebackhide__ = True
    if workload == "aligned":
        return run_case(
            suite,
            case_id,
            binding,
            deployment,
            mode,
            shapes=("exact",),
            known=known,
            num_turns=num_turns,
            resend=resend,
        )
    with expect_known(case_id, known) as run:
        if workload == "shared-prefix":
            run.record = run_siblings(suite, case_id, binding, deployment, mode)
        elif workload == "small-budget":
            cell = case_id.removesuffix(f"-{workload}")
            run.record = run_small_budget(
                suite, case_id, binding, deployment, mode, cell
            )
        elif workload == "abort-retry":
            if budget is None:
                raise ValueError(f"{case_id}: abort-retry needs the servers' budget")
            run.record = run_abort_retry(
                suite, case_id, binding, deployment, mode, budget
            )
        elif workload == "eviction":
            if eviction is None:
                raise ValueError(f"{case_id}: eviction needs its plan")
            run.record = run_eviction(
                suite, case_id, binding, deployment, mode, eviction
            )
        elif workload == "pd-resend":
            run.record = run_resend(
                suite, case_id, binding, deployment, mode, pd_resend_length, workload
            )
        else:
            raise ValueError(f"{case_id}: no real-server play of workload {workload!r}")
    return run.record


def decoder_resend_problems(
    resend: Turn, units: Units, mode: Mode, deployment: Deployment
) -> list[str]:
    """A P/D resend's decoder hits in its own cache what the rule of its
    role says (:func:`decoder_resend_hit`): the last block end of what its
    decode of the same prompt loaded, within the resend's checkpoint, or
    nothing where it keeps no cache or its cache was reset."""
    assert resend.output is not None
    hit = resend.output.decoder_hit
    # The decoder serves the same model in the same mode: the units its
    # prefiller reported.
    expected = decoder_resend_hit(resend.prompt_len, units, mode, deployment)
    if hit == expected:
        return []
    if expected:
        why = (
            f"{expected}, what its decode of the same {resend.prompt_len}-token "
            f"prompt cached up to the resend's checkpoint"
        )
    elif deployment.offload:
        why = "0: its device cache was reset before the resend"
    else:
        why = "0: it keeps no prefix cache"
    return [f"resend: the decoder's own cache hit {hit} tokens, not {why}"]


def pd_resend_length(units: Units) -> int:
    """The prompt of a P/D resend: the prefiller sees it less the trailing
    tokens the decoder recomputes (PD_PREFILL_BACKOFF), and that part ends
    on a block, so that every block of it is cached there
    (nixl/base_scheduler.py _truncate_request_for_prefill; vLLM #53514)."""
    return shape_length("exact", units) + PD_PREFILL_BACKOFF

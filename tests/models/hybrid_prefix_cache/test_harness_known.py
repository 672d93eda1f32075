# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of known failures and case records: a session judged by evidence
and geometry, the CPU table's shared failures, a refusal at start, evidence
that stops a case, and how records explain and print. No server, any
platform."""

import json
from dataclasses import FrozenInstanceError, replace

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    CaseRecord,
    Deployment,
    Known,
    Mode,
    ServerPool,
    Suite,
    Units,
    WorkloadRun,
    finding,
    run_case,
)
from tests.models.hybrid_prefix_cache.harness.compare import (
    Sample,
    Turn,
    first_divergence,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    select_known,
)
from tests.models.hybrid_prefix_cache.harness.known import (
    STALE,
    evidence_shown,
    judge_confirmed_elsewhere,
    judge_failure,
)
from tests.models.hybrid_prefix_cache.harness.problems import Problem
from tests.models.hybrid_prefix_cache.harness.servers import (
    REPORT_DIR_ENV,
    ServerError,
)
from tests.models.hybrid_prefix_cache.harness.session import (
    CaseSession,
    case_session,
)


def _sample(tokens, logprobs):
    return Sample(
        token_ids=tokens,
        text="",
        token_logprobs=logprobs,
        top_logprobs=[{t: lp} for t, lp in zip(tokens, logprobs)],
        prompt_tokens=10,
        cached_tokens=0,
    )


def test_first_divergence():
    a = _sample([5, 6, 7], [-0.1, -0.2, -0.3])
    assert first_divergence(a, a) == ""
    b = _sample([5, 9, 7], [-0.1, -0.5, -0.3])
    message = first_divergence(a, b)
    assert "index 1" in message and "6:-0.2000" in message and "9:-0.5000" in message


@pytest.fixture(autouse=True)
def _reports(tmp_path, monkeypatch):
    """Every case session writes its record: here, into the test's folder."""
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))
    return tmp_path


def test_a_session_judges_its_known_failure():
    bug = Known("xfail", "a bug", evidence="kernel_x")
    with (
        pytest.raises(pytest.xfail.Exception, match="a bug"),
        case_session("c", known=(bug,)),
    ):
        raise AssertionError("... kernel_x failed ...")
    with (
        pytest.raises(AssertionError, match="without 'kernel_x'"),
        case_session("c", known=(bug,)),
    ):
        raise AssertionError("something else")
    with (
        pytest.raises(pytest.fail.Exception, match="XPASS"),
        case_session("c", known=(bug,)),
    ):
        pass
    refused = Known("unsupported", "not on CPU", evidence="no streams")
    with (
        pytest.raises(pytest.skip.Exception, match="not on CPU"),
        case_session("c", known=(refused,)),
    ):
        raise AssertionError("server log: no streams here")
    with case_session("c") as case:
        pass
    assert case.record is not None and case.record.verdict == ""
    with pytest.raises(ValueError):
        Known("maybe", "r", "e")
    with pytest.raises(ValueError, match="config time"):
        Known("xfail", "r", "e", at_config=True)


def _observe(case: CaseSession, problem: str | None, units: Units | None) -> None:
    """A case's servers resolve ``units``; it fails with ``problem``, if any."""
    case.units = units
    if problem is not None:
        case.problems.append(problem)


def _record(problem: str | None, units: Units | None) -> CaseRecord:
    """A case's record, failing with ``problem`` unless it is None."""
    return CaseRecord("c", units=units, problems=() if problem is None else (problem,))


def test_a_session_judges_by_geometry_before_it_writes(_reports):
    """An entry with a geometry holds only where the servers reported it; a
    listed case fails by its problems or by an exception. The verdict is in
    the record, and in its JSON, before the outcome is raised."""
    at256 = Known("xfail", "lost", evidence="cached 0 <", geometry=(256, 256))
    big, small = Units(block=256, hit=256), Units(block=128, hit=128)

    def written(case: CaseSession) -> str:
        assert case.record is not None
        data = json.loads((_reports / "c.json").read_text())
        assert data["verdict"] == case.record.verdict
        return case.record.verdict

    with (
        pytest.raises(pytest.xfail.Exception),
        case_session("c", known=(at256,)) as case,
    ):
        _observe(case, "turn 1: cached 0 < expected checkpoint 512", big)
    assert written(case) == "known xfail"
    with case_session("c", known=(at256,)) as case:
        # Not listed at this geometry: the record is the caller's to assert.
        _observe(case, "turn 1: cached 0 < expected checkpoint 256", small)
    assert written(case) == "" and case.record is not None and not case.record.ok
    with (
        pytest.raises(AssertionError, match="update the table"),
        case_session("c", known=(at256,)) as case,
    ):
        _observe(case, "turn 1: lost", big)
    assert written(case) == "FAIL: stale table"
    refused = Known("unsupported", "no", evidence="streams", geometry=(256, 256))
    with (
        pytest.raises(pytest.skip.Exception),
        case_session("c", known=(refused,)) as case,
    ):
        _observe(case, None, big)
        raise AssertionError("no streams")
    assert written(case) == "known refusal"
    with pytest.raises(AssertionError, match="no streams"), case_session("c"):
        raise AssertionError("no streams")
    with (
        pytest.raises(pytest.fail.Exception, match="XPASS"),
        case_session("c", known=(at256,)) as case,
    ):
        _observe(case, None, big)
    assert written(case) == "FAIL: XPASS"
    with case_session("c", known=(at256,)) as case:
        _observe(case, None, small)
    with pytest.raises(ValueError, match="several"):
        select_known((at256, at256), big)
    assert select_known((at256,), None) is None


def test_record_explains_its_problems():
    record = _record(None, Units(block=256, hit=64))
    assert record.ok
    turn = Turn("conv", 2, 900, 700, 512, bound=640)
    turn.problems.append("turn 2: cached 0 < expected checkpoint 512")
    record = replace(record, turns=(turn,))
    assert not record.ok
    text = record.explain()
    assert text.startswith("c: 1 problem(s)\nturn 2: cached 0 < expected")
    assert "== c: hit unit 64, block 256" in text and "FAIL" in text


@pytest.mark.parametrize("at_once", ["concurrent", "batched-restores"])
def test_cpu_concurrent_cases_play_the_shapes_that_pass_alone(at_once: str):
    """A case of shapes at once (concurrent, or its batched restores) plays the
    sweep shapes that pass on their own at the geometry its servers resolve
    to, and expects them all to pass."""
    from tests.models.hybrid_prefix_cache.cpu_known import MATRIX

    at256, at128 = Units(block=256, hit=256), Units(block=128, hit=128)
    block = f"plain-block-{at_once}"
    assert MATRIX.concurrent_shapes(block, at256) == ("plus1", "tail37")
    shapes = MATRIX.concurrent_shapes(block, at128)
    assert "exact" in shapes and "unit-minus1" not in shapes
    assert MATRIX.known_for(block) == ()
    partial = f"plain-partial-{at_once}"
    for units in (at256, at128, None):
        assert len(MATRIX.concurrent_shapes(partial, units)) == 7
    assert MATRIX.known_for(partial) == ()
    assert MATRIX.concurrent_shapes("plain-block", at256) == ()


def test_cpu_shared_failures_name_a_case_that_confirms_them():
    """A cell that skips because another confirms its failure names a case
    that runs on this machine, expects the same failure and confirms it
    itself; and each mechanism is confirmed somewhere."""
    from tests.models.hybrid_prefix_cache import cpu_binding as cpu
    from tests.models.hybrid_prefix_cache import cpu_known

    matrix = cpu_known.MATRIX
    runnable = {c for c in matrix.cases if cpu_known.core_shortage(c) is None}
    shared = {
        case_id: known
        for case_id in matrix.cases
        for known in matrix.known_for(case_id)
        if known.confirmed_by is not None
    }
    assert {k.confirmed_by for k in shared.values()} == {
        "plain-block-ngram",
        "offload-block",
        "dp2-ep-block",
        "plain-block-small-budget",
        "plain-partial-small-budget",
    }
    for case_id, known in shared.items():
        confirmer = known.confirmed_by
        assert confirmer in runnable, (case_id, confirmer)
        # The same mechanism, which each case shows its own way where it runs.
        same = [
            (k.kind, k.reason, k.geometry, k.releases)
            for k in matrix.known_for(confirmer)
        ]
        mine = (known.kind, known.reason, known.geometry, known.releases)
        assert mine in same, (case_id, confirmer)
    refused_at_config = [
        case_id
        for case_id in matrix.cases
        if any(k.at_config for k in matrix.known_for(case_id))
    ]
    assert sorted(refused_at_config) == sorted(
        f"{d}-{m}" for d in ("dcp2", "dcp2-offload") for m in cpu.MODES
    )


class _RefusingPool(ServerPool):
    """A pool whose servers refuse to start, as a server that exits during
    startup does (ServerError, with the whole log)."""

    def acquire(self, binding, deployment, mode):
        raise ServerError("the serve server exited with code 1", "log: no streams")


def test_a_refusal_at_start_is_judged_and_summarized(tmp_path, monkeypatch):
    """A case whose servers refuse to start is judged by its known entry
    (the evidence may be in the server's log) and lands in the suite's
    records with the summary's verdict; unlisted, the error propagates."""
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))
    suite = Suite(pool=_RefusingPool())
    binding = Binding(model="m", base_args=(), token_ids=(10, 20), env={})
    refused = Known("unsupported", "not on CPU", evidence="no streams")
    with pytest.raises(pytest.skip.Exception, match="not on CPU"):
        run_case(WorkloadRun(suite, "c", binding, Deployment(), Mode(), (refused,)))
    with pytest.raises(ServerError, match="exited with code 1"):
        run_case(WorkloadRun(suite, "d", binding, Deployment(), Mode()))
    outcomes = [(r.case_id, r.outcome, r.verdict) for r in suite.records]
    assert outcomes == [
        ("c", "error: ServerError", "known refusal"),
        ("d", "error: ServerError", ""),
    ]


def test_records_and_suites_print_in_one_line():
    """What pytest shows of a failed ``assert record.ok`` and of the
    fixture: one line each, not every sample of every turn."""
    turn = Turn("conv", 1, 900, 700, 512, bound=640, prompt=[5] * 900)
    record = replace(_record("turn 1: lost", Units(block=256, hit=256)), turns=(turn,))
    record = replace(record, outcome="FAIL")
    assert repr(record) == "CaseRecord('c': FAIL, 1 turns)"
    suite = Suite()
    suite.records.append(record)
    assert repr(suite) == "Suite(1 case records, 0 server starts)"


def test_a_known_bug_stops_its_case_once_its_evidence_shows():
    found = finding("lost-checkpoint", "exact turn 1", cached=0, expected=512)
    bug = Known("xfail", "a bug", found=found)
    lost = Problem(
        "exact turn 1: cached 0 < expected checkpoint 512",
        "lost-checkpoint",
        "exact turn 1",
        cached=0,
        expected=512,
        previous=768,
    )
    assert not evidence_shown(bug, ["turn 0: fine"])
    assert evidence_shown(bug, [lost])
    # The same words without the finding, or the finding at other numbers: not it.
    assert not evidence_shown(bug, [str(lost)])
    other = Problem(str(lost), lost.kind, lost.where, **{**lost.numbers, "cached": 256})
    assert not evidence_shown(bug, [other])
    # A crash, a refusal, no entry: every turn is played.
    crash = Known("xfail", "a crash", evidence="Traceback")
    assert not evidence_shown(crash, ["Traceback"])
    refusal = Known("unsupported", "refused", found=found)
    assert not evidence_shown(refusal, [lost])
    assert not evidence_shown(None, [lost])


def test_a_finding_is_matched_on_its_kind_and_numbers_not_its_words():
    """A known failure of the record names what a check finds; the check's
    sentence can change and the verdict stays, and numbers that are not the
    ones found make the table stale."""
    lost = Problem(
        "reworded: nothing hit where 512 was due",
        "lost-checkpoint",
        "exact turn 1",
        cached=0,
        expected=512,
        previous=768,
    )
    entry = Known(
        "xfail", "lost", found=finding("lost-checkpoint", "exact turn 1", cached=0)
    )
    assert (
        judge_failure("c", entry, str(lost), problems=[lost]).verdict == "known xfail"
    )
    wrong = replace(entry, found=finding("lost-checkpoint", "exact turn 1", cached=256))
    stale = judge_failure("c", wrong, str(lost), problems=[lost])
    assert stale.verdict == STALE
    assert "lost-checkpoint at exact turn 1 (cached 256)" in stale.message
    with pytest.raises(ValueError, match="numbers"):
        Problem("x", "lost-checkpoint", "turn 1", cached=0)
    with pytest.raises(ValueError, match="no check finds"):
        finding("lost-checkpoint", "turn 1", restored=0)
    with pytest.raises(ValueError, match="either"):
        Known("xfail", "both", evidence="x", found=entry.found)


def test_a_played_turn_is_final(tmp_path, monkeypatch):
    """The record keeps each turn as played: nothing adds a problem to it or
    changes it after the case ended; the live turn is not the record's."""
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))
    turn = Turn("conv", 1, 900, 700, 512, bound=640, prompt=[5] * 900)
    with case_session("c") as case:
        case.units = Units(block=256, hit=256)
        case.add(turn)
    assert case.record is not None
    (played,) = case.record.turns
    # The session that wrote the record takes nothing more.
    with pytest.raises(AssertionError, match="has ended"):
        case.add(problem="found after the verdict")
    with pytest.raises(AttributeError):
        played.problems.append("found after the verdict")
    with pytest.raises(FrozenInstanceError, match="its record is final"):
        played.expected = 0
    turn.problems.append("found after the verdict")
    assert case.record.ok and not played.problems


def test_a_shared_failure_is_taken_only_from_a_case_that_confirmed_it():
    """A case whose failure another confirms takes that verdict only where
    the other confirmed it in this session; where it did not run, or passed
    (at a geometry its entry does not hold for), the case runs itself."""
    shared = Known("xfail", "a bug", evidence="kernel_x", confirmed_by="first")
    refused = replace(shared, kind="unsupported")
    runs = [({}, shared), ({"first": ""}, shared)]
    runs += [
        ({"first": "FAIL: stale table"}, shared),
        ({"first": "known xfail"}, refused),
    ]
    for verdicts, entry in runs:
        # An outcome taken here would end this test as an xfail or a skip.
        try:
            judge_confirmed_elsewhere((entry,), verdicts)
        except (pytest.xfail.Exception, pytest.skip.Exception) as e:
            pytest.fail(f"{entry.kind} after {verdicts} took another's verdict: {e}")
    with pytest.raises(pytest.xfail.Exception, match="as in first"):
        judge_confirmed_elsewhere((shared,), {"first": "known xfail"})
    with pytest.raises(pytest.skip.Exception, match="as in first"):
        judge_confirmed_elsewhere((refused,), {"first": "known refusal"})

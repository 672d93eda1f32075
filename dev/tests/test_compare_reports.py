# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/compare_reports.py on synthetic case records (no server): which
turns it marks, the verdict of every case, and its exit status."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_reports import (  # noqa: E402
    case_verdict,
    compare,
    format_case,
    load_records,
    main,
    turn_changes,
)


def turn(
    index,
    cached,
    *,
    expected=None,
    bound=None,
    prompt_len=2350,
    tokens=(5, 6, 7),
    divergence="",
    diff=0.0,
    problems=(),
    conversation="",
):
    """One turn as CaseRecord.as_json writes it. Turn 0 expects nothing;
    later ones expect (and are bounded by) 1536 unless told."""
    if expected is None:
        expected = 0 if index == 0 else 1536
    if bound is None:
        bound = expected
    return {
        "conversation": conversation,
        "turn": index,
        "prompt_len": prompt_len,
        "prev_len": 0 if index == 0 else 1573,
        "expected": expected,
        "bound": bound,
        "cached": cached,
        "max_logprob_diff": None if divergence else diff,
        "divergence": divergence,
        "seconds": 1.0,
        "hit": {"token_ids": list(tokens), "cached_tokens": cached},
        "recompute": {"token_ids": list(tokens), "cached_tokens": 0},
        "problems": list(problems),
        "notices": [],
    }


def record(case_id, outcome, turns, atol=0.0, problems=()):
    return {
        "case_id": case_id,
        "outcome": outcome,
        "turns": turns,
        "problems": list(problems),
        "serve": {"logprob_atol": atol},
    }


GOOD = [turn(0, 0), turn(1, 1536), turn(2, 2304, expected=2304)]
LOST = [
    turn(0, 0),
    turn(1, 0, problems=["turn 1: cached 0 < expected checkpoint 1536"]),
    turn(2, 2304, expected=2304),
]


def test_same_when_nothing_changed():
    a, b = record("plain-block", "pass", GOOD), record("plain-block", "pass", GOOD)
    assert case_verdict(a, b) == ("same", "pass on both")
    table = format_case("plain-block", a, b)
    assert "*" not in table


def test_a_lost_checkpoint_that_b_keeps_is_fixed():
    a, b = record("c", "FAIL", LOST), record("c", "pass", GOOD)
    verdict, detail = case_verdict(a, b)
    assert verdict == "fixed"
    assert detail == "A FAIL, B pass; 1 turn changed"
    assert turn_changes(LOST[1], GOOD[1], 0.0, 0.0) == [
        "hit",
        "hit verdict",
        "turn verdict",
    ]
    marked = [line for line in format_case("c", a, b).splitlines() if "*" in line]
    assert len(marked) == 1 and "* hit, hit verdict, turn verdict" in marked[0]
    assert " LOW " in marked[0] and " FAIL " in marked[0]


def test_logprobs_beyond_the_tolerance_with_the_same_tokens_is_broken():
    off = [turn(0, 0), turn(1, 1536, diff=7.7e-3, problems=["logprobs"]), GOOD[2]]
    a, b = record("c", "pass", GOOD), record("c", "FAIL", off)
    assert case_verdict(a, b)[0] == "broken"
    assert turn_changes(GOOD[1], off[1], 0.0, 0.0) == ["logprobs", "turn verdict"]
    # Within a looser tolerance the same difference agrees.
    assert turn_changes(GOOD[1], off[1], 0.0, 1e-2) == ["turn verdict"]
    assert "0.0077 OFF" in format_case("c", a, b)


def test_token_agreement_and_output_changes_are_told_apart():
    diverged = turn(1, 1536, divergence="first diverging token at index 2")
    assert turn_changes(GOOD[1], diverged, 0.0, 0.0) == ["tokens", "logprobs"]
    other_output = turn(1, 1536, tokens=(9, 9, 9))
    assert turn_changes(GOOD[1], other_output, 0.0, 0.0) == ["output"]


def test_unknown_tolerance_marks_any_difference_but_does_not_judge_it():
    a = record("c", "pass", GOOD, atol=None)
    b = record("c", "pass", [GOOD[0], turn(1, 1536, diff=1e-5), GOOD[2]], atol=None)
    assert "~" in format_case("c", a, b).splitlines()[4]
    assert case_verdict(a, b) == ("same", "pass on both; 1 turn changed")


def test_both_failing():
    fewer = [turn(0, 0), GOOD[1], LOST[2]]
    still = record("c", "FAIL", LOST)
    # B fixes nothing and breaks nothing.
    assert case_verdict(still, record("c", "FAIL", LOST))[0] == "same"
    # B newly fails turn 2 although it fixes turn 1.
    worse = [turn(0, 0), GOOD[1], turn(2, 0, expected=2304, problems=["lost"])]
    verdict, detail = case_verdict(still, record("c", "FAIL", worse))
    assert verdict == "broken" and "B newly fails turn 2" in detail
    # B fails only case-level checks (counters), which A passed.
    counters = record("c", "FAIL", fewer, problems=["counter moved by 3"])
    assert case_verdict(record("c", "pass", GOOD), counters)[0] == "broken"
    verdict, detail = case_verdict(still, record("c", "error: ServerError", []))
    assert verdict == "same" and detail.startswith("fails on both")


def test_cases_one_side_lacks_or_skipped():
    a = record("c", "pass", GOOD)
    assert case_verdict(a, None) == ("only in A", "B has no record; A: pass")
    assert case_verdict(None, a)[0] == "only in B"
    skipped = record("c", "skipped", [])
    assert case_verdict(a, skipped) == ("only in A", "A pass, B skipped")
    assert case_verdict(skipped, skipped) == ("same", "skipped on both")


@pytest.mark.parametrize(
    "b_outcome, b_turns, status",
    [("pass", GOOD, 0), ("FAIL", LOST, 1)],
    ids=["fixed", "broken"],
)
def test_compare_text_and_status(b_outcome, b_turns, status):
    records_a = {
        "plain-block": record(
            "plain-block",
            "FAIL" if status == 0 else "pass",
            LOST if status == 0 else GOOD,
        ),
        "pd-block": record("pd-block", "pass", GOOD),
    }
    records_b = {
        "plain-block": record("plain-block", b_outcome, b_turns),
        "tp2-block": record("tp2-block", "pass", GOOD),
    }
    text, got = compare(records_a, records_b, "pinned", "mine")
    assert got == 1  # pd-block is only in A, either way
    verdicts = text.split("== verdicts")[1].splitlines()
    assert verdicts[0] == " (A: pinned; B: mine)"
    expected = "fixed" if status == 0 else "broken"
    assert verdicts[1].split()[:2] == ["plain-block", expected]
    assert verdicts[2].split()[:4] == ["pd-block", "only", "in", "A"]
    assert verdicts[3].split()[:4] == ["tp2-block", "only", "in", "B"]
    # Without the case B lacks, a fix exits 0 and a break 1.
    del records_a["pd-block"]
    assert compare(records_a, records_b)[1] == status


def test_main_reads_the_folders(tmp_path, capsys):
    for side, outcome, turns in (("A", "FAIL", LOST), ("B", "pass", GOOD)):
        folder = tmp_path / side
        (folder / "server-logs").mkdir(parents=True)
        (folder / "server-logs" / "serve-1.log").write_text("log")
        (folder / "plain-block.json").write_text(
            json.dumps(record("plain-block", outcome, turns))
        )
        (folder / "not-a-record.json").write_text("[1, 2]")
    assert list(load_records(tmp_path / "A")) == ["plain-block"]
    assert main([str(tmp_path / "A"), str(tmp_path / "B")]) == 0
    out = capsys.readouterr().out
    assert "plain-block  fixed      A FAIL, B pass; 1 turn changed" in out
    assert main([str(tmp_path / "A"), str(tmp_path / "none")]) == 1
    assert "no report folder" in capsys.readouterr().err

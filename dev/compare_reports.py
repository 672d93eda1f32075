# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Compare two runs of the hybrid prefix-cache suite, case by case.

    python dev/compare_reports.py [--label-a A] [--label-b B] REPORTS_A REPORTS_B

Each folder holds the JSON records the cases of one run wrote
(``HYBRID_PC_REPORT_DIR``; see ``CaseRecord.as_json`` in
tests/models/hybrid_prefix_cache/harness/records.py). For every case, the turn
tables of both runs are printed side by side, and a turn is marked where its
hit (``cached``), its hit verdict against the expected checkpoint and the
bound, its tokens (equal to the recompute's, or the output itself) or its
logprob agreement (the largest sampled-logprob difference from the recompute,
within the tolerance the record names) changed. A line per case ends it:

* ``same``: both pass, or both fail with no turn failing anew (nor new
  case-level problems);
* ``fixed``: A fails, B passes;
* ``broken``: A passes and B fails, or B fails a turn (or a case-level
  check) that A passed;
* ``only in A`` / ``only in B``: one run has no record of the case, or
  skipped it.

The exit status is 1 when a case is broken or only in A (B lost it), or
when neither folder holds a record; else 0.
Pure functions below; ``main`` reads the folders.
"""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

NOT_RUN = ("skipped", "xfail")


def load_records(folder: Path) -> dict[str, dict]:
    """The records in ``folder`` (``<case_id>.json``), by case id."""
    records = {}
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "case_id" in record:
            records[record["case_id"]] = record
    return records


def outcome_class(outcome: str) -> str:
    """The class of a case's outcome: pass, fail (FAIL or an error), or
    that of a case not run to a verdict (skipped, xfail)."""
    if outcome == "pass":
        return "pass"
    if outcome in NOT_RUN:
        return outcome
    return "fail"


def tolerance(record: dict) -> float | None:
    """The sampled-logprob tolerance the case ran with; None if unknown or
    none was measured."""
    return (record.get("serve") or {}).get("logprob_atol")


def turn_key(turn: dict) -> tuple[str, str]:
    return (turn.get("conversation") or "", str(turn.get("turn")))


def hit_verdict(turn: dict) -> str:
    """The hit against the expected checkpoint and the bound: ok, LOW
    (below the expected checkpoint), OVER (above the bound), or "-" (no
    hit)."""
    cached = turn.get("cached")
    if cached is None:
        return "-"
    if cached < turn["expected"]:
        return "LOW"
    if cached > turn["bound"]:
        return "OVER"
    return "ok"


def token_agreement(turn: dict) -> str:
    """The hit's tokens against the recompute's: same, DIFF, or "-"."""
    divergence = turn.get("divergence")
    if divergence is None:
        return "-"
    return "DIFF" if divergence else "same"


def logprob_agreement(turn: dict, atol: float | None) -> str:
    """The sampled logprobs against the recompute's: ok (within the
    tolerance, or exactly equal where none is known), OFF (beyond it), "~"
    (they differ, with no tolerance to judge by), or "-" (no pair)."""
    diff = turn.get("max_logprob_diff")
    if diff is None:
        return "-"
    if atol is None:
        return "ok" if diff == 0 else "~"
    return "ok" if diff <= atol else "OFF"


def hit_tokens(turn: dict) -> list | None:
    return (turn.get("hit") or {}).get("token_ids")


def turn_changes(a: dict, b: dict, atol_a: float | None, atol_b: float | None) -> list:
    """What changed from turn ``a`` to turn ``b``."""
    changes = []
    if (a["expected"], a["bound"]) != (b["expected"], b["bound"]):
        changes.append("expected/bound")
    if a.get("cached") != b.get("cached"):
        changes.append("hit")
    if hit_verdict(a) != hit_verdict(b):
        changes.append("hit verdict")
    if token_agreement(a) != token_agreement(b):
        changes.append("tokens")
    elif hit_tokens(a) != hit_tokens(b):
        changes.append("output")
    if logprob_agreement(a, atol_a) != logprob_agreement(b, atol_b):
        changes.append("logprobs")
    if bool(a.get("problems")) != bool(b.get("problems")):
        changes.append("turn verdict")
    return changes


def _turn_verdict(turn: dict | None) -> str:
    if turn is None:
        return "absent"
    return "FAIL" if turn.get("problems") else "notice" if turn.get("notices") else "ok"


def _diff(turn: dict) -> str:
    diff = turn.get("max_logprob_diff")
    return "-" if diff is None else "0" if diff == 0 else f"{diff:.3g}"


SIDE_HEADER = (
    f"{'cached':>6} {'hit':<4} {'tokens':<6} {'max|dlp|':>9} {'lp':<3} {'turn':<6}"
)


def _side(turn: dict | None, atol: float | None) -> str:
    if turn is None:
        return f"{'(no such turn)':<{len(SIDE_HEADER)}}"
    cached = turn.get("cached")
    return (
        f"{'-' if cached is None else cached:>6} {hit_verdict(turn):<4} "
        f"{token_agreement(turn):<6} {_diff(turn):>9} "
        f"{logprob_agreement(turn, atol):<3} {_turn_verdict(turn):<6}"
    )


def paired_turns(a: dict | None, b: dict | None) -> list:
    """(A's turn or None, B's turn or None) in A's order, then B's own."""
    turns_a = (a or {}).get("turns") or []
    turns_b = (b or {}).get("turns") or []
    by_key = {turn_key(t): t for t in turns_b}
    pairs = [(t, by_key.pop(turn_key(t), None)) for t in turns_a]
    keys_a = {turn_key(t) for t in turns_a}
    pairs += [(None, t) for t in turns_b if turn_key(t) not in keys_a]
    return pairs


def case_verdict(a: dict | None, b: dict | None) -> tuple[str, str]:
    """(verdict, detail) of one case, from A's and B's records."""
    if a is None or b is None:
        side, other = ("B", b) if a is None else ("A", a)
        missing = "A" if a is None else "B"
        return f"only in {side}", f"{missing} has no record; {side}: {other['outcome']}"
    ca, cb = outcome_class(a["outcome"]), outcome_class(b["outcome"])
    pairs = paired_turns(a, b)
    atol_a, atol_b = tolerance(a), tolerance(b)
    changed = sum(
        1
        for ta, tb in pairs
        if ta is None or tb is None or turn_changes(ta, tb, atol_a, atol_b)
    )
    note = f"; {changed} turn{'s' if changed != 1 else ''} changed" if changed else ""
    if ca in NOT_RUN or cb in NOT_RUN:
        if ca == cb:
            return "same", f"{ca} on both"
        side = "B" if ca in NOT_RUN else "A"
        return f"only in {side}", f"A {a['outcome']}, B {b['outcome']}"
    if ca == cb == "pass":
        return "same", f"pass on both{note}"
    if ca == "fail" and cb == "pass":
        return "fixed", f"A {a['outcome']}, B pass{note}"
    if ca == "pass":
        return "broken", f"A pass, B {b['outcome']}{note}"
    newly = [
        tb
        for ta, tb in pairs
        if tb is not None and tb.get("problems") and not (ta and ta.get("problems"))
    ]
    fixed = [
        ta
        for ta, tb in pairs
        if ta is not None and ta.get("problems") and not (tb and tb.get("problems"))
    ]
    if newly:
        names = ", ".join(_turn_name(t) for t in newly)
        return "broken", f"fails on both, and B newly fails {names}{note}"
    if b.get("problems") and not a.get("problems"):
        return "broken", f"fails on both, and B newly fails case-level checks{note}"
    detail = f"fails on both (A {a['outcome']}, B {b['outcome']})"
    if fixed:
        detail += f"; B fixes {', '.join(_turn_name(t) for t in fixed)}"
    return "same", detail + note


def _turn_name(turn: dict) -> str:
    what = "resend" if turn.get("turn") == "resend" else f"turn {turn.get('turn')}"
    return f"{turn.get('conversation') or ''} {what}".strip()


def format_case(case_id: str, a: dict | None, b: dict | None) -> str:
    """Both runs' turn tables of one case, side by side, changes marked."""
    atol_a = tolerance(a) if a else None
    atol_b = tolerance(b) if b else None

    def outcome(record: dict | None) -> str:
        return "no record" if record is None else record["outcome"]

    left = (
        f"{'conversation':<14} {'turn':>6} {'prompt':>6} {'expected':>8} {'bound':>5}"
    )
    width = len(SIDE_HEADER)
    lines = [
        f"== {case_id}: A {outcome(a)}, B {outcome(b)}",
        f"{'':<{len(left)}} | {'A':<{width}} | {'B':<{width}} |",
        f"{left} | {SIDE_HEADER} | {SIDE_HEADER} | changed",
    ]
    for ta, tb in paired_turns(a, b):
        ref = ta if ta is not None else tb
        if ta is not None and tb is not None:
            changes = turn_changes(ta, tb, atol_a, atol_b)
        else:
            changes = ["only in " + ("A" if tb is None else "B")]
        line = (
            f"{ref.get('conversation') or '-':<14} {ref.get('turn')!s:>6} "
            f"{ref['prompt_len']:>6} {ref['expected']:>8} {ref['bound']:>5} | "
            f"{_side(ta, atol_a)} | {_side(tb, atol_b)} |"
        )
        lines.append(line + (" * " + ", ".join(changes) if changes else ""))
    for side, record, other in (("A", a, b), ("B", b, a)):
        if record is None:
            continue
        seen = set((other or {}).get("problems") or [])
        lines += [
            f"{side}: case problem: {p}"
            for p in record.get("problems") or []
            if p not in seen
        ]
    return "\n".join(lines)


def compare(
    records_a: dict[str, dict],
    records_b: dict[str, dict],
    label_a: str = "A",
    label_b: str = "B",
) -> tuple[str, int]:
    """The comparison's text and exit status."""
    case_ids = list(records_a) + [c for c in records_b if c not in records_a]
    blocks = [
        f"A: {label_a}\nB: {label_b}\n"
        f"per side: cached, hit (ok / LOW: below the expected checkpoint / "
        f"OVER: above the bound), tokens (hit vs recompute), max|dlp| and lp "
        f"(ok / OFF: beyond the tolerance / ~: no tolerance), turn verdict"
    ]
    verdicts = []
    for case_id in case_ids:
        a, b = records_a.get(case_id), records_b.get(case_id)
        blocks.append(format_case(case_id, a, b))
        verdicts.append((case_id, *case_verdict(a, b)))
    width = max([len(c) for c in case_ids] + [4])
    summary = [f"== verdicts (A: {label_a}; B: {label_b})"]
    summary += [f"{c:<{width}}  {v:<9}  {d}" for c, v, d in verdicts]
    if not case_ids:
        summary.append("no case records in either folder")
    counts = {}
    for _, verdict, _ in verdicts:
        counts[verdict] = counts.get(verdict, 0) + 1
    summary.append(
        ", ".join(f"{n} {v}" for v, n in counts.items()) or "nothing compared"
    )
    blocks.append("\n".join(summary))
    bad = any(v in ("broken", "only in A") for _, v, _ in verdicts)
    return "\n\n".join(blocks), int(bad or not case_ids)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports_a", type=Path)
    parser.add_argument("reports_b", type=Path)
    parser.add_argument("--label-a", default="A")
    parser.add_argument("--label-b", default="B")
    args = parser.parse_args(argv)
    for folder in (args.reports_a, args.reports_b):
        if not folder.is_dir():
            print(f"compare_reports: error: no report folder {folder}", file=sys.stderr)
            return 1
    text, status = compare(
        load_records(args.reports_a),
        load_records(args.reports_b),
        f"{args.label_a} (records in {args.reports_a})",
        f"{args.label_b} (records in {args.reports_b})",
    )
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())

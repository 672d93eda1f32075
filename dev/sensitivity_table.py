# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The smallest restored-state error the CPU tier catches, row by row (not a
test). Run it through the suite, which provisions first:

    dev/suite.sh sensitivity [--factors 0.9,0.99,0.999] [-k ROW_OR_CASE]

For each plant of ``sensitivity_plants.py`` that a row needs, it writes the
plant's patch into a scratch folder and runs the row's cases on the CPU tier
(``dev/suite.sh cpu-tier --vllm-patch PATCH``) once with the plant off
(clean) and once per factor (``HYBRID_PC_PLANT_FACTOR``), each into its own
report folder. It reads each case's record (red or green, and every
comparison's gap) and the servers' logs (how often the plant fired, the
relative change it made), then prints a markdown table: a row per case,
clean, then each size caught or missed with the largest gap. ``--out FILE``
also writes it there, ``--keep DIR`` keeps the patches and reports there.

Only the standard library is used.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sensitivity_plants import FACTOR_ENV, patch_for  # noqa: E402


@dataclass(frozen=True)
class Row:
    """A row of the table: ``cases`` of the CPU tier under ``plant`` (None:
    not served on CPU, for ``why``)."""

    name: str
    plant: str | None
    cases: tuple[str, ...] = ()
    why: str = ""


ROWS = (
    Row("block", "hits", ("plain-block",)),
    Row("partial", "hits", ("plain-partial",)),
    Row("P/D", "pd", ("pd-block",)),
    Row("batched", "hits", ("plain-block-concurrent", "plain-partial-concurrent")),
    Row(
        "batched restores",
        "batched",
        ("plain-block-batched-restores", "plain-partial-batched-restores"),
    ),
    # cpu_known._SPEC: the engine dies on the first request with a drafter.
    Row(
        "with a drafter",
        None,
        why="not served on CPU: with prefix caching a drafter kills the engine "
        "on its first request (the Triton-only precopy_mamba_align_fused_kernel;"
        " cpu_known._SPEC)",
    ),
)


@dataclass
class Verdict:
    """A case's outcome in one run and the gaps of its comparisons."""

    red: bool
    word: str
    gap: float = 0.0
    tolerance: float | None = 0.0
    judged: str = ""
    red_turns: list[str] = field(default_factory=list)

    def gap_text(self) -> str:
        gap = f"{self.gap:.3g}"
        if self.judged and self.judged != "exact":
            gap += f" (tol {self.tolerance:.3g})"
        return gap

    def cell(self, clean: bool = False) -> str:
        if clean:
            return f"{'red' if self.red else 'green'}, {self.gap_text()}"
        return f"{'caught' if self.red else 'missed'}, {self.gap_text()}"


def _turn_name(turn: dict) -> str:
    label = "resend" if turn.get("resend") else f"turn {turn.get('turn')}"
    conversation = turn.get("conversation")
    return f"{conversation} {label}" if conversation else label


def verdict_of(record: dict) -> Verdict:
    """Red or green, and the largest gap over every turn's comparisons
    (with the tolerance of that comparison), from a case's JSON record."""
    red = record.get("outcome") != "pass"
    word = record.get("verdict") or record.get("outcome") or "?"
    best = Verdict(red, word, gap=-1.0)
    for turn in record.get("turns", ()):
        if turn.get("problems"):
            best.red_turns.append(_turn_name(turn))
        for comparison in turn.get("comparisons") or ():
            gap = comparison.get("gap")
            if gap is not None and gap > best.gap:
                best.gap = gap
                best.tolerance = comparison.get("tolerance")
                best.judged = comparison.get("judged", "")
    best.gap = max(best.gap, 0.0)
    return best


PLANT_LINE = re.compile(r"PLANT\((\w+)\): x(\S+) .*realized (\S+)")


def plant_firings(log_dir: Path) -> tuple[int, float, float]:
    """How often the plant fired in the servers' logs under ``log_dir``, and
    the smallest and largest relative change it made."""
    changes = []
    for log in sorted(log_dir.glob("**/*.log")):
        for line in log.read_text(errors="replace").splitlines():
            found = PLANT_LINE.search(line)
            if found:
                changes.append(float(found.group(3)))
    if not changes:
        return 0, 0.0, 0.0
    return len(changes), min(changes), max(changes)


def size_label(factor: float) -> str:
    return f"{(1 - factor) * 100:.3g}% (x{factor:g})"


def render_table(results: dict, factors: list[float], rows=ROWS) -> str:
    """``results[(case, factor or None)]`` = (Verdict, firings of its run) as
    markdown; a size whose plant never fired is not counted as caught."""
    factors = sorted(factors)  # the largest error first
    head = ["row", "case", "clean"] + [size_label(f) for f in factors]
    head.append("smallest caught")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        if row.plant is None:
            cells = [row.name, "-", row.why] + ["-"] * len(factors) + ["-"]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        for case in row.cases:
            clean = results.get((case, None))
            cells = [row.name, case]
            cells.append("not run" if clean is None else clean[0].cell(clean=True))
            smallest = None
            for factor in factors:
                got = results.get((case, factor))
                if got is None:
                    cells.append("not run")
                    continue
                verdict, (fired, _, _) = got
                cells.append(verdict.cell() + ("" if fired else ", plant never fired"))
                if verdict.red and fired and (smallest is None or factor > smallest):
                    smallest = factor
            cells.append("-" if smallest is None else f"{(1 - smallest) * 100:.3g}%")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def selected(rows, keyword: str | None) -> list[Row]:
    """The rows named by ``keyword``, or holding a case it names (then only
    those cases)."""
    if not keyword:
        return list(rows)
    chosen = []
    for row in rows:
        cases = tuple(c for c in row.cases if keyword in c)
        if keyword in row.name:
            chosen.append(row)
        elif cases:
            chosen.append(Row(row.name, row.plant, cases, row.why))
    return chosen


def run_cases(
    suite: Path, patch: Path, cases, factor, report: Path, log
) -> tuple[int, float]:
    """One run of the CPU tier on ``cases`` with the plant at ``factor``
    (None: off); its exit status and seconds."""
    env = {**os.environ, "HYBRID_PC_REPORT_DIR": str(report)}
    env.pop(FACTOR_ENV, None)
    if factor is not None:
        env[FACTOR_ENV] = repr(factor)
    # pytest -k takes brackets: "[plain-block]" is that case, not its siblings.
    keyword = " or ".join(f"[{case}]" for case in cases)
    command = [str(suite), "cpu-tier", "--vllm-patch", str(patch), "-k", keyword]
    start = time.monotonic()
    with open(log, "w") as out:
        status = subprocess.run(command, env=env, stdout=out, stderr=out).returncode
    return status, time.monotonic() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, required=True, help="the pinned sdist")
    parser.add_argument("--suite", type=Path, required=True, help="dev/suite.sh")
    parser.add_argument("--factors", default="0.9,0.99,0.999")
    parser.add_argument("-k", dest="keyword", help="rows or cases containing it")
    parser.add_argument("--no-clean", action="store_true", help="skip the clean run")
    parser.add_argument("--keep", type=Path, help="keep patches and reports here")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    factors = [float(f) for f in args.factors.split(",") if f]
    rows = selected(ROWS, args.keyword)
    work = args.keep or Path(tempfile.mkdtemp(prefix="sensitivity-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = ([] if args.no_clean else [None]) + factors
    results: dict = {}
    for factor in runs:
        for plant in dict.fromkeys(r.plant for r in rows if r.plant):
            cases = [c for r in rows if r.plant == plant for c in r.cases]
            patch = work / f"{plant}.patch"
            if not patch.exists():
                patch.write_text(patch_for(plant, args.sdist))
            name = f"{plant}-{'clean' if factor is None else factor}"
            report = work / name
            status, seconds = run_cases(
                args.suite, patch, cases, factor, report, work / f"{name}.log"
            )
            fired = plant_firings(report / "server-logs")
            print(
                f"sensitivity: {name}: {cases}, exit {status}, {seconds:.0f} s; "
                f"the plant fired {fired[0]}x, moving the state by "
                f"{fired[1]:.2e} to {fired[2]:.2e} (relative)",
                flush=True,
            )
            for case in cases:
                path = report / f"{case}.json"
                if path.is_file():
                    verdict = verdict_of(json.loads(path.read_text()))
                else:
                    verdict = Verdict(True, f"no record (exit {status})")
                results[(case, factor)] = (verdict, fired)
                cell = verdict.cell(clean=factor is None)
                print(f"sensitivity:   {case}: {verdict.word}; {cell}")
    table = render_table(results, factors, rows)
    print(table)
    if args.out:
        args.out.write_text(table)
    print(f"sensitivity: patches, logs and reports in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

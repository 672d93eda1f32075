# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/sensitivity_table.py's pure parts (no server): the plants' patch text,
the verdict read from a case record, the firings read from server logs, and
the table."""

import difflib
import io
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sensitivity_plants import (  # noqa: E402
    FACTOR_ENV,
    PLANTS,
    Edit,
    plant_patch,
    planted,
    sdist_sources,
)
from sensitivity_table import (  # noqa: E402
    ROWS,
    Row,
    Verdict,
    plant_firings,
    render_table,
    selected,
    verdict_of,
)


def anchors_only(plant: str) -> dict[str, str]:
    """A stand-in source per file: each anchor once, between other lines."""
    return {
        path: "".join(f"line {i}\n{edit.anchor}" for i, edit in enumerate(edits))
        + "end\n"
        for path, edits in PLANTS[plant].items()
    }


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_patch_reads_the_factor_and_applies_back(plant):
    sources = anchors_only(plant)
    patch = plant_patch(plant, sources)
    assert FACTOR_ENV in patch
    for path in sources:
        assert f"--- a/{path}\n+++ b/{path}\n" in patch
    # Only insertions: every anchor stays, and the plant is marked.
    removed = [line for line in patch.splitlines() if line.startswith("-")]
    assert all(line.startswith("--- a/") for line in removed)
    for path, text in sources.items():
        new = planted(text, PLANTS[plant][path], path)
        assert "PLANT(" in new
        back = difflib.restore(
            difflib.ndiff(text.splitlines(True), new.splitlines(True)), 2
        )
        assert "".join(back) == new


def test_edit_before_and_after():
    text = "a\nb\nc\n"
    assert planted(text, (Edit("b\n", "x\n"),), "f") == "a\nb\nx\nc\n"
    assert planted(text, (Edit("b\n", "x\n", before=True),), "f") == "a\nx\nb\nc\n"


def test_missing_repeated_or_planted_anchor_refused():
    with pytest.raises(ValueError, match="found 0 times"):
        planted("a\n", (Edit("b\n", "x\n"),), "f")
    with pytest.raises(ValueError, match="found 2 times"):
        planted("b\nb\n", (Edit("b\n", "x\n"),), "f")
    with pytest.raises(ValueError, match="already planted"):
        planted("# PLANT(hits)\nb\n", (Edit("b\n", "x\n"),), "f")


def test_sources_read_from_an_sdist(tmp_path):
    sdist = tmp_path / "vllm-0.32.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in (("vllm/a.py", "A\n"), ("vllm/b.py", "B\n")):
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-0.32.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert sdist_sources(sdist, ["vllm/a.py"]) == {"vllm/a.py": "A\n"}
    with pytest.raises(ValueError, match="lacks"):
        sdist_sources(sdist, ["vllm/c.py"])


def record(outcome, gaps, tolerance=0.0, same_path=True, problems=()):
    """A case record as CaseRecord.as_json writes it: a turn per gap."""
    turns = [
        {
            "conversation": "",
            "turn": i,
            "problems": list(problems) if i == len(gaps) - 1 else [],
            "comparisons": [
                {
                    "what": "hit vs recompute",
                    "gap": gap,
                    "tolerance": tolerance,
                    "same_path": same_path,
                    "judged": "exact" if tolerance == 0 else "measured noise",
                }
            ],
        }
        for i, gap in enumerate(gaps)
    ]
    return {"case_id": "plain-block", "outcome": outcome, "verdict": "", "turns": turns}


def test_verdict_of_a_red_and_a_green_record():
    red = verdict_of(record("FAIL", [0.0, 0.0564, 0.0545], problems=["apart"]))
    assert (red.red, red.gap, red.judged, red.red_turns) == (
        True,
        0.0564,
        "exact",
        ["turn 2"],
    )
    assert red.cell() == "caught, 0.0564"
    green = verdict_of(record("pass", [0.0, 0.01], tolerance=0.2, same_path=False))
    assert not green.red
    assert green.cell() == "missed, 0.01 (tol 0.2)"
    assert green.cell(clean=True) == "green, 0.01 (tol 0.2)"
    assert verdict_of({"outcome": "pass", "turns": []}).gap == 0.0


def test_plant_firings_from_server_logs(tmp_path):
    logs = tmp_path / "server-logs"
    logs.mkdir()
    (logs / "serve-1.log").write_text(
        "INFO other\n"
        "WARNING [mamba_utils.py:1] PLANT(hits): x0.99 on 1 hit(s) in a step "
        "of 1; realized 1.020e-02\n"
    )
    (logs / "serve-2.log").write_text(
        "PLANT(pd): x0.99 on request r, blocks [(1, [3])]; realized 9.000e-03\n"
    )
    assert plant_firings(logs) == (2, 0.009, 0.0102)
    assert plant_firings(tmp_path / "none") == (0, 0.0, 0.0)


def test_table_marks_the_smallest_caught_and_unfired_sizes():
    rows = (Row("block", "hits", ("plain-block",)), Row("drafter", None, why="no"))
    fired = (3, 0.009, 0.01)
    results = {
        ("plain-block", None): (Verdict(False, "pass"), (0, 0.0, 0.0)),
        ("plain-block", 0.9): (Verdict(True, "FAIL", gap=0.5), fired),
        ("plain-block", 0.99): (Verdict(True, "FAIL", gap=0.05), fired),
        ("plain-block", 0.999): (Verdict(True, "FAIL", gap=0.1), (0, 0.0, 0.0)),
    }
    table = render_table(results, [0.9, 0.99, 0.999], rows).splitlines()
    assert table[0] == (
        "| row | case | clean | 10% (x0.9) | 1% (x0.99) | 0.1% (x0.999) "
        "| smallest caught |"
    )
    assert table[2] == (
        "| block | plain-block | green, 0 | caught, 0.5 | caught, 0.05 "
        "| caught, 0.1, plant never fired | 1% |"
    )
    assert table[3] == "| drafter | - | no | - | - | - | - |"


def test_rows_selected_by_name_or_case():
    assert [r.name for r in selected(ROWS, None)] == [r.name for r in ROWS]
    (batched,) = selected(ROWS, "plain-partial-concurrent")
    assert batched.cases == ("plain-partial-concurrent",)
    assert [r.name for r in selected(ROWS, "P/D")] == ["P/D"]

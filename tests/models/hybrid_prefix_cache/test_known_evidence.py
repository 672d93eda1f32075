# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every known failure of the CPU and GPU tiers' tables, fed by the path
its failure really arrives by (harness.Known.arrives): a crash (an
exception, and the logs of the case's servers), a refusal of the config, or
the oracle's own words on a record. Each entry must see its evidence there,
and a failure without it must fail as a stale table. No server: the crash's
log is the text the report of the real failure gives."""

from dataclasses import replace
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache import cpu_known, gpu_binding
from tests.models.hybrid_prefix_cache.cpu_binding import cpu_binding
from tests.models.hybrid_prefix_cache.harness import (
    Known,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.servers import (
    REPORT_DIR_ENV,
)
from tests.models.hybrid_prefix_cache.harness.session import case_session
from tests.models.hybrid_prefix_cache.replayed_turns import (
    branch_apart_turn,
    crashed_case,
    lost_checkpoint_turn,
    lost_resend_turn,
    restored_apart_turn,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid

pytestmark = pytest.mark.skip_global_cleanup


def _tables() -> dict[str, dict[str, tuple[Known, ...]]]:
    """The CPU and GPU tiers' tables of known failures, by the tier's name
    (Kimi-K3's: kimi_k3/test_prefix_cache_known.py)."""
    return {"cpu": cpu_known.KNOWN, "gpu": gpu_binding.KNOWN}


def _entries(arrives: str) -> list:
    """(case id, entry) of every entry of both tiers' tables whose failure
    arrives by ``arrives``, those another case confirms too (where that one
    did not, each confirms itself); each as under a release it holds for,
    whatever the vLLM under test (its wording is what is checked)."""
    found = [
        (name, case, k)
        for name, table in _tables().items()
        for case, ks in table.items()
        for k in ks
    ]
    return [
        pytest.param(
            case, replace(entry, releases=None), id=f"{table}-{case}-{entry.arrives}"
        )
        for table, case, entry in found
        if entry.arrives == arrives
    ]


# What the oracle says on the record of each case whose failure arrives
# there, by case and geometry: the turn it plays, as the failure was
# reported (cpu_known.py).
RECORD_FAILURES = {
    ("plain-block-exact", (256, 256)): lambda: lost_checkpoint_turn(
        "exact", 1, 768, Units(block=256, hit=256)
    ),
    ("plain-block-half-plus1", (256, 256)): lambda: lost_checkpoint_turn(
        "half-plus1", 1, 897, Units(block=256, hit=256)
    ),
    ("plain-block-unit-minus1", (256, 256)): lambda: lost_checkpoint_turn(
        "unit-minus1", 1, 1023, Units(block=256, hit=256)
    ),
    # Turn 2 of 2065 tokens hits 1280 at block 128, 3.9e-3 from its
    # recompute with the same tokens.
    ("plain-block-unit-minus1", (128, 128)): lambda: restored_apart_turn(
        "unit-minus1", 2, 1288, Units(block=128, hit=128), 3.9e-3
    ),
}
# The GPU tier's offload cells in partial mode on an H200 (block 80, unit 16):
# turn 1 resumed at the block end 240 where the previous 277-token prompt's
# checkpoint is 272.
RECORD_FAILURES |= {
    (case, (80, 16)): lambda: lost_checkpoint_turn(
        "", 1, 277, Units(block=80, hit=16), 240
    )
    for case in ("offload-partial", "pd-offload-partial")
}
RECORD_FAILURES |= {
    # With MTP, whose drop puts the checkpoint a unit lower (256), on the host
    # and, where vLLM 0.26 saved no state there, on the device alike.
    (case, (80, 16)): lambda: lost_checkpoint_turn(
        "", 1, 277, Units(block=80, hit=16), 240, drops_unit=True
    )
    for case in ("offload-partial-mtp", "plain-partial-mtp")
}
RECORD_FAILURES |= {
    # The resend of 1831 tokens restored 1760 from the host, where MTP's drop
    # puts its checkpoint at 1680.
    ("offload-block-mtp", (80, 80)): lambda: lost_resend_turn(
        1831, 80, hit=1760, drops_unit=True
    ),
    # Turn 1 of the aligned shape restored 160 and sat 0.0422 from its twin.
    ("pd-block-aligned", (80, 80)): lambda: restored_apart_turn(
        "exact", 1, 240, Units(block=80, hit=80), 0.0422, pd=True
    ),
    # vLLM 0.34.0 on an H100: turn 1 restored 256 (block) or 512 (partial,
    # block 192) and sat 0.0484, 0.046 and 0.0421 from its cold twin.
    ("pd-partial-aligned", (192, 64)): lambda: restored_apart_turn(
        "exact", 1, 576, Units(block=192, hit=64), 0.0484, pd=True
    ),
    ("pd-block-mtp-aligned", (128, 128)): lambda: restored_apart_turn(
        "exact", 1, 384, Units(block=128, hit=128), 0.046, pd=True
    ),
    ("pd-partial-mtp-aligned", (192, 64)): lambda: restored_apart_turn(
        "exact", 1, 576, Units(block=192, hit=64), 0.0421, pd=True
    ),
}
RECORD_FAILURES |= {
    ("pd-block-aligned", (256, 256)): lambda: lost_checkpoint_turn(
        "exact", 1, 768, Units(block=256, hit=256)
    ),
    # The 769-token resend, of which the prefiller sees 768 tokens.
    ("pd-block-pd-resend", (256, 256)): lambda: lost_resend_turn(769, 256, backoff=1),
    # Turn 1 restored 704 tokens and sat 0.00285 from its cold twin.
    ("pd-partial-aligned", (256, 64)): lambda: restored_apart_turn(
        "exact", 1, 768, Units(block=256, hit=64), 0.00285, pd=True
    ),
    # At block 128 (AVX2 only), turn 1 restored 256 and 320 tokens and sat
    # 0.0639 and 0.00409 from its cold twin.
    ("pd-block-aligned", (128, 128)): lambda: restored_apart_turn(
        "exact", 1, 384, Units(block=128, hit=128), 0.0639, pd=True
    ),
    ("pd-partial-aligned", (128, 64)): lambda: restored_apart_turn(
        "exact", 1, 384, Units(block=128, hit=64), 0.00409, pd=True
    ),
    # The small-budget cases' branch, 0.205 and 0.173 from its recompute.
    ("plain-block-small-budget", (256, 256)): lambda: branch_apart_turn(
        Units(block=256, hit=256), 0.205
    ),
    ("plain-partial-small-budget", (256, 64)): lambda: branch_apart_turn(
        Units(block=256, hit=64), 0.173
    ),
    # At block 256 with a float32 state on an AVX2-only CPU: TP2's branch
    # took another token than its recompute at index 2 and 3, P/D's sat
    # 0.0609 and 0.104 from its cold twin.
    ("tp2-block-small-budget", (256, 256)): lambda: branch_apart_turn(
        Units(block=256, hit=256), 0.034, parts_at=2
    ),
    ("tp2-partial-small-budget", (256, 64)): lambda: branch_apart_turn(
        Units(block=256, hit=64), 0.0149, parts_at=3
    ),
    ("pd-block-small-budget", (256, 256)): lambda: branch_apart_turn(
        Units(block=256, hit=256), 0.0609, pd=True
    ),
    ("pd-partial-small-budget", (256, 64)): lambda: branch_apart_turn(
        Units(block=256, hit=64), 0.104, pd=True
    ),
}
GEOMETRY = {None: Units(block=256, hit=256)}


@pytest.fixture(autouse=True)
def _reports(tmp_path, monkeypatch):
    """Every case session writes its record: here, into the test's folder."""
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))


def _units(entry: Known) -> Units:
    if entry.geometry is None:
        return GEOMETRY[None]
    block, hit = entry.geometry
    return Units(block=block, hit=hit)


def _crash(case_id: str, entry: Known, text: str, tmp_path: Path, how: str) -> None:
    crashed_case(case_id, entry, text, tmp_path, how, _units(entry))


@pytest.mark.parametrize(("case_id", "entry"), _entries("crash"))
@pytest.mark.parametrize("how", ["request", "metrics"])
def test_a_crash_shows_its_evidence(case_id, entry, how, tmp_path):
    outcome = (
        pytest.skip.Exception if entry.kind == "unsupported" else pytest.xfail.Exception
    )
    with pytest.raises(outcome):
        _crash(case_id, entry, f"Traceback ... {entry.evidence} ...", tmp_path, how)
    with pytest.raises(AssertionError, match="update the table") as stale:
        _crash(case_id, entry, "Traceback ... another error ...", tmp_path, how)
    # One screen: the log and the record named by path, not pasted.
    message = str(stale.value)
    assert "INFO starting" not in message
    assert f"server logs: {tmp_path / f'{how}.log'}" in message
    assert f"record: {tmp_path / f'{case_id}.json'}" in message


@pytest.mark.parametrize(("case_id", "entry"), _entries("record"))
def test_a_record_shows_its_evidence(case_id, entry):
    key = (case_id, entry.geometry)
    assert key in RECORD_FAILURES, f"no failing record for {key}"
    turn = RECORD_FAILURES[key]()
    assert turn.problems, "the oracle accepted the reported failure"
    with (
        pytest.raises(pytest.xfail.Exception),
        case_session(case_id, known=(entry,)) as case,
    ):
        case.units = _units(entry)
        case.turns.append(turn)
    with (
        pytest.raises(AssertionError, match="update the table"),
        case_session(case_id, known=(entry,)) as case,
    ):
        case.units = _units(entry)
        case.problems.append("another problem")


@pytest.fixture(scope="module")
def binding(tmp_path_factory):
    return cpu_binding(write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid")))


@pytest.mark.parametrize(("case_id", "entry"), _entries("config"))
def test_a_refused_config_shows_its_evidence(case_id, entry, binding):
    """The refusal of vLLM's own config build, in-process, on the servers'
    arguments."""
    with pytest.raises(pytest.skip.Exception, match="confirmed"):
        cpu_known.confirm_at_config(binding, case_id, entry)
    stale = Known(
        entry.kind, entry.reason, "a refusal vLLM never gives", at_config=True
    )
    with pytest.raises(AssertionError, match="update the table"):
        cpu_known.confirm_at_config(binding, case_id, stale)


def test_every_entry_is_fed_by_its_arrival():
    """Each test above takes the entries of one arrival path; together they
    cover every entry."""
    fed = sum(len(_entries(path)) for path in ("crash", "record", "config"))
    entries = [k for t in _tables().values() for ks in t.values() for k in ks]
    assert fed == len(entries) > 0

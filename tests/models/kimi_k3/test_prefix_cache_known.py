# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every known failure of the Kimi-K3 binding's tables (``kimi.KNOWN``), fed
by the path its failure really arrives by: each must see its evidence there,
and a failure without it must fail as a stale table. No server and no GPU:
the crash's log is the text the report of the real failure gives."""

from dataclasses import replace

import pytest

from tests.models.hybrid_prefix_cache.harness import Units
from tests.models.hybrid_prefix_cache.harness.servers import REPORT_DIR_ENV
from tests.models.hybrid_prefix_cache.replayed_turns import crashed_case
from tests.models.kimi_k3 import prefix_cache_binding as kimi

pytestmark = pytest.mark.skip_global_cleanup

# What #59392 reported on GB200 (DEVELOPERS.md's real B200 numbers).
DCP_SPEC_REPORT = "causal_seqlens_kv_global must have shape (9,), got (2,)"


def _entries() -> list:
    """(case id, entry) of every entry a served case of its own confirms, each
    as under a release it holds for (its wording is what is checked); the
    scheduler tier's replays confirm theirs (test_prefix_cache_scheduler.py)."""
    return [
        pytest.param(case, replace(k, releases=None), id=f"{platform}-{case}")
        for platform, table in kimi.KNOWN.items()
        for case, entries in table.items()
        for k in entries
        if k.confirmed_by is None and not k.replayed
    ]


@pytest.fixture(autouse=True)
def _reports(tmp_path, monkeypatch):
    """Every case session writes its record: here, into the test's folder."""
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))


@pytest.mark.parametrize(("case_id", "entry"), _entries())
@pytest.mark.parametrize("how", ["request", "metrics"])
def test_a_crash_shows_its_evidence(case_id, entry, how, tmp_path):
    assert entry.arrives == "crash", f"{case_id}: arrives by {entry.arrives}"
    units = Units(block=256, hit=256)
    outcome = (
        pytest.skip.Exception if entry.kind == "unsupported" else pytest.xfail.Exception
    )
    with pytest.raises(outcome):
        crashed_case(case_id, entry, f"... {entry.evidence} ...", tmp_path, how, units)
    with pytest.raises(AssertionError, match="update the table"):
        crashed_case(case_id, entry, "Traceback ... another ...", tmp_path, how, units)


def test_the_dcp_spec_entries_expect_flashinfers_error():
    """The error the real failure reported (#59392), not an oracle message
    that a crash can never produce."""
    entries = [k for ks in kimi.KNOWN["sm100"].values() for k in ks if not k.replayed]
    assert entries and all(k.arrives == "crash" for k in entries)
    assert all(k.evidence in DCP_SPEC_REPORT for k in entries)

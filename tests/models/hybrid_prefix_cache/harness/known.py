# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one judge of known failures, for every tier: a listed failure must show
its evidence (else the table is stale), and a listed pass is a strict XPASS."""

from typing import NoReturn

import pytest

from tests.models.hybrid_prefix_cache.harness.deployment import Known

# What the session's summary calls a case that failed as its table says.
KNOWN_VERDICTS = {"xfail": "known xfail", "unsupported": "known refusal"}


def judge_failure(case_id: str, entry: Known, text: str, record=None) -> NoReturn:
    """A listed case failed with ``text``; a record gets the verdict."""
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


def judge_pass(case_id: str, entry: Known, record=None) -> NoReturn:
    if record is not None:
        record.verdict = "FAIL: XPASS"
    pytest.fail(
        f"[XPASS(strict)] {case_id} is listed as {entry.kind} "
        f"({entry.reason}) but passed: remove it from the table",
        pytrace=False,
    )


def judge_confirmed_elsewhere(entries: tuple[Known, ...]) -> None:
    """A shared failure is confirmed once (Known.confirmed_by): the other cases
    take that case's outcome without running."""
    for entry in entries:
        if entry.confirmed_by is not None:
            outcome = pytest.xfail if entry.kind == "xfail" else pytest.skip
            outcome(f"{entry.reason} (as in {entry.confirmed_by}, which confirms it)")

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one judge of known failures: a listed failure must show its evidence (else the
table is stale), a listed pass is a strict XPASS; enacted once the record is saved."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

import pytest

from tests.models.hybrid_prefix_cache.harness.deployment import Known

# What the session's summary calls a case that failed as its table says.
KNOWN_VERDICTS = {"xfail": "known xfail", "unsupported": "known refusal"}
STALE = "FAIL: stale table"


@dataclass(frozen=True)
class Judgment:
    """A listed case's verdict, and the pytest outcome that says it."""

    verdict: str
    message: str

    def enact(self, cause: BaseException | None = None) -> NoReturn:
        if self.verdict == KNOWN_VERDICTS["unsupported"]:
            pytest.skip(self.message)
        if self.verdict == KNOWN_VERDICTS["xfail"]:
            pytest.xfail(self.message)
        if self.verdict == "FAIL: XPASS":
            pytest.fail(self.message, pytrace=False)
        raise AssertionError(self.message) from cause


def judge_failure(
    case_id: str, entry: Known, text: str, shown: str = "", problems: Sequence[str] = ()
) -> Judgment:
    """A listed case failed with ``text`` and found ``problems``; a stale table's
    message says ``shown`` (the problems, and the logs by path), else ``text``."""
    if not entry.shown(text, problems):
        return Judgment(
            STALE,
            f"{case_id} is listed as {entry.kind} ({entry.reason}) and "
            f"failed, but without {entry.expects}: update the table.\n"
            + (shown or text),
        )
    how = "confirmed" if entry.kind == "unsupported" else "seen"
    message = f"{entry.reason} ({how}: {entry.expects})"
    return Judgment(KNOWN_VERDICTS[entry.kind], message)


def judge_pass(case_id: str, entry: Known) -> Judgment:
    return Judgment(
        "FAIL: XPASS",
        f"[XPASS(strict)] {case_id} is listed as {entry.kind} "
        f"({entry.reason}) but passed: remove it from the table",
    )


def evidence_shown(entry: Known | None, problems: list[str]) -> bool:
    """Whether ``problems`` show the bug's ``found``: later turns change nothing."""
    if entry is None or entry.kind != "xfail" or entry.found is None:
        return False
    return entry.shown("", problems)


def judge_confirmed_elsewhere(
    entries: tuple[Known, ...], verdicts: Mapping[str, str]
) -> None:
    """A shared failure is confirmed once (Known.confirmed_by): the others take its
    outcome (``verdicts``, by case id) unrun; where it did not run or passed, all do."""
    for entry in entries:
        confirmer, verdict = entry.confirmed_by, KNOWN_VERDICTS[entry.kind]
        if confirmer is not None and verdicts.get(confirmer) == verdict:
            outcome = pytest.xfail if entry.kind == "xfail" else pytest.skip
            outcome(f"{entry.reason} (as in {confirmer}, which confirmed it)")

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Session plumbing of the hybrid prefix-cache suite: run tests that need
the same servers one after another, stop the reused servers at the end, and
print a summary of every case."""

import pytest

from tests.models.hybrid_prefix_cache import harness


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{harness.SERVERS_MARK}(key): tests with the same key need the same "
        "servers and run one after another",
    )


def pytest_collection_modifyitems(items) -> None:
    harness.group_by_servers(items)


@pytest.fixture(scope="session", autouse=True)
def hybrid_prefix_cache_servers():
    """The pool of reused servers, stopped when the session ends."""
    yield harness.POOL
    harness.POOL.close()


def pytest_terminal_summary(terminalreporter) -> None:
    records, harness.SUMMARY[:] = list(harness.SUMMARY), []
    pool = harness.POOL
    if not records:
        return
    write = terminalreporter.write_line
    terminalreporter.section("hybrid prefix cache: every case")
    write(
        f"{'case':<34} {'outcome':<18} {'turns':>5} {'failed':>6} "
        f"{'notices':>7} {'start s':>8} {'case s':>7}"
    )
    for r in records:
        failed = sum(1 for t in r.turns if t.problems)
        notices = sum(len(t.notices) for t in r.turns) + len(r.notices)
        start = "+".join(f"{s:.0f}" for s in r.startup_seconds) or (
            "reused" if r.reused else "-"
        )
        write(
            f"{r.case_id:<34} {r.outcome:<18} {len(r.turns):>5} {failed:>6} "
            f"{notices:>7} {start:>8} {r.seconds:>7.1f}"
        )
    write(
        f"servers started: {pool.starts}, deployments reused: {pool.reuses}, "
        f"records in {harness.report_folder().resolve()}"
    )

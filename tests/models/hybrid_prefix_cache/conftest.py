# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Session plumbing of the hybrid prefix-cache suite: run tests that need
the same servers one after another, stop the reused servers at the end, and
print a summary of every case and write where the session's time went."""

import json
import time

import psutil
import pytest

from tests.models.hybrid_prefix_cache import harness


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{harness.SERVERS_MARK}(key): tests with the same key need the same "
        "servers and run one after another",
    )
    # Both tiers' conftests re-export this hook; register the timer once.
    if not config.pluginmanager.has_plugin(SessionTimes.NAME):
        config.pluginmanager.register(SessionTimes(), SessionTimes.NAME)


def pytest_collection_modifyitems(items) -> None:
    harness.group_by_servers(items)


class SessionTimes:
    """Where the session's time went, for dev/benchmark_cpu_tier.py's
    breakdown: the process's start (interpreter and imports, up to this
    plugin), collection, and each test's setup, call and teardown with its
    outcome, written to <report folder>/session.json at the end of a
    session that wrote case records there."""

    NAME = "hybrid-prefix-cache-times"

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.before = time.time() - psutil.Process().create_time()
        self.collection = 0.0
        self.tests: dict[str, dict] = {}

    def pytest_collection_finish(self) -> None:
        self.collection = time.monotonic() - self.started

    def pytest_runtest_logreport(self, report) -> None:
        test = self.tests.setdefault(report.nodeid, {})
        test[report.when] = round(report.duration, 2)
        if report.when == "call" or report.outcome != "passed":
            xfailed = hasattr(report, "wasxfail")
            test["outcome"] = "xfailed" if xfailed else report.outcome

    def pytest_sessionfinish(self) -> None:
        folder = harness.report_folder(create=False)
        if not self.tests or not folder.is_dir():
            return
        data = {
            "seconds": round(time.monotonic() - self.started + self.before, 2),
            "start_seconds": round(self.before, 2),
            "collection_seconds": round(self.collection, 2),
            "tests": self.tests,
        }
        (folder / "session.json").write_text(json.dumps(data, indent=1))


@pytest.fixture
def should_do_global_cleanup_after_test() -> bool:
    """No test here sets up vLLM's distributed state or a device in-process
    (servers are processes of their own; the scheduler tier and the
    in-process config checks build configs only), so skip the global cleanup
    of vLLM's tests/conftest.py after each test, as that fixture's
    docstring invites: about 0.4 s per test here."""
    return False


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
            f"{r.case_id:<34} {r.verdict or r.outcome:<18} {len(r.turns):>5} "
            f"{failed:>6} "
            f"{notices:>7} {start:>8} {r.seconds:>7.1f}"
        )
    write(
        f"servers started: {pool.starts}, deployments reused: {pool.reuses}, "
        f"records in {harness.report_folder().resolve()}"
    )

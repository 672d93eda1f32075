# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A case's counter window, owned by its session: each server's counters at
its start (:func:`open_window`), the completions its servers answered while it
was open (each server books its own) and what the case knows their engines
saw unanswered, reconciled at its end (:func:`close_window`)."""

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tests.models.hybrid_prefix_cache.harness.client import (
    METRICS_POLL_INTERVAL,
    METRICS_SETTLE_SECONDS,
    read_counters,
)
from tests.models.hybrid_prefix_cache.harness.compare import Turn
from tests.models.hybrid_prefix_cache.harness.deployment import Mode
from tests.models.hybrid_prefix_cache.harness.reconcile import (
    SPEC_DRAFTS,
    Ledger,
    counter_deltas,
    drafter_problems,
    expected_requests,
    server_deltas,
    server_problems,
)
from tests.models.hybrid_prefix_cache.harness.servers import Server


@dataclass
class Window:
    """Counters of a case's servers at its start, and how many completions
    each had answered then (Server.answers); the requests their engines saw
    that no completion answered (an abort), booked by the case."""

    servers: Sequence[Server]
    counters: list[dict[str, float | None]]
    marks: list[int] = field(default_factory=list)
    unanswered: list[Ledger] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _index(self, server: Server) -> int:
        return next(i for i, s in enumerate(self.servers) if s is server)

    def book_unanswered(self, server: Server, entry: Ledger) -> None:
        """A request ``server``'s engine saw but never answered."""
        with self._lock:
            index = self._index(server)
            self.unanswered[index] = self.unanswered[index] + entry

    def answered(self, index: int) -> Ledger:
        """What the ``index``-th server answered since the window opened."""
        return self.servers[index].answered_since(self.marks[index])


def open_window(servers: Sequence[Server]) -> Window:
    return Window(
        servers,
        [read_counters(server) for server in servers],
        [server.answers() for server in servers],
        [Ledger() for _ in servers],
    )


def close_window(
    window: Window, mode: Mode, turns: Sequence[Turn]
) -> tuple[dict, list[str]]:
    """Each server's counter deltas since :func:`open_window`, and every way
    they disagree with what its completions reported
    (:func:`counter_problems`) or with the route every request must take
    (:func:`expected_requests`, against vLLM's own request_success count)."""
    deltas, problems = {}, []
    drafts = 0.0
    routes = expected_requests(len(window.servers), turns)
    for index, server in enumerate(window.servers):
        spec = server.spec
        name = spec.name
        ledger = window.answered(index) + window.unanswered[index]
        before = window.counters[index]

        def check(
            now: dict, before=before, name=name, ledger=ledger, spec=spec, index=index
        ) -> list[str]:
            return server_problems(
                name,
                counter_deltas(now, before),
                ledger,
                prefix_caching=spec.prefix_caching,
                connector=spec.connector,
                route=routes[index],
            )

        deadline = time.monotonic() + METRICS_SETTLE_SECONDS
        now = read_counters(server)
        while check(now) and time.monotonic() < deadline:
            time.sleep(METRICS_POLL_INTERVAL)
            now = read_counters(server)
        problems += check(now)
        moved = counter_deltas(now, before)
        deltas[name] = server_deltas(ledger, moved)
        drafts += moved[SPEC_DRAFTS] or 0.0
    problems += drafter_problems(mode, drafts)
    return deltas, problems

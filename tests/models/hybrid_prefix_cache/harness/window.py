# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A case's counter window, owned by its session: each server's counters at its
start, the completions its servers answered while it was open and what the case
knows their engines saw unanswered, reconciled at its end (:func:`close_window`)."""

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
    expected_requests,
    server_problems,
)
from tests.models.hybrid_prefix_cache.harness.servers import Server


@dataclass
class Window:
    """Per server: ``marks``, its Server.answers at the start; ``unanswered``, the
    requests its engine saw that no completion answered (an abort)."""

    servers: Sequence[Server]
    counters: list[dict[str, float | None]]
    marks: list[int]
    unanswered: list[Ledger]
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def book_unanswered(self, server: Server, entry: Ledger) -> None:
        """A request ``server``'s engine saw but never answered."""
        with self._lock:
            index = next(i for i, s in enumerate(self.servers) if s is server)
            self.unanswered[index] += entry


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
    """Each server's counter deltas since :func:`open_window`, and every way they
    disagree with what its completions reported (:func:`counter_problems`) or with
    the route every request must take (:func:`expected_requests`, against vLLM's
    own request_success count)."""
    deltas, problems, drafts = {}, [], 0.0
    routes = expected_requests(len(window.servers), turns)
    for server, before, mark, unanswered, route in zip(
        window.servers,
        window.counters,
        window.marks,
        window.unanswered,
        routes,
        strict=True,
    ):
        spec = server.spec
        ledger = server.answered_since(mark) + unanswered
        deadline = time.monotonic() + METRICS_SETTLE_SECONDS
        while True:
            moved = counter_deltas(read_counters(server), before)
            found = server_problems(
                spec.name, moved, ledger, spec.prefix_caching, spec.connector, route
            )
            if not found or time.monotonic() >= deadline:
                break
            time.sleep(METRICS_POLL_INTERVAL)
        problems += found
        deltas[spec.name] = {
            "requests": ledger.requests,
            "usage_prompt_tokens": ledger.prompt_tokens,
            "usage_cached_tokens": ledger.cached_tokens,
            "engine_queries": ledger.queries,
            "engine_held": ledger.held,
            **moved,
        }
        drafts += moved[SPEC_DRAFTS] or 0.0
    if mode.spec is not None and drafts <= 0:
        problems.append(
            f"speculative mode, but {SPEC_DRAFTS} did not grow: the drafter "
            f"never ran, so the case would pass vacuously"
        )
    return deltas, problems

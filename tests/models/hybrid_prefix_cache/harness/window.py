# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A case's counter window, owned by its session: each server's counters at its start,
then what it answered and its engine saw unanswered, reconciled at the end."""

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tests.models.hybrid_prefix_cache.harness import client, compare, reconcile
from tests.models.hybrid_prefix_cache.harness.deployment import Mode
from tests.models.hybrid_prefix_cache.harness.reconcile import Ledger
from tests.models.hybrid_prefix_cache.harness.servers import Server, ServerSpec


@dataclass
class Window:
    """Per server: ``marks``, Server.answers at the start; ``unanswered``, aborts."""

    servers: Sequence[Server]
    counters: list[dict[str, float | None]]
    marks: list[int]
    unanswered: list[Ledger]
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def book_unanswered(self, server: Server, entry: Ledger) -> None:
        with self._lock:
            index = next(i for i, s in enumerate(self.servers) if s is server)
            self.unanswered[index] += entry


def open_window(servers: Sequence[Server]) -> Window:
    counters = [client.read_counters(server) for server in servers]
    marks = [server.answers() for server in servers]
    return Window(servers, counters, marks, [Ledger() for _ in servers])


def server_problems(
    spec: ServerSpec, moved: dict[str, float | None], ledger: Ledger, route: int | None
) -> list[str]:
    """:func:`reconcile.counter_problems`; completions vs ``route`` (None: success)."""
    name, done = spec.name, moved[reconcile.REQUESTS_DONE] or 0.0
    found = reconcile.counter_problems(
        name, moved, ledger, spec.prefix_caching, spec.connector
    )
    if route is not None and ledger.requests != route:
        found.append(
            f"{name} server: answered {ledger.requests} completions, expected {route} "
            f"(each turn through the deployment, each recompute on the decoder alone)"
        )
    elif done != ledger.requests:
        found.append(
            f"{name} server: {reconcile.REQUESTS_DONE} moved by {done:g}, but it "
            f"answered {ledger.requests} completions"
        )
    return found


def close_window(
    window: Window, mode: Mode, turns: Sequence[compare.Turn]
) -> tuple[dict, list[str]]:
    """Each server's counter deltas since :func:`open_window`, how they disagree with
    its usage or route (:func:`server_problems`, ``reconcile.expected_requests``)."""
    deltas, problems, drafts = {}, [], 0.0
    routes = reconcile.expected_requests(len(window.servers), turns)
    opened = zip(window.servers, window.counters, window.marks, window.unanswered)
    for (server, before, mark, unanswered), route in zip(opened, routes, strict=True):
        ledger = server.answered_since(mark) + unanswered
        deadline = time.monotonic() + client.METRICS_SETTLE_SECONDS
        while True:
            moved = reconcile.counter_deltas(client.read_counters(server), before)
            found = server_problems(server.spec, moved, ledger, route)
            if not found or time.monotonic() >= deadline:
                break
            time.sleep(client.METRICS_POLL_INTERVAL)
        problems += found
        deltas[server.spec.name] = {
            "requests": ledger.requests,
            "usage_prompt_tokens": ledger.prompt_tokens,
            "usage_cached_tokens": ledger.cached_tokens,
            "engine_queries": ledger.queries,
            "engine_held": ledger.held,
            **moved,
        }
        drafts += moved[reconcile.SPEC_DRAFTS] or 0.0
    if mode.spec is not None and drafts <= 0:
        problems.append(
            f"speculative mode, but {reconcile.SPEC_DRAFTS} did not grow: the drafter "
            f"never ran, so the case would pass vacuously"
        )
    return deltas, problems

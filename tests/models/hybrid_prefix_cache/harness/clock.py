# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a case's time goes: the per-phase clock of the running case."""

import contextlib
import contextvars
import time
from collections.abc import Iterator

# for the record and dev/benchmark_cpu_tier.py; the rest is "other"
PHASES = ("start", "stop", "requests", "metrics", "reset")


class PhaseClock:
    """Seconds per outermost phase of one case; its threads' batch is timed whole."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._active: str | None = None


CLOCK: contextvars.ContextVar[PhaseClock | None] = contextvars.ContextVar(
    "hybrid_prefix_cache_clock", default=None
)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase ``name`` of the running case, if any."""
    clock = CLOCK.get()
    if clock is None or clock._active is not None:
        yield
        return
    clock._active, start = name, time.monotonic()
    try:
        yield
    finally:
        clock.seconds[name] += time.monotonic() - start
        clock._active = None

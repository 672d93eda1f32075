# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of each workload, one module per ``workloads`` module
so that the workloads' plays never load this tier; :func:`catalog` finds them."""

import functools

from tests.models.hybrid_prefix_cache.scheduler.cell import Replay
from tests.models.hybrid_prefix_cache.workloads import package_catalog


@functools.cache
def catalog() -> dict[str, Replay]:
    """Every replay, by its workload's name."""
    return package_catalog(
        __path__, __name__, Replay, lambda r: r.workload.name, "two replays of {!r}"
    )

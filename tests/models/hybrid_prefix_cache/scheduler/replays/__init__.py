# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of each workload, one module per module of the
``workloads`` package, so the workloads' plays never load the scheduler tier;
:func:`catalog` finds new ones."""

import functools
import importlib
import pkgutil

from tests.models.hybrid_prefix_cache.scheduler.cell import Replay


@functools.cache
def catalog() -> dict[str, Replay]:
    """Every replay, by its workload's name."""
    found: dict[str, Replay] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if (
                isinstance(value, Replay)
                and found.get(value.workload.name) is not value
            ):
                if value.workload.name in found:
                    raise ValueError(f"two replays of {value.workload.name!r}")
                found[value.workload.name] = value
    return dict(sorted(found.items()))

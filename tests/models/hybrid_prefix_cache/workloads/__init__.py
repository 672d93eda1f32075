# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workloads beside the growing conversation, one module each, with its
:class:`harness.Workload` and play (``scheduler.replays`` holds the replays);
:func:`catalog` finds new ones."""

import functools
import importlib
import pkgutil

from tests.models.hybrid_prefix_cache.harness.workload import Workload


@functools.cache
def catalog() -> dict[str, Workload]:
    """Every workload, by name."""
    found: dict[str, Workload] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, Workload) and found.get(value.name) is not value:
                if value.name in found:
                    raise ValueError(f"two workloads are named {value.name!r}")
                found[value.name] = value
    return dict(sorted(found.items()))

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workloads beside the growing conversation, one module each with its Workload
and play (their replays: ``scheduler.replays``); :func:`catalog` finds new ones."""

import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable

from tests.models.hybrid_prefix_cache.harness.cases import Workload


def package_catalog(
    path: Iterable[str], package: str, kind: type, name_of: Callable, twice: str
) -> dict:
    """Every ``kind`` at the top of the modules of ``package`` (its ``__path__``
    and ``__name__``), by ``name_of``, sorted; a name of two values raises ``twice``."""
    found: dict = {}
    for info in pkgutil.iter_modules(path):
        module = importlib.import_module(f"{package}.{info.name}")
        for value in [v for v in vars(module).values() if isinstance(v, kind)]:
            if found.setdefault(name_of(value), value) is not value:
                raise ValueError(twice.format(name_of(value)))
    return dict(sorted(found.items()))


@functools.cache
def catalog() -> dict[str, Workload]:
    return package_catalog(
        __path__, __name__, Workload, lambda w: w.name, "two workloads are named {!r}"
    )

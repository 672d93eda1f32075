# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A poll delay (DELAY_ENV, microseconds) for NIXL's UCX progress thread, imported first
via PYTHONPATH, vLLM's nixl/base_worker.py unchanged: NIXL's ``_api.py`` hardcodes
``pthrDelay = 0``, so the thread spins a core (nixlUcxSharedThread)."""

import importlib.abc
import importlib.machinery
import os
import sys

DELAY_ENV = "HYBRID_PC_NIXL_PROGRESS_DELAY_US"


class _Bindings:
    """NIXL's binding module, with agents built at ``delay_us``."""

    def __init__(self, bindings, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str):
        return getattr(self._bindings, name)

    def nixlAgent(self, name, config):  # noqa: N802 - NIXL's name
        config.pthrDelay = self._delay_us  # delayed, it still wakes on a UCX event
        delay = f"{self._delay_us} us ({DELAY_ENV})"
        text = f"nixl_progress: agent {name}: progress thread poll delay {delay}"
        print(text, file=sys.stderr, flush=True)
        return self._bindings.nixlAgent(name, config)


class _AgentModuleFinder(importlib.abc.MetaPathFinder):
    """Finds NIXL's ``_api`` and swaps in :class:`_Bindings` once it ran."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, name, path, target=None):
        if name not in ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            module.nixlBind = _Bindings(module.nixlBind, self.delay_us)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(DELAY_ENV):
    sys.meta_path.insert(0, _AgentModuleFinder(int(os.environ[DELAY_ENV])))

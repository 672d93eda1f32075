# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A poll delay for NIXL's UCX progress thread, for the CPU tier's P/D
servers (cpu_binding.NIXL_PROGRESS puts this folder first on their
PYTHONPATH, so Python imports this file at start; nothing else is in it).

NIXL's Python agent (``nixl_agent.__init__`` in the wheel's ``_api.py``)
builds its ``nixlAgentConfig`` with ``pthrDelay = 0`` and offers no knob for
it, and vLLM builds its agent with the progress thread on
(distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py: only
``num_threads`` and ``capture_telemetry`` are passed). The UCX backend's
shared progress thread waits in ``poll()`` on the workers' event fds for
that delay, rounded up to whole milliseconds (nixlUcxSharedThread), so a
delay of 0 makes it spin: a whole core per P/D instance, on a machine with
a core per instance. With a delay the thread still wakes at once on a UCX
event, and at the latest after the delay; transfers are also progressed
whenever vLLM polls them (checkXferState). Nothing of vLLM is changed.

The delay, in microseconds, is HYBRID_PC_NIXL_PROGRESS_DELAY_US; unset, this
file does nothing. Each agent it sets says so on stderr (the server log).
"""

import importlib.abc
import importlib.machinery
import os
import sys

DELAY_ENV = "HYBRID_PC_NIXL_PROGRESS_DELAY_US"
# The module of each NIXL wheel variant that builds the agent's config.
AGENT_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api")


class _Bindings:
    """NIXL's binding module as ``_api`` sees it, with agents built at
    ``delay_us``."""

    def __init__(self, bindings, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str):
        return getattr(self._bindings, name)

    def nixlAgent(self, name, config):  # noqa: N802 - NIXL's name
        config.pthrDelay = self._delay_us
        print(
            f"nixl_progress: agent {name}: progress thread poll delay "
            f"{self._delay_us} us ({DELAY_ENV})",
            file=sys.stderr,
            flush=True,
        )
        return self._bindings.nixlAgent(name, config)


class _AgentModuleFinder(importlib.abc.MetaPathFinder):
    """Finds NIXL's ``_api`` as the path finder does, and once it ran, hands
    it :class:`_Bindings` in place of its binding module."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, name, path, target=None):
        if name not in AGENT_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        delay_us = self.delay_us

        def exec_module(module) -> None:
            run(module)
            module.nixlBind = _Bindings(module.nixlBind, delay_us)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(DELAY_ENV):
    sys.meta_path.insert(0, _AgentModuleFinder(int(os.environ[DELAY_ENV])))

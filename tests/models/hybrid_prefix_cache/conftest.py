# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Session plumbing of the hybrid prefix-cache suite: the suite's pytest
plugin (harness/plugin.py), and this folder's own opt-out of vLLM's global
cleanup after each test."""

import sys

import pytest

from tests.models.hybrid_prefix_cache.harness.plugin import *  # noqa: F401,F403

SCHEDULER_ENGINE = "tests.models.hybrid_prefix_cache.scheduler.engine"


def pytest_terminal_summary(terminalreporter) -> None:
    """Say plainly when the vLLM under test cannot run its CPU model runner
    here, which the scheduler tier, running no model, did without."""
    engine = sys.modules.get(SCHEDULER_ENGINE)
    if engine is None or not engine.runner_needs_triton():
        return
    import vllm

    terminalreporter.write_line(
        f"vLLM {vllm.__version__} refuses to run its CPU model runner on this "
        f"x86 CPU without Triton (triton-cpu), which is not installed here "
        f"(platforms/cpu.py CpuPlatform.check_and_update_config): no CPU server "
        f"of it can start. The scheduler tier, which runs no model, built its "
        f"configs with Triton declared present for that check alone "
        f"(scheduler.build_config).",
        yellow=True,
    )


# Here, not in the plugin: models/kimi_k3, whose prefix-cache module loads the
# plugin too, holds upstream's GPU tests, which need the global cleanup.
@pytest.fixture
def should_do_global_cleanup_after_test() -> bool:
    """No test here sets up vLLM's distributed state or a device in-process
    (servers are processes of their own; the scheduler tier and the
    in-process config checks build configs only), so skip the global cleanup
    of vLLM's tests/conftest.py after each test, as that fixture's
    docstring invites: about 0.4 s per test here."""
    return False

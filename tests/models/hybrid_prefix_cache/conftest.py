# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Session plumbing: the suite's pytest plugin (harness/plugin.py) and fixtures."""

import sys

import pytest

from tests.models.hybrid_prefix_cache.harness.plugin import *  # noqa: F401,F403

SCHEDULER_ENGINE = "tests.models.hybrid_prefix_cache.scheduler.engine"


def pytest_terminal_summary(terminalreporter) -> None:
    """Say when this vLLM cannot run its CPU model runner here (no Triton)."""
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


# Imported when asked for: the GPU tier collects this folder on other releases.
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The CPU tier's model; also the Kimi-K3 scheduler's stand-in ModelConfig."""
    from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid

    return write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid"))


@pytest.fixture(scope="module")
def cpu_binding(tiny_model):
    from tests.models.hybrid_prefix_cache import cpu_binding as cpu

    return cpu.cpu_binding(tiny_model)


# Not in the plugin: models/kimi_k3 loads it and its GPU tests need the cleanup.
@pytest.fixture
def should_do_global_cleanup_after_test() -> bool:
    """No test here sets up a device in-process: skip tests/conftest.py's cleanup."""
    return False

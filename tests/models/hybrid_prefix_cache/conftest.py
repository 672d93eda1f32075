# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Session plumbing of the hybrid prefix-cache suite: the suite's pytest
plugin (harness/plugin.py), and this folder's own opt-out of vLLM's global
cleanup after each test."""

import pytest

from tests.models.hybrid_prefix_cache.harness.plugin import *  # noqa: F401,F403


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

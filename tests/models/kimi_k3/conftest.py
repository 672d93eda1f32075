# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Kimi-K3 prefix-cache matrix shares the hybrid prefix-cache suite's
test grouping, server pool and case summary."""

from tests.models.hybrid_prefix_cache.harness.plugin import *  # noqa: F401,F403

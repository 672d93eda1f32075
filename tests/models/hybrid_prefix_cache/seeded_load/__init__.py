# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The load format ``hybrid_seeded`` and the env that gives it to a server."""

from pathlib import Path

from tests.models.hybrid_prefix_cache.seeded_load.hybrid_seeded_load import (
    LOAD_FORMAT,
    seeded_init,
)

__all__ = ["ENV", "LOAD_FORMAT", "seeded_init"]

ENV = {"PYTHONPATH": str(Path(__file__).parent)}

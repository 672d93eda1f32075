# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The load format ``hybrid_seeded`` and the env that gives it to a server: its code
(``hybrid_seeded_load.py``) runs in the server as a vLLM general plugin; a test needs
only the name it registers (test_seeded_load.py checks it) and the folder."""

from pathlib import Path

__all__ = ["ENV", "LOAD_FORMAT"]

LOAD_FORMAT = "hybrid_seeded"
ENV = {"PYTHONPATH": str(Path(__file__).parent)}

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/provision.sh, run as the provisioning tests run it."""

import os
import subprocess
from pathlib import Path

PROVISION = Path(__file__).resolve().parents[1] / "provision.sh"


def run_provision(timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """dev/provision.sh with ``env`` over this process's environment."""
    return subprocess.run(
        ["bash", str(PROVISION)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )

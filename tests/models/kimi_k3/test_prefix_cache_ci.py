# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prefix-cache suite's CI files, checked against this vLLM checkout.

``.buildkite/test_areas/models_basic.yaml`` must parse with unique keys,
name only paths that exist, and shard the Kimi-K3 matrix so that every case
runs exactly once. ``.buildkite/scripts/install-kv-connectors.sh`` must pick
the NIXL wheel variant of torch's CUDA version (checked in its dry-run mode
against a stub ``python3``) and, on this platform, have installed a NIXL that
imports.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import vllm
from vllm.platforms import current_platform

ROOT = Path(__file__).resolve().parents[3]
TESTS = ROOT / "tests"
AREA = ROOT / ".buildkite/test_areas/models_basic.yaml"
SCRIPT = ROOT / ".buildkite/scripts/install-kv-connectors.sh"
MATRIX_MODULE = "models/kimi_k3/test_prefix_cache.py"
SHARDED_KEY = "kimi-k3-prefix-cache-4xb200"
SINGLE_GPU_KEY = "kimi-k3-unit-tests-b200"
CPU_KEY = "hybrid-prefix-cache-cpu"
OUR_KEYS = (SINGLE_GPU_KEY, SHARDED_KEY, CPU_KEY)
# The installed vllm package stands for the checkout's source vllm/ folder
# (same version); it is the folder that exists wherever the tests import vllm.
VLLM_SOURCE_ROOT = Path(vllm.__file__).resolve().parent.parent


def _steps() -> list[dict]:
    return yaml.safe_load(AREA.read_text())["steps"]


def _step(key: str) -> dict:
    (step,) = [s for s in _steps() if s["key"] == key]
    return step


def _pytest_commands(step: dict) -> list[list[str]]:
    commands = [
        *step["commands"],
        *step.get("mirror", {}).get("amd", {}).get("commands", []),
    ]
    return [shlex.split(c) for c in commands if c.startswith("pytest ")]


def collect(argv: list[str], shard: tuple[int, int] | None = None) -> list[str]:
    """The node ids a step's pytest command selects, run from tests/."""
    args = []
    for arg in argv[1:]:
        if shard is not None:
            arg = arg.replace("$$BUILDKITE_PARALLEL_JOB_COUNT", str(shard[1]))
            arg = arg.replace("$$BUILDKITE_PARALLEL_JOB", str(shard[0]))
        if arg not in ("-v", "-s"):
            args.append(arg)
    assert not any("$" in arg for arg in args), args
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
            *args,
        ],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


def in_matrix(node: str) -> bool:
    """Whether a collected node id is a case of the Kimi-K3 matrix module."""
    return node.split("::", 1)[0].endswith(MATRIX_MODULE)


def test_area_parses_with_unique_keys():
    keys = [step["key"] for step in _steps()]
    assert len(keys) == len(set(keys)), "models_basic.yaml repeats a key"
    for key in OUR_KEYS:
        assert keys.count(key) == 1, key


@pytest.mark.parametrize("key", OUR_KEYS)
def test_source_file_dependencies_exist(key):
    step = _step(key)
    paths = [
        *step["source_file_dependencies"],
        *step.get("mirror", {}).get("amd", {}).get("source_file_dependencies", []),
    ]
    missing = []
    for path in (p.lstrip("!") for p in paths):
        root = VLLM_SOURCE_ROOT if path.startswith("vllm/") else ROOT
        if not (root / path).exists():
            missing.append(path)
    assert not missing, f"{key}: no such paths: {missing}"


@pytest.mark.parametrize("key", OUR_KEYS)
def test_command_test_paths_exist(key):
    for argv in _pytest_commands(_step(key)):
        paths = [a for a in argv[1:] if not a.startswith("-")]
        ignored = [a.split("=", 1)[1] for a in argv if a.startswith("--ignore=")]
        missing = [p for p in paths + ignored if not (TESTS / p).exists()]
        assert not missing, f"{key}: {shlex.join(argv)} names missing {missing}"


def test_shards_select_every_matrix_case_once():
    (argv,) = _pytest_commands(_step(SHARDED_KEY))
    assert MATRIX_MODULE in argv
    everything = collect(
        [
            a
            for a in argv
            if not a.startswith("--shard-id") and not a.startswith("--num-shards")
        ]
    )
    shards = [collect(argv, shard=(i, 2)) for i in range(2)]
    assert all(shards), "a shard selects nothing"
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == sorted(everything)
    assert len(everything) == 31
    assert all(in_matrix(node) for node in everything)


def test_single_gpu_step_collects_no_matrix_case():
    argv = _pytest_commands(_step(SINGLE_GPU_KEY))[0]
    nodes = collect(argv)
    assert nodes, "the single-GPU Kimi K3 step collects nothing"
    assert not [n for n in nodes if in_matrix(n)]


def _requirements_pin(name: str) -> str:
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        if line.replace(" ", "").startswith("nixl=="):
            return line.replace(" ", "").split("==", 1)[1]
    raise AssertionError(f"requirements/{name} pins no nixl")


def dry_run(tmp_path: Path, probe: str) -> subprocess.CompletedProcess:
    """Run the install script against a stub python3 that reports ``probe``."""
    stub = tmp_path / "bin"
    stub.mkdir(parents=True)
    (stub / "python3").write_text(f"#!/bin/sh\ncat >/dev/null\necho '{probe}'\n")
    (stub / "python3").chmod(0o755)
    path = os.pathsep.join([str(stub), "/usr/bin", "/bin"])
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={"PATH": path, "KV_CONNECTORS_DRY_RUN": "1", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("major", "other", "requirements"),
    [("12", "13", "kv_connectors_cu12.txt"), ("13", "12", "kv_connectors.txt")],
)
def test_install_script_picks_the_cuda_variant(tmp_path, major, other, requirements):
    result = dry_run(tmp_path, f"cuda {major}")
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if line.startswith("+")]
    pin = _requirements_pin(requirements)
    assert any(f"requirements/{requirements}" in c for c in commands), commands
    assert any("uninstall" in c and f"nixl-cu{other}" in c for c in commands)
    (install,) = [c for c in commands if f"nixl-cu{major}==" in c]
    assert "--no-deps" in install
    assert install.endswith(f"nixl-cu{major}=={pin}"), install
    # torch is held at what is installed.
    assert all("-c " in c for c in commands if "-r " in c)


def test_install_script_rocm_and_unknown_cuda(tmp_path):
    rocm = dry_run(tmp_path / "rocm", "rocm -")
    assert rocm.returncode == 0, rocm.stderr
    assert "requirements/kv_connectors_rocm.txt" in rocm.stdout
    cuda11 = dry_run(tmp_path / "cuda11", "cuda 11")
    assert cuda11.returncode == 1
    assert "no NIXL wheel variant for CUDA 11" in cuda11.stderr


@pytest.mark.skipif(
    not current_platform.is_cpu(), reason="checks the CPU install of NIXL"
)
def test_nixl_installed_on_cpu():
    """install-kv-connectors.sh ran before this suite; NIXL must import."""
    from vllm.distributed import nixl_utils
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    connector = KVConnectorFactory.get_connector_class_by_name("NixlConnector")
    assert "Nixl" in connector.__name__, connector
    # vLLM's NIXL loader answers None when the nixl package does not import.
    assert nixl_utils.NixlWrapper is not None, "vLLM finds no usable NIXL"
    assert nixl_utils.nixl_agent_config is not None

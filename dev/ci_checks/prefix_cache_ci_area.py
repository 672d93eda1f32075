# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vLLM checkout's ``.buildkite/test_areas/models_basic.yaml``, with our
files laid over it, as the CI checks read it: steps, their pytest commands and
folders, setup, scripts. The checks run from the checkout (dev/suite.sh), so
the checkout is the working folder; HYBRID_PC_CHECKOUT names another."""

import os
import re
import shlex
from pathlib import Path

import vllm
import yaml

ROOT = Path(os.environ.get("HYBRID_PC_CHECKOUT", os.getcwd())).resolve()
if not (ROOT / ".buildkite/test_areas").is_dir() or not (ROOT / "tests").is_dir():
    raise RuntimeError(
        f"{ROOT} is no vLLM checkout: run the CI checks from one "
        f"(dev/suite.sh does) or name it in HYBRID_PC_CHECKOUT"
    )
TESTS = ROOT / "tests"
AREA = ROOT / ".buildkite/test_areas/models_basic.yaml"
SCRIPT = ROOT / ".buildkite/scripts/install-kv-connectors.sh"
MATRIX_MODULE = "models/kimi_k3/test_prefix_cache.py"
BINDING_MODULE = "models/kimi_k3/prefix_cache_binding.py"
SHARDED_KEY = "kimi-k3-prefix-cache-4xb200"
SINGLE_GPU_KEY = "kimi-k3-unit-tests-b200"
CPU_KEY = "hybrid-prefix-cache-cpu"
GPU_KEY = "hybrid-prefix-cache-gpu"
OUR_KEYS = (SINGLE_GPU_KEY, SHARDED_KEY, GPU_KEY, CPU_KEY)
GPU_TIER_MODULE = "models/hybrid_prefix_cache/test_gpu_tier.py"
# A step that imports a file of these folders must list it as a trigger.
SUITE_FOLDERS = ("tests/models/hybrid_prefix_cache/", "tests/models/kimi_k3/")
HARNESS = "tests/models/hybrid_prefix_cache/harness/"
# The installed vllm stands for the checkout's source vllm/ (same version).
VLLM_SOURCE_ROOT = Path(vllm.__file__).resolve().parent.parent


def _steps() -> list[dict]:
    return yaml.safe_load(AREA.read_text())["steps"]


def _step(key: str) -> dict:
    (step,) = [s for s in _steps() if s["key"] == key]
    return step


def _pytest_commands(step: dict) -> list[list[str]]:
    return [argv for argv, _ in _pytest_runs(step)]


# vLLM's pipeline generator runs every test-area step here by default.
DEFAULT_WORKING_DIR = "/vllm-workspace/tests"


def _here(working_dir: str) -> Path:
    """The folder of this checkout that a CI working_dir is."""
    relative = Path(working_dir).relative_to("/vllm-workspace")
    return ROOT / relative


def _pytest_runs(step: dict) -> list[tuple[list[str], Path]]:
    """A step's and its mirror's pytest commands, split, with where each runs."""
    here = step.get("working_dir", DEFAULT_WORKING_DIR)
    amd = step.get("mirror", {}).get("amd", {})
    runs = [(c, here) for c in step.get("commands", [])]
    runs += [(c, amd.get("working_dir", here)) for c in amd.get("commands", [])]
    return [
        (shlex.split(c), _here(folder)) for c, folder in runs if c.startswith("pytest ")
    ]


def _unsharded(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith(("--shard-id", "--num-shards"))]


def covered(path: str, listed: list[str]) -> bool:
    """Whether a trigger of ``listed`` (a file, or a folder/) covers ``path``."""
    return any(path == d or (d.endswith("/") and path.startswith(d)) for d in listed)


def in_matrix(node: str) -> bool:
    """Whether a collected node id is a case of the Kimi-K3 matrix module."""
    return node.split("::", 1)[0].endswith(MATRIX_MODULE)


TRIGGERS = "source_file_dependencies"
# 0.34.0's KV connector steps only verify the packages its image bakes in.
CHECK_SCRIPT = ".buildkite/scripts/check-kv-connectors.sh"
INSTALL_SCRIPT = SCRIPT.relative_to(ROOT).as_posix()


def setup(commands: list) -> list:
    """A step's setup: its commands before its first pytest command."""
    pytest_at = [i for i, c in enumerate(commands) if c.startswith("pytest ")]
    return commands[: pytest_at[0] if pytest_at else len(commands)]


def scripts(commands: list) -> list[str]:
    """The files of the checkout's .buildkite/scripts/ that commands run."""
    found = re.findall(r"(?<![\w.-])(\.buildkite/scripts/[\w./-]+)", " ".join(commands))
    return list(dict.fromkeys(found))

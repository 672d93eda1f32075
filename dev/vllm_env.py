# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks a virtual environment with its own vLLM (``env VENV``): that its
vLLM imports, is of the pinned release line, runs on the CPU platform and is
registered as the distribution ``vllm``, that it has ``bin/vllm``, and what
the suite imports beside vLLM (pytest, tblib, ...), naming what is missing."""

import json
import os
import subprocess
import tempfile
from pathlib import Path

from vllm_tree import Refusal, check_release_line

# What the suite imports beside vLLM, by module, with the distribution to
# install when it is missing (pinned where dev/requirements-cpu.txt pins it).
SUITE_MODULES = {
    "pytest": "pytest",
    "pytest_shard": "pytest-shard",
    "tblib": "tblib",
    "requests": "requests",
    "prometheus_client": "prometheus-client",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "torch": "torch",
}


PROBE = r"""
import importlib.metadata as md
import importlib.util
import json
import sys

modules = json.loads(sys.argv[1])
out = {"missing": [m for m in modules if importlib.util.find_spec(m) is None]}
try:
    import vllm

    out["file"] = vllm.__file__
    out["version"] = getattr(vllm, "__version__", None)
    from vllm.platforms import current_platform

    out["cpu"] = bool(current_platform.is_cpu())
    out["platform"] = str(getattr(current_platform, "device_type", "?"))
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
try:
    out["distribution"] = md.version("vllm")
except md.PackageNotFoundError:
    out["distribution"] = None
print("PROBE " + json.dumps(out))
"""


def requirement_pins(requirements: Path | None) -> dict[str, str]:
    pins = {}
    if requirements is not None and requirements.is_file():
        for line in requirements.read_text().splitlines():
            name, sep, _ = line.partition("==")
            if sep and not line.startswith("#"):
                pins[name.strip().lower()] = line.strip()
    return pins


def check_env(venv: Path, pinned: str, requirements: Path | None = None) -> Path:
    """``venv`` if its vLLM can run the suite; otherwise a Refusal."""
    venv = venv.resolve()
    python = venv / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise Refusal(f"{venv} is not a virtual environment (no bin/python)")
    with tempfile.TemporaryDirectory() as cwd:  # no vllm/ of the caller's cwd
        result = subprocess.run(
            [str(python), "-c", PROBE, json.dumps(list(SUITE_MODULES))],
            cwd=cwd,
            capture_output=True,
            text=True,
        )
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    if not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise Refusal(f"{python} cannot run a probe: {tail}")
    probe = json.loads(lines[-1].removeprefix("PROBE "))
    if "error" in probe:
        raise Refusal(f"{venv} cannot import vllm ({probe['error']})")
    check_release_line(str(probe["version"]), pinned, f"{venv}'s vllm")
    if not probe["cpu"]:
        raise Refusal(
            f"{venv}'s vllm runs on the {probe['platform']!r} platform, not on "
            f"CPU: build it for CPU (VLLM_TARGET_DEVICE=cpu)"
        )
    if probe["distribution"] is None:
        raise Refusal(
            f"{venv}'s vllm is not installed as the distribution 'vllm' "
            f"(vLLM's CLI reads importlib.metadata.version('vllm')): install "
            f"it with pip, e.g. pip install -e ."
        )
    if not os.access(venv / "bin" / "vllm", os.X_OK):
        raise Refusal(f"{venv} has no bin/vllm, which the suite starts servers with")
    if probe["missing"]:
        pins = requirement_pins(requirements)
        wanted = [SUITE_MODULES[m] for m in probe["missing"]]
        install = " ".join(pins.get(name, name) for name in wanted)
        raise Refusal(
            f"{venv} lacks {', '.join(wanted)}, which the suite needs beside "
            f"vLLM: {python} -m pip install {install}"
        )
    return venv

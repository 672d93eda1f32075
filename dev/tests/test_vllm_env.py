# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/vllm_under_test.py env: the checks of a developer's environment, on
fake environments."""

import sys
import venv
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vllm_under_test as vut  # noqa: E402

from .vllm_fakes import write_files

DEV = Path(__file__).resolve().parents[1]
PINNED = "0.32.0"


FAKE_VLLM = {
    "vllm/__init__.py": "__version__ = {version!r}\n",
    "vllm/platforms/__init__.py": (
        "class _P:\n"
        "    device_type = {device!r}\n"
        "    def is_cpu(self):\n"
        "        return self.device_type == 'cpu'\n"
        "current_platform = _P()\n"
    ),
}


def fake_env(
    tmp_path: Path,
    version="0.32.1",
    device="cpu",
    dist=True,
    cli=True,
    have=tuple(vut.SUITE_MODULES),
) -> Path:
    """A virtual environment with a stand-in vllm and stand-ins of the
    modules in ``have``."""
    path = tmp_path / "venv"
    venv.create(path, with_pip=False)
    site = next((path / "lib").glob("python3*/site-packages"))
    for name, text in FAKE_VLLM.items():
        write_files(site, {name: text.format(version=version, device=device)})
    for module in have:
        write_files(site, {f"{module}/__init__.py": ""})
    if dist:
        info = site / f"vllm-{version}+cpu.dist-info"
        write_files(info, {"METADATA": f"Name: vllm\nVersion: {version}+cpu\n"})
    if cli:
        (path / "bin/vllm").write_text("#!/bin/sh\necho fake\n")
        (path / "bin/vllm").chmod(0o755)
    return path


REQUIREMENTS = DEV / "requirements-cpu.txt"


def test_a_complete_environment_is_accepted(tmp_path):
    path = fake_env(tmp_path)
    assert vut.check_env(path, PINNED, REQUIREMENTS) == path


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"version": "0.33.0"}, "'s vllm is vLLM 0.33.0, not of the pinned release"),
        ({"device": "cuda"}, "'s vllm runs on the 'cuda' platform, not on CPU"),
        ({"dist": False}, "is not installed as the distribution 'vllm'"),
        ({"cli": False}, "has no bin/vllm"),
        (
            {"have": ("requests", "torch", "transformers", "tokenizers")},
            "lacks pytest, pytest-shard, tblib, prometheus-client, which the "
            "suite needs beside vLLM: ",
        ),
    ],
    ids=["release-line", "platform", "distribution", "cli", "missing"],
)
def test_an_unfit_environment_is_refused(tmp_path, kwargs, message):
    path = fake_env(tmp_path, **kwargs)
    with pytest.raises(vut.Refusal) as refusal:
        vut.check_env(path, PINNED, REQUIREMENTS)
    assert message in str(refusal.value)
    if "have" in kwargs:  # says how, with our pins
        assert "-m pip install pytest==9.2.0 pytest-shard==0.1.2 tblib==3.2.2 " in (
            str(refusal.value)
        )


def test_an_environment_without_vllm_or_python(tmp_path):
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)
    with pytest.raises(vut.Refusal, match="cannot import vllm .ModuleNotFoundError"):
        vut.check_env(bare, PINNED)
    with pytest.raises(vut.Refusal, match="is not a virtual environment"):
        vut.check_env(tmp_path / "nothing", PINNED)

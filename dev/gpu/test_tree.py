# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's own test helpers of the release the GPU bundle carries, for the
accelerator machine: the suite runs from a vLLM checkout's tests/ (it uses
``tests.utils.RemoteOpenAIServer`` and ``tests.models.utils``), and the
machine has no package index to fetch them from.

    python dev/gpu/test_tree.py [OUT_DIR]   # default <repo>/.gpu-bundle

Downloads the release's sdist (the version of bundle.toml's vLLM) and writes
``vllm-tests.tar.gz``: the few files of its tests/ that the suite imports,
and its pyproject.toml (pytest's markers). Nothing of it is committed here;
dev/gpu/run_tier.sh lays the suite's tests/ over it on the machine.
"""

import argparse
import os
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().parent / "bundle.toml"
NAME = "vllm-tests.tar.gz"
# What the suite imports of a checkout's tests/, and pytest's settings.
FILES = (
    "pyproject.toml",
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/utils.py",
    "tests/models/__init__.py",
    "tests/models/utils.py",
)


def pinned_version() -> str:
    with open(CONFIG, "rb") as f:
        return tomllib.load(f)["vllm"]


def fetch_sdist(version: str, cache: Path) -> Path:
    """The vLLM ``version`` sdist, from the package index (its metadata is
    built with no device, and with the version as released)."""
    sdist = cache / f"vllm-{version}.tar.gz"
    if sdist.exists():
        return sdist
    cache.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "empty",
        "VLLM_VERSION_OVERRIDE": version,
    }
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
    command += ["--no-binary", ":all:", "--no-build-isolation", "-d", str(cache)]
    subprocess.run([*command, f"vllm=={version}"], env=env, check=True)
    if not sdist.exists():
        raise SystemExit(f"test_tree.py: pip left no {sdist.name} in {cache}")
    return sdist


def write_tree(sdist: Path, version: str, out: Path) -> Path:
    """Write :data:`FILES` of ``sdist`` into ``out``/:data:`NAME`, with
    fixed times and owners, so that the same sdist gives the same bytes."""
    target = out / NAME
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist) as source, tarfile.open(target, "w:gz") as tree:
        for name in FILES:
            member = source.getmember(prefix + name)
            data = source.extractfile(member)
            member.name = name
            member.mtime, member.uid, member.gid = 0, 0, 0
            member.uname = member.gname = ""
            member.pax_headers = {}
            tree.addfile(member, data)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dev/gpu/test_tree.py")
    parser.add_argument("out_dir", nargs="?", type=Path, default=REPO / ".gpu-bundle")
    args = parser.parse_args(argv)
    version = pinned_version()
    sdist = fetch_sdist(version, args.out_dir / "cache" / "sdist")
    target = write_tree(sdist, version, args.out_dir)
    print(f"wrote {target} ({target.stat().st_size} bytes) from vLLM {version}")


if __name__ == "__main__":
    main()

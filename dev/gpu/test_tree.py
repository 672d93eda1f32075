# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's own test helpers of the release the GPU bundle carries, for the
accelerator machine: the suite runs from a vLLM checkout's tests/ (it uses
``tests.utils.RemoteOpenAIServer`` and ``tests.models.utils``), and the
machine has no package index to fetch them from.

    python dev/gpu/test_tree.py [OUT_DIR]   # default <repo>/.gpu-bundle

Downloads the release's sdist (the version of bundle.toml's vLLM) and writes
``vllm-tests.tar.gz``: the few files of its tests/ that the suite imports,
and its pyproject.toml (pytest's markers), with the wheels those files
import that neither the machine nor the bundle has (:data:`WHEELS`). Nothing
of it is committed here; dev/gpu/run_tier.sh installs the wheels and lays the
suite's tests/ over the files on the machine.
"""

import argparse
import ast
import os
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().parent / "bundle.toml"
NAME = "vllm-tests.tar.gz"
# What the suite imports of a checkout's tests/ (and what those import of
# it, found by closure), and pytest's settings.
SEEDS = ("tests/conftest.py", "tests/utils.py", "tests/models/utils.py")
SETTINGS = ("pyproject.toml",)
# What vLLM's tests/conftest.py imports that the machine lacks (seen on the
# H200: "No module named 'tblib'"), at the version the CPU tier pins.
WHEELS = ("tblib==3.2.2",)


def _imported(path: str, source: str) -> set[str]:
    """The modules of the tests package that ``source`` (at ``path``)
    imports, anywhere in it, as file paths of either form (module.py or
    package/__init__.py)."""
    package = path.rsplit("/", 1)[0].split("/")
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = [*base, *(node.module or "").split(".")]
            module = [part for part in module if part]
            names = [".".join(module)]
            names += [".".join([*module, alias.name]) for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "tests":
                continue
            for end in range(1, len(parts) + 1):
                stem = "/".join(parts[:end])
                found |= {f"{stem}.py", f"{stem}/__init__.py"}
    return found


def closure(members: dict[str, bytes]) -> list[str]:
    """The files of ``members`` (path in the tests/ tree: bytes) that the
    seeds reach by their imports, the seeds and their packages included."""
    wanted, todo = set(), [*SEEDS]
    while todo:
        path = todo.pop()
        if path in wanted or path not in members:
            continue
        wanted.add(path)
        todo += sorted(_imported(path, members[path].decode()))
        parent = path.rsplit("/", 1)[0]
        while parent:
            todo.append(f"{parent}/__init__.py")
            parent = parent.rpartition("/")[0]
    return sorted(wanted)


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


def fetch_wheels(cache: Path) -> list[Path]:
    """:data:`WHEELS`, pure-Python wheels, from the package index."""
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
    command += ["--only-binary", ":all:", "-d", str(cache), *WHEELS]
    subprocess.run(command, check=True)
    names = {w.split("==")[0].replace("-", "_") for w in WHEELS}
    return sorted(p for p in cache.glob("*.whl") if p.name.split("-")[0] in names)


def write_tree(sdist: Path, version: str, out: Path, wheels=()) -> Path:
    """Write the files of ``sdist`` that the suite needs (:func:`closure`,
    and :data:`SETTINGS`) into ``out``/:data:`NAME`, with fixed times and
    owners, so that the same sdist gives the same bytes."""
    target = out / NAME
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist) as source, tarfile.open(target, "w:gz") as tree:
        tests = {
            m.name.removeprefix(prefix): m
            for m in source.getmembers()
            if m.isfile()
            and m.name.startswith(prefix + "tests/")
            and m.name.endswith(".py")
        }
        contents = {name: source.extractfile(m).read() for name, m in tests.items()}
        for name in [*SETTINGS, *closure(contents)]:
            member = source.getmember(prefix + name)
            data = source.extractfile(member)
            member.name = name
            member.mtime, member.uid, member.gid = 0, 0, 0
            member.uname = member.gname = ""
            member.pax_headers = {}
            tree.addfile(member, data)
        for wheel in wheels:
            info = tree.gettarinfo(wheel, arcname=f"wheels/{wheel.name}")
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(wheel, "rb") as f:
                tree.addfile(info, f)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dev/gpu/test_tree.py")
    parser.add_argument("out_dir", nargs="?", type=Path, default=REPO / ".gpu-bundle")
    parser.add_argument("--vllm", help="the release (default: bundle.toml's)")
    args = parser.parse_args(argv)
    version = args.vllm or pinned_version()
    sdist = fetch_sdist(version, args.out_dir / "cache" / "sdist")
    wheels = fetch_wheels(args.out_dir / "cache" / "test-wheels")
    target = write_tree(sdist, version, args.out_dir, wheels)
    print(f"wrote {target} ({target.stat().st_size} bytes) from vLLM {version}")


if __name__ == "__main__":
    main()

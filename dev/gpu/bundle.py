# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Carry vLLM to the accelerator machine, which has no package index.

    python dev/gpu/bundle.py build [OUT_DIR]   # default <repo>/.gpu-bundle
    python dev/gpu/bundle.py verify [OUT_DIR]
    python dev/gpu/bundle.py calls [OUT_DIR]   # the device calls, in order

``build`` downloads the vLLM wheel for the machine (bundle.toml: Python 3.12,
Linux x86-64), cuts the files it does not need there, lets pip resolve vLLM's
requirements for that target, keeps what the machine lacks (less the heavy
optional packages), adds NIXL in a part of its own, and writes tars split into
``part-NN`` files with ``manifest.json``. pip runs under the machine's Python
version (``--python``): pip evaluates markers for the interpreter it runs in.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import manifest as mf  # noqa: E402
from closure import (  # noqa: E402
    Closure,
    Dist,
    canonicalize_name,
    requirements,
    satisfies,
    walk,
    wheel_dist,
)
from wheels import sha256_file, split, trim_wheel, write_tar  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).resolve().parent / "bundle.toml"
MiB = mf.MiB
# Report what pip said, never where from.
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)


class BundleError(Exception):
    pass


def find_python(version: str) -> str | None:
    """A working ``python<version>``: on PATH, else a pyenv build (whose shim
    on PATH fails unless that version is selected)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = [shutil.which(f"python{version}")]
    found += sorted(map(str, root.glob(f"versions/{version}.*/bin/python{version}")))
    probe = "import sys; print('%d.%d' % sys.version_info[:2])"
    for python in filter(None, found):
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == version:
            return python
    return None


def platforms(glibc: str) -> list[str]:
    """The manylinux tags, newest first; pip matches each one exactly."""
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for n in range(int(glibc.split(".")[1]), 4, -1):
        tags.append(f"manylinux_2_{n}_x86_64")
        if n in legacy:
            tags.append(f"{legacy[n]}_x86_64")
    return tags


class Pip:
    """pip for the machine's target; each run's output goes to a log in the
    cache, and a failure says pip's last error lines."""

    def __init__(self, python: str, cfg: dict, cache: Path, extra: list[str]):
        self.python, self.cache, self.extra = python, cache, extra
        self.target = ["--only-binary=:all:", "--implementation", "cp"]
        self.target += ["--python-version", cfg["machine"]["python"]]
        for tag in platforms(cfg["machine"]["glibc"]):
            self.target += ["--platform", tag]

    def __call__(self, log: str, *args: str) -> None:
        cmd = [self.python, "-m", "pip", *args, *self.target, *self.extra]
        with open(self.cache / log, "w") as out:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode:
            lines = (self.cache / log).read_text().splitlines()
            said = [ln for ln in lines if "ERROR" in ln][-3:] or lines[-3:]
            said = [URL.sub("<index>", ln) for ln in said]
            raise BundleError(f"pip {args[0]} failed ({log}): {' | '.join(said)}")

    def download(self, log: str, dest: Path, pins: list[str]) -> None:
        self(log, "download", "-q", "--no-deps", "-d", str(dest), *pins)

    def report(self, log: str, roots: list[str], pins: dict[str, str]) -> dict:
        out, cons = self.cache / f"{log}.json", self.cache / f"{log}.pins.txt"
        cons.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
        args = ["install", "--dry-run", "--ignore-installed", "-q", "--report"]
        args += [str(out), "--target", str(self.cache / "target"), "-c", str(cons)]
        self(f"{log}.log", *args, *roots)
        return json.loads(out.read_text())


@dataclass
class Resolution:
    dists: dict[str, Dist]  # pip's choice for each name, vLLM's from its wheel
    files: dict[str, tuple[str, str | None]]  # its file name and sha256
    main: Closure  # what vLLM needs
    side: Closure  # what NIXL needs beyond that
    roots: dict[str, list[str]]
    platforms: list[str]
    known: dict[str, str]
    present: set[str]  # what the machine's own packages serve
    pins: dict[str, str] = field(default_factory=dict)
    note: str = ""
    drops: dict[str, list[str]] = field(default_factory=dict)
    # the machine's packages replaced, because a requirement refuses the
    # version there: name -> {required_by: specifier}
    replaced: dict[str, dict[str, str]] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)  # name -> why


def read_report(report: dict, cfg: dict) -> tuple[dict, dict]:
    env, want = report["environment"], cfg["machine"]["markers"]
    keys = ("python_version", "sys_platform", "platform_machine", "implementation_name")
    wrong = {k: env.get(k) for k in keys if env.get(k) != want[k]}
    if wrong:
        raise BundleError(
            f"pip ran for {wrong}, the machine is { ({k: want[k] for k in wrong}) }: "
            f"give --python a Python {want['python_version']} on Linux x86-64"
        )
    dists, files = {}, {}
    for item in report["install"]:
        meta, info = item["metadata"], item["download_info"]
        name = canonicalize_name(meta["name"])
        dists[name] = Dist(name, meta["version"], tuple(meta.get("requires_dist", ())))
        sha = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        files[name] = (info["url"].rsplit("/", 1)[-1], sha)
    return dists, files


def pip_roots(vllm: Dist, env: dict[str, str], leave: set[str]) -> list[str]:
    """The requirements of ``vllm`` on the machine, as pip's roots, less ``leave``: what
    never travels (excluded), so its pins need not exist in the registry, and
    what the machine keeps (pinned to its own version instead)."""
    roots = []
    for req in requirements(vllm, env):
        if canonicalize_name(req.name) not in leave:
            req.marker = None
            roots.append(str(req))
    return roots


def needing(
    free: Resolution, known: dict, kept: set[str], carried: set[str], env: dict
) -> dict[str, dict[str, str]]:
    """The machine's packages that a carried package's requirement refuses,
    by pip's free choice of it, until none is left: name -> {by: specifier}."""
    found: dict[str, dict[str, str]] = {}
    grew = True
    while grew:
        grew = False
        for name in sorted(carried | set(found)):
            dist = free.dists.get(name)
            for req in requirements(dist, env) if dist else ():
                dep, spec = canonicalize_name(req.name), str(req.specifier)
                travel = kept | carried | set(found)
                if (
                    dep in known
                    and dep not in travel
                    and not satisfies(known[dep], spec)
                ):
                    found[dep], grew = {name: spec}, True
    return found


def pinned_in_conflict(log: str, pins: dict[str, str]) -> dict[str, dict[str, str]]:
    """The pins pip names in a conflict it cannot resolve (its "Cannot install"
    and "The conflict is caused by" lines): name -> {"pip": its words}."""
    said = [
        ln.strip()
        for ln in log.splitlines()
        if "Cannot install" in ln or "(constraint)" in ln or " depends on " in ln
    ]
    found = {}
    for line in said:
        for name, version in re.findall(r"([A-Za-z0-9][\w.-]*)==([\w.+!-]+)", line):
            name = canonicalize_name(name)
            if pins.get(name) == version.rstrip(".,"):
                said = URL.sub("<index>", line).removeprefix("ERROR: ")
                found[name] = {"pip": said[:200]}
    return found


def resolve(
    pip: Pip, cfg: dict, vllm_wheel: Path, nixl: list[str], kept: dict[str, str]
) -> Resolution:
    """Resolve with only the kept packages pinned, to learn which of the
    machine's known versions some requirement refuses, then again with the
    others pinned and the refused ones carried, until no carried package
    refuses another."""
    vllm = wheel_dist(vllm_wheel)
    known = {canonicalize_name(n): v for n, v in cfg["present"]["versions"].items()}
    present = set(known) | {canonicalize_name(n) for n in cfg["present"]["unversioned"]}
    excluded = {canonicalize_name(n) for n in cfg["excluded"]}
    env = cfg["machine"]["markers"]
    unknown = sorted(set(kept) - set(known))
    if unknown:
        raise BundleError(f"kept but no version known there: {', '.join(unknown)}")
    fixed = {n: known[n] for n in kept}
    asks = pip_roots(vllm, env, excluded | set(kept))
    roots = {"main.tar": [f"vllm=={vllm.version}"], "nixl.tar": nixl}

    def close(log: str, pins: dict[str, str], carried: set[str]) -> Resolution:
        report = pip.report(log, [*asks, *nixl], {**pins, **fixed})
        dists, files = read_report(report, cfg)
        dists["vllm"] = vllm
        have = present - carried
        main = walk(roots["main.tar"], dists, env, have, excluded)
        side = walk(nixl, dists, env, have, excluded, stop=set(main.needed))
        if main.problems or side.problems:
            said = "; ".join(main.problems + side.problems)
            raise BundleError(f"resolution incomplete: {said}")
        tags = platforms(cfg["machine"]["glibc"])
        hits = mf.present_hits(main, side)
        stay = set(kept) | excluded
        refused = {
            n: by for n, by in mf.conflicts(hits, known).items() if n not in stay
        }
        return Resolution(
            dists,
            files,
            main,
            side,
            roots,
            tags,
            known,
            have,
            pins,
            kept=kept,
            replaced=refused,
        )

    free = close("resolve-unpinned", {}, set())
    res, error, why, carried = free, None, {}, set()
    for turn in range(1, 6):
        why.update({n: by for n, by in res.replaced.items() if n not in why})
        why.update(needing(free, known, set(kept) | excluded, set(why), env))
        if turn > 1 and error is None and set(why) <= carried:
            break
        carried = set(why)
        pins = {n: v for n, v in known.items() if n not in carried}
        try:
            res, error = close(f"resolve-{turn}", pins, carried), None
        except BundleError as e:
            error = e
            log = (pip.cache / f"resolve-{turn}.log").read_text(errors="replace")
            found = pinned_in_conflict(log, pins)
            if not found:
                break
            why.update(found)
            continue
        # close() saw only what the machine still serves: add the carried
        res.replaced.update({n: why[n] for n in carried})
        res.note = "the machine's known versions pinned, less those carried"
    if error is not None:
        res = free
        res.note = f"unpinned, since with pins: {error}"
    # What only an excluded package needs stays behind with it.
    kept_names = set(res.main.needed) | set(res.side.needed)
    for c in (res.main, res.side):
        for x, extras in c.excluded_extras.items():
            root = f"{x}[{','.join(sorted(extras))}]" if extras else x
            only = walk(
                [root], res.dists, env, present, excluded - {x}, stop=kept_names
            )
            res.drops[x] = sorted(set(res.drops.get(x, [])) | set(only.needed) - {x})
    return res


def fetch(pip: Pip, res: Resolution, names: list[str], dest: Path, log: str) -> list:
    """The wheels pip chose, each checked against the sha256 pip resolved."""
    if names:
        pins = [f"{n}=={res.dists[n].version}" for n in names]
        pip.download(log, dest, pins)
    paths = []
    for n in names:
        file, sha = res.files[n]
        path = dest / file
        if not path.exists():
            raise BundleError(f"pip downloaded no {file}")
        if sha and sha256_file(path) != sha:
            raise BundleError(f"{file} differs from the file pip resolved")
        paths.append(path)
    return paths


def package(out: Path, cache: Path, tars: dict[str, list[Path]], limit: int) -> list:
    """Each tar cut into parts, numbered on across tars."""
    for old in out.glob("part-*"):
        old.unlink()
    entries: list[dict] = []
    for name, files in tars.items():
        tar = cache / name
        write_tar(tar, files)
        first = sum(len(e["parts"]) for e in entries)
        parts = [
            {"name": p.name, "sha256": sha256_file(p), "size": p.stat().st_size}
            for p in split(tar, out, first, limit)
        ]
        sha, size = sha256_file(tar), tar.stat().st_size
        entries.append({"name": name, "sha256": sha, "size": size, "parts": parts})
        tar.unlink()
    return entries


def build(args: argparse.Namespace, cfg: dict) -> dict:
    out = Path(args.out_dir).resolve()
    cache = out / "cache"
    for d in ("vllm", "wheels", "trimmed"):
        (cache / d).mkdir(parents=True, exist_ok=True)
    pip = Pip(args.python, cfg, cache, args.pip_arg)
    version = cfg["vllm"]
    trims = [r for r in cfg["trim"] if applies(r, version)]
    kept = {} if args.carry_kept else cfg.get("kept", {})
    kept = {canonicalize_name(n): why for n, why in kept.items()}
    src = Path(args.vllm_wheel) if args.vllm_wheel else None
    if src is None:
        pip.download("download-vllm.log", cache / "vllm", [f"vllm=={version}"])
        src = next((cache / "vllm").glob(f"vllm-{version}-*.whl"))
    res = resolve(pip, cfg, src, [] if args.no_nixl else list(cfg["nixl"]), kept)
    if res.dists["vllm"].version != version:
        raise BundleError(f"{src.name} is vllm {res.dists['vllm'].version}")
    wheels = cache / "wheels"
    deps = sorted(set(res.main.needed) - {"vllm"})
    deps = fetch(pip, res, deps, wheels, "download-deps.log")
    side = fetch(pip, res, sorted(res.side.needed), wheels, "download-nixl.log")
    trimmed = cache / "trimmed" / src.name
    cut = trim_wheel(src, trimmed, trims)
    tars = {"main.tar": [trimmed, *deps]}
    if side:
        tars["nixl.tar"] = side
    limit = int(args.part_mib * MiB)
    entries = package(out, cache, tars, limit)
    wheel = {"original": src, "trimmed": trimmed, "cut": cut}
    manifest = mf.make({**cfg, "trim": trims}, res, wheel, tars, entries, limit)
    mf.write(out, manifest)
    return manifest


def excluded_for(entries: dict, version: str) -> dict[str, str]:
    """The ``[excluded]`` entries that hold for ``version``: name -> reason. An
    entry is its reason, or a table of ``reason`` and ``releases``."""
    return {
        name: entry if isinstance(entry, str) else entry["reason"]
        for name, entry in entries.items()
        if isinstance(entry, str) or applies(entry, version)
    }


def applies(rule: dict, version: str) -> bool:
    """A trim rule's ``releases`` (a specifier, default all) holds ``version``."""
    return satisfies(version, rule.get("releases", ""))


def carried(out: Path, manifest: dict) -> list[str]:
    """What the largest call carries: a part, the manifest and the working
    tree (tracked and untracked-not-ignored files) all count to 64 MiB."""
    git = ["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"]
    done = subprocess.run(git, capture_output=True)
    if done.returncode:
        return []
    files = [REPO / n.decode() for n in done.stdout.split(b"\0") if n]
    tree = sum(p.stat().st_size for p in files if p.is_file())
    total = tree + (out / "manifest.json").stat().st_size
    total += max(p["size"] for p in manifest["parts"])
    line = f"largest call: {total / MiB:.1f} MiB of 64 (tree {tree / MiB:.1f} MiB)"
    return [line + (": over, lower part_mib" if total > 64 * MiB else "")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["build", "verify", "calls"])
    ap.add_argument("out_dir", nargs="?", default=str(REPO / ".gpu-bundle"))
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--python", help="runs pip (default: the machine's version)")
    ap.add_argument("--vllm", help="the release to carry (default: the config's)")
    ap.add_argument(
        "--carry-kept",
        action="store_true",
        help="carry pip's choice of what the config keeps (its torch: route 2)",
    )
    ap.add_argument("--no-nixl", action="store_true", help="leave NIXL out")
    ap.add_argument("--vllm-wheel", help="a vLLM wheel here instead of a download")
    ap.add_argument("--part-mib", type=float, help="default: the config's")
    ap.add_argument("--pip-arg", action="append", default=[], help="passed to pip")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    try:
        if args.command == "build":
            cfg = tomllib.loads(Path(args.config).read_text())
            cfg["vllm"] = args.vllm or cfg["vllm"]
            cfg["excluded"] = excluded_for(cfg["excluded"], cfg["vllm"])
            args.part_mib = args.part_mib or cfg["part_mib"]
            version = cfg["machine"]["python"]
            args.python = args.python or find_python(version)
            if args.python is None:
                raise BundleError(f"no python{version} here to run pip: give --python")
            manifest = build(args, cfg)
            lines = mf.summary(manifest) + carried(out, manifest) + ["device calls:"]
            print("\n".join(lines + mf.calls(out, manifest, REPO)))
            return 0
        manifest = json.loads((out / "manifest.json").read_text())
        if args.command == "calls":
            print("\n".join(mf.calls(out, manifest, REPO)))
            return 0
        from verify import verify

        with tempfile.TemporaryDirectory() as tmp:
            problems = verify(out, Path(tmp))
        print("\n".join(mf.summary(manifest) + carried(out, manifest) + problems))
        print(f"verify: {len(problems)} problem(s)")
        return 1 if problems else 0
    except (BundleError, ValueError, OSError) as e:
        print(f"bundle.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

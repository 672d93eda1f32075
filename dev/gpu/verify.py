# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check a built GPU bundle from its files alone, as the machine will see it.

Each check reads what travels (the parts, the tars they make, the wheels in
them, each wheel's METADATA and RECORD) against manifest.json; none trusts
what bundle.py computed on the way. Returns one line per problem.
"""

import json
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

from closure import walk, wheel_dist
from wheels import check_record, sha256_file


def check_parts(out: Path, manifest: dict) -> list[str]:
    problems = []
    limit = manifest["part_limit"]
    for part in manifest["parts"]:
        path = out / part["name"]
        if not path.is_file():
            problems.append(f"{part['name']}: missing")
            continue
        size = path.stat().st_size
        if size > limit:
            problems.append(f"{part['name']}: {size} bytes, over the limit of {limit}")
        if size != part["size"] or sha256_file(path) != part["sha256"]:
            problems.append(f"{part['name']}: sha256 or size differs from the manifest")
    return problems


def unpack(out: Path, manifest: dict, tmp: Path) -> list[str]:
    """Reassemble each tar from its parts into ``tmp`` and unpack it there."""
    problems = []
    for entry in manifest["tars"]:
        tar = tmp / entry["name"]
        with open(tar, "wb") as f:
            for part in entry["parts"]:
                with open(out / part["name"], "rb") as src:
                    shutil.copyfileobj(src, f)
        if sha256_file(tar) != entry["sha256"]:
            problems.append(f"{entry['name']}: sha256 differs from the manifest")
        with tarfile.open(tar) as tf:
            names = set(tf.getnames())
            tf.extractall(tmp, filter="data")
        want = {
            f"wheels/{w['file']}"
            for w in manifest["wheels"]
            if w["tar"] == entry["name"]
        }
        problems += [
            f"{entry['name']}: holds {n}, not in the manifest"
            for n in sorted(names - want)
        ]
        problems += [f"{entry['name']}: lacks {n}" for n in sorted(want - names)]
        tar.unlink()
    return problems


def check_vllm(path: Path, manifest: dict) -> list[str]:
    meta = manifest["vllm_wheel"]
    problems = []
    if sha256_file(path) != meta["trimmed"]["sha256"]:
        problems.append(f"{path.name}: not the trimmed wheel of the manifest")
    rules = [re.compile(r["pattern"]) for r in meta["cut"]]
    listed = {p for r in meta["cut"] for p in r["paths"] or ()}
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if name in listed or any(rx.fullmatch(name) for rx in rules):
                problems.append(f"{path.name}: still holds trimmed {name}")
    return problems + check_record(path)


def check_closure(wheels: list[Path], manifest: dict) -> list[str]:
    """Every requirement of each root, for the machine's markers, is a wheel
    here (one version, satisfying it), present there, or declared excluded;
    and every wheel here is needed."""
    problems, dists = [], {}
    for path in wheels:
        dist = wheel_dist(path)
        if dist.name in dists:
            problems.append(
                f"two versions of {dist.name}: {dists[dist.name].version}"
                f" and {dist.version}"
            )
        dists[dist.name] = dist
    present = set(manifest["present_names"])
    excluded = {x["name"] for x in manifest["excluded"]}
    env = manifest["machine"]["markers"]
    needed: set[str] = set()
    for roots in manifest["roots"].values():
        closure = walk(roots, dists, env, present, excluded)
        problems += closure.problems
        needed |= set(closure.needed)
    problems += [
        f"{n} is bundled but nothing needs it" for n in sorted(set(dists) - needed)
    ]
    return problems


def verify(out: Path, tmp: Path) -> list[str]:
    manifest = json.loads((out / "manifest.json").read_text())
    problems = check_parts(out, manifest)
    if problems:
        return problems
    tmp.mkdir(parents=True, exist_ok=True)
    problems += unpack(out, manifest, tmp)
    wheels = []
    for w in manifest["wheels"]:
        path = tmp / "wheels" / w["file"]
        if not path.is_file():
            continue  # unpack() said so
        if sha256_file(path) != w["sha256"] or path.stat().st_size != w["size"]:
            problems.append(f"{w['file']}: sha256 or size differs from the manifest")
        wheels.append(path)
    problems += check_vllm(tmp / "wheels" / manifest["vllm_wheel"]["file"], manifest)
    return problems + check_closure(wheels, manifest)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""manifest.json of the GPU bundle, its summary, and the device calls that
carry it. The manifest names files, versions and checksums, never where a file
came from."""

import json
from pathlib import Path

from closure import Closure, canonicalize_name, satisfies
from wheels import sha256_file

MiB = 1 << 20


def conflicts(hits: dict[str, dict[str, str]], known: dict[str, str]) -> dict:
    """Known versions there that some requirement's specifier refuses."""
    out = {}
    for name, by in hits.items():
        if name in known:
            bad = {p: s for p, s in by.items() if not satisfies(known[name], s)}
            if bad:
                out[name] = bad
    return out


def present_hits(*closures: Closure) -> dict[str, dict[str, str]]:
    hits: dict[str, dict[str, str]] = {}
    for c in closures:
        for name, by in c.present.items():
            hits.setdefault(name, {}).update(by)
    return hits


def trimmed_by_rule(rules: list[dict], cut: list[dict], most: int = 16) -> list:
    """What each rule cut: a count and size, and the paths where they are few
    (the pattern names the rest; one call carries this manifest with a part)."""
    out = []
    for rule in rules:
        files = [c for c in cut if c["rule"] == rule["pattern"]]
        paths = sorted(c["path"] for c in files)
        out.append(
            {
                **rule,
                "files": len(files),
                "size": sum(c["size"] for c in files),
                "paths": paths if len(paths) <= most else None,
            }
        )
    return out


def wheel_entry(path: Path, res, tar: str) -> dict:
    name = canonicalize_name(path.name.split("-")[0])
    by = res.main.needed.get(name) or res.side.needed.get(name)
    return {
        "file": path.name,
        "name": name,
        "version": res.dists[name].version,
        "sha256": sha256_file(path),
        "size": path.stat().st_size,
        "tar": tar,
        "required_by": sorted(by),
    }


def make(cfg: dict, res, wheel: dict, tars: dict, entries: list, limit: int) -> dict:
    """``wheel``: the vLLM wheel's original and trimmed paths and what was cut;
    ``tars``: each tar's wheel paths; ``entries``: each tar's parts."""
    src, trimmed = wheel["original"], wheel["trimmed"]
    wheels = [wheel_entry(p, res, t) for t, paths in tars.items() for p in paths]
    hits = present_hits(res.main, res.side)
    bad = conflicts(hits, res.known)
    present = [
        {
            "name": n,
            "version": res.known.get(n),
            "required": dict(sorted(by.items())),
            "satisfied": None if n not in res.known else n not in bad,
            **({"kept": res.kept[n]} if n in res.kept else {}),
        }
        for n, by in sorted(hits.items())
    ]
    replaced = [
        {
            "name": n,
            "there": res.known[n],
            "carried": res.dists[n].version,
            "because": dict(sorted(by.items())),
        }
        for n, by in sorted(res.replaced.items())
    ]
    excluded = []
    for n, reason in sorted(cfg["excluded"].items()):
        by = {**res.main.excluded.get(n, {}), **res.side.excluded.get(n, {})}
        excluded.append(
            {
                "name": n,
                "version": res.dists[n].version if n in res.dists else None,
                "reason": reason,
                "required_by": sorted(by),
                "drops": res.drops.get(n, []),
            }
        )
    main = [w["size"] for w in wheels if w["tar"] == "main.tar"]
    return {
        "format": 1,
        "vllm": cfg["vllm"],
        "part_limit": limit,
        "machine": {**cfg["machine"], "platforms": res.platforms},
        "roots": {t: res.roots[t] for t in tars},
        "vllm_wheel": {
            "file": trimmed.name,
            "original": {"sha256": sha256_file(src), "size": src.stat().st_size},
            "trimmed": {"sha256": sha256_file(trimmed), "size": trimmed.stat().st_size},
            "cut": trimmed_by_rule(cfg["trim"], wheel["cut"]),
        },
        "resolution": {"note": res.note, "pins": dict(sorted(res.pins.items()))},
        "wheels": sorted(wheels, key=lambda w: (w["tar"], w["name"])),
        "excluded": excluded,
        "present": present,
        "replaced": replaced,
        "present_names": sorted(res.present),
        "tars": entries,
        "parts": [dict(p, tar=t["name"]) for t in entries for p in t["parts"]],
        "totals": {
            "deps": sum(main) - trimmed.stat().st_size,
            "deps_count": len(main) - 1,
            "nixl": sum(w["size"] for w in wheels if w["tar"] == "nixl.tar"),
        },
    }


def write(out: Path, manifest: dict) -> None:
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def calls(out: Path, manifest: dict, repo: Path) -> list[str]:
    """The device calls that bring the parts over, one per part, back to back;
    the last one also carries the test tree (dev/gpu/test_tree.py), installs
    and starts the tier (its lanes: dev/gpu/README.md, "On the machine")."""
    try:
        rel = out.resolve().relative_to(repo)
    except ValueError:
        rel = Path("<the bundle folder, git-ignored inside the repo>")
    lines = []
    parts = manifest["parts"]
    for i, p in enumerate(parts):
        carry = [f"{rel}/{p['name']}", f"{rel}/manifest.json"]
        cmd = f"bash dev/gpu/stash.sh {rel}/{p['name']}"
        if i == len(parts) - 1:
            carry.append(f"{rel}/vllm-tests.tar.gz")
            cmd += (
                " && bash dev/gpu/install.sh"
                " && bash dev/gpu/tier_job.sh start tier --deadline 900 --lane ..."
                " && bash dev/gpu/tier_job.sh wait 360 tier"
            )
        lines.append(f"carry={json.dumps(carry)} command={cmd!r}")
    return lines


def summary(manifest: dict) -> list[str]:
    w, totals, parts = manifest["vllm_wheel"], manifest["totals"], manifest["parts"]
    lines = [
        f"vllm {manifest['vllm']}: wheel {w['original']['size'] / MiB:.1f} MiB, "
        f"{w['trimmed']['size'] / MiB:.1f} MiB trimmed "
        f"({sum(t['files'] for t in w['cut'])} files cut, "
        f"{sum(t['size'] for t in w['cut']) / MiB:.1f} MiB unpacked)",
        f"deps: {totals['deps_count']} wheels, {totals['deps'] / MiB:.1f} MiB; "
        f"nixl: {totals['nixl'] / MiB:.1f} MiB",
        f"parts: {len(parts)} ("
        + ", ".join(f"{p['name']} {p['size'] / MiB:.1f} MiB {p['tar']}" for p in parts)
        + ")",
        "excluded: "
        + ", ".join(
            f"{x['name']} (+{len(x['drops'])})" if x["drops"] else x["name"]
            for x in manifest["excluded"]
        ),
        f"resolution: {manifest['resolution']['note']}",
    ]
    for r in manifest.get("replaced", ()):
        by = ", ".join(
            f"pip says: {spec}" if n == "pip" else f"{n} wants {spec}"
            for n, spec in r["because"].items()
        )
        lines.append(f"carried: {r['name']} {r['carried']} over {r['there']}; {by}")
    for p in manifest["present"]:
        if p["satisfied"] is False:
            need = ", ".join(
                f"{by} wants {spec}"
                for by, spec in p["required"].items()
                if not satisfies(p["version"], spec)
            )
            kind = "kept" if p.get("kept") else "conflict"
            lines.append(f"{kind}: {p['name']} {p['version']} there; {need}")
    return lines

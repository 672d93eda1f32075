# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which distributions some roots need on the target machine.

A walk over ``Requires-Dist``, markers evaluated for the target (not for the
interpreter that runs this), extras followed. It stops at what the machine
already has and at the heavy optional packages we leave out. pip chooses the
versions; this only decides which of pip's choices travel. The same walk
checks a built bundle from its wheels' own METADATA (verify.py).
"""

import email.parser
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

__all__ = [
    "Dist",
    "Closure",
    "walk",
    "wheel_dist",
    "requirements",
    "satisfies",
    "canonicalize_name",
]


@dataclass(frozen=True)
class Dist:
    name: str  # canonical
    version: str
    requires: tuple[str, ...]


@dataclass
class Closure:
    # name -> {required_by: specifier}, for each kind of end the walk reached
    needed: dict[str, dict[str, str]] = field(default_factory=dict)
    present: dict[str, dict[str, str]] = field(default_factory=dict)
    excluded: dict[str, dict[str, str]] = field(default_factory=dict)
    # the extras an excluded package was asked with (what it would pull in)
    excluded_extras: dict[str, set[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def satisfies(version: str, specifier: str) -> bool:
    return SpecifierSet(specifier).contains(Version(version), prereleases=True)


def _applies(marker: Marker | None, env: dict[str, str], extras: set[str]) -> bool:
    if marker is None:
        return True
    # "" stands for no extra, as pip evaluates a requirement without one.
    return any(marker.evaluate({**env, "extra": e}) for e in {"", *extras})


def requirements(
    dist: Dist, env: dict[str, str], extras: set[str] = frozenset()
) -> list[Requirement]:
    """``dist``'s requirements that apply on the target, asked with ``extras``."""
    found = []
    for line in dist.requires:
        req = Requirement(line)
        if _applies(req.marker, env, set(extras)):
            found.append(req)
    return found


def walk(
    roots: list[str],
    dists: dict[str, Dist],
    env: dict[str, str],
    present: set[str],
    excluded: set[str],
    stop: set[str] = frozenset(),
) -> Closure:
    """The closure of ``roots`` (requirement strings) over ``dists`` (keyed by
    canonical name).

    ``stop`` names are neither entered nor reported (a second walk uses it
    to find what only an excluded package needs).
    """
    out = Closure()
    extras_seen: dict[str, set[str]] = {}
    todo: list[tuple[str, set[str], str, str]] = []
    for root in map(Requirement, roots):
        todo.append(
            (canonicalize_name(root.name), set(), "<root>", str(root.specifier))
        )
    while todo:
        name, extras, parent, spec = todo.pop()
        if name in stop:
            continue
        if name in present:
            out.present.setdefault(name, {})[parent] = spec
            continue
        if name in excluded:
            out.excluded.setdefault(name, {})[parent] = spec
            out.excluded_extras.setdefault(name, set()).update(extras)
            continue
        dist = dists.get(name)
        if dist is None:
            out.problems.append(f"{name}{spec} (required by {parent}) is not there")
            continue
        if spec and not satisfies(dist.version, spec):
            out.problems.append(
                f"{name} {dist.version} does not satisfy {parent}'s {name}{spec}"
            )
        first = name not in out.needed
        out.needed.setdefault(name, {})[parent] = spec
        seen = extras_seen.setdefault(name, set())
        if not first and extras <= seen:
            continue
        seen |= {canonicalize_name(e) for e in extras}
        for req in requirements(dist, env, seen):
            todo.append(
                (canonicalize_name(req.name), set(req.extras), name, str(req.specifier))
            )
    return out


def wheel_dist(path: Path) -> Dist:
    """A wheel's name, version and Requires-Dist, from its METADATA."""
    with zipfile.ZipFile(path) as zf:
        meta_name = next(
            n
            for n in zf.namelist()
            if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
        )
        text = zf.read(meta_name).decode()
    meta = email.parser.Parser().parsestr(text, headersonly=True)
    return Dist(
        canonicalize_name(meta["Name"]),
        meta["Version"],
        tuple(r.strip() for r in meta.get_all("Requires-Dist") or ()),
    )

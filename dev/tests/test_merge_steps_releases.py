# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/merge_steps.py: our steps over each vLLM release provisioned here."""

import re
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
AREA = ".buildkite/test_areas/models_basic.yaml"
sys.path.insert(0, str(REPO / "dev"))
from merge_steps import merge  # noqa: E402


def _replaced_in_place(upstream: str, ours: str) -> str:
    """The merge as it was before upstream disabled steps: each of our steps
    replaces upstream's step of its key, text for text, and the others are
    appended (for a file with no comments between steps around ours)."""
    steps = re.split(r"(?m)^(?=- )", ours.split("steps:\n", 1)[1])
    bodies = {yaml.safe_load(b)[0]["key"]: b.rstrip("\n") + "\n" for b in steps if b}
    head, rest = upstream.split("\nsteps:\n", 1)
    out = []
    for block in re.split(r"(?m)^(?=- )", rest):
        key = yaml.safe_load(block)[0]["key"] if block.startswith("- ") else None
        if key in bodies:
            block = bodies.pop(key) + block[len(block.rstrip("\n")) + 1 :]
        out.append(block)
    text = head + "\nsteps:\n" + "".join(out)
    for body in bodies.values():
        text += ("" if text.endswith("\n\n") else "\n") + body
    return text


SDISTS = sorted(REPO.glob(".vllm-checkout/vllm-*.tar.gz"))


def _upstream_steps(text: str) -> dict[str, dict]:
    """Upstream's steps by key, active or commented out (``# - label``)."""
    steps = {s["key"]: s for s in yaml.safe_load(text)["steps"]}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# - "):
            block = [line]
            for more in lines[i + 1 :]:
                if not more.startswith("#  "):
                    break
                block.append(more)
            step = yaml.safe_load("\n".join(x[2:] for x in block))[0]
            steps.setdefault(step["key"], step)
    return steps


def _image(step: dict) -> list:
    depends = step.get("depends_on") or []
    return [depends] if isinstance(depends, str) else depends


def _setup(commands: list) -> list:
    firsts = [i for i, c in enumerate(commands) if c.startswith("pytest ")]
    return commands[: firsts[0] if firsts else len(commands)]


@pytest.mark.parametrize("sdist", SDISTS, ids=lambda p: p.name)
def test_ours_over_a_provisioned_release(sdist):
    """Over each release provisioned here: where upstream's steps are active
    and shard as ours do (0.32.0), ours replace them as written; where
    upstream commented a step out (0.33.0), its comment stays above ours.
    Where upstream has one of our steps, the merged step runs upstream's
    setup (0.34.0: check-kv-connectors.sh, not our install script) and
    keeps upstream's mirrors (0.34.0's MI355 one for the 4xB200 step, with
    its env and sharding as upstream has them, ours declaring none)."""
    name = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(f"{name}/{AREA}")
        assert member is not None
        upstream = member.read().decode()
    ours = (REPO / AREA).read_text()
    merged = merge(upstream, ours)
    if "\n# - label:" not in upstream:
        assert merged == _replaced_in_place(upstream, ours)
    for line in upstream.splitlines():
        if line.startswith("# ") and not line.startswith(("# - ", "#  ")):
            assert line in merged.splitlines(), line
    theirs = _upstream_steps(upstream)
    mine = {s["key"]: s for s in yaml.safe_load(ours)["steps"]}
    for step in yaml.safe_load(merged)["steps"]:
        key = step["key"]
        if key not in mine or key not in theirs:
            continue
        their_setup = _setup(theirs[key].get("commands", []))
        if their_setup:
            assert _setup(step["commands"]) == their_setup, key
            scripts = re.findall(r"\.buildkite/scripts/\S+", " ".join(their_setup))
            listed = [t for t in step["source_file_dependencies"] if ".buildkite/" in t]
            assert listed == scripts, (key, listed, scripts)
        for platform, job in (theirs[key].get("mirror") or {}).items():
            if platform not in (mine[key].get("mirror") or {}):
                assert step["mirror"][platform] == job, (key, platform)
    # A step upstream lacks runs the setup upstream gives a step of ours set
    # up as it is on the same image (0.34.0: the GPU tier's step, as the
    # 4xB200 one, checks the baked-in KV connectors); the CPU step, on
    # another image, keeps ours.
    steps = {s["key"]: s for s in yaml.safe_load(merged)["steps"]}
    for key in mine.keys() - theirs.keys():
        own = _setup(mine[key].get("commands", []))
        donors = [
            other
            for other in mine.keys() & theirs.keys()
            if _image(mine[other]) == _image(mine[key])
            and _setup(mine[other].get("commands", [])) == own
            and _setup(theirs[other].get("commands", []))
        ]
        want = _setup(steps[donors[0]]["commands"]) if donors else own
        assert _setup(steps[key]["commands"]) == want, (key, donors)

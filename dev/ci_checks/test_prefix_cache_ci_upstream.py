# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where upstream has one of our steps, active or commented out, the merged
step takes upstream's form, setup and mirror, and the sharded step allows
no less time than upstream's."""

import contextlib
import re
import sys
import tarfile

import pytest
import yaml
from prefix_cache_ci_area import (
    AREA,
    CHECK_SCRIPT,
    CPU_KEY,
    INSTALL_SCRIPT,
    MATRIX_MODULE,
    OUR_KEYS,
    ROOT,
    SHARDED_KEY,
    _step,
    _steps,
    scripts,
    setup,
)

# No distributed state or device in-process: skip vLLM's global cleanup.
pytestmark = pytest.mark.skip_global_cleanup


# dev/suite.sh and dev/provision.sh keep vLLM's sdist beside the checkout they
# unpack from it; this marker says that this is such a checkout.
SDIST_CHECKOUT_MARKER = ".hybrid-pc-complete"


def upstream_area() -> str:
    """Upstream's own models_basic.yaml: our overlay merged our steps into
    the checkout's copy, so the original is only in the sdist tarball."""
    tarball = ROOT.parent / f"{ROOT.name}.tar.gz"
    if not tarball.is_file():
        assert not (ROOT / SDIST_CHECKOUT_MARKER).exists(), (
            f"this checkout was unpacked from {tarball.name}, which is gone"
        )
        pytest.skip(
            f"no sdist {tarball} beside this checkout (not one made by "
            "dev/provision.sh), so upstream's original models_basic.yaml "
            "cannot be told from the merged one"
        )
    member = f"{ROOT.name}/{AREA.relative_to(ROOT).as_posix()}"
    with tarfile.open(tarball) as tar:
        data = tar.extractfile(member)
        assert data is not None, f"{member} in {tarball} is not a file"
        return data.read().decode()


def test_upstream_area_skips_only_outside_an_sdist_checkout(tmp_path, monkeypatch):
    checkout = tmp_path / "vllm-x"
    checkout.mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", checkout)
    with pytest.raises(pytest.skip.Exception, match="no sdist"):
        upstream_area()
    (checkout / SDIST_CHECKOUT_MARKER).touch()
    with pytest.raises(AssertionError, match="which is gone"):
        upstream_area()


def upstream_steps(text: str) -> list[tuple[dict, list[str] | None]]:
    """Upstream's steps, active and commented out, in order: (the step,
    None for an active one, else the comment lines right above it). A
    commented-out step is a ``# - `` line and the ``#   `` lines under it
    (how vLLM disables a step), which read as one step once uncommented."""
    steps: list[tuple[dict, list[str] | None]] = []
    lines = text.splitlines()
    active = iter(yaml.safe_load(text)["steps"])
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("- "):
            steps.append((next(active), None))
        elif line.startswith("# - "):
            end = next(
                (j for j in range(i + 1, len(lines)) if not lines[j].startswith("#  ")),
                len(lines),
            )
            block = "\n".join(x[2:] for x in lines[i:end])
            with contextlib.suppress(yaml.YAMLError, ValueError, KeyError, TypeError):
                (step,) = yaml.safe_load(block)
                step["key"]  # prose that reads as a list item is no step
                lead = []
                for above in reversed(lines[:i]):
                    if not above.startswith("#") or above.startswith("#  "):
                        break
                    lead.insert(0, above)
                steps.append((step, lead))
            i = end
            continue
        i += 1
    return steps


def upstream_step(key: str) -> tuple[dict | None, list[str] | None]:
    """Upstream's step ``key`` (active first, else commented out) and the
    comment above it if commented out; (None, None) where upstream has none."""
    found = [
        (s, lead) for s, lead in upstream_steps(upstream_area()) if s["key"] == key
    ]
    found.sort(key=lambda pair: pair[1] is not None)
    return found[0] if found else (None, None)


# The fields in which upstream decides how a step is scheduled and sharded
# (dev/merge_steps.py takes them from upstream's step, active or not).
FORM = ("label", "optional", "soft_fail", "automatic_shard", "parallelism")
FORM += ("device", "num_devices")
SHARD_FLAGS = ("--shard-id=$$BUILDKITE_PARALLEL_JOB",)
SHARD_FLAGS += ("--num-shards=$$BUILDKITE_PARALLEL_JOB_COUNT",)


# Our steps that declare no mirror of their own: where upstream's step has
# one (0.34.0's 4xB200 step, on MI355), the merged step's is upstream's.
WITHOUT_OWN_MIRROR = (SHARDED_KEY, CPU_KEY)


def _sharding(step: dict) -> tuple:
    return bool(step.get("automatic_shard")), step.get("parallelism")


def test_upstream_steps_reads_commented_out_steps():
    text = (
        "steps:\n- label: a\n  key: a\n\n# Off until X.\n# - label: b\n"
        "#   key: b\n#   # why\n#   optional: true\n\n# - prose, not a step\n"
    )
    (a, none), (b, lead) = upstream_steps(text)
    assert (a["key"], none) == ("a", None)
    assert b == {"label": "b", "key": "b", "optional": True}
    assert lead == ["# Off until X."]


def test_sharded_timeout_not_below_upstreams():
    """Where upstream shards the step as ours does, ours allows no less
    time than upstream's; where it shards it otherwise (automatic_shard),
    the merged step has upstream's timeout, which its shards are sized for."""
    theirs, _ = upstream_step(SHARDED_KEY)
    assert theirs is not None, f"upstream has no {SHARDED_KEY}, not even commented out"
    assert MATRIX_MODULE in " ".join(theirs["commands"])
    merged = _step(SHARDED_KEY)
    ours, upstreams = merged["timeout_in_minutes"], theirs["timeout_in_minutes"]
    if _sharding(merged) == _sharding(theirs) and "parallelism" in theirs:
        assert ours >= upstreams, (
            f"{SHARDED_KEY}: {ours} min, below upstream's {upstreams} min for "
            "fewer turns per case"
        )
    else:
        assert ours == upstreams, (ours, upstreams)


def _block(text: str, key: str) -> list[str]:
    """The lines of step ``key`` in a test-area file (uncommented, if it is
    commented out there), from its ``- `` line to the next blank line."""
    lines = [line[2:] if line.startswith("# ") else line for line in text.splitlines()]
    (at,) = [i for i, line in enumerate(lines) if line == f"  key: {key}"]
    start = max(i for i in range(at) if lines[i].startswith("- "))
    end = next((i for i in range(at, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def _form_comments(block: list[str]) -> list[str]:
    """The comment lines of a step that stand above one of its FORM fields."""
    found, pending = [], []
    for line in block:
        if line.strip().startswith("#"):
            pending.append(line)
            continue
        field = re.match(r"  ([a-z_]+):", line)
        if field and field.group(1) in FORM:
            found += pending
        pending = []
    return found


@pytest.mark.parametrize("key", OUR_KEYS)
def test_merged_step_takes_upstreams_form(key):
    """Where upstream has the step, active or commented out, the merged step
    is scheduled and sharded as upstream's (0.33.0: the 4xB200 step as
    [Nightly], optional and automatic_shard, without pytest-shard's flags;
    0.32.0: a per-PR step in 2 pytest-shard jobs, as before), upstream's
    comments on those fields come with them, and a commented-out step's
    comment stays right above it. A step upstream lacks is appended."""
    theirs, lead = upstream_step(key)
    merged = _step(key)
    keys = [s["key"] for s in _steps()]
    if theirs is None:
        upstream_keys = [s["key"] for s, _ in upstream_steps(upstream_area())]
        assert all(keys.index(key) > keys.index(k) for k in upstream_keys if k in keys)
        return
    for field in FORM:
        assert merged.get(field) == theirs.get(field), (key, field)
    # Its mirrors too: each of upstream's is there, in upstream's form.
    for platform, job in (theirs.get("mirror") or {}).items():
        mine = (merged.get("mirror") or {}).get(platform)
        assert mine is not None, f"{key}: upstream's {platform} mirror is lost"
        for field in FORM:
            assert mine.get(field) == job.get(field), (key, platform, field)
        if key in WITHOUT_OWN_MIRROR:
            assert mine == job, f"{key}: the {platform} mirror is not upstream's"
    for command in merged["commands"]:
        if command.startswith("pytest "):
            flags = [flag in command for flag in SHARD_FLAGS]
            assert flags == [bool(merged.get("parallelism"))] * 2, (key, command)
    text = AREA.read_text()
    block = _block(text, key)
    for comment in _form_comments(_block(upstream_area(), key)):
        assert comment in block, f"{key}: upstream's {comment.strip()!r} is lost"
    if lead is not None:
        lines = text.splitlines()
        label = lines.index(block[0])
        assert lines[label - len(lead) : label] == lead, (
            f"{key}: upstream's {lead} is not right above it"
        )


def test_merged_step_runs_upstreams_setup():
    """How a job gets its packages is upstream's to say: where upstream's
    step has a setup (the commands before its first pytest), the merged step
    runs exactly it, with no install of ours: vLLM 0.34.0 bakes the KV
    connectors into its CI image and its 4xB200 step runs
    check-kv-connectors.sh ("jobs must not install packages at runtime"),
    where 0.32.0 and 0.33.0 run install-kv-connectors.sh as ours does."""
    theirs, _ = upstream_step(SHARDED_KEY)
    assert theirs is not None, f"upstream has no {SHARDED_KEY}, not even commented out"
    merged = _step(SHARDED_KEY)
    their_setup = setup(theirs["commands"])
    assert their_setup, f"upstream's {SHARDED_KEY} has no setup: {theirs['commands']}"
    assert setup(merged["commands"]) == their_setup, (merged["commands"], their_setup)
    assert scripts(merged["commands"]) == scripts(their_setup)
    if (ROOT / CHECK_SCRIPT).is_file():
        # The checkout verifies baked-in packages: nothing may install them.
        assert CHECK_SCRIPT in scripts(merged["commands"]), merged["commands"]
        assert INSTALL_SCRIPT not in " ".join(merged["commands"]), merged["commands"]

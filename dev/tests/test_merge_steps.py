"""dev/merge_steps.py: our steps replace upstream's by key, new ones append,
and nothing else in upstream's file changes."""

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

UPSTREAM = """\
group: Models
depends_on:
  - image-build
steps:
- label: "A"
  key: a
  commands:
  - pytest a  # keep this comment

# A comment between steps stays.
- label: "B"
  key: b
  commands:
  - pytest b

- label: "C"
  key: c
  commands: [pytest c]
"""

OURS = """\
# our header is not copied
steps:
- label: "B"
  key: b
  commands:
  - pytest b --ours

- label: "D"
  key: d
  commands: [pytest d]
"""


def test_replaces_in_place_and_appends():
    merged = merge(UPSTREAM, OURS)
    assert merged == (
        UPSTREAM.replace(
            '- label: "B"\n  key: b\n  commands:\n  - pytest b\n',
            '- label: "B"\n  key: b\n  commands:\n  - pytest b --ours\n',
        )
        + '\n- label: "D"\n  key: d\n  commands: [pytest d]\n'
    )


def test_is_idempotent_on_upstream():
    assert merge(UPSTREAM, "steps:\n") == UPSTREAM


def test_rejects_repeated_keys():
    with pytest.raises(ValueError, match="repeat a key"):
        merge(UPSTREAM, OURS + "- label: again\n  key: d\n")


def test_rejects_a_step_without_key():
    with pytest.raises(ValueError, match="without a key"):
        merge(UPSTREAM, "steps:\n- label: nokey\n")


def test_keeps_comments_after_a_replaced_step():
    """Comment lines between steps belong to what follows: replacing the
    step before them keeps them."""
    merged = merge(UPSTREAM, "steps:\n- label: A\n  key: a\n  commands: [ours]\n")
    assert "# A comment between steps stays.\n" in merged
    assert merged.index("[ours]") < merged.index("# A comment between")


def test_takes_upstreams_label():
    """Upstream names its step (a FORM field): our label gives way."""
    merged = merge(UPSTREAM, 'steps:\n- label: "C, ours"\n  key: c\n')
    assert '- label: "C"\n  key: c\n' in merged


# A file that disables a step the way vLLM 0.33.0's models_basic.yaml does:
# a comment, then the step commented out line by line.
DISABLED = """\
steps:
- label: "A"
  key: a
  commands: [pytest a]

# Disabled until X is locked.
# - label: "Sharded [Nightly]"
#   key: s
#   # Nightly only: big pods wait.
#   optional: true
#   automatic_shard: true
#   timeout_in_minutes: 75
#   device: big
#   commands:
#   - pytest s

- label: "C"
  key: c
  commands: [pytest c]
"""

OURS_SHARDED = """\
steps:
- label: "Sharded %N"
  key: s
  # Derived for 2 pytest-shard jobs.
  timeout_in_minutes: 90
  device: big
  parallelism: 2
  source_file_dependencies:
  - vllm/ours/
  commands:
  - bash install.sh
  - pytest -v -s s.py --shard-id=$$BUILDKITE_PARALLEL_JOB --num-shards=$$N
"""


def test_replaces_a_commented_out_step_in_upstreams_form():
    """Ours takes the commented-out step's place under its comment, with
    upstream's label, optional and automatic_shard (and their comment),
    upstream's timeout (it shards otherwise), no parallelism and no
    pytest-shard flags; our triggers and commands otherwise."""
    merged = merge(DISABLED, OURS_SHARDED)
    assert merged == DISABLED.replace(
        DISABLED[DISABLED.index("# - label") : DISABLED.index('\n\n- label: "C"')]
        + "\n",
        '- label: "Sharded [Nightly]"\n'
        "  key: s\n"
        "  # Nightly only: big pods wait.\n"
        "  optional: true\n"
        "  automatic_shard: true\n"
        "  timeout_in_minutes: 75\n"
        "  device: big\n"
        "  source_file_dependencies:\n"
        "  - vllm/ours/\n"
        "  commands:\n"
        "  - bash install.sh\n"
        "  - pytest -v -s s.py\n",
    )
    assert "# Disabled until X is locked.\n- label" in merged


def test_same_sharding_keeps_ours_and_the_longer_timeout():
    """Upstream's step sharded as ours (parallelism 2): ours as written,
    with the longer of the two timeouts, whichever is ours."""
    upstream = (
        'steps:\n- label: "Sharded %N"\n  key: s\n  timeout_in_minutes: 120\n'
        "  device: big\n  parallelism: 2\n  commands: [pytest s]\n"
    )
    merged = merge(upstream, OURS_SHARDED)
    expected = OURS_SHARDED.replace(
        "  # Derived for 2 pytest-shard jobs.\n  timeout_in_minutes: 90\n",
        "  timeout_in_minutes: 120\n",
    )
    assert merged == expected
    shorter = upstream.replace("120", "75")
    assert merge(shorter, OURS_SHARDED) == OURS_SHARDED


def test_refuses_parallel_jobs_that_would_all_run_everything():
    upstream = 'steps:\n- label: "S"\n  key: s\n  parallelism: 3\n'
    with pytest.raises(ValueError, match="every job would run every test"):
        merge(upstream, 'steps:\n- label: "S"\n  key: s\n  commands: [pytest s]\n')


# A file whose step verifies what its image holds instead of installing it,
# and runs on a second platform too, the way vLLM 0.34.0's 4xB200 step does.
VERIFIES = """\
steps:
- label: "Sharded [Nightly]"
  key: s
  optional: true
  automatic_shard: true
  timeout_in_minutes: 75
  device: big
  source_file_dependencies:
  - vllm/theirs/
  - .buildkite/scripts/verify.sh
  commands:
  # Baked into the image.
  - bash /vllm-workspace/.buildkite/scripts/verify.sh
  - pytest -v -s s.py
  mirror:
    other:
      label: "Sharded elsewhere"
      device: other_4
      env:
        PROTOCOL: "tcp"
      source_file_dependencies:
      - vllm/platforms/other.py
"""

OURS_INSTALLING = """\
steps:
- label: "Sharded %N"
  key: s
  timeout_in_minutes: 90
  device: big
  parallelism: 2
  source_file_dependencies:
  - vllm/ours/
  # The setup script.
  - .buildkite/scripts/install.sh
  commands:
  # Installs what the tests need.
  - bash /vllm-workspace/.buildkite/scripts/install.sh
  - pytest -v -s s.py --shard-id=$$BUILDKITE_PARALLEL_JOB --num-shards=$$N
"""


def test_takes_upstreams_setup_and_its_mirror():
    """Where upstream's step sets itself up otherwise (a verify script, no
    install), the merged step runs upstream's setup lines with their
    comments in place of ours, triggers on upstream's script in place of
    ours, and keeps upstream's mirror, which ours lacks, as upstream has it
    (its env, and no automatic_shard where upstream gives it none)."""
    merged = merge(VERIFIES, OURS_INSTALLING)
    assert merged == (
        "steps:\n"
        '- label: "Sharded [Nightly]"\n'
        "  key: s\n"
        "  optional: true\n"
        "  automatic_shard: true\n"
        "  timeout_in_minutes: 75\n"
        "  device: big\n"
        "  source_file_dependencies:\n"
        "  - vllm/ours/\n"
        "  # The setup script.\n"
        "  - .buildkite/scripts/verify.sh\n"
        "  commands:\n"
        "  # Baked into the image.\n"
        "  - bash /vllm-workspace/.buildkite/scripts/verify.sh\n"
        "  - pytest -v -s s.py\n" + VERIFIES[VERIFIES.index("  mirror:") :]
    )
    (step,) = yaml.safe_load(merged)["steps"]
    theirs = yaml.safe_load(VERIFIES)["steps"][0]
    assert step["mirror"] == theirs["mirror"]
    assert "automatic_shard" not in step["mirror"]["other"]


def test_takes_upstreams_setup_from_flow_sequences():
    """Commands and triggers written as flow sequences (``[a, b]``) merge
    too, written out as blocks where they change."""
    upstream = (
        'steps:\n- label: "S"\n  key: s\n  commands: '
        '["bash /vllm-workspace/.buildkite/scripts/verify.sh", "pytest s"]\n'
    )
    ours = (
        'steps:\n- label: "S"\n  key: s\n'
        "  source_file_dependencies: [a/, .buildkite/scripts/install.sh]\n"
        "  commands: [bash /vllm-workspace/.buildkite/scripts/install.sh, pytest s]\n"
    )
    assert merge(upstream, ours) == (
        'steps:\n- label: "S"\n  key: s\n  source_file_dependencies:\n'
        "  - a/\n  - .buildkite/scripts/verify.sh\n  commands:\n"
        "  - bash /vllm-workspace/.buildkite/scripts/verify.sh\n  - pytest s\n"
    )


def test_keeps_our_setup_where_upstream_has_none():
    """An upstream step with no setup lines says nothing of how the job is
    set up: ours stays."""
    upstream = VERIFIES.replace(
        "  # Baked into the image.\n  - bash /vllm-workspace/.buildkite/scripts"
        "/verify.sh\n",
        "",
    )
    (step,) = yaml.safe_load(merge(upstream, OURS_INSTALLING))["steps"]
    assert step["commands"][0] == "bash /vllm-workspace/.buildkite/scripts/install.sh"
    assert ".buildkite/scripts/install.sh" in step["source_file_dependencies"]


# Steps upstream lacks: one set up as OURS_INSTALLING's step on the same
# image, one on another image.
OURS_APPENDED = """
- label: "New"
  key: n
  source_file_dependencies:
  - vllm/new/
  - .buildkite/scripts/install.sh
  commands:
  # Installs what the tests need.
  - bash /vllm-workspace/.buildkite/scripts/install.sh
  - pytest -v -s n.py

- label: "Elsewhere"
  key: e
  depends_on:
  - image-build-cpu
  source_file_dependencies:
  - .buildkite/scripts/install.sh
  commands:
  - bash /vllm-workspace/.buildkite/scripts/install.sh
  - pytest -v -s e.py
"""


def test_an_appended_step_takes_upstreams_setup_on_the_same_image():
    """A step upstream lacks is appended as ours, but where upstream sets up
    a step of ours that is set up as it is, on the same image, otherwise,
    it runs upstream's setup (with its comments) and triggers on its script;
    on another image it keeps ours, and where upstream's setup is ours, it
    stays as written."""
    merged = merge(VERIFIES, OURS_INSTALLING + OURS_APPENDED)
    new, elsewhere = OURS_APPENDED.split("\n\n")
    verifies = new.replace("install.sh", "verify.sh").replace(
        "# Installs what the tests need.", "# Baked into the image."
    )
    assert merged.endswith(f"{verifies}\n\n{elsewhere}"), merged
    installs = VERIFIES.replace(
        "  # Baked into the image.\n  - bash /vllm-workspace/.buildkite/scripts"
        "/verify.sh\n",
        "  - bash /vllm-workspace/.buildkite/scripts/install.sh\n",
    )
    assert merge(installs, OURS_INSTALLING + OURS_APPENDED).endswith(OURS_APPENDED)


def test_refuses_two_upstream_setups_for_one_appended_step():
    upstream = VERIFIES + VERIFIES.split("steps:\n", 1)[1].replace(
        "key: s", "key: t"
    ).replace("verify.sh", "check.sh")
    ours = OURS_INSTALLING + OURS_INSTALLING.split("steps:\n", 1)[1].replace(
        "key: s", "key: t"
    )
    with pytest.raises(ValueError, match="n: upstream sets up steps of ours"):
        merge(upstream, ours + OURS_APPENDED)


def test_a_mirror_of_ours_takes_upstreams_mirror_form():
    """Where both have a mirror for a platform, ours stays, in the form of
    upstream's (its automatic_shard, label, device); a platform only
    upstream mirrors to is added as upstream has it."""
    upstream = (
        'steps:\n- label: "U"\n  key: u\n  automatic_shard: true\n'
        "  commands:\n  - pytest u\n  mirror:\n    amd:\n"
        "      automatic_shard: true\n"
        '      label: "U amd"\n      device: amd_1\n'
        "      commands:\n      - pytest theirs\n"
        '    tpu:\n      label: "U tpu"\n      device: tpu_1\n'
    )
    ours = (
        'steps:\n- label: "U"\n  key: u\n  commands:\n  - pytest u\n'
        '  mirror:\n    amd:\n      label: "ours"\n      device: amd_1\n'
        "      commands:\n      # ours\n      - pytest ours\n"
    )
    (step,) = yaml.safe_load(merge(upstream, ours))["steps"]
    assert step["mirror"] == {
        "amd": {
            "label": "U amd",
            "device": "amd_1",
            "automatic_shard": True,
            "commands": ["pytest ours"],
        },
        "tpu": {"label": "U tpu", "device": "tpu_1"},
    }
    assert "      # ours\n      - pytest ours\n" in merge(upstream, ours)


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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/merge_steps.py: a merged step runs upstream's setup and keeps its
mirrors; a step upstream lacks runs the setup upstream gives a step of ours
set up as it is on the same image."""

import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev"))
from merge_steps import merge  # noqa: E402

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

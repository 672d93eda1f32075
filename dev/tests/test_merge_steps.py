# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""dev/merge_steps.py: our steps replace upstream's by key, new ones append,
and nothing else in upstream's file changes."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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

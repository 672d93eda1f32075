"""dev/merge_steps.py: our steps replace upstream's by key, new ones append,
and nothing else in upstream's file changes."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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
- label: "B, ours"
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
            '- label: "B, ours"\n  key: b\n  commands:\n  - pytest b --ours\n',
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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reading a Buildkite test-area file as text: its runs of step and gap
lines, the steps commented out in a gap, and a step's fields, each with the
comments above it, so that the merge keeps upstream's text.
"""

import re

import yaml


def split_steps(text: str) -> tuple[str, list[list]]:
    """(everything up to and including ``steps:``, segments): a segment is
    ``["step", lines]`` (one step's own lines) or ``["gap", lines]`` (blank
    lines and column-0 comments between steps, where commented-out steps
    stand)."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip() == "steps:")
    except StopIteration:
        raise ValueError("no top-level 'steps:' line") from None
    segments: list[list] = []
    for line in lines[start + 1 :]:
        between = not line.strip() or line.startswith("#")
        if line.startswith("- "):
            segments.append(["step", [line]])
        elif not segments or (between and segments[-1][0] == "step"):
            segments.append(["gap", [line]])
        elif between or segments[-1][0] == "step":
            segments[-1][1].append(line)
        elif len(segments) > 1:
            # A step's own line after blank or comment lines: they were the
            # step's too.
            gap = segments.pop()[1]
            segments[-1][1] += [*gap, line]
        else:
            raise ValueError(f"a line before the first step: {line!r}")
    return "".join(lines[: start + 1]), segments


def load_step(text: str) -> dict:
    loaded = yaml.safe_load(text)
    if not isinstance(loaded, list) or len(loaded) != 1:
        raise ValueError(f"not one step: {text[:80]!r}")
    (step,) = loaded
    if not isinstance(step, dict) or "key" not in step:
        label = step.get("label") if isinstance(step, dict) else step
        raise ValueError(f"a step without a key: {label!r}")
    return step


def uncomment(line: str) -> str:
    return line[2:] if line.startswith("# ") else line[1:]


def commented_steps(gap: list[str]) -> list[tuple[int, int, dict]]:
    """The commented-out steps of a gap: (first line, end, the step), where
    a commented-out step is a ``# - `` line and the ``#   `` lines that
    follow it, read as YAML once uncommented."""
    found, i = [], 0
    while i < len(gap):
        if not gap[i].startswith("# - "):
            i += 1
            continue
        end = i + 1
        while end < len(gap) and gap[end].startswith("#  "):
            end += 1
        try:
            step = load_step("".join(uncomment(line) for line in gap[i:end]))
        except (ValueError, yaml.YAMLError):
            step = None  # prose that happens to start like a list item
        if step is not None:
            found.append((i, end, step))
        i = end
    return found


def field_chunks(text: str, indent: int = 2) -> list[tuple[str, str]]:
    """A mapping's text cut into its fields at ``indent``, in order: (name,
    text), each text with the comment lines above its field. A step's first
    line must come with its ``- `` written as two spaces (:func:`field_text`),
    so that fields can be reordered."""
    field = re.compile(rf"{' ' * indent}([A-Za-z_][\w-]*):")
    chunks: list[list] = []
    pending: list[str] = []
    for line in text.splitlines(keepends=True):
        match = field.match(line)
        if match:
            chunks.append([match.group(1), [*pending, line]])
            pending = []
        elif not line.strip() or line.lstrip().startswith("#"):
            pending.append(line)
        else:
            chunks[-1][1] += [*pending, line]
            pending = []
    if pending:
        chunks[-1][1] += pending
    return [(name, "".join(text)) for name, text in chunks]


def field_text(body: str) -> str:
    """A step's text with its ``- `` written as two spaces."""
    return "  " + body[2:]


def split_head(chunk: str) -> tuple[str, str]:
    """A field's text cut after its ``name:`` line (the comments above it
    and that line; the lines of its value)."""
    lines = chunk.splitlines(keepends=True)
    at = next(i for i, x in enumerate(lines) if x.strip() and x.lstrip()[0] != "#")
    return "".join(lines[: at + 1]), "".join(lines[at + 1 :])


def _items(value: str) -> list[str]:
    """The items of a block sequence's text, each with the comment lines
    above it (and, for the last, the blank or comment lines after it)."""
    items: list[list[str]] = []
    pending: list[str] = []
    indent = None
    for line in value.splitlines(keepends=True):
        stripped = line.lstrip()
        if stripped.startswith("- ") and indent in (None, len(line) - len(stripped)):
            indent = len(line) - len(stripped)
            items.append([*pending, line])
            pending = []
        elif not stripped or stripped.startswith("#") or not items:
            pending.append(line)
        else:
            items[-1] += [*pending, line]
            pending = []
    if pending:
        if not items:
            raise ValueError(f"not a block sequence: {value!r}")
        items[-1] += pending
    return ["".join(item) for item in items]


def _block_items(commands: list, indent: int) -> list[str]:
    """``commands`` written as block sequence items at ``indent``."""
    return [" " * indent + yaml.safe_dump([c], width=float("inf")) for c in commands]


def sequence_items(chunk: str, values: list) -> tuple[str, list[str]]:
    """A sequence field's text as (its head, its items' texts); a flow
    sequence (``[a, b]``) is written out as a block."""
    head, value = split_head(chunk)
    items = _items(value) if value.strip() else []
    if len(items) == len(values):
        return head, items
    *above, line = head.splitlines(keepends=True)
    indent = len(line) - len(line.lstrip())
    head = "".join(above) + line[: line.index(":") + 1] + "\n"
    return head, _block_items(values, indent)


def item_indent(item: str) -> int:
    line = next(x for x in item.splitlines() if x.lstrip().startswith("- "))
    return len(line) - len(line.lstrip())


def reindent(text: str, delta: int) -> str:
    """``text`` moved ``delta`` columns right (left where negative)."""
    lines = text.splitlines(keepends=True)
    if delta >= 0:
        return "".join(" " * delta + line if line.strip() else line for line in lines)
    cut = -delta
    assert all(not line.strip() or line[:cut] == " " * cut for line in lines), text
    return "".join(line[cut:] if line.strip() else line for line in lines)

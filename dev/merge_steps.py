"""Merge our Buildkite steps into one of vLLM's ``test_areas`` files by key.

    python dev/merge_steps.py UPSTREAM OURS > MERGED

The merge works on text: a YAML library that wrote the result would drop
upstream's comments. YAML only reads pieces of it (keys, fields) and, at the
end, checks the result.

A step of OURS whose ``key`` UPSTREAM has takes the place of upstream's step:
of an active step, or of a commented-out one (the ``# - label: ...`` run of
lines with which vLLM disables a step, e.g. 0.33.0's
``.buildkite/test_areas/models_basic.yaml``). A step with a new key is
appended. Everything else of UPSTREAM is kept byte for byte, its comments
between steps too: the comment above a commented-out step that ours replaces
stays above ours. The merge verifies all this before printing anything.

Where upstream has the step, active or commented out, upstream has decided
how it is scheduled and sharded, and the merged step takes that form from
upstream's step (:data:`FORM`, :func:`merged_step`); the rest (triggers,
commands, dependencies, mirrors) stays ours. The fields and their rule:

* ``label``, ``optional``, ``soft_fail``, ``automatic_shard``,
  ``parallelism``, ``device``, ``num_devices``: upstream's value, with its
  comment, where upstream sets the field; dropped where upstream does not.
  A field whose value equals ours keeps our text.
* ``timeout_in_minutes``: ours is derived for our sharding. Where upstream
  shards the step as we do (the same ``automatic_shard`` and
  ``parallelism``), the larger of the two; where it shards it otherwise,
  upstream's, whose jobs that sharding sizes.
* ``commands``: without ``parallelism`` no job has a
  ``BUILDKITE_PARALLEL_JOB``, and vLLM's pipeline generator shards an
  ``automatic_shard`` step itself, refusing a pytest command that carries
  pytest-shard's flags: so ``--shard-id``/``--num-shards`` are dropped from
  our pytest commands when the merged form has no ``parallelism``.
"""

import re
import sys

import yaml

# The fields that say how a step is scheduled and sharded.
FORM = (
    "label",
    "optional",
    "soft_fail",
    "automatic_shard",
    "parallelism",
    "device",
    "num_devices",
)
TIMEOUT = "timeout_in_minutes"
SHARD_FLAGS = re.compile(r"\s+--(?:shard-id|num-shards)(?:=|\s+)\S+")
FIELD = re.compile(r"  ([A-Za-z_][\w-]*):")


# ---------------------------------------------------------------------------
# Reading a test-area file: its head, and runs of step and gap lines.


def _split(text: str) -> tuple[str, list[list]]:
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


def _load_step(text: str) -> dict:
    loaded = yaml.safe_load(text)
    if not isinstance(loaded, list) or len(loaded) != 1:
        raise ValueError(f"not one step: {text[:80]!r}")
    (step,) = loaded
    if not isinstance(step, dict) or "key" not in step:
        label = step.get("label") if isinstance(step, dict) else step
        raise ValueError(f"a step without a key: {label!r}")
    return step


def _uncomment(line: str) -> str:
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
            step = _load_step("".join(_uncomment(line) for line in gap[i:end]))
        except (ValueError, yaml.YAMLError):
            step = None  # prose that happens to start like a list item
        if step is not None:
            found.append((i, end, step))
        i = end
    return found


# ---------------------------------------------------------------------------
# A step's fields, as text and as values.


def _chunks(body: str) -> list[tuple[str, str]]:
    """A step's text cut into its top-level fields, in order: (name, text),
    each text with the comment lines above its field. The first field's
    ``- `` is written as two spaces, so that fields can be reordered."""
    lines = body.splitlines(keepends=True)
    lines[0] = "  " + lines[0][2:]
    chunks: list[list] = []
    pending: list[str] = []
    for line in lines:
        match = FIELD.match(line)
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


def _join(chunks: list[tuple[str, str]]) -> str:
    text = "".join(text for _, text in chunks)
    return "- " + text[2:]


def _sharding(step: dict) -> tuple:
    return bool(step.get("automatic_shard")), step.get("parallelism")


def unshard(command: str) -> str:
    """A command without pytest-shard's ``--shard-id``/``--num-shards``."""
    return SHARD_FLAGS.sub("", command)


def _fit_commands(commands: list, parallel: bool, key: str) -> list:
    if parallel:
        pytest_commands = [c for c in commands if c.startswith("pytest ")]
        if pytest_commands and not any(SHARD_FLAGS.search(c) for c in commands):
            raise ValueError(
                f"{key}: upstream runs it in parallel jobs, and our pytest "
                "commands carry no --shard-id: every job would run every test"
            )
        return commands
    return [unshard(c) if isinstance(c, str) else c for c in commands]


def merged_step(ours: dict, theirs: dict | None) -> dict:
    """The values of the step that ours becomes over upstream's (``None``:
    upstream has no such step). The rule is the module's docstring."""
    if theirs is None:
        return dict(ours)
    merged = {k: v for k, v in ours.items() if k not in FORM}
    merged.update({k: theirs[k] for k in FORM if k in theirs})
    if TIMEOUT in theirs:
        if _sharding(ours) == _sharding(theirs) and TIMEOUT in ours:
            merged[TIMEOUT] = max(ours[TIMEOUT], theirs[TIMEOUT])
        else:
            merged[TIMEOUT] = theirs[TIMEOUT]
    if "commands" in merged:
        parallel = bool(merged.get("parallelism"))
        merged["commands"] = _fit_commands(merged["commands"], parallel, ours["key"])
    return merged


def _merged_text(our_body: str, their_body: str | None) -> str:
    """Our step's text turned into :func:`merged_step`'s values: our fields'
    text where the value is ours, upstream's (with its comments) where it is
    upstream's."""
    if their_body is None:
        return our_body
    ours, theirs = _load_step(our_body), _load_step(their_body)
    want = merged_step(ours, theirs)
    their_chunks = dict(_chunks(their_body))
    chunks = []
    for name, text in _chunks(our_body):
        if name not in want:
            continue
        if want[name] != ours[name]:
            if name == "commands":
                text = "".join(unshard(line) for line in text.splitlines(True))
            else:
                text = their_chunks[name]
        chunks.append((name, text))
    # Upstream's fields that ours lacks, after the field upstream puts them
    # after (never first: both start with the label).
    order = [name for name, _ in _chunks(their_body)]
    for index, name in enumerate(order):
        if name not in want or name in dict(chunks):
            continue
        before = [n for n in order[:index] if n in dict(chunks)]
        at = [n for n, _ in chunks].index(before[-1]) + 1 if before else 1
        chunks.insert(at, (name, their_chunks[name]))
    return _join(chunks)


# ---------------------------------------------------------------------------
# The merge.


def merge(upstream: str, ours: str) -> str:
    head, segments = _split(upstream)
    our_bodies = [
        "".join(lines).rstrip("\n") + "\n"
        for kind, lines in _split(ours)[1]
        if kind == "step"
    ]
    replacements = {_load_step(body)["key"]: body for body in our_bodies}
    if len(replacements) != len(our_bodies):
        raise ValueError("our steps repeat a key")
    active = {
        _load_step("".join(lines))["key"] for kind, lines in segments if kind == "step"
    }
    used = set()
    out: list[str] = []
    for kind, lines in segments:
        if kind == "step":
            body = "".join(lines)
            key = _load_step(body)["key"]
            if key in replacements:
                trail = body[len(body.rstrip("\n")) + 1 :]
                out.append(_merged_text(replacements[key], body) + trail)
                used.add(key)
            else:
                out.append(body)
            continue
        gap, position = list(lines), 0
        for start, end, step in commented_steps(lines):
            key = step["key"]
            if key not in replacements or key in active or key in used:
                continue
            their_body = "".join(_uncomment(line) for line in lines[start:end])
            text = _merged_text(replacements[key], their_body)
            gap[start - position : end - position] = [text]
            position += end - start - 1
            used.add(key)
        out.append("".join(gap))
    for key, body in replacements.items():
        if key not in used:
            if out and not out[-1].endswith("\n\n"):
                out[-1] += "\n"
            out.append(body)
    text = head + "".join(out)
    _verify(upstream, ours, text)
    return text


def _expected_steps(upstream: str, ours: dict[str, dict]) -> list[dict]:
    """The merged file's steps, by value: upstream's steps in order, the
    commented-out ones that ours replace where they stand, ours appended."""
    steps, placed = [], set()
    active = {
        _load_step("".join(lines))["key"]
        for kind, lines in _split(upstream)[1]
        if kind == "step"
    }
    for kind, lines in _split(upstream)[1]:
        if kind == "step":
            theirs = _load_step("".join(lines))
            if theirs["key"] in ours:
                steps.append(merged_step(ours[theirs["key"]], theirs))
                placed.add(theirs["key"])
            else:
                steps.append(theirs)
            continue
        for _, _, theirs in commented_steps(lines):
            key = theirs["key"]
            if key in ours and key not in active and key not in placed:
                steps.append(merged_step(ours[key], theirs))
                placed.add(key)
    return steps + [step for key, step in ours.items() if key not in placed]


def _gap_lines(text: str, keys: set[str]) -> list[str]:
    """The lines between steps, less the commented-out steps of ``keys``."""
    kept = []
    for kind, lines in _split(text)[1]:
        if kind != "gap":
            continue
        skip = set()
        for start, end, step in commented_steps(lines):
            if step["key"] in keys:
                skip.update(range(start, end))
        kept += [line for i, line in enumerate(lines) if i not in skip]
    return kept


def _is_subsequence(needles: list[str], haystack: list[str]) -> bool:
    it = iter(haystack)
    return all(any(n == h for h in it) for n in needles)


def _verify(upstream: str, ours: str, merged: str) -> None:
    before, after = yaml.safe_load(upstream), yaml.safe_load(merged)
    our_steps = {s["key"]: s for s in yaml.safe_load(ours)["steps"] or []}
    if after["steps"] != _expected_steps(upstream, our_steps):
        raise AssertionError("the merged steps are not upstream's with ours")
    rest = {k: v for k, v in before.items() if k != "steps"}
    if {k: v for k, v in after.items() if k != "steps"} != rest:
        raise AssertionError("the merge changed more than the steps")
    keys = [s["key"] for s in after["steps"]]
    if len(keys) != len(set(keys)):
        raise AssertionError(f"the merged file repeats keys: {keys}")
    if _split(merged)[0] != _split(upstream)[0]:
        raise AssertionError("the merge changed the lines before 'steps:'")
    merged_lines = merged.splitlines(keepends=True)
    for kind, lines in _split(upstream)[1]:
        body = "".join(lines)
        key = _load_step(body)["key"] if kind == "step" else None
        if key is not None and key not in our_steps and body not in merged:
            raise AssertionError(f"step {key} changed")
    if not _is_subsequence(_gap_lines(upstream, set(our_steps)), merged_lines):
        raise AssertionError("the merge lost upstream's lines between steps")


def main() -> None:
    upstream_path, ours_path = sys.argv[1:]
    with open(upstream_path) as f:
        upstream = f.read()
    with open(ours_path) as f:
        ours = f.read()
    sys.stdout.write(merge(upstream, ours))


if __name__ == "__main__":
    main()

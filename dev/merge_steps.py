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
how it is scheduled, sharded and set up, and the merged step takes that from
upstream's step (:data:`FORM`, :func:`merged_step`); the rest (triggers,
tests, dependencies) stays ours. The fields and their rule:

* ``label``, ``optional``, ``soft_fail``, ``automatic_shard``,
  ``parallelism``, ``device``, ``num_devices``: upstream's value, with its
  comment, where upstream sets the field; dropped where upstream does not.
  A field whose value equals ours keeps our text.
* ``timeout_in_minutes``: ours is derived for our sharding. Where upstream
  shards the step as we do (the same ``automatic_shard`` and
  ``parallelism``), the larger of the two; where it shards it otherwise,
  upstream's, whose jobs that sharding sizes.
* ``commands``: a step's setup is its commands before its first pytest
  command (how the job gets what its tests need). Where upstream's step has
  a setup, the merged step runs upstream's setup lines, with their comments,
  in place of ours: vLLM 0.34.0 bakes the KV connectors into its CI image
  and its step only verifies them (``.buildkite/scripts/
  check-kv-connectors.sh``: "jobs must not install packages at runtime"),
  where 0.32.0 and 0.33.0 run ``install-kv-connectors.sh``, as ours does.
  Our triggers on the ``.buildkite/scripts/`` files our setup runs then
  give way to those upstream's setup runs.
  Without ``parallelism`` no job has a ``BUILDKITE_PARALLEL_JOB``, and
  vLLM's pipeline generator shards an ``automatic_shard`` step itself,
  refusing a pytest command that carries pytest-shard's flags: so
  ``--shard-id``/``--num-shards`` are dropped from our pytest commands when
  the merged form has no ``parallelism``.
* ``mirror``: a mirror of upstream's step (0.34.0's 4xB200 step runs on
  ``mi355_4`` too) is kept as upstream has it where ours has no mirror for
  that platform; where both have one, ours, with the rules above applied to
  it against upstream's (its ``automatic_shard`` and the other form fields
  are upstream's).

A step upstream lacks is appended as ours, but for its setup: where a step
of ours that upstream has is set up as it is, on the same image (the same
``depends_on``), and upstream's step runs another setup, the appended step
runs that one (:func:`adopted_step`): upstream says how a job on its image
gets its packages (0.34.0's image has the KV connectors baked in), not our
step. A step on another image (the CPU one) keeps its own.
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
TRIGGERS = "source_file_dependencies"
SHARD_FLAGS = re.compile(r"\s+--(?:shard-id|num-shards)(?:=|\s+)\S+")
# A script of vLLM's .buildkite/scripts/ in a command, by its path in the
# checkout (the job's /vllm-workspace/ prefix left out).
SCRIPT = re.compile(r"(?<![\w.-])(\.buildkite/scripts/[\w./-]+)")


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


def _chunks(text: str, indent: int = 2) -> list[tuple[str, str]]:
    """A mapping's text cut into its fields at ``indent``, in order: (name,
    text), each text with the comment lines above its field. A step's first
    line must come with its ``- `` written as two spaces (:func:`_field_text`),
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


def _field_text(body: str) -> str:
    """A step's text with its ``- `` written as two spaces."""
    return "  " + body[2:]


def _split_head(chunk: str) -> tuple[str, str]:
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


def _sequence(chunk: str, values: list) -> tuple[str, list[str]]:
    """A sequence field's text as (its head, its items' texts); a flow
    sequence (``[a, b]``) is written out as a block."""
    head, value = _split_head(chunk)
    items = _items(value) if value.strip() else []
    if len(items) == len(values):
        return head, items
    *above, line = head.splitlines(keepends=True)
    indent = len(line) - len(line.lstrip())
    head = "".join(above) + line[: line.index(":") + 1] + "\n"
    return head, _block_items(values, indent)


def _item_indent(item: str) -> int:
    line = next(x for x in item.splitlines() if x.lstrip().startswith("- "))
    return len(line) - len(line.lstrip())


def _reindent(text: str, delta: int) -> str:
    """``text`` moved ``delta`` columns right (left where negative)."""
    lines = text.splitlines(keepends=True)
    if delta >= 0:
        return "".join(" " * delta + line if line.strip() else line for line in lines)
    cut = -delta
    assert all(not line.strip() or line[:cut] == " " * cut for line in lines), text
    return "".join(line[cut:] if line.strip() else line for line in lines)


def _sharding(step: dict) -> tuple:
    return bool(step.get("automatic_shard")), step.get("parallelism")


def unshard(command: str) -> str:
    """A command without pytest-shard's ``--shard-id``/``--num-shards``."""
    return SHARD_FLAGS.sub("", command)


def _is_pytest(command) -> bool:
    return isinstance(command, str) and command.startswith("pytest ")


def setup(commands: list) -> list:
    """A step's setup: its commands before its first pytest command."""
    first = next((i for i, c in enumerate(commands) if _is_pytest(c)), len(commands))
    return commands[:first]


def scripts(commands: list) -> list[str]:
    """The ``.buildkite/scripts/`` files that ``commands`` run, as triggers
    name them (relative to the checkout)."""
    found = []
    for command in commands:
        for path in SCRIPT.findall(command if isinstance(command, str) else ""):
            if path not in found:
                found.append(path)
    return found


def _setup_triggers(listed: list, ours: list, theirs: list) -> list:
    """Our triggers with those on the scripts our setup runs replaced by the
    scripts upstream's setup runs (in the place of the first replaced)."""
    drop = [s for s in scripts(ours) if s not in scripts(theirs)]
    add = [s for s in scripts(theirs) if s not in listed]
    out = []
    for trigger in listed:
        if trigger in drop:
            out += add
            add = []
        else:
            out.append(trigger)
    return out + add


def _fit_commands(commands: list, parallel: bool, key: str) -> list:
    if parallel:
        pytest_commands = [c for c in commands if _is_pytest(c)]
        if pytest_commands and not any(SHARD_FLAGS.search(c) for c in commands):
            raise ValueError(
                f"{key}: upstream runs it in parallel jobs, and our pytest "
                "commands carry no --shard-id: every job would run every test"
            )
        return commands
    return [unshard(c) if isinstance(c, str) else c for c in commands]


def image(step: dict) -> tuple[str, ...]:
    """The builds a step's job waits for, which give it its image: its own
    ``depends_on``, else (empty) the file's."""
    depends = step.get("depends_on") or ()
    return (depends,) if isinstance(depends, str) else tuple(depends)


def _with_setup(step: dict, their_setup: list) -> dict:
    """``step`` running ``their_setup`` in place of its own, triggering on
    the scripts that runs in place of those its own ran."""
    step = dict(step)
    commands = step["commands"]
    our_setup = setup(commands)
    step["commands"] = [*their_setup, *commands[len(our_setup) :]]
    if TRIGGERS in step:
        step[TRIGGERS] = _setup_triggers(step[TRIGGERS], our_setup, their_setup)
    return step


def setup_donor(ours: dict, placed: list[tuple[dict, dict]]) -> dict | None:
    """For a step of ours that upstream lacks, the upstream step whose setup
    it runs (:func:`adopted_step`): of ``placed``, the (ours, upstream's)
    pairs of the steps upstream has, one whose step of ours is set up as
    ``ours`` on its image and whose upstream step is set up otherwise."""
    our_setup = setup(ours.get("commands") or [])
    donors = [
        theirs
        for mine, theirs in placed
        if our_setup
        and image(mine) == image(ours)
        and setup(mine.get("commands") or []) == our_setup
        and setup(theirs.get("commands") or []) not in ([], our_setup)
    ]
    setups = {tuple(setup(theirs["commands"])) for theirs in donors}
    if len(setups) > 1:
        raise ValueError(
            f"{ours.get('key')}: upstream sets up steps of ours set up as it is "
            f"in several ways: {sorted(setups)}"
        )
    return donors[0] if donors else None


def adopted_step(ours: dict, donor: dict | None) -> dict:
    """The values of a step of ours that upstream lacks: ours, running the
    setup of ``donor`` (:func:`setup_donor`), if any."""
    if donor is None:
        return dict(ours)
    step = _with_setup(ours, setup(donor["commands"]))
    parallel = bool(step.get("parallelism"))
    step["commands"] = _fit_commands(step["commands"], parallel, ours.get("key"))
    return step


def merged_step(ours: dict, theirs: dict | None, key: str | None = None) -> dict:
    """The values of the step (or mirror job) that ours becomes over
    upstream's (``None``: upstream has no such step). The rule is the
    module's docstring."""
    if theirs is None:
        return dict(ours)
    key = ours.get("key", key)
    merged = {k: v for k, v in ours.items() if k not in FORM}
    merged.update({k: theirs[k] for k in FORM if k in theirs})
    if TIMEOUT in theirs:
        if _sharding(ours) == _sharding(theirs) and TIMEOUT in ours:
            merged[TIMEOUT] = max(ours[TIMEOUT], theirs[TIMEOUT])
        else:
            merged[TIMEOUT] = theirs[TIMEOUT]
    if "commands" in merged:
        their_setup = setup(theirs.get("commands") or [])
        if their_setup:
            merged = _with_setup(merged, their_setup)
        parallel = bool(merged.get("parallelism"))
        merged["commands"] = _fit_commands(merged["commands"], parallel, key)
    if isinstance(theirs.get("mirror"), dict):
        mirror = dict(ours.get("mirror") or {})
        for platform, job in theirs["mirror"].items():
            mine = mirror.get(platform)
            mirror[platform] = job if mine is None else merged_step(mine, job, key)
        merged["mirror"] = mirror
    return merged


def _commands_text(chunk: str, their_chunk: str, ours: list, theirs: list) -> str:
    """Our ``commands`` field's text with upstream's setup lines (and their
    comments) in place of ours, and pytest-shard's flags dropped where the
    merged step has none (the caller checks the value)."""
    head, items = _sequence(chunk, ours)
    their_setup = setup(theirs or [])
    if their_setup:
        their_items = _sequence(their_chunk, theirs)[1]
        shift = _item_indent(items[0]) - _item_indent(their_items[0])
        their_items = [_reindent(item, shift) for item in their_items]
        items = [*their_items[: len(their_setup)], *items[len(setup(ours)) :]]
    lines = "".join(items).splitlines(keepends=True)
    return head + "".join(unshard(line) for line in lines)


def _triggers_text(chunk: str, ours: list, want: list) -> str:
    """Our trigger list's text turned into ``want``: each trigger that goes
    is replaced, at its place and under its comments, by those that come."""
    head, items = _sequence(chunk, ours)
    add = [t for t in want if t not in ours]
    out = []
    for item in items:
        line = next(x for x in item.splitlines(True) if x.lstrip().startswith("- "))
        if yaml.safe_load(line.lstrip()[2:]) in want:
            out.append(item)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        out.append(item.replace(line, "".join(f"{indent}- {t}\n" for t in add)))
        add = []
    if add:
        indent = " " * _item_indent(out[-1])
        out.append("".join(f"{indent}- {t}\n" for t in add))
    return head + "".join(out)


def _mirror_text(
    chunk: str, their_chunk: str, ours: dict, theirs: dict, want: dict, indent: int
) -> str:
    """Our ``mirror`` field's text turned into ``want``, job by job."""
    head, value = _split_head(chunk)
    their_jobs = dict(_chunks(_split_head(their_chunk)[1], indent + 2))
    jobs = []
    for platform, text in _chunks(value, indent + 2):
        if want[platform] != ours[platform]:
            job_head, fields = _split_head(text)
            their_fields = _split_head(their_jobs[platform])[1]
            text = job_head + _fields_text(
                fields,
                their_fields,
                ours[platform],
                theirs[platform],
                want[platform],
                indent + 4,
            )
        jobs.append(text)
    jobs += [their_jobs[p] for p in want if p not in ours]
    return head + "".join(jobs)


def _fields_text(
    text: str, their_text: str, ours: dict, theirs: dict, want: dict, indent: int
) -> str:
    """Our mapping's text (fields at ``indent``) turned into ``want``: our
    fields' text where the value is ours, upstream's (with its comments)
    where it is upstream's."""
    their_chunks = dict(_chunks(their_text, indent))
    chunks = []
    for name, chunk in _chunks(text, indent):
        if name not in want:
            continue
        if want[name] != ours[name]:
            if name == "commands":
                chunk = _commands_text(
                    chunk, their_chunks.get(name, ""), ours[name], theirs.get(name)
                )
            elif name == TRIGGERS:
                chunk = _triggers_text(chunk, ours[name], want[name])
            elif name == "mirror":
                chunk = _mirror_text(
                    chunk,
                    their_chunks[name],
                    ours[name],
                    theirs[name],
                    want[name],
                    indent,
                )
            else:
                chunk = their_chunks[name]
        chunks.append((name, chunk))
    # Upstream's fields that ours lacks, after the field upstream puts them
    # after (a step's never first: it starts with its label).
    order = [name for name, _ in _chunks(their_text, indent)]
    first = 1 if indent == 2 else 0
    for index, name in enumerate(order):
        if name not in want or name in dict(chunks):
            continue
        before = [n for n in order[:index] if n in dict(chunks)]
        at = [n for n, _ in chunks].index(before[-1]) + 1 if before else first
        chunks.insert(at, (name, their_chunks[name]))
    return "".join(chunk for _, chunk in chunks)


def _merged_text(our_body: str, their_body: str | None) -> str:
    """Our step's text turned into :func:`merged_step`'s values."""
    if their_body is None:
        return our_body
    ours, theirs = _load_step(our_body), _load_step(their_body)
    want = merged_step(ours, theirs)
    text = _fields_text(
        _field_text(our_body), _field_text(their_body), ours, theirs, want, 2
    )
    return "- " + text[2:]


def _adopted_text(our_body: str, placed: list[tuple[str, str]]) -> str:
    """The text of a step of ours that upstream lacks, turned into
    :func:`adopted_step`'s values; ``placed``: the (ours, upstream's) texts
    of the steps upstream has."""
    ours = _load_step(our_body)
    pairs = [(_load_step(mine), _load_step(body), body) for mine, body in placed]
    donor = setup_donor(ours, [(mine, theirs) for mine, theirs, _ in pairs])
    if donor is None:
        return our_body
    their_body = next(body for _, theirs, body in pairs if theirs is donor)
    want = adopted_step(ours, donor)
    text = _fields_text(
        _field_text(our_body), _field_text(their_body), ours, donor, want, 2
    )
    return "- " + text[2:]


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
    # (ours, upstream's) texts of the steps upstream has.
    placed: list[tuple[str, str]] = []
    out: list[str] = []
    for kind, lines in segments:
        if kind == "step":
            body = "".join(lines)
            key = _load_step(body)["key"]
            if key in replacements:
                trail = body[len(body.rstrip("\n")) + 1 :]
                out.append(_merged_text(replacements[key], body) + trail)
                used.add(key)
                placed.append((replacements[key], body))
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
            placed.append((replacements[key], their_body))
        out.append("".join(gap))
    for key, body in replacements.items():
        if key not in used:
            if out and not out[-1].endswith("\n\n"):
                out[-1] += "\n"
            out.append(_adopted_text(body, placed))
    text = head + "".join(out)
    _verify(upstream, ours, text)
    return text


def _expected_steps(upstream: str, ours: dict[str, dict]) -> list[dict]:
    """The merged file's steps, by value: upstream's steps in order, the
    commented-out ones that ours replace where they stand, ours appended."""
    steps, placed, pairs = [], set(), []
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
                pairs.append((ours[theirs["key"]], theirs))
            else:
                steps.append(theirs)
            continue
        for _, _, theirs in commented_steps(lines):
            key = theirs["key"]
            if key in ours and key not in active and key not in placed:
                steps.append(merged_step(ours[key], theirs))
                placed.add(key)
                pairs.append((ours[key], theirs))
    return steps + [
        adopted_step(step, setup_donor(step, pairs))
        for key, step in ours.items()
        if key not in placed
    ]


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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
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

Where upstream has the step, active or commented out, upstream decides how
it is scheduled, sharded and set up (``step_form.merged_step``); its
triggers, tests and dependencies stay ours:

* ``label``, ``optional``, ``soft_fail``, ``automatic_shard``,
  ``parallelism``, ``device``, ``num_devices`` (``step_form.FORM``):
  upstream's value, with its comment, where upstream sets the field; dropped
  where it does not. A field whose value equals ours keeps our text.
* ``timeout_in_minutes``: the larger of the two where upstream shards the
  step as we do (the same ``automatic_shard`` and ``parallelism``), else
  upstream's, whose jobs that sharding sizes.
* ``commands``: upstream's setup (its commands before the first pytest) in
  place of ours (0.34.0 bakes the KV connectors into its image and only
  verifies them), our triggers on our setup's scripts giving way to its.
  Without ``parallelism``, pytest-shard's flags are dropped: vLLM's pipeline
  generator shards an ``automatic_shard`` step itself and refuses them.
* ``mirror``: upstream's where ours has none for that platform; else ours,
  under these rules against upstream's.

A step upstream lacks runs the setup upstream gives a step of ours set up as
it is on the same image (``step_form.adopted_step``); one on another image
(the CPU one) keeps its own. The file's text is read by ``area_text.py``.
"""

import sys
from pathlib import Path

import yaml

# Run as a script (dev/ first on sys.path) or imported from dev/tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from area_text import (  # noqa: E402
    commented_steps,
    field_chunks,
    field_text,
    item_indent,
    load_step,
    reindent,
    sequence_items,
    split_head,
    split_steps,
    uncomment,
)
from step_form import (  # noqa: E402
    TRIGGERS,
    adopted_step,
    merged_step,
    setup,
    setup_donor,
    unshard,
)


def _commands_text(chunk: str, their_chunk: str, ours: list, theirs: list) -> str:
    """Our ``commands`` field's text with upstream's setup lines (and their
    comments) in place of ours, and pytest-shard's flags dropped where the
    merged step has none (the caller checks the value)."""
    head, items = sequence_items(chunk, ours)
    their_setup = setup(theirs or [])
    if their_setup:
        their_items = sequence_items(their_chunk, theirs)[1]
        shift = item_indent(items[0]) - item_indent(their_items[0])
        their_items = [reindent(item, shift) for item in their_items]
        items = [*their_items[: len(their_setup)], *items[len(setup(ours)) :]]
    lines = "".join(items).splitlines(keepends=True)
    return head + "".join(unshard(line) for line in lines)


def _triggers_text(chunk: str, ours: list, want: list) -> str:
    """Our trigger list's text turned into ``want``: each trigger that goes
    is replaced, at its place and under its comments, by those that come."""
    head, items = sequence_items(chunk, ours)
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
        indent = " " * item_indent(out[-1])
        out.append("".join(f"{indent}- {t}\n" for t in add))
    return head + "".join(out)


def _mirror_text(
    chunk: str, their_chunk: str, ours: dict, theirs: dict, want: dict, indent: int
) -> str:
    """Our ``mirror`` field's text turned into ``want``, job by job."""
    head, value = split_head(chunk)
    their_jobs = dict(field_chunks(split_head(their_chunk)[1], indent + 2))
    jobs = []
    for platform, text in field_chunks(value, indent + 2):
        if want[platform] != ours[platform]:
            job_head, fields = split_head(text)
            their_fields = split_head(their_jobs[platform])[1]
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
    their_chunks = dict(field_chunks(their_text, indent))
    chunks = []
    for name, chunk in field_chunks(text, indent):
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
    order = [name for name, _ in field_chunks(their_text, indent)]
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
    ours, theirs = load_step(our_body), load_step(their_body)
    want = merged_step(ours, theirs)
    text = _fields_text(
        field_text(our_body), field_text(their_body), ours, theirs, want, 2
    )
    return "- " + text[2:]


def _adopted_text(our_body: str, placed: list[tuple[str, str]]) -> str:
    """The text of a step of ours that upstream lacks, turned into
    :func:`adopted_step`'s values; ``placed``: the (ours, upstream's) texts
    of the steps upstream has."""
    ours = load_step(our_body)
    pairs = [(load_step(mine), load_step(body), body) for mine, body in placed]
    donor = setup_donor(ours, [(mine, theirs) for mine, theirs, _ in pairs])
    if donor is None:
        return our_body
    their_body = next(body for _, theirs, body in pairs if theirs is donor)
    want = adopted_step(ours, donor)
    text = _fields_text(
        field_text(our_body), field_text(their_body), ours, donor, want, 2
    )
    return "- " + text[2:]


def merge(upstream: str, ours: str) -> str:
    head, segments = split_steps(upstream)
    our_bodies = [
        "".join(lines).rstrip("\n") + "\n"
        for kind, lines in split_steps(ours)[1]
        if kind == "step"
    ]
    replacements = {load_step(body)["key"]: body for body in our_bodies}
    if len(replacements) != len(our_bodies):
        raise ValueError("our steps repeat a key")
    active = {
        load_step("".join(lines))["key"] for kind, lines in segments if kind == "step"
    }
    used = set()
    # (ours, upstream's) texts of the steps upstream has.
    placed: list[tuple[str, str]] = []
    out: list[str] = []
    for kind, lines in segments:
        if kind == "step":
            body = "".join(lines)
            key = load_step(body)["key"]
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
            their_body = "".join(uncomment(line) for line in lines[start:end])
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
        load_step("".join(lines))["key"]
        for kind, lines in split_steps(upstream)[1]
        if kind == "step"
    }
    for kind, lines in split_steps(upstream)[1]:
        if kind == "step":
            theirs = load_step("".join(lines))
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
    for kind, lines in split_steps(text)[1]:
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
    if split_steps(merged)[0] != split_steps(upstream)[0]:
        raise AssertionError("the merge changed the lines before 'steps:'")
    merged_lines = merged.splitlines(keepends=True)
    for kind, lines in split_steps(upstream)[1]:
        body = "".join(lines)
        key = load_step(body)["key"] if kind == "step" else None
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

"""Merge our Buildkite steps into one of vLLM's ``test_areas`` files by key.

    python dev/merge_steps.py UPSTREAM OURS > MERGED

A step of OURS whose ``key`` is already in UPSTREAM replaces that step where
it stands; a step with a new key is appended. The rest of UPSTREAM is kept
byte for byte, which the merge verifies before printing anything.
"""

import sys

import yaml


def split_steps(text: str) -> tuple[str, list[str]]:
    """(everything up to and including ``steps:``, one text per step)."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip() == "steps:")
    except StopIteration:
        raise ValueError("no top-level 'steps:' line") from None
    head, blocks = "".join(lines[: start + 1]), []
    for line in lines[start + 1 :]:
        if line.startswith("- ") or not blocks:
            blocks.append(line)
        else:
            blocks[-1] += line
    return head, blocks


def step_key(block: str) -> str:
    (step,) = yaml.safe_load(block)
    if "key" not in step:
        raise ValueError(f"a step without a key: {step.get('label')!r}")
    return step["key"]


def _body_and_trail(block: str) -> tuple[str, str]:
    body = block.rstrip("\n") + "\n"
    return body, block[len(body) :]


def merge(upstream: str, ours: str) -> str:
    head, blocks = split_steps(upstream)
    _, our_blocks = split_steps(ours)
    replacements = {step_key(b): _body_and_trail(b)[0] for b in our_blocks}
    if len(replacements) != len(our_blocks):
        raise ValueError("our steps repeat a key")
    merged, used = [], set()
    for block in blocks:
        key = step_key(block)
        if key in replacements:
            merged.append(replacements[key] + _body_and_trail(block)[1])
            used.add(key)
        else:
            merged.append(block)
    for key, body in replacements.items():
        if key not in used:
            if merged and not merged[-1].endswith("\n\n"):
                merged[-1] += "\n"
            merged.append(body)
    text = head + "".join(merged)
    _verify(upstream, ours, text)
    return text


def _verify(upstream: str, ours: str, merged: str) -> None:
    before, after = yaml.safe_load(upstream), yaml.safe_load(merged)
    our_steps = yaml.safe_load(ours)["steps"] or []
    new = {s["key"]: s for s in our_steps}
    expected = [new.pop(s["key"], s) for s in before["steps"]] + list(new.values())
    if after["steps"] != expected:
        raise AssertionError("the merged steps are not upstream's with ours")
    rest = {k: v for k, v in before.items() if k != "steps"}
    if {k: v for k, v in after.items() if k != "steps"} != rest:
        raise AssertionError("the merge changed more than the steps")
    keys = [s["key"] for s in after["steps"]]
    if len(keys) != len(set(keys)):
        raise AssertionError(f"the merged file repeats keys: {keys}")
    replaced = {s["key"] for s in our_steps}
    for block in split_steps(upstream)[1]:
        if step_key(block) not in replaced and block not in merged:
            raise AssertionError(f"step {step_key(block)} changed in the merge")


def main() -> None:
    upstream_path, ours_path = sys.argv[1:]
    with open(upstream_path) as f:
        upstream = f.read()
    with open(ours_path) as f:
        ours = f.read()
    sys.stdout.write(merge(upstream, ours))


if __name__ == "__main__":
    main()

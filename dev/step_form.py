# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How a step of ours is merged over upstream's, by value (the rule is
``dev/merge_steps.py``'s docstring)."""

import re

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
    upstream's (``None``: upstream has no such step). The rule is
    merge_steps.py's docstring."""
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

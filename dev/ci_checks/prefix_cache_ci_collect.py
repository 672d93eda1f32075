# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A step's pytest commands collected in this process, or in a fresh
interpreter that records the files it imports, each once a session."""

import functools
import os
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from prefix_cache_ci_area import (
    ROOT,
    SUITE_FOLDERS,
    TESTS,
    _pytest_runs,
    _unsharded,
)

from tests.models.kimi_k3.prefix_cache_collected import collected_ids


def _collect_args(argv: list[str], shard: tuple[int, int] | None) -> list[str]:
    args = []
    for arg in argv[1:]:
        if shard is not None:
            arg = arg.replace("$$BUILDKITE_PARALLEL_JOB_COUNT", str(shard[1]))
            arg = arg.replace("$$BUILDKITE_PARALLEL_JOB", str(shard[0]))
        if arg not in ("-v", "-s"):
            args.append(arg)
    assert not any("$" in arg for arg in args), args
    return args


def collect_in_process(
    argv: list[str], shard: tuple[int, int] | None = None
) -> list[str]:
    """What :func:`collect` returns, collected in this process (see
    collected_ids). Only for commands that select modules this session
    imports anyway (the matrix module); a command that imports other test
    modules, or whose imports are the point, goes to :func:`collect`."""
    args = []
    for arg in _collect_args(argv, shard):
        if arg.startswith("--ignore="):
            arg = f"--ignore={TESTS / arg.split('=', 1)[1]}"
        elif not arg.startswith("-"):
            arg = str(TESTS / arg)
        args.append(arg)
    return collected_ids(args)


class Collection(NamedTuple):
    """A command's ``pytest --collect-only`` in a fresh interpreter."""

    result: subprocess.CompletedProcess
    # Where RECORD_IMPORTS wrote the imported files (nothing there if pytest
    # never finished collecting).
    imports: Path


@functools.cache
def _recorder() -> tempfile.TemporaryDirectory:
    """The session's folder of RECORD_IMPORTS and what it records (held
    here, it goes when the interpreter exits)."""
    folder = tempfile.TemporaryDirectory(prefix="record-imports-")
    (Path(folder.name) / "record_imports.py").write_text(RECORD_IMPORTS)
    return folder


# A fresh interpreter imports vllm and torch, and so several tests asking for
# the same step's collection cost most of this module's time: each distinct
# collection runs once a session, recording its node ids and its imports at
# once, at most two at a time (each keeps a core busy).
_COLLECTORS = ThreadPoolExecutor(2)


@functools.cache
def _collection(args: tuple[str, ...], cwd: Path) -> Future[Collection]:
    """The collection of pytest arguments ``args`` run from ``cwd``, started
    on the first call."""
    recorder = Path(_recorder().name)
    imports = Path(tempfile.mkdtemp(dir=recorder)) / "imports.txt"
    pythonpath = os.pathsep.join(
        p for p in (str(recorder), os.environ.get("PYTHONPATH")) if p
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        "-p",
        "record_imports",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": pythonpath, "RECORD_IMPORTS_TO": str(imports)}

    def run() -> Collection:
        result = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        )
        return Collection(result, imports)

    return _COLLECTORS.submit(run)


def _start(
    argv: list[str], shard: tuple[int, int] | None = None, cwd: Path = TESTS
) -> Future[Collection]:
    return _collection(tuple(_collect_args(argv, shard)), cwd.resolve())


def collection(
    argv: list[str], shard: tuple[int, int] | None = None, cwd: Path = TESTS
) -> Collection:
    """A step's pytest command collected from ``cwd`` (tests/, where our
    steps run) in a fresh interpreter, once a session."""
    found = _start(argv, shard, cwd).result()
    result = found.result
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    return found


def collect(
    argv: list[str],
    shard: tuple[int, int] | None = None,
    cwd: Path = TESTS,
    errors: list[str] | None = None,
) -> list[str]:
    """The node ids a step's pytest command selects (:func:`collection`);
    ``errors`` gets the modules that failed to collect, with pytest's
    error."""
    result = collection(argv, shard, cwd).result
    if errors is not None:
        errors += [
            line.strip("_ ")
            for line in result.stdout.splitlines()
            if "ERROR collecting" in line or line.startswith("E   ")
        ]
    return [line for line in result.stdout.splitlines() if "::" in line]


# A pytest plugin that writes the file of every module imported by the end
# of collection (conftest.py files included) to $RECORD_IMPORTS_TO.
RECORD_IMPORTS = """
import os
import sys


def pytest_collection_finish(session):
    with open(os.environ["RECORD_IMPORTS_TO"], "w") as out:
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if path:
                print(path, file=out)
"""


def _has_code(path: Path) -> bool:
    """Whether a file holds more than blank lines and comments (an empty
    ``__init__.py`` cannot change what a step does)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return any(line and not line.startswith("#") for line in lines)


def imported_suite_files(argv: list[str], cwd: Path = TESTS) -> set[str]:
    """The files of the suite's folders that collecting ``argv`` (run from
    ``cwd``) imports, relative to the checkout."""
    record = collection(argv, cwd=cwd).imports
    files = set()
    for line in record.read_text().splitlines():
        path = Path(line).resolve()
        if not path.is_relative_to(ROOT) or not path.is_file():
            continue
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(SUITE_FOLDERS) and _has_code(path):
            files.add(relative)
    return files


def step_imports(step: dict) -> set[str]:
    """The files of the suite that a step's pytest commands import."""
    # Every shard imports the same files.
    runs = [(_unsharded(argv), here) for argv, here in _pytest_runs(step)]
    # Each command's collection in a fresh interpreter of its own, all started
    # before waiting on the first.
    for argv, here in runs:
        _start(argv, cwd=here)
    return set().union(*(imported_suite_files(argv, here) for argv, here in runs))

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs of ``.buildkite/scripts/install-kv-connectors.sh`` for its checks:
dry runs against a stub ``python3``, real runs against stubs that record
what they are asked, and what a run installs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prefix_cache_ci_area import ROOT, SCRIPT

MOONCAKE_CU12 = "mooncake-transfer-engine"
MOONCAKE_CU13 = "mooncake-transfer-engine-cuda13"


def _requirements_pin(name: str) -> str:
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        if line.replace(" ", "").startswith("nixl=="):
            return line.replace(" ", "").split("==", 1)[1]
    raise AssertionError(f"requirements/{name} pins no nixl")


def _script_setting(name: str) -> str:
    """A NAME=value setting of the install script."""
    (value,) = re.findall(rf"^{name}=(\S+)$", SCRIPT.read_text(), re.MULTILINE)
    return value


# A python3 for the script's dry runs: it answers the platform probe with
# $STUB_PROBE and runs every other script it is given with this interpreter;
# with $STUB_SITE, one that sees only the distributions installed there (no
# site-packages), so that what the script reads as installed is the test's.
STUB_PROBING_PYTHON = """#!{python}
import os
import subprocess
import sys

script = sys.stdin.read()
if "torch.version.hip" in script:
    print(os.environ["STUB_PROBE"])
    sys.exit(0)
argv, env = [{python!r}, *sys.argv[1:]], dict(os.environ)
if os.environ.get("STUB_SITE"):
    argv.insert(1, "-S")
    env["PYTHONPATH"] = os.environ["STUB_SITE"]
run = subprocess.run(argv, input=script, text=True, env=env)
sys.exit(run.returncode)
"""


def dry_run(
    tmp_path: Path,
    probe: str,
    requirements: Path | None = None,
    site: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run the install script in its dry-run mode on a platform that the
    stub python3 reports as ``probe``, with the distributions of ``site``
    alone installed, if given. Its temporary files go to tmp_path/tmp."""
    (tmp_path / "tmp").mkdir(parents=True)
    env = {
        "KV_CONNECTORS_DRY_RUN": "1",
        "TMPDIR": str(tmp_path / "tmp"),
        "STUB_PROBE": probe,
        "STUB_SITE": str(site or ""),
    }
    if requirements is not None:
        env["KV_CONNECTORS_REQUIREMENTS"] = str(requirements)
    stubs = {"python3": STUB_PROBING_PYTHON.format(python=sys.executable)}
    return run_script(tmp_path, stubs, env)


def run_script(
    tmp_path: Path, stubs: dict[str, str], env: dict[str, str]
) -> subprocess.CompletedProcess:
    """Run the install script with ``stubs`` (name: text) first on PATH,
    HOME in tmp_path and ``env`` beside them."""
    stub = tmp_path / "bin"
    stub.mkdir(parents=True)
    for name, text in stubs.items():
        (stub / name).write_text(text)
        (stub / name).chmod(0o755)
    path = os.pathsep.join([str(stub), "/usr/bin", "/bin"])
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={"PATH": path, "HOME": str(tmp_path), **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def read_jsonl(log: Path) -> list:
    """The JSON lines a stub logged, none where it never ran."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def _commands(result: subprocess.CompletedProcess) -> list[list[str]]:
    """The commands a dry run printed, each split into its words."""
    return [line[2:].split() for line in result.stdout.splitlines() if line[:2] == "+ "]


def _names(argv: list[str], package: str) -> bool:
    """Whether a command names ``package`` itself, with or without a version."""
    return any(re.split(r"[<>=!~;\[ ]", arg, maxsplit=1)[0] == package for arg in argv)


def _requires(requirements: str, package: str) -> bool:
    lines = (ROOT / "requirements" / requirements).read_text().splitlines()
    return any(_names([line.replace(" ", "")], package) for line in lines)


def _index(commands: list[list[str]], command: list[str]) -> int:
    """Where ``command`` stands in ``commands`` (by identity)."""
    (index,) = [i for i, c in enumerate(commands) if c is command]
    return index


def _installs(commands: list[list[str]]) -> list[list[str]]:
    return [c for c in commands if "install" in c and "uninstall" not in c]


def _locked_packages(command: list[str]) -> dict[str, str]:
    """The NAME==VERSION arguments of an install command, which must install
    those alone: --no-deps, no requirements file, no range."""
    assert "--no-deps" in command, f"resolves dependencies: {command}"
    assert "-r" not in command and "-c" not in command, command
    packages = command[command.index("--no-deps") + 1 :]
    assert packages, command
    for package in packages:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", package), package
    return dict(package.split("==") for package in packages)


# vLLM's KV connector lock (0.34.0 on), and the input it is compiled from.
KV_LOCK = ROOT / "requirements/test/kv_connectors_cuda.txt"


def _without_kv_lock() -> None:
    if KV_LOCK.is_file():
        pytest.skip(
            f"this checkout has vLLM's KV connector lock ({KV_LOCK.name}), which "
            "the script installs instead (test_install_script_installs_the_lock)"
        )


MOONCAKE_CASES = [
    # (CUDA major, its requirements, its Mooncake build, the other build)
    ("12", "kv_connectors_cu12.txt", MOONCAKE_CU12, MOONCAKE_CU13),
    ("13", "kv_connectors.txt", MOONCAKE_CU13, MOONCAKE_CU12),
]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _rocm_lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements/test/rocm.txt").read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, version = line.split("==", 1)
            pins[_canonical(name)] = version.strip()
    return pins


def lock_entries(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """A hash lock's entries, as pip reads them: {name: (version, hashes)}
    (``uv pip compile --generate-hashes`` output: ``NAME==VERSION \\`` and
    the ``--hash=`` lines under it)."""
    entries: dict[str, tuple[str, frozenset[str]]] = {}
    name = None
    for line in text.splitlines():
        match = re.match(r"([A-Za-z0-9][\w.-]*)==([^\s;\\]+)", line)
        if match:
            name = _canonical(match.group(1))
            assert name not in entries, f"{name} twice"
            entries[name] = (match.group(2), frozenset())
        elif name and line[:1].isspace():
            version, hashes = entries[name]
            entries[name] = (version, hashes | set(re.findall(r"--hash=(\S+)", line)))
        else:
            name = None
    return entries


def _lock_install(result: subprocess.CompletedProcess) -> str:
    """The text a dry run installs a lock from: its only install command
    must be hash-checked, --no-deps, from one file."""
    (install,) = _installs(_commands(result))
    assert "--require-hashes" in install and "--no-deps" in install, install
    at = install.index("-r")
    assert [a for a in install[at + 2 :] if not a.startswith("-")] == [], install
    flags = install[install.index("install") + 1 : at]
    assert not [f for f in flags if not f.startswith("-") or "=" in f], flags
    return Path(install[at + 1]).read_text()


def _installed(site: Path, name: str, version: str) -> None:
    """Make ``name`` ``version`` an installed distribution of ``site``."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )


def _fake_lock(folder: Path, entries: dict[str, str], owned: list[str]) -> Path:
    """A hash lock of ``entries`` ({name: version}) compiled from an input
    naming ``owned``, as vLLM keeps kv_connectors_cuda.txt beside its .in."""
    folder.mkdir(parents=True)
    lock = folder / "kv_connectors_cuda.txt"
    lock.write_text(
        "# a lock as uv pip compile writes one\n"
        + "".join(
            f"{name}=={version} \\\n"
            f"    --hash=sha256:{name.encode().hex():0<64} \\\n"
            f"    --hash=sha256:{version.encode().hex():1<64}\n"
            "    # via -r kv_connectors_cuda.in\n"
            for name, version in entries.items()
        )
    )
    lock.with_suffix(".in").write_text("".join(f"{n}\n" for n in owned))
    return lock


# Stubs for a real (not dry) run: python3 and uv that record what they are
# asked to do. python3 answers the platform probe and fails the script it is
# given when that holds the marker in $STUB_FAIL_ON.
STUB_PYTHON = """#!{python}
import json
import os
import sys

script = "" if sys.stdin.isatty() else sys.stdin.read()
with open({log!r}, "a") as log:
    print(json.dumps({{"argv": sys.argv[1:], "script": script}}), file=log)
if "torch.version.hip" in script:
    print({probe!r})
elif os.environ.get("STUB_FAIL_ON") and os.environ["STUB_FAIL_ON"] in script:
    sys.exit(1)
"""
STUB_UV = """#!{python}
import json
import sys

with open({log!r}, "a") as log:
    print(json.dumps(sys.argv[1:]), file=log)
"""


def stubbed_run(
    tmp_path: Path, probe: str, fail_on: str = ""
) -> tuple[subprocess.CompletedProcess, list[dict], list[list[str]]]:
    """Run the install script for real against the stubs: its result, what
    python3 was asked to run, and the uv commands."""
    python_log, uv_log = tmp_path / "python3.jsonl", tmp_path / "uv.jsonl"
    stubs = {
        "python3": STUB_PYTHON.format(
            python=sys.executable, log=str(python_log), probe=probe
        ),
        "uv": STUB_UV.format(python=sys.executable, log=str(uv_log)),
    }
    result = run_script(tmp_path, stubs, {"STUB_FAIL_ON": fail_on})
    return result, read_jsonl(python_log), read_jsonl(uv_log)


def _site_run(
    tmp_path: Path, probe: str, lock: Path, site: Path
) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run the install script for real with ``lock``, python3 seeing the
    distributions of ``site`` alone and uv recording what it is asked: the
    result and the uv commands."""
    uv_log = tmp_path / "uv.jsonl"
    stubs = {
        "python3": STUB_PROBING_PYTHON.format(python=sys.executable),
        "uv": STUB_UV.format(python=sys.executable, log=str(uv_log)),
        "mooncake_master": "#!/bin/sh\n",
    }
    env = {
        "TMPDIR": str(tmp_path),
        "STUB_PROBE": probe,
        "STUB_SITE": str(site),
        "KV_CONNECTORS_REQUIREMENTS": str(lock),
    }
    return run_script(tmp_path, stubs, env), read_jsonl(uv_log)

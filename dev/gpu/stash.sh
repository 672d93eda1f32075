#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# What each part-carrying device call runs: check the carried part's sha256
# against the manifest.json carried beside it, then move the part (and copy
# the manifest) into the gathering folder outside the repo, where the next
# calls find it while the machine stays warm.
#
#   bash dev/gpu/stash.sh .gpu-bundle/part-NN [DEST]    # DEST: /tmp/gpu-bundle
#
# A DEST that holds another build's parts (another manifest) is cleared first.
set -euo pipefail

PYTHON=${PYTHON:-python3}
die() {
    echo "stash.sh: $*" >&2
    exit 1
}

part=${1:?usage: stash.sh PART [DEST]}
dest=${2:-/tmp/gpu-bundle}
name=$(basename "$part")
manifest=$(dirname "$part")/manifest.json
[ -f "$part" ] || die "no $part here: name it in the call's carry"
[ -f "$manifest" ] || die "no manifest.json beside $part: carry it too"

# python3 reads the manifest: the machine has no jq.
want=$("$PYTHON" -c '
import json, sys
m = json.load(open(sys.argv[1]))
print(*[p["sha256"] for p in m["parts"] if p["name"] == sys.argv[2]] or ["none"])
' "$manifest" "$name")
[ "$want" != none ] || die "$name is not a part of $manifest"
got=$(sha256sum "$part" | cut -d' ' -f1)
[ "$got" = "$want" ] || die "bad checksum: part $name has sha256 $got, manifest says $want"

mkdir -p "$dest"
if [ -f "$dest/manifest.json" ] && ! cmp -s "$manifest" "$dest/manifest.json"; then
    echo "stash.sh: $dest held another build's parts; cleared" >&2
    rm -f "$dest"/part-* "$dest/manifest.json"
fi
cp "$manifest" "$dest/manifest.json.partial"
mv -f "$dest/manifest.json.partial" "$dest/manifest.json"
mv -f "$part" "$dest/$name"

counts=$("$PYTHON" -c '
import json, os, sys
names = [p["name"] for p in json.load(open(sys.argv[1]))["parts"]]
print(sum(os.path.exists(os.path.join(sys.argv[2], n)) for n in names), len(names))
' "$dest/manifest.json" "$dest")
read -r have total <<<"$counts"
echo "stash.sh: $name ok; $have of $total parts in $dest"

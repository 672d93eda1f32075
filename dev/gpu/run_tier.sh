#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# On the accelerator machine: install the GPU bundle (dev/gpu/install.sh),
# lay the suite's tests/ over vLLM's own test helpers of that release
# (.gpu-bundle/vllm-tests.tar.gz, dev/gpu/test_tree.py), and run the GPU tier
# (tests/models/hybrid_prefix_cache/test_gpu_tier.py) with plain pytest,
# leaving each lane's log and every case's record under $OUT.
#
#   bash dev/gpu/run_tier.sh [--plant FILE] [--deadline SECONDS] \
#       [--lane EXPR]... [pytest args]
#
# Each --lane is a pytest -k expression run as a pytest process of its own,
# all at once (the GPU and its cores take several servers side by side),
# once the first has read the geometry (test_gpu_tier.UNITS_FILE_ENV); without
# one, a single lane runs everything. --plant FILE runs FILE (a scratch
# patch, never committed) with python3 against a copy of the installed vllm
# package, which the lanes then import instead. --deadline interrupts the
# lanes (as Ctrl-C does) that many seconds after they start, so that what
# they recorded is packed before the device call's own limit.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-out}
SITE=/tmp/site
TREE=/tmp/gpu-tests
die() {
    echo "run_tier.sh: $*" >&2
    exit 1
}

plant= lanes=() deadline=
while [ $# -gt 0 ]; do
    case $1 in
    --plant) plant=${2:?--plant needs a file} && shift 2 ;;
    --deadline) deadline=${2:?--deadline needs seconds} && shift 2 ;;
    --lane) lanes+=("${2:?--lane needs a -k expression}") && shift 2 ;;
    *) break ;;
    esac
done
[ ${#lanes[@]} -gt 0 ] || lanes=("")
tests=$REPO/.gpu-bundle/vllm-tests.tar.gz
[ -f "$tests" ] || die "no $tests: carry it (dev/gpu/test_tree.py writes it)"

bash "$REPO/dev/gpu/install.sh" --target "$SITE" >&2
path=$SITE
if [ -n "$plant" ]; then
    # Hard links, so that the copy costs nothing: the plant must replace a
    # file it changes (unlink, then write), never write into it.
    rm -rf /tmp/plant-site && mkdir -p /tmp/plant-site
    cp -rl "$SITE/vllm" /tmp/plant-site/vllm
    python3 "$plant" /tmp/plant-site/vllm || die "the plant $plant failed"
    path=/tmp/plant-site:$SITE
fi
export PYTHONPATH=$path PATH=$SITE/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -rf "$TREE" && mkdir -p "$TREE"
tar -xzf "$tests" -C "$TREE"
(cd "$REPO" && cp -r --parents tests "$TREE/")
mkdir -p "$OUT"
python3 -c 'import torch, vllm; print("vLLM", vllm.__version__, "from", vllm.__file__,
    "on", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' |
    tee "$OUT/header.txt"

export HYBRID_PC_GPU_UNITS_FILE=/tmp/gpu-units.json
rm -f "$HYBRID_PC_GPU_UNITS_FILE"
limit=()
[ -z "$deadline" ] || limit=(timeout --signal=INT --kill-after=60 "$deadline")
status=0 pids=()
for i in "${!lanes[@]}"; do
    select=()
    [ -z "${lanes[$i]}" ] || select=(-k "${lanes[$i]}")
    (cd "$TREE" && HYBRID_PC_REPORT_DIR="$TREE/report-$i" "${limit[@]}" python3 -m \
        pytest -v -s -rA -p no:cacheprovider \
        tests/models/hybrid_prefix_cache/test_gpu_tier.py "${select[@]}" "$@" \
        >"$OUT/lane-$i.log" 2>&1) &
    pids+=($!)
    # The others start once the first has read the geometry (or ended).
    while [ "$i" = 0 ] && [ ! -f "$HYBRID_PC_GPU_UNITS_FILE" ] &&
        kill -0 "${pids[0]}" 2>/dev/null; do sleep 2; done
done
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
for i in "${!lanes[@]}"; do
    log=$OUT/lane-$i.log
    echo "== lane $i (${lanes[$i]:-all}): $(grep -E '^=+ .* in [0-9.]+s' \
        "$log" | tail -n 1)"
    grep -E '^(FAILED|ERROR) ' "$log" || true
    # The whole log goes with the records; its summary comes back as is.
    mkdir -p "$TREE/report-$i" && mv "$log" "$TREE/report-$i/pytest.log"
    sed -n '/short test summary info\|hybrid prefix cache: every case/,$p' \
        "$TREE/report-$i/pytest.log" >"$log"
done
# Every case's record and server log, in one file (what comes back is few).
(cd "$TREE" && tar -czf "$OUT/records.tgz" report-*)
exit "$status"

#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# On the accelerator machine: install the GPU bundle (dev/gpu/install.sh),
# lay the suite's tests/ over vLLM's own test helpers of that release
# (.gpu-bundle/vllm-tests.tar.gz, dev/gpu/test_tree.py, whose wheels go in
# too), and run the GPU tier (tests/models/hybrid_prefix_cache/
# test_gpu_tier.py) with plain pytest; each lane's log and every case's
# record and server log are left in /tmp/gpu-results/NAME, and a summary is
# printed.
#
#   bash dev/gpu/run_tier.sh [--name NAME] [--plant FILE] [--deadline SECONDS] \
#       [--lane EXPR]... [pytest args]
#
# Each --lane is a pytest -k expression run as a pytest process of its own,
# all at once (the GPU and its cores take several servers side by side),
# once the first has read the geometry (test_gpu_tier.UNITS_FILE_ENV); without
# one, a single lane runs everything. --plant FILE runs FILE (a scratch
# patch, never committed) with python3 against a copy of the installed vllm
# package, which the lanes then import instead. --deadline interrupts the
# lanes (as Ctrl-C does) that many seconds after they start, so that what
# they recorded is kept within the device call's own limit. Runs of other
# names may go side by side (the first installs; start it alone).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SITE=/tmp/site
die() {
    echo "run_tier.sh: $*" >&2
    exit 1
}

name=tier plant= lanes=() deadline=
while [ $# -gt 0 ]; do
    case $1 in
    --name) name=${2:?--name needs a name} && shift 2 ;;
    --plant) plant=${2:?--plant needs a file} && shift 2 ;;
    --deadline) deadline=${2:?--deadline needs seconds} && shift 2 ;;
    --lane) lanes+=("${2:?--lane needs a -k expression}") && shift 2 ;;
    *) break ;;
    esac
done
[ ${#lanes[@]} -gt 0 ] || lanes=("")
tests=$REPO/.gpu-bundle/vllm-tests.tar.gz
[ -f "$tests" ] || die "no $tests: carry it (dev/gpu/test_tree.py writes it)"
TREE=/tmp/gpu-tests-$name
RESULTS=/tmp/gpu-results/$name

bash "$REPO/dev/gpu/install.sh" --target "$SITE" >&2
rm -rf "$TREE" "$RESULTS" && mkdir -p "$TREE" "$RESULTS"
tar -xzf "$tests" -C "$TREE"
# Into $SITE once: runs side by side share it, so a run that finds the wheels
# there (or on the machine) leaves them alone rather than reinstall them under
# a neighbour that imports them.
if compgen -G "$TREE/wheels/*.whl" >/dev/null &&
    ! PYTHONPATH=$SITE python3 -c "import tblib" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
        --upgrade "$TREE"/wheels/*.whl
fi
path=$SITE
if [ -n "$plant" ]; then
    # Hard links, so that the copy costs nothing: the plant must replace a
    # file it changes (unlink, then write), never write into it.
    copy=/tmp/plant-site-$name
    rm -rf "$copy" && mkdir -p "$copy"
    cp -rl "$SITE/vllm" "$copy/vllm"
    python3 "$plant" "$copy/vllm" || die "the plant $plant failed"
    path=$copy:$SITE
fi
export PYTHONPATH=$path PATH=$SITE/bin:$PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
(cd "$REPO" && cp -r --parents tests "$TREE/")
python3 -c 'import torch, vllm; print("vLLM", vllm.__version__, "from", vllm.__file__,
    "on", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' |
    tee "$RESULTS/header.txt"

# A file the caller names is shared with runs beside this one (the geometry
# of one GPU is one); else this run's own, read afresh.
if [ -z "${HYBRID_PC_GPU_UNITS_FILE:-}" ]; then
    export HYBRID_PC_GPU_UNITS_FILE=/tmp/gpu-units-$name.json
    rm -f "$HYBRID_PC_GPU_UNITS_FILE"
fi
limit=()
[ -z "$deadline" ] || limit=(timeout --signal=INT --kill-after=60 "$deadline")
status=0 pids=()
for i in "${!lanes[@]}"; do
    select=()
    [ -z "${lanes[$i]}" ] || select=(-k "${lanes[$i]}")
    (cd "$TREE" && HYBRID_PC_REPORT_DIR="$RESULTS/report-$i" "${limit[@]}" python3 -m \
        pytest -v -s -rA -p no:cacheprovider \
        tests/models/hybrid_prefix_cache/test_gpu_tier.py "${select[@]}" "$@" \
        >"$RESULTS/lane-$i.log" 2>&1) &
    pids+=($!)
    # The others start once the first has read the geometry (or ended).
    while [ "$i" = 0 ] && [ ! -f "$HYBRID_PC_GPU_UNITS_FILE" ] &&
        kill -0 "${pids[0]}" 2>/dev/null; do sleep 2; done
done
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
for i in "${!lanes[@]}"; do
    log=$RESULTS/lane-$i.log
    echo "== $name lane $i (${lanes[$i]:-all}): $(grep -E '^=+ .* in [0-9.]+s' "$log" |
        tail -n 1)"
    grep -E '^(FAILED|ERROR) ' "$log" | cut -c1-300 || true
    # The summary table of the harness's plugin: every case's verdict.
    sed -n '/hybrid prefix cache: every case/,/^servers started/p' "$log"
done
exit "$status"

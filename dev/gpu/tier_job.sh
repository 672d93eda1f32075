#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Launch-and-poll for GPU tier runs longer than one device call (10 minutes):
# `start` detaches dev/gpu/run_tier.sh with setsid, so that it outlives the
# call while the machine stays warm; `wait` follows it for at most SECONDS,
# then, once it has ended, packs its results into $OUT (one tar per run).
#
#   bash dev/gpu/tier_job.sh start NAME [run_tier.sh options and pytest args]
#   bash dev/gpu/tier_job.sh wait SECONDS NAME...
#
# `wait` prints each run's progress (tests done, the last verdicts) and exits
# 0 once every named run has ended, 3 while one still runs (call it again in
# the next device call, within the machine's idle release). Each run's
# summary, lane logs, records and server logs go to $OUT/NAME.tar.gz.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
JOBS=/tmp/gpu-results
die() {
    echo "tier_job.sh: $*" >&2
    exit 1
}

start() {
    local name=${1:?start needs a NAME} && shift
    mkdir -p "$JOBS"
    [ ! -f "$JOBS/$name.pid" ] || ! kill -0 "$(cat "$JOBS/$name.pid")" 2>/dev/null ||
        die "$name is already running"
    rm -f "$JOBS/$name.rc" "$JOBS/$name.out"
    setsid bash -c '
        bash "$1" --name "$2" "${@:4}" >"$3.out" 2>&1
        echo $? >"$3.rc"' _ "$REPO/dev/gpu/run_tier.sh" "$name" "$JOBS/$name" "$@" \
        </dev/null >/dev/null 2>&1 &
    echo $! >"$JOBS/$name.pid"
    echo "tier_job.sh: $name started (pid $!), output in $JOBS/$name.out"
}

progress() {
    local name=$1 logs
    logs=$(compgen -G "$JOBS/$name/lane-*.log" || true)
    if [ -z "$logs" ]; then
        echo "== $name: no lane yet; $(tail -n 1 "$JOBS/$name.out" 2>/dev/null)"
        return
    fi
    # shellcheck disable=SC2086  # lane logs have no spaces
    echo "== $name: $(cat $logs | grep -cE ' (PASSED|FAILED|XFAIL|XPASS|ERROR|SKIPPED)') done"
    # shellcheck disable=SC2086
    grep -hE '::.* (PASSED|FAILED|XFAIL|XPASS|ERROR)' $logs | tail -n 3 | cut -c1-200 || true
}

pack() {
    local name=$1
    [ -n "${OUT:-}" ] || die "OUT is unset: run it in a device call"
    cat "$JOBS/$name.out"
    tar -czf "$OUT/$name.tar.gz" -C "$JOBS" "$name" "$name.out" "$name.rc"
    echo "tier_job.sh: $name ended with status $(cat "$JOBS/$name.rc");" \
        "results in \$OUT/$name.tar.gz"
}

wait_for() {
    local seconds=${1:?wait needs SECONDS} && shift
    [ $# -gt 0 ] || die "wait needs at least one NAME"
    local name deadline=$((SECONDS + seconds))
    for name in "$@"; do
        [ -f "$JOBS/$name.pid" ] || die "no run named $name: start it first"
    done
    while :; do
        local running=()
        for name in "$@"; do
            [ -f "$JOBS/$name.rc" ] || running+=("$name")
        done
        [ ${#running[@]} -gt 0 ] && [ "$SECONDS" -lt "$deadline" ] || break
        sleep 10
    done
    for name in "$@"; do
        if [ -f "$JOBS/$name.rc" ]; then pack "$name"; else progress "$name"; fi
    done
    [ ${#running[@]} = 0 ] || {
        echo "tier_job.sh: still running: ${running[*]}"
        exit 3
    }
}

case ${1:-} in
start) shift && start "$@" ;;
wait) shift && wait_for "$@" ;;
*) die "usage: tier_job.sh start NAME [run_tier args] | wait SECONDS NAME..." ;;
esac

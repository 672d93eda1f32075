#!/usr/bin/env bash
# Run the hybrid prefix-cache suite on this machine, provisioning first.
#
#   dev/suite.sh cpu-tier   the main job: the CPU-tier suite, printing every
#                           case's turn table (pytest -v -s)
#   dev/suite.sh all        ruff (check and format --check, vLLM's settings)
#                           on our files, then every test of this project:
#                           dev/tests (provisioning), then the overlaid tests
#   dev/suite.sh scheduler  the scheduler tier alone: every cell's expected
#                           hits and counter rule replayed through vLLM's own
#                           scheduler in-process (test_scheduler_conformance.py;
#                           seconds, no server, no NIXL install)
#   dev/suite.sh benchmark  the CPU tier's lifecycle benchmark
#                           (dev/benchmark_cpu_tier.py; not a test)
#
# Extra arguments go to pytest. Our tests/ and .buildkite/ files are laid
# over the vLLM checkout before every run, and pytest runs from the checkout,
# so `tests.utils` and `tests.models.utils` are vLLM's own.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MAIN_TESTS=(tests/models/hybrid_prefix_cache/test_cpu_tier.py)
SCHEDULER_TESTS=(tests/models/hybrid_prefix_cache/test_scheduler_conformance.py)
ALL_TESTS=(
    tests/models/hybrid_prefix_cache
    tests/models/kimi_k3/test_prefix_cache.py
    tests/models/kimi_k3/test_prefix_cache_matrix.py
    tests/models/kimi_k3/test_prefix_cache_ci.py
)

die() {
    echo "suite: error: $*" >&2
    exit 1
}

job=${1:-}
case "$job" in
    cpu-tier | all | scheduler | benchmark) shift ;;
    *) die "usage: dev/suite.sh cpu-tier|all|scheduler|benchmark [args...]" ;;
esac

env_lines=$("$REPO/dev/provision.sh") || exit
VENV=$(sed -n 's/^VENV=//p' <<<"$env_lines")
CHECKOUT=$(sed -n 's/^CHECKOUT=//p' <<<"$env_lines")

# Lay our files over the checkout. Files a previous overlay added and we no
# longer have are removed again, or restored from the sdist if they are
# upstream's, so the checkout always equals upstream plus this repository.
overlay() {
    local manifest="$CHECKOUT/.hybrid-pc-overlay" tarball
    tarball="$(dirname "$CHECKOUT")/$(basename "$CHECKOUT").tar.gz"
    local -a ours=()
    mapfile -t ours < <(cd "$REPO" && git ls-files -co --exclude-standard -- tests .buildkite)
    [ ${#ours[@]} -gt 0 ] || die "no tests/ or .buildkite/ files in $REPO"
    if [ -f "$manifest" ]; then
        local old
        while IFS= read -r old; do
            printf '%s\n' "${ours[@]}" | grep -qxF -- "$old" && continue
            rm -f "$CHECKOUT/$old"
            tar -xzf "$tarball" -C "$(dirname "$CHECKOUT")" \
                "$(basename "$CHECKOUT")/$old" 2>/dev/null || true
        done <"$manifest"
    fi
    (cd "$REPO" && cp --parents -f -- "${ours[@]}" "$CHECKOUT/") ||
        die "could not copy our files into $CHECKOUT"
    # Our test-area files hold only our steps: merge them into upstream's by
    # key (dev/merge_steps.py) instead of replacing upstream's whole file.
    local area upstream
    for area in "${ours[@]}"; do
        [[ $area == .buildkite/test_areas/*.yaml ]] || continue
        upstream=$(tar -xzOf "$tarball" "$(basename "$CHECKOUT")/$area" 2>/dev/null) ||
            continue
        "$VENV/bin/python" "$REPO/dev/merge_steps.py" <(printf '%s\n' "$upstream") \
            "$REPO/$area" >"$CHECKOUT/$area.merged" ||
            die "could not merge $area into upstream's"
        mv "$CHECKOUT/$area.merged" "$CHECKOUT/$area"
    done
    printf '%s\n' "${ours[@]}" >"$manifest"
    OURS_PY=()
    local f
    for f in "${ours[@]}"; do [[ $f == *.py ]] && OURS_PY+=("$f"); done
}

overlay
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Every case writes its JSON record (and every server its log) here.
export HYBRID_PC_REPORT_DIR=${HYBRID_PC_REPORT_DIR:-$REPO/hybrid-prefix-cache-report}
cd "$CHECKOUT"

# The CPU-capable NIXL, installed by the script CI uses: the P/D cases need
# it (they fail, not skip, without it). `all` runs it twice, since it must be
# idempotent; test_prefix_cache_ci.py checks that it imports. The scheduler
# tier builds only the connectors' scheduler sides, which need no NIXL.
runs=1
[ "$job" = all ] && runs=2
[ "$job" = scheduler ] && runs=0
for run in $(seq "$runs"); do
    echo "suite: install-kv-connectors.sh, run $run"
    bash "$CHECKOUT/.buildkite/scripts/install-kv-connectors.sh"
done

if [ "$job" = benchmark ]; then
    # -P: not dev/ first on sys.path, where dev/tests would shadow tests/.
    exec env PYTHONPATH="$CHECKOUT" python -P "$REPO/dev/benchmark_cpu_tier.py" "$@"
fi
if [ "$job" = all ]; then
    echo "suite: ruff check and ruff format --check on ${#OURS_PY[@]} files"
    # vLLM's pyproject settings apply; its source vllm/ is moved aside here,
    # so say what ruff would infer from it in a real checkout.
    first_party=(--config "lint.isort.known-first-party = ['vllm', 'tests']")
    ruff check "${first_party[@]}" "${OURS_PY[@]}"
    ruff format --check "${OURS_PY[@]}"
    ruff check --config "$CHECKOUT/pyproject.toml" "$REPO/dev"
    ruff format --check --config "$CHECKOUT/pyproject.toml" "$REPO/dev"
    echo "suite: the provisioning tests (dev/tests)"
    (cd "$REPO" && python -m pytest -v -rA -p no:cacheprovider dev/tests)
    tests=("${ALL_TESTS[@]}")
elif [ "$job" = scheduler ]; then
    tests=("${SCHEDULER_TESTS[@]}")
else
    tests=("${MAIN_TESTS[@]}")
fi
exec python -m pytest -v -s -rA "${tests[@]}" "$@"

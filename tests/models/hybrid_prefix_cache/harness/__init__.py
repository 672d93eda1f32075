# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model-agnostic harness for prefix-cache tests of hybrid models.

Hybrid models (linear attention or Mamba layers beside attention layers) can
only reuse a prefix at a checkpoint, where vLLM saved the recurrent state.
A growing conversation must therefore hit at least the last checkpoint of the
previous prompt on every turn, and the output must equal a recompute of the
same prompt under a fresh ``cache_salt``.

This package knows nothing about any model. A tier binds it to one: a
:class:`Binding` says which model to serve and how, frozen dataclasses say
what to deploy (:class:`Deployment` of :class:`Instance`) and how to match
(:class:`Mode`), and :func:`run_case` does the rest, on the session's
:class:`Suite` (the plugin's fixture ``hybrid_suite``), returning a record
the test asserts on::

    record = run_case(hybrid_suite, case_id, binding, deployment, mode)
    assert record.ok, record.explain()

The oracle, per turn (:func:`check_turn`):

* lower bound: ``cached >= expected``, the previous prompt's last checkpoint
  (:func:`expected_cached`);
* upper bound (:func:`impossible_hit`): a hit lands on a hit-unit boundary,
  never reaches past what this salt's earlier requests stored (the previous
  prompt), and leaves at least the last prompt token to compute. A hit above
  the expected checkpoint but within these bounds is legitimate (a whole
  unit-aligned previous prompt may be reused) and shows as a notice;
* the recompute (and any control) under a fresh salt hits nothing;
* like against like: the hit's greedy tokens and sampled logprobs equal those
  of the cold request on its own numerical path (its recompute on the same
  server, played alone; under P/D a cold twin through the same pair) within
  the binding's tolerance, 0 on CPU; under P/D of one configuration, the
  transfer within it too (``transfer``: the relay against the decoder alone
  one token on, the decoder alone against the prefiller alone); batched on
  servers that compute each request as alone
  (``Binding.batch_invariant_env``), each hit against its recompute alone
  within it too; across paths (elsewhere a batched hit against its batched
  cold twin, and under P/D of two configurations the cold twin against the
  decoder alone), within
  :data:`PATH_NOISE_MARGIN` times the largest gap of the case's cold
  controls, at least :data:`PATH_NOISE_MIN_PAIRS` of them
  (:func:`check_paths`, :func:`control_shifts`), a parting whose chosen
  tokens move by no more than that tolerance being a near tie, no failure
  (:func:`near_tie`); where no tolerance is measured (GPUs),
  ``check_logprobs_close`` decides;
* a resend hits exactly the rule's checkpoint (:func:`expected_resend`);
* per case, from ``/metrics``: the prefix-cache counters of every server move
  by exactly the usage its requests reported, a P/D decoder counts a NIXL
  transfer per request, an offload hit is counted by the external (connector)
  counters, and a speculative mode really drafted.

Servers (:class:`Server`) log to a file whose tail every startup or request
failure quotes, start one after another or all at once (per binding), and
are reused across cases with exactly the same arguments and environment
(:class:`ServerPool`); cases are isolated by ``cache_salt``.

Which module owns what (each imports only the ones above it):

* ``rules``: what vLLM promises, rule by rule, each naming its vLLM file
  and function, release by release: checkpoints, expected and largest hits
  (:func:`expectation`, :func:`plan_turns`), resends, drafters
  (:func:`drafting`), decode-time checkpoints, the P/D backoff; the one
  module to read when following a release;
* ``deployment``: the deployment model (:class:`Mode`, :class:`Instance`,
  :class:`Deployment`, :class:`Binding`, ``server_args``), the geometry a
  server reports (:class:`Units`) and the known-failure entries
  (:class:`Known`);
* ``compare``: how outputs are judged: :class:`Sample`, :class:`Turn`,
  :func:`check_turn` (a turn against its rule and its own path) and
  :func:`check_paths` (across paths, against the case's measured noise);
* ``transfer``: the P/D transfer judged exactly (:func:`check_transfer`);
* ``reconcile``: the counter rule (:class:`Ledger`,
  :func:`counter_problems`, :func:`expected_requests`);
* ``clock``: the per-phase clock of a case (:func:`phase`);
* ``servers``: :class:`Server`, starting and reusing servers
  (:class:`ServerPool`), the report folder;
* ``client``: requests (:func:`complete`, :func:`send`), cache resets,
  ``/metrics`` reads and the counter window of a case;
* ``conversation``: conversations, their shapes, and playing turns;
* ``records``: a case's record (:class:`CaseRecord`, ``ok``,
  ``explain()``), its table, JSON report and reproducer
  (:func:`reported_case`);
* ``cases``: a session's :class:`Suite` (server pool and records), running
  a case (:func:`serve_case`, :func:`run_case`, :func:`run_resend`) and
  :func:`expect_known`;
* ``matrix``: a binding's :class:`Matrix` (its :class:`Case` list, known
  failures and pytest params), the same for every tier, the grouping of
  tests that need the same servers (:func:`servers_mark`), and their split
  across parallel jobs by cost (:func:`case_seconds`, :func:`shard_by_cost`);
* ``workloads``: the workloads beside the growing conversation
  (:data:`WORKLOADS`: shared prefixes, abort and retry, eviction, small
  budgets, aligned prompts, P/D resends, asynchronous scheduling), the
  property each holds and the arithmetic of its expectation;
* ``plugin``: the pytest plugin (:class:`SuitePlugin`, with the session
  fixture ``hybrid_suite``) that the CPU tier's conftest and the Kimi-K3
  module register.

rules.py, compare.py, transfer.py, reconcile.py and workloads.py are pure (no
``requests``, no clock): a unit test or the scheduler tier uses them without a
server. No module holds mutable state: the pool and the records belong to a
:class:`Suite`, and servers are listed (for leak checks) in a ``launched``
list their caller passes.
"""

# Every public name of the harness, for ``from ...harness import X`` and
# ``harness.X``; F401: these imports are the re-exports.
from tests.models.hybrid_prefix_cache.harness.cases import (  # noqa: F401
    KNOWN_VERDICTS,
    KnownRun,
    Suite,
    evidence_seen,
    expect_known,
    failure_text,
    run_abort_retry,
    run_case,
    run_eviction,
    run_resend,
    run_siblings,
    run_small_budget,
    run_workload,
    serve_case,
)
from tests.models.hybrid_prefix_cache.harness.client import (  # noqa: F401
    CONTROL_TIMEOUT,
    MAX_TOKENS,
    METRICS_POLL_INTERVAL,
    METRICS_SETTLE_SECONDS,
    PREFILL_KV_TRANSFER_PARAMS,
    REQUEST_TIMEOUT,
    RESET_ATTEMPTS,
    RESET_INTERVAL,
    TOKEN_ID_PREFIX,
    Window,
    cache_config,
    close_window,
    complete,
    give_up,
    max_model_len,
    open_window,
    read_counters,
    read_metrics,
    reset_prefix_caches,
    send,
)
from tests.models.hybrid_prefix_cache.harness.clock import (  # noqa: F401
    PHASES,
    PhaseClock,
    phase,
)
from tests.models.hybrid_prefix_cache.harness.compare import (  # noqa: F401
    NUM_LOGPROBS,
    PATH_NOISE_MARGIN,
    PATH_NOISE_MIN_PAIRS,
    Comparison,
    PathNoise,
    Sample,
    Turn,
    check_paths,
    check_turn,
    cold_pairs,
    compare,
    control_shifts,
    first_divergence,
    logprob_gap,
    near_tie,
    pairs_noise,
    path_noise,
)
from tests.models.hybrid_prefix_cache.harness.conversation import (  # noqa: F401
    SHAPES,
    Conversation,
    Play,
    finish_turns,
    fresh_salt,
    grown_prompt,
    measure_path_noise,
    planned_turn,
    play_turn,
    random_tokens,
    reference_conversation,
    run_conversations,
    shape_length,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (  # noqa: F401
    Binding,
    Deployment,
    Instance,
    Known,
    Mode,
    Units,
    cpu_offload,
    device_ranges,
    kv_connector,
    matrix_modes,
    multi_connector,
    select_known,
    server_args,
    with_serve_args,
    with_serve_env,
)
from tests.models.hybrid_prefix_cache.harness.matrix import (  # noqa: F401
    CASE_TURNS,
    CONCURRENT,
    SERVERS_MARK,
    Case,
    Matrix,
    case_seconds,
    group_by_servers,
    servers_mark,
    shard_by_cost,
)
from tests.models.hybrid_prefix_cache.harness.plugin import (  # noqa: F401
    SuitePlugin,
)
from tests.models.hybrid_prefix_cache.harness.reconcile import (  # noqa: F401
    EXTERNAL_HITS,
    EXTERNAL_QUERIES,
    FIRST_TOKENS,
    NIXL_BYTES,
    NIXL_TRANSFERS,
    PREFIX_HITS,
    PREFIX_QUERIES,
    REQUESTS_DONE,
    SPEC_DRAFTS,
    Ledger,
    aborted_entry,
    counter_problems,
    decoder_problems,
    decoder_pulls,
    decoder_resend_hit,
    expected_requests,
    ledger_entry,
)
from tests.models.hybrid_prefix_cache.harness.records import (  # noqa: F401
    CaseRecord,
    format_table,
    reported_case,
)
from tests.models.hybrid_prefix_cache.harness.rules import (  # noqa: F401
    FIRST_PROMPT_BLOCKS,
    FIRST_PROMPT_TAIL,
    NUM_TURNS,
    PD_PREFILL_BACKOFF,
    TURN_TOKENS,
    Drafting,
    PlannedTurn,
    decode_checkpoint,
    decoded_expectation,
    drafting,
    exact_budget,
    expectation,
    expected_cached,
    expected_resend,
    hit_bound,
    holds_for,
    impossible_hit,
    partial_unit,
    plan_turns,
    prompt_end_checkpoint,
    release_under_test,
    seen_lengths,
)
from tests.models.hybrid_prefix_cache.harness.servers import (  # noqa: F401
    HEALTH_POLL_INTERVAL,
    LOG_TAIL_LINES,
    PD_ENV,
    REPORT_DIR_ENV,
    Server,
    ServerError,
    ServerPool,
    ServerSpec,
    layered_env,
    log_folder,
    report_folder,
    serve,
    server_specs,
    start_servers,
    wait_healthy,
)
from tests.models.hybrid_prefix_cache.harness.workloads import (  # noqa: F401
    ABORT_AFTER_FRACTION,
    ABORT_ATTEMPTS,
    BRANCH_SHARED_BLOCKS,
    EVICTION_POOL_REQUESTS,
    EVICTION_PRESSURE_REQUESTS,
    NUM_SIBLINGS,
    WORKLOADS,
    EvictionPlan,
    Workload,
    abort_checkpoint,
    abort_landing,
    abort_length,
    abort_problems,
    abort_retry_length,
    branch_checkpoint,
    branch_lengths,
    budget_problems,
    eviction_args,
    eviction_filler,
    eviction_max_len,
    eviction_problems,
    junction_checkpoint,
    overlap_problems,
    served_budget,
    shared_prefix_length,
    sibling_tail_length,
    small_budget_args,
    small_budgets,
)

# dev/benchmark_cpu_tier.py stops servers with harness.RemoteOpenAIServer.
from tests.utils import RemoteOpenAIServer  # noqa: F401

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model-agnostic harness for prefix-cache tests of hybrid models.

Hybrid models (linear attention or Mamba layers beside attention layers) can
only reuse a prefix at a checkpoint, where vLLM saved the recurrent state.
A growing conversation must therefore hit at least the last checkpoint of the
previous prompt on every turn, and the output must equal a recompute of the
same prompt under a fresh ``cache_salt``.

This module knows nothing about any model. A tier binds it to one: a
:class:`Binding` says which model to serve and how, frozen dataclasses say
what to deploy (:class:`Deployment` of :class:`Instance`) and how to match
(:class:`Mode`), and :func:`run_case` does the rest.

The oracle, per turn (:func:`check_turn`):

* lower bound: ``cached >= expected``, the previous prompt's last checkpoint
  (:func:`expected_cached`);
* upper bound (:func:`impossible_hit`): a hit lands on a hit-unit boundary,
  never reaches past what this salt's earlier requests stored (the previous
  prompt), and leaves at least the last prompt token to compute. A hit above
  the expected checkpoint but within these bounds is legitimate (a whole
  unit-aligned previous prompt may be reused) and shows as a notice;
* the recompute under a fresh salt hits nothing, and its greedy tokens and
  the sampled tokens' logprobs equal the hit's within the binding's
  tolerance (``check_logprobs_close`` as well);
* per case, from ``/metrics``: the prefix-cache counters of every server move
  by exactly the usage its requests reported, a P/D decoder counts a NIXL
  transfer per request, an offload hit is counted by the external (connector)
  counters, and a speculative mode really drafted.

Servers (:class:`Server`) log to a file whose tail every startup or request
failure quotes, start one after another or all at once (per binding), and
are reused across cases with exactly the same arguments and environment
(:class:`ServerPool`); cases are isolated by ``cache_salt``.
"""

import contextlib
import contextvars
import json
import os
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from math import lcm
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.models.hybrid_prefix_cache.reproducer import serve_info, update_reproducer
from tests.models.utils import check_logprobs_close
from tests.utils import (
    RemoteOpenAIServer,
    _redact_sensitive_cli_args,
    _sanitize_pythonpath_env,
)
from vllm.utils.network_utils import get_open_port

# The conversation: the first prompt spans FIRST_PROMPT_BLOCKS blocks plus an
# unaligned tail; every later turn appends TURN_TOKENS tokens (the previous
# output, then random token ids); the last turn resends the last prompt.
NUM_TURNS = 3
FIRST_PROMPT_BLOCKS = 3
FIRST_PROMPT_TAIL = 37
TURN_TOKENS = 777
MAX_TOKENS = 8
NUM_LOGPROBS = 5
TOKEN_ID_PREFIX = "token_id:"
REQUEST_TIMEOUT = 600.0
# Every other call to a server (metrics, cache reset): a loaded 2-core
# machine once left a P/D server's /metrics unanswered for more than 30 s
# (CI, stop 17), so these get the same generous bound as a request.
CONTROL_TIMEOUT = REQUEST_TIMEOUT
# An offload deployment's prefix-cache reset answers success=false while
# blocks are still held (e.g. by in-flight offload transfers); retry.
RESET_ATTEMPTS = 120
RESET_INTERVAL = 0.5
# Counters are exported after the engine step that moved them; poll for
# this long before calling a mismatch.
METRICS_SETTLE_SECONDS = 15.0
METRICS_POLL_INTERVAL = 0.25
HEALTH_POLL_INTERVAL = 0.5
LOG_TAIL_LINES = 60
# Environment of every instance of a P/D deployment: hybrid models transfer
# their conv state in the DS layout.
PD_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
# The prefill leg of a P/D request asks the prefiller to keep the KV for a
# remote decoder.
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# The trailing prompt tokens a P/D prefiller never sees. vLLM's NIXL
# scheduler truncates a do_remote_decode request when it is added
# (distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py,
# _prefill_backoff and _truncate_request_for_prefill): by one token for a
# model with Mamba layers, whose last token the decoder recomputes; by more
# only for multi-module MTP, which no tier here uses. The prefiller's lookup,
# its checkpoints and its query counter see the shorter prompt, and the
# decoder loads exactly that many tokens (_get_remote_prefill_token_count).
PD_PREFILL_BACKOFF = 1
# Where every case writes its JSON record.
REPORT_DIR_ENV = "HYBRID_PC_REPORT_DIR"

# Prometheus counters the oracle reconciles, by role.
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
REQUESTS_DONE = "vllm:request_success_total"


# Drafting methods that vLLM treats as EAGLE-style (they read the target's
# hidden states): vllm/config/speculative.py, SpeculativeConfig.use_eagle.
# With one of them, vLLM drops the trailing hash unit of every prefix-cache
# lookup and saves the prompt-end Mamba checkpoint one unit lower, unless
# the config sets disable_eagle_block_drop (SpeculativeConfig.
# use_eagle_block_drop, read by v1/core/sched/scheduler.py Scheduler.__init__
# and by model_executor/layers/mamba/checkpoint.py). An n-gram drafter does
# neither. test_harness.py checks this set against the installed vLLM.
EAGLE_STYLE_METHODS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})


@dataclass(frozen=True)
class Mode:
    """How prefixes are matched: by block, or by a finer prefix match unit,
    with or without speculative decoding."""

    prefix_match_unit: int | None = None
    spec: Mapping | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.spec is not None and "method" not in self.spec:
            raise ValueError(
                "a speculative config must name its method: whether the prefix "
                "cache drops a unit depends on it"
            )

    @property
    def drops_unit(self) -> bool:
        """Whether vLLM drops the trailing hit unit for this drafter
        (``SpeculativeConfig.use_eagle_block_drop``)."""
        if self.spec is None:
            return False
        return self.spec["method"] in EAGLE_STYLE_METHODS and not self.spec.get(
            "disable_eagle_block_drop", False
        )

    def args(self, prefix_caching: bool = True) -> list[str]:
        """The mode's ``vllm serve`` arguments; an instance without prefix
        caching gets no prefix match unit, which it would not use."""
        args = []
        if self.prefix_match_unit is not None and prefix_caching:
            args += ["--prefix-match-unit", str(self.prefix_match_unit)]
        if self.spec is not None:
            args += ["--speculative-config", json.dumps(self.spec)]
        return args


@dataclass(frozen=True)
class Instance:
    """One ``vllm serve`` process, the devices it owns, and its own
    environment and extra arguments (e.g. CPU thread binding)."""

    tp: int = 1
    dp: int = 1
    dcp: int = 1
    expert_parallel: bool = False
    kv_config: Mapping | None = field(default=None, hash=False)
    prefix_caching: bool = True
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    serve_args: tuple[str, ...] = ()

    @property
    def num_devices(self) -> int:
        return self.tp * self.dp

    def args(self) -> list[str]:
        args = []
        if self.tp > 1:
            args += ["--tensor-parallel-size", str(self.tp)]
        if self.dp > 1:
            args += ["--data-parallel-size", str(self.dp)]
        if self.dcp > 1:
            args += ["--decode-context-parallel-size", str(self.dcp)]
        if self.expert_parallel:
            args.append("--enable-expert-parallel")
        if self.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_config)]
        caching = "--enable-prefix-caching" if self.prefix_caching else None
        args.append(caching or "--no-enable-prefix-caching")
        return [*args, *self.serve_args]


@dataclass(frozen=True)
class Deployment:
    """The instances of one case: a decoder, optionally fed by a prefiller.

    ``offload`` means the hit must come from the CPU offload tier: the
    instances' GPU prefix caches are reset before every turn.
    """

    decode: Instance = Instance()
    prefill: Instance | None = None
    offload: bool = False

    @property
    def instances(self) -> tuple[Instance, ...]:
        if self.prefill is None:
            return (self.decode,)
        return (self.prefill, self.decode)

    @property
    def num_devices(self) -> int:
        return sum(instance.num_devices for instance in self.instances)

    @property
    def cache_backoff(self) -> int:
        """Trailing prompt tokens that the instance consulting its prefix
        cache never sees: the P/D prefiller's (:data:`PD_PREFILL_BACKOFF`)."""
        return 0 if self.prefill is None else PD_PREFILL_BACKOFF

    @property
    def compares_logprobs(self) -> bool:
        """Whether a hit's logprobs can be held to the recompute's.

        Under P/D with different TP sizes, prefiller and decoder hold
        differently sharded (and, with dummy weights, different) weights.
        """
        return self.prefill is None or self.prefill.tp == self.decode.tp


def device_ranges(deployment: Deployment) -> list[range]:
    """Disjoint, contiguous device ids for each instance, in order."""
    ranges, start = [], 0
    for instance in deployment.instances:
        ranges.append(range(start, start + instance.num_devices))
        start += instance.num_devices
    return ranges


@dataclass(frozen=True)
class Binding:
    """What a tier binds the harness to.

    ``token_ids`` is the half-open range random prompt ids are drawn from.
    ``logprob_atol`` bounds the difference between the sampled tokens'
    logprobs of a cache hit and of its recompute when requests run one at a
    time, ``batched_logprob_atol`` when they are batched with other
    conversations, ``pd_logprob_atol`` under P/D, where the hit takes the
    P/D path and the recompute runs on the decoder alone: the prefiller
    computes all but the last prompt token and the decoder that one, so the
    two are not bit-identical even without a hit. None where no tolerance
    has been measured on the platform (``check_logprobs_close`` still
    applies). ``concurrent_start`` starts a
    deployment's instances at once instead of one after another.
    """

    model: str
    base_args: tuple[str, ...]
    token_ids: tuple[int, int]
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    startup_timeout: float = 600.0
    logprob_atol: float | None = 0.0
    batched_logprob_atol: float | None = None
    pd_logprob_atol: float | None = None
    # The variable that gives a P/D instance its own devices, or None where
    # instances share the machine (the CPU backend).
    visible_devices_env: str | None = "CUDA_VISIBLE_DEVICES"
    concurrent_start: bool = True


@dataclass(frozen=True)
class Known:
    """A cell that cannot pass, and the text its failure must contain.

    ``kind`` is "xfail" for a vLLM bug (the cell runs, must fail with
    ``evidence``, and fails loudly if it passes) or "unsupported" for a
    feature the platform does not implement (the server must refuse with
    ``evidence``; the cell then skips with ``reason``). ``geometry`` is the
    (block, hit unit) its servers reported where the failure was seen, for a
    failure that depends on it; None where it does not.

    How a failure is confirmed, cheapest first: ``confirmed_by`` names the
    one case that confirms a failure several cells share (this cell then
    skips without a run); ``at_config`` says vLLM refuses while it builds its
    config, so the refusal is confirmed by building the config in-process
    from the servers' own arguments, and the servers only start if it builds.
    """

    kind: str
    reason: str
    evidence: str
    geometry: tuple[int, int] | None = None
    confirmed_by: str | None = None
    at_config: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("xfail", "unsupported"):
            raise ValueError(f"unknown kind of known failure: {self.kind!r}")
        if self.at_config and self.kind != "unsupported":
            raise ValueError("only a refusal can be confirmed at config time")

    def applies(self, units: "Units | None") -> bool:
        if self.geometry is None:
            return True
        return units is not None and (units.block, units.hit) == self.geometry


def select_known(entries: Sequence[Known], units: "Units | None") -> Known | None:
    """The entry of ``entries`` that applies where the case's servers
    reported ``units`` (None: no server answered), if any."""
    found = [known for known in entries if known.applies(units)]
    if len(found) > 1:
        raise ValueError(f"several known failures apply at {units}: {found}")
    return found[0] if found else None


# What the session's summary calls a case that failed as its table says.
KNOWN_VERDICTS = {"xfail": "known xfail", "unsupported": "known refusal"}


@dataclass
class KnownRun:
    """What :func:`expect_known` needs of the case it wraps: its record,
    which holds the geometry its servers reported."""

    record: "CaseRecord | None" = None  # defined below


@contextlib.contextmanager
def expect_known(
    case_id: str, known: Known | Sequence[Known] | None
) -> Iterator[KnownRun]:
    """Run a cell under the known-failure entry that applies to it, if any.

    A listed cell must fail, and its failure (message or the failing
    server's log) must contain the entry's evidence; otherwise the table is
    stale and the cell fails. Unlisted cells run as they are. An entry with a
    geometry applies only where the case's servers reported it: the body sets
    ``run.record`` to what :func:`run_case` returns, and a failing case
    carries its record on the exception.
    """
    entries = () if known is None else (known,) if isinstance(known, Known) else known
    run = KnownRun()
    try:
        yield run
    except Exception as e:
        record = getattr(e, "case_record", None)
        entry = select_known(entries, record.units if record else None)
        if entry is None:
            raise
        text = str(e)
        if entry.evidence not in text + getattr(e, "log", ""):
            if record is not None:
                record.verdict = "FAIL: stale table"
            raise AssertionError(
                f"{case_id} is listed as {entry.kind} ({entry.reason}) and "
                f"failed, but without {entry.evidence!r}: update the table.\n"
                f"{text}"
            ) from e
        if record is not None:
            record.verdict = KNOWN_VERDICTS[entry.kind]
        if entry.kind == "unsupported":
            pytest.skip(f"{entry.reason} (confirmed: {entry.evidence!r})")
        pytest.xfail(f"{entry.reason} (seen: {entry.evidence!r})")
    entry = select_known(entries, run.record.units if run.record else None)
    if entry is None:
        return
    if run.record is not None:
        run.record.verdict = "FAIL: XPASS"
    pytest.fail(
        f"[XPASS(strict)] {case_id} is listed as {entry.kind} "
        f"({entry.reason}) but passed: remove it from the table",
        pytrace=False,
    )


# Tests marked with the same key need the same servers; the conftest puts
# them next to each other so that the server pool can reuse them.
SERVERS_MARK = "hybrid_servers"


def servers_mark(key: str) -> pytest.MarkDecorator:
    return getattr(pytest.mark, SERVERS_MARK)(key)


def group_by_servers(items: list) -> None:
    """Reorder ``items`` in place so that those marked with the same
    servers key run one after another, where the first of them was."""

    def key(item) -> str | None:
        mark = item.get_closest_marker(SERVERS_MARK)
        return None if mark is None else mark.args[0]

    groups: dict[str, list] = {}
    for item in items:
        if key(item) is not None:
            groups.setdefault(key(item), []).append(item)
    ordered, placed = [], set()
    for item in items:
        k = key(item)
        if k is None:
            ordered.append(item)
        elif k not in placed:
            placed.add(k)
            ordered.extend(groups[k])
    items[:] = ordered


def matrix_params(
    deployments: Mapping[str, Deployment],
    modes: Mapping[str, Mode],
    known: Mapping[str, Known],
    device_marks: Callable[[int], list] | None = None,
) -> list:
    """One ``pytest.param(deployment, mode)`` per cell, id
    ``<deployment>-<mode>``; ``device_marks(n)`` gives the marks of a cell
    that needs ``n`` > 1 devices.

    ``known`` is the binding's known-failure table, checked here to name
    only cells of the matrix; the test runs a listed cell under
    :func:`expect_known`, so it must fail with the entry's evidence and a
    fix shows as a strict XPASS.
    """
    ids = {f"{d}-{m}" for d in deployments for m in modes}
    unknown = sorted(set(known) - ids)
    if unknown:
        raise ValueError(f"known failures name no case of the matrix: {unknown}")
    params = []
    for dep_name, deployment in deployments.items():
        for mode_name, mode in modes.items():
            case_id = f"{dep_name}-{mode_name}"
            marks = [servers_mark(case_id)]
            if device_marks is not None and deployment.num_devices > 1:
                marks += device_marks(deployment.num_devices)
            params.append(pytest.param(deployment, mode, id=case_id, marks=marks))
    return params


def server_args(binding: Binding, instance: Instance, mode: Mode) -> list[str]:
    """The ``vllm serve`` arguments (after the model) of one instance."""
    return [*binding.base_args, *instance.args(), *mode.args(instance.prefix_caching)]


def prompt_end_checkpoint(prompt_len: int, unit: int, drops_unit: bool) -> int:
    """Where vLLM saves the Mamba state at the end of a ``prompt_len``-token
    prefill, which is also the deepest hit a later request can resume at.

    From v1/kv_cache_interface.py, get_mamba_prefill_checkpoint_position
    (``unit`` is the hit unit, vLLM's cache_hit_alignment_tokens): without
    an EAGLE-style drafter, the last unit boundary strictly inside the prompt
    (the last token is recomputed for its logits); with one, the last unit
    boundary within the prompt, one unit lower (the lookup in
    v1/core/kv_cache_coordinator.py reads that unit as the drafter's proof
    and drops it).
    """
    limit = prompt_len if drops_unit else prompt_len - 1
    checkpoint = limit // unit * unit
    if drops_unit:
        checkpoint -= unit
    return max(checkpoint, 0)


def expected_cached(prev_len: int, unit: int, drops_unit: bool) -> int:
    """The hit a turn must reach: the prompt-end checkpoint of the previous
    prompt of ``prev_len`` tokens (0 on the first turn)."""
    if prev_len <= 0:
        return 0
    return prompt_end_checkpoint(prev_len, unit, drops_unit)


def expected_resend(prompt_len: int, unit: int, drops_unit: bool) -> int:
    """The hit of an exact resend of a ``prompt_len``-token prompt: its own
    prompt-end checkpoint. With DSpark and unit 128, 7449 tokens hit 7296."""
    return prompt_end_checkpoint(prompt_len, unit, drops_unit)


def hit_bound(prev_len: int, prompt_len: int, unit: int) -> int:
    """The largest hit that can be real: the last unit boundary within both
    what this salt stored before (the previous prompt) and the current
    prompt minus its last token."""
    return min(prev_len, prompt_len - 1) // unit * unit


def impossible_hit(cached: int, prev_len: int, prompt_len: int, unit: int) -> str:
    """Why ``cached`` cannot be a real hit, or "" if it can.

    A hit lands on a ``unit`` boundary, cannot reach past what this salt's
    earlier requests stored (the previous prompt), and always leaves at
    least the last prompt token to compute.
    """
    if cached % unit:
        return f"cached {cached} is not a multiple of the hit unit {unit}"
    if cached > prev_len:
        return f"cached {cached} exceeds the previous prompt's {prev_len} tokens"
    if cached >= prompt_len:
        return f"cached {cached} leaves nothing of the {prompt_len}-token prompt"
    return ""


@dataclass(frozen=True)
class PlannedTurn:
    """One request of a conversation, as sent: its prompt length, the
    length of the previous prompt of the same salt, and whether it resends
    that previous prompt exactly."""

    index: int
    prompt_len: int
    prev_len: int
    resend: bool = False


def plan_turns(first_len: int) -> list[PlannedTurn]:
    """The requests of a conversation whose first prompt has ``first_len``
    tokens: NUM_TURNS turns, each TURN_TOKENS longer than the one before,
    then an exact resend of the last prompt."""
    turns, prev_len = [], 0
    for index in range(NUM_TURNS):
        prompt_len = first_len + index * TURN_TOKENS
        turns.append(PlannedTurn(index, prompt_len, prev_len))
        prev_len = prompt_len
    turns.append(PlannedTurn(NUM_TURNS, prev_len, prev_len, resend=True))
    return turns


def seen_lengths(prev_len: int, prompt_len: int, backoff: int) -> tuple[int, int]:
    """The previous and the current prompt's lengths as an instance that
    sees every prompt ``backoff`` tokens short has them (see
    :attr:`Deployment.cache_backoff`)."""
    return max(prev_len - backoff, 0), prompt_len - backoff


def expectation(
    turn: PlannedTurn, unit: int, drops_unit: bool, backoff: int = 0
) -> tuple[int, int]:
    """(expected hit, largest possible hit) of ``turn``, on an instance that
    sees every prompt ``backoff`` tokens short."""
    prev_len, prompt_len = seen_lengths(turn.prev_len, turn.prompt_len, backoff)
    return (
        expected_cached(prev_len, unit, drops_unit),
        hit_bound(prev_len, prompt_len, unit),
    )


# --- counters ----------------------------------------------------------------


@dataclass(frozen=True)
class Ledger:
    """What a server's prefix-cache counters must have moved by, summed
    over the completions it answered (see :func:`ledger_entry`)."""

    requests: int = 0
    prompt_tokens: int = 0  # as usage reported them
    cached_tokens: int = 0  # as usage reported them
    queries: int = 0  # the prompt tokens the engine's scheduler saw
    held: int = 0  # of those, the tokens it did not compute (local + external)

    def __add__(self, other: "Ledger") -> "Ledger":
        return Ledger(
            *(a + b for a, b in zip(vars(self).values(), vars(other).values()))
        )

    def __sub__(self, other: "Ledger") -> "Ledger":
        return Ledger(
            *(a - b for a, b in zip(vars(self).values(), vars(other).values()))
        )


def ledger_entry(
    prompt_tokens: int, cached_tokens: int, kv_transfer_params: Mapping | None
) -> Ledger:
    """One completion's share of its server's counters, by its role.

    vLLM counts a request once, when it is admitted with a prefix-cache
    lookup (v1/core/sched/scheduler.py, Scheduler.schedule): the local
    counters take its tokens and local hit (KVCacheManager.
    record_prefix_cache_stats), the external ones, on a server with a KV
    connector, its tokens less the local hit and the connector's hit.
    Usage's cached_tokens is the local plus the external hit (v1/metrics/
    stats.py, PrefillStats.set), except on a P/D decoder, where it is the
    prefiller's hit that the transfer carried (remote_prefill_cached_tokens,
    v1/engine/output_processor.py). So:

    * an ordinary request (also a P/D recompute on the decoder alone): the
      engine saw the prompt, and held the cached tokens;
    * a P/D prefill leg: the engine saw the prompt less PD_PREFILL_BACKOFF,
      and held the cached tokens;
    * a P/D decode leg: the engine saw the whole prompt, and held all but
      the PD_PREFILL_BACKOFF tokens (its own hit plus what NIXL loaded).
    """
    params = kv_transfer_params or {}
    queries, held = prompt_tokens, cached_tokens
    if params.get("do_remote_decode"):
        queries = prompt_tokens - PD_PREFILL_BACKOFF
    elif params.get("do_remote_prefill"):
        held = prompt_tokens - PD_PREFILL_BACKOFF
    return Ledger(1, prompt_tokens, cached_tokens, queries, held)


def counter_problems(
    name: str,
    moved: Mapping[str, float | None],
    ledger: Ledger,
    prefix_caching: bool,
    connector: bool,
) -> list[str]:
    """Every way one server's counter deltas ``moved`` disagree with the
    ``ledger`` of the completions it answered (see :func:`ledger_entry`):

    * ``prefix_cache_queries`` moved by the tokens its engine saw (by none
      without prefix caching: KVCacheManager.record_prefix_cache_stats skips
      a request whose lookup is disabled);
    * ``prefix_cache_hits`` plus ``external_prefix_cache_hits`` moved by the
      tokens it held: usage counts a connector's hit (an offload tier, a
      store, a NIXL transfer) where only the external counter does;
    * with a KV connector, ``external_prefix_cache_queries`` moved by the
      tokens seen less the local hits.
    """

    def value(key: str) -> float:
        return moved.get(key) or 0.0

    problems = []
    queries = ledger.queries if prefix_caching else 0
    if value(PREFIX_QUERIES) != queries:
        problems.append(
            f"{name} server: {PREFIX_QUERIES} moved by {value(PREFIX_QUERIES):g}, "
            f"but its engine saw {queries} prompt tokens in {ledger.requests} "
            f"completions (usage: {ledger.prompt_tokens})"
        )
    hits = value(PREFIX_HITS) + value(EXTERNAL_HITS)
    if hits != ledger.held:
        problems.append(
            f"{name} server: {PREFIX_HITS} ({value(PREFIX_HITS):g}) plus "
            f"{EXTERNAL_HITS} ({value(EXTERNAL_HITS):g}) moved by {hits:g}, but "
            f"its {ledger.requests} completions held {ledger.held} tokens (usage "
            f"reported {ledger.cached_tokens} cached): usage and the server's "
            f"own counters disagree"
        )
    external = ledger.queries - value(PREFIX_HITS)
    if connector and value(EXTERNAL_QUERIES) != external:
        problems.append(
            f"{name} server: {EXTERNAL_QUERIES} moved by "
            f"{value(EXTERNAL_QUERIES):g}, expected {external:g}: the tokens "
            f"its engine saw less its local hits"
        )
    return problems


# --- servers ---------------------------------------------------------------


# --- where a case's time goes ---------------------------------------------

# The phases a case's wall time is split into (the rest is "other"), for its
# record and dev/benchmark_cpu_tier.py's breakdown.
PHASES = ("start", "stop", "requests", "metrics", "reset")


class PhaseClock:
    """Seconds per phase of one case. Only the outermost phase counts (a
    metrics poll that reads the counters is one "metrics" span), and threads
    started by the case (concurrent turns) record nothing themselves: the
    batch that runs them is timed as a whole."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._active: str | None = None


_CLOCK: contextvars.ContextVar[PhaseClock | None] = contextvars.ContextVar(
    "hybrid_prefix_cache_clock", default=None
)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase ``name`` of the running case, if any."""
    clock = _CLOCK.get()
    if clock is None or clock._active is not None:
        yield
        return
    clock._active, start = name, time.monotonic()
    try:
        yield
    finally:
        clock.seconds[name] += time.monotonic() - start
        clock._active = None


class ServerError(AssertionError):
    """A server failed to start, died, or did not answer. ``log`` is the
    server's whole log, where the message quotes only its tail."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class ServerSpec:
    """Everything that makes one ``vllm serve`` process what it is. Two
    equal specs serve the same thing; that is what server reuse keys on."""

    name: str
    model: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # A NIXL instance needs its own side-channel port, drawn at start.
    side_channel_port: bool = False
    # What the counter rule (counter_problems) needs to know of the server.
    prefix_caching: bool = True
    connector: bool = False


def server_specs(
    binding: Binding, deployment: Deployment, mode: Mode
) -> tuple[ServerSpec, ...]:
    """The servers of ``deployment`` in ``mode``, prefiller first."""
    names = ("serve",) if deployment.prefill is None else ("prefill", "decode")
    specs = []
    for name, instance, devices in zip(
        names, deployment.instances, device_ranges(deployment)
    ):
        env = {**binding.env, **instance.env}
        if deployment.offload:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        if deployment.prefill is not None:
            env.update(PD_ENV)
            if binding.visible_devices_env is not None:
                env[binding.visible_devices_env] = ",".join(map(str, devices))
        specs.append(
            ServerSpec(
                name=name,
                model=binding.model,
                args=tuple(server_args(binding, instance, mode)),
                env=tuple(sorted(env.items())),
                side_channel_port=deployment.prefill is not None,
                prefix_caching=instance.prefix_caching,
                connector=instance.kv_config is not None,
            )
        )
    return tuple(specs)


def log_folder() -> Path:
    folder = report_folder() / "server-logs"
    folder.mkdir(exist_ok=True)
    return folder


# Every server this process launched, for leak checks.
LAUNCHED: list["Server"] = []


class Server(RemoteOpenAIServer):
    """``vllm serve`` with its output in a log file (echoed to stdout, each
    line prefixed with the server's name), a health wait that the caller
    runs (so several servers can start at once), and a ledger of the usage
    its completions reported."""

    def __init__(
        self, spec: ServerSpec, startup_timeout: float, port: int | None = None
    ) -> None:
        self.spec = spec
        self.startup_timeout = startup_timeout
        self.log_path = log_folder() / f"{spec.name}-{uuid.uuid4().hex[:8]}.log"
        self.launched = time.monotonic()
        self.startup_seconds: float | None = None
        self.ledger = Ledger()
        self._ledger_lock = threading.Lock()
        # Every process seen in the server's group while it ran.
        self.seen_pids: set[int] = set()
        env = dict(spec.env)
        if spec.side_channel_port:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(get_open_port())
        args = list(spec.args) + ([] if port is None else ["--port", str(port)])
        super().__init__(
            spec.model,
            args,
            env_dict=env,
            auto_port=port is None,
            max_wait_seconds=startup_timeout,
        )

    def _start_server(
        self, model: str, vllm_serve_args: list[str], env_dict: dict[str, str] | None
    ) -> None:
        env = os.environ.copy()
        # The test process may have initialized a device; never fork it.
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        env.update(env_dict or {})
        _sanitize_pythonpath_env(env)
        command = ["vllm", "serve", model, *vllm_serve_args]
        # What is shown (here, and in every failure) hides secrets in the
        # arguments, as RemoteOpenAIServer._start_server does.
        self.command = _redact_sensitive_cli_args(command)
        print(f"[{self.spec.name}] {' '.join(self.command)}  (log: {self.log_path})")
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed by the copier
        try:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # Its own process group, so the whole tree can be killed.
                start_new_session=True,
            )
        except BaseException:
            log.close()
            raise
        self.seen_pids.add(self.proc.pid)
        LAUNCHED.append(self)
        threading.Thread(
            target=self._copy_output, args=(log,), daemon=True, name="server-log"
        ).start()

    def _copy_output(self, log) -> None:
        prefix = f"[{self.spec.name}] ".encode()
        assert self.proc.stdout is not None
        with log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                with contextlib.suppress(OSError):
                    os.write(1, prefix + line)

    def _wait_for_server(self, *, url: str, timeout: float) -> None:
        # Deferred: start_servers() waits, for one or several servers.
        self.health_url = url

    def pids(self) -> list[int]:
        """The live processes of this server's process group (remembered in
        ``seen_pids``)."""
        pids = self._find_pgid_members(self.proc.pid)
        self.seen_pids.update(pids)
        return pids

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def error(self, what: str) -> ServerError:
        """A :class:`ServerError` about this server, with its log."""
        try:
            log = self.log_path.read_text(errors="replace")
        except OSError:
            log = ""
        return ServerError(self.failure(what), log)

    def failure(self, what: str) -> str:
        """A message about this server that quotes its log tail."""
        tail = self.log_tail()
        hint = ""
        if "Address already in use" in tail or "address already in use" in tail:
            hint = f" (port {self.port} is already in use)"
        return (
            f"the {self.spec.name} server {what}{hint}.\n"
            f"command: {' '.join(self.command)}\n"
            f"last {LOG_TAIL_LINES} lines of {self.log_path}:\n{tail}"
        )

    def record(self, entry: "Ledger") -> None:
        with self._ledger_lock:
            self.ledger = self.ledger + entry


def _healthy(server: Server) -> bool:
    try:
        return requests.get(server.health_url, timeout=5).status_code == 200
    except requests.RequestException:
        return False


def wait_healthy(servers: Sequence[Server]) -> None:
    """Wait until every server answers /health; raise, quoting the log of
    the first that exits or outlasts its startup timeout."""
    pending = [server for server in servers if server.startup_seconds is None]
    while pending:
        for server in list(pending):
            code = server.proc.poll()
            if code is not None:
                raise server.error(f"exited with code {code} during startup")
            if _healthy(server):
                server.startup_seconds = time.monotonic() - server.launched
                server.pids()
                print(f"[{server.spec.name}] healthy in {server.startup_seconds:.1f} s")
                pending.remove(server)
            elif time.monotonic() - server.launched > server.startup_timeout:
                raise server.error(
                    f"did not become healthy within {server.startup_timeout:.0f} s"
                )
        if pending:
            time.sleep(HEALTH_POLL_INTERVAL)


def start_servers(
    specs: Sequence[ServerSpec], startup_timeout: float, concurrent: bool
) -> list[Server]:
    """Start ``specs`` (at once, or each after the previous is healthy) and
    wait until all are healthy. If any fails, every server started so far is
    stopped before the error propagates."""
    servers: list[Server] = []
    try:
        for spec in specs:
            servers.append(Server(spec, startup_timeout))
            if not concurrent:
                wait_healthy(servers[-1:])
        wait_healthy(servers)
    except BaseException:
        RemoteOpenAIServer.shutdown_many(servers)
        raise
    return servers


@contextlib.contextmanager
def serve(
    binding: Binding, deployment: Deployment, mode: Mode
) -> Iterator[list[Server]]:
    """Serve every instance of ``deployment`` (prefiller first); shut them
    down together however the block ends."""
    servers = start_servers(
        server_specs(binding, deployment, mode),
        binding.startup_timeout,
        binding.concurrent_start,
    )
    try:
        yield servers
    finally:
        RemoteOpenAIServer.shutdown_many(servers)


class ServerPool:
    """Keeps the servers of the last deployment running for the next case
    that needs exactly the same ones (same model, arguments, environment).

    At most one deployment runs at a time; asking for another stops it.
    """

    def __init__(self) -> None:
        self._specs: tuple[ServerSpec, ...] | None = None
        self._servers: list[Server] = []
        self.starts = 0
        self.reuses = 0
        self.startup_seconds: list[float] = []

    def acquire(
        self, binding: Binding, deployment: Deployment, mode: Mode
    ) -> list[Server]:
        specs = server_specs(binding, deployment, mode)
        alive = all(server.proc.poll() is None for server in self._servers)
        if specs == self._specs and alive:
            self.reuses += 1
            return self._servers
        self.close()
        with phase("start"):
            servers = start_servers(
                specs, binding.startup_timeout, binding.concurrent_start
            )
        self._specs, self._servers = specs, servers
        self.starts += len(servers)
        self.startup_seconds += [s.startup_seconds or 0.0 for s in servers]
        return servers

    def close(self) -> None:
        servers, self._servers, self._specs = self._servers, [], None
        with phase("stop"):
            RemoteOpenAIServer.shutdown_many(servers)


POOL = ServerPool()


def reset_prefix_caches(servers: Sequence[RemoteOpenAIServer]) -> None:
    with phase("reset"):
        _reset_prefix_caches(servers)


def _reset_prefix_caches(servers: Sequence[RemoteOpenAIServer]) -> None:
    """Drop every server's device prefix cache, keeping the offloaded one,
    so that the next hit must come from the CPU tier."""
    for server in servers:
        url = server.url_for("reset_prefix_cache")
        for _ in range(RESET_ATTEMPTS):
            response = requests.post(
                url, params={"reset_external": "false"}, timeout=CONTROL_TIMEOUT
            )
            response.raise_for_status()
            if response.json().get("success"):
                break
            time.sleep(RESET_INTERVAL)
        else:
            raise AssertionError(
                f"{url} kept answering success=false for "
                f"{RESET_ATTEMPTS * RESET_INTERVAL:.0f} s"
            )


def read_metrics(server: RemoteOpenAIServer) -> dict[str, list]:
    """The server's Prometheus samples, by sample name."""
    with phase("metrics"):
        response = requests.get(server.url_for("metrics"), timeout=CONTROL_TIMEOUT)
    response.raise_for_status()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def read_counters(server: RemoteOpenAIServer) -> dict[str, float | None]:
    """The reconciled counters of one server, summed over engines; None for
    a counter the server does not export."""
    samples = read_metrics(server)
    names = (
        PREFIX_QUERIES,
        PREFIX_HITS,
        EXTERNAL_QUERIES,
        EXTERNAL_HITS,
        NIXL_TRANSFERS,
        NIXL_BYTES,
        SPEC_DRAFTS,
        REQUESTS_DONE,
    )
    return {
        name: sum(s.value for s in samples[name]) if name in samples else None
        for name in names
    }


def cache_config(server: RemoteOpenAIServer) -> dict[str, str]:
    """The labels of the server's ``vllm:cache_config_info`` metric."""
    samples = read_metrics(server).get("vllm:cache_config_info")
    if not samples:
        raise AssertionError(f"{server.url_root} exports no vllm:cache_config_info")
    return dict(samples[0].labels)


@dataclass(frozen=True)
class Units:
    """The checkpoint geometry a server reports."""

    block: int  # lcm of the attention and Mamba block sizes
    hit: int  # the finest boundary a hit can land on

    @classmethod
    def from_cache_config(cls, labels: Mapping[str, str], mode: Mode) -> "Units":
        block = lcm(int(labels["block_size"]), int(labels["mamba_block_size"]))
        if mode.prefix_match_unit is None:
            return cls(block=block, hit=block)
        reported = labels.get("prefix_match_unit")
        if reported != str(mode.prefix_match_unit):
            raise AssertionError(
                f"server reports prefix_match_unit={reported!r}, "
                f"expected {mode.prefix_match_unit}"
            )
        return cls(block=block, hit=mode.prefix_match_unit)


# --- requests --------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One completion: its greedy tokens, logprobs and prompt usage."""

    token_ids: list[int]
    text: str
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    prompt_tokens: int
    cached_tokens: int
    kv_transfer_params: dict | None = None

    def as_tokens_text_logprobs(self) -> tuple:
        return (self.token_ids, self.text, self.top_logprobs)


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise AssertionError(f"token {token!r} is not in the token-id form")
    return int(token.removeprefix(TOKEN_ID_PREFIX))


def _request_failure(server: RemoteOpenAIServer, what: str) -> ServerError:
    if isinstance(server, Server):
        try:  # a server that just died may take a moment to be reaped
            code = server.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            what += f"; the server exited with code {code}"
        return server.error(what)
    return ServerError(f"{server.url_root}: {what}")


def complete(
    server: RemoteOpenAIServer,
    model: str,
    prompt: Sequence[int],
    salt: str,
    *,
    max_tokens: int = MAX_TOKENS,
    kv_transfer_params: dict | None = None,
) -> Sample:
    """A greedy completion of ``prompt`` (token ids) under ``salt``."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": NUM_LOGPROBS,
        "cache_salt": salt,
        "return_tokens_as_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    url = server.url_for("v1/completions")
    try:
        with phase("requests"):
            response = requests.post(url, json=body, timeout=REQUEST_TIMEOUT)
    except requests.RequestException as e:
        raise _request_failure(
            server, f"did not answer a completion ({type(e).__name__}: {e})"
        ) from None
    if response.status_code != 200:
        raise _request_failure(
            server,
            f"answered a completion with {response.status_code}: "
            f"{response.text[:2000]}",
        )
    data = response.json()
    choice, usage = data["choices"][0], data["usage"]
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is None:
        raise AssertionError(
            "the server reports no usage.prompt_tokens_details.cached_tokens; "
            "serve with --enable-prompt-tokens-details"
        )
    if isinstance(server, Server):
        server.record(
            ledger_entry(
                usage["prompt_tokens"], details["cached_tokens"], kv_transfer_params
            )
        )
    logprobs = choice["logprobs"]
    return Sample(
        token_ids=[_token_id(t) for t in logprobs["tokens"]],
        text=choice["text"],
        token_logprobs=list(logprobs["token_logprobs"]),
        top_logprobs=[
            {_token_id(t): lp for t, lp in top.items()}
            for top in logprobs["top_logprobs"]
        ],
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=details["cached_tokens"],
        kv_transfer_params=data.get("kv_transfer_params"),
    )


def _poll_counter(
    server: RemoteOpenAIServer, name: str, done: Callable[[float], bool]
) -> float | None:
    """Read counter ``name`` until ``done(value)`` or the settle time ends;
    the last value read (None if the server does not export it)."""
    deadline = time.monotonic() + METRICS_SETTLE_SECONDS
    with phase("metrics"):
        while True:
            value = read_counters(server)[name]
            if value is None or done(value) or time.monotonic() > deadline:
                return value
            time.sleep(METRICS_POLL_INTERVAL)


def send(
    servers: Sequence[RemoteOpenAIServer],
    model: str,
    prompt: Sequence[int],
    salt: str,
    problems: list[str] | None = None,
) -> Sample:
    """One turn's request through the deployment.

    With a prefiller (``servers`` = prefiller, decoder), the prefiller
    computes the prompt and keeps its KV for the decoder; the decoder then
    pulls it over the KV connector and generates. The hit is the
    prefiller's: that is where the prefix cache is consulted. When
    ``problems`` is given (requests sent one at a time), the decoder must
    also count a NIXL transfer for the request and report the prefiller's
    hit as its cached prefix.
    """
    if len(servers) == 1:
        return complete(servers[0], model, prompt, salt)
    prefiller, decoder = servers
    prefill = complete(
        prefiller,
        model,
        prompt,
        salt,
        max_tokens=1,
        kv_transfer_params=PREFILL_KV_TRANSFER_PARAMS,
    )
    if not prefill.kv_transfer_params:
        raise AssertionError(
            f"the prefiller {prefiller.url_root} returned no kv_transfer_params"
        )
    before = read_counters(decoder)[NIXL_TRANSFERS] if problems is not None else 0
    decode = complete(
        decoder,
        model,
        prompt,
        salt,
        kv_transfer_params=prefill.kv_transfer_params,
    )
    if problems is not None:
        after = _poll_counter(decoder, NIXL_TRANSFERS, lambda v: v > (before or 0))
        if before is None or after is None:
            problems.append(f"the decoder exports no {NIXL_TRANSFERS}")
        elif after <= before:
            problems.append(
                f"the decoder's {NIXL_TRANSFERS} stayed at {after:g}: no KV "
                f"was transferred for this request"
            )
        if decode.cached_tokens != prefill.cached_tokens:
            problems.append(
                f"the decoder reports {decode.cached_tokens} cached tokens, "
                f"the prefiller hit {prefill.cached_tokens}"
            )
    return replace(decode, cached_tokens=prefill.cached_tokens)


# --- the oracle ------------------------------------------------------------


@dataclass
class Turn:
    conversation: str
    index: int
    prompt_len: int
    prev_len: int
    expected: int
    bound: int = 0
    resend: bool = False
    # Trailing tokens the caching instance does not see (P/D prefiller).
    backoff: int = 0
    output: Sample | None = None
    recompute: Sample | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    # As played, for the record and a failing case's reproducer.
    prompt: list[int] = field(default_factory=list, repr=False)
    salt: str = ""

    @property
    def name(self) -> str:
        what = "resend" if self.resend else f"turn {self.index}"
        return f"{self.conversation} {what}".strip()

    @property
    def max_logprob_diff(self) -> float | None:
        if self.output is None or self.recompute is None:
            return None
        if self.output.token_ids != self.recompute.token_ids:
            return None
        pairs = zip(self.output.token_logprobs, self.recompute.token_logprobs)
        return max((abs(a - b) for a, b in pairs), default=0.0)


def _top(sample: Sample, index: int) -> str:
    ranked = sorted(sample.top_logprobs[index].items(), key=lambda kv: -kv[1])
    return ", ".join(f"{token}:{logprob:.4f}" for token, logprob in ranked)


def first_divergence(hit: Sample, recompute: Sample) -> str:
    """Where the greedy tokens of a hit and its recompute part, with both
    sides' top-k there; "" if they agree."""
    for i, (a, b) in enumerate(zip(hit.token_ids, recompute.token_ids)):
        if a != b:
            return (
                f"first diverging token at index {i}: the hit chose {a} "
                f"(top-{NUM_LOGPROBS}: {_top(hit, i)}), the recompute chose {b} "
                f"(top-{NUM_LOGPROBS}: {_top(recompute, i)})"
            )
    if len(hit.token_ids) != len(recompute.token_ids):
        return (
            f"the hit has {len(hit.token_ids)} tokens, the recompute "
            f"{len(recompute.token_ids)}"
        )
    return ""


def check_turn(
    turn: Turn,
    units: Units,
    logprob_atol: float | None,
    compare_logprobs: bool = True,
) -> None:
    """Record in ``turn.problems`` every way this turn is wrong, and in
    ``turn.notices`` what is legitimate but unexpected."""
    out, rec = turn.output, turn.recompute
    assert out is not None and rec is not None
    name = turn.name
    prev_seen, prompt_seen = seen_lengths(turn.prev_len, turn.prompt_len, turn.backoff)
    for sample, what in ((out, "hit"), (rec, "recompute")):
        if sample.prompt_tokens != turn.prompt_len:
            turn.problems.append(
                f"{name}: the {what} reports {sample.prompt_tokens} prompt "
                f"tokens, sent {turn.prompt_len}"
            )
    if rec.cached_tokens != 0:
        turn.problems.append(
            f"{name}: the recompute under a fresh cache_salt reported "
            f"{rec.cached_tokens} cached tokens, expected 0 (is cache_salt "
            f"ignored?)"
        )
    if out.cached_tokens < turn.expected:
        vacuous = " (no hit at all)" if out.cached_tokens == 0 else ""
        turn.problems.append(
            f"{name}: cached {out.cached_tokens} < expected checkpoint "
            f"{turn.expected} of the previous {turn.prev_len}-token prompt "
            f"(hit unit {units.hit}): a checkpoint was lost{vacuous}"
        )
    why = impossible_hit(out.cached_tokens, prev_seen, prompt_seen, units.hit)
    if why:
        turn.problems.append(
            f"{name}: impossible hit, over-reported: {why} (bound {turn.bound})"
        )
    elif out.cached_tokens > turn.expected:
        turn.notices.append(
            f"{name}: cached {out.cached_tokens} is above the expected "
            f"{turn.expected} but within the bound {turn.bound}"
        )
    if not compare_logprobs:
        return
    # Where a tolerance was measured, any token difference is wrong. Where
    # none was (near-tied logits, and a hit and a miss that run different
    # GEMM shapes on GPUs, vLLM #33123), a divergence is legitimate as long
    # as check_logprobs_close accepts it, as upstream's test holds it.
    divergence = first_divergence(out, rec)
    if divergence and logprob_atol is not None:
        turn.problems.append(f"{name}: output differs from the recompute: {divergence}")
    elif divergence:
        turn.notices.append(f"{name}: {divergence} (check_logprobs_close decides)")
    try:
        check_logprobs_close(
            outputs_0_lst=[rec.as_tokens_text_logprobs()],
            outputs_1_lst=[out.as_tokens_text_logprobs()],
            name_0=f"{name} recompute",
            name_1=f"{name} cache hit",
        )
    except AssertionError as e:
        turn.problems.append(
            f"{name}: output differs from the recompute beyond "
            f"check_logprobs_close: {e}"
        )
        return
    diff = turn.max_logprob_diff
    if logprob_atol is not None and diff is not None and diff > logprob_atol:
        turn.problems.append(
            f"{name}: sampled logprobs differ from the recompute by {diff:.3g} "
            f"> {logprob_atol:g}, with the same tokens: the restored state is "
            f"wrong"
        )


# --- conversations ---------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """A growing conversation: its label, the first prompt's length and
    the seed of its random tokens."""

    label: str
    first_len: int
    seed: str


def reference_conversation(units: Units, seed: str) -> Conversation:
    """The reference shape: three blocks and an unaligned tail."""
    return Conversation("", FIRST_PROMPT_BLOCKS * units.block + FIRST_PROMPT_TAIL, seed)


# Tail-sweep shapes: the first prompt is FIRST_PROMPT_BLOCKS blocks, plus one
# hit unit when the boundary should fall inside a block ("inblock"), plus a
# tail past that last boundary, given as a function of the hit unit.
SHAPES: dict[str, tuple[bool, Callable[[int], int]]] = {
    "exact": (False, lambda unit: 0),
    "plus1": (False, lambda unit: 1),
    "tail37": (False, lambda unit: 37 % unit),
    "half-plus1": (False, lambda unit: unit // 2 + 1),
    "unit-minus1": (False, lambda unit: unit - 1),
    "inblock-exact": (True, lambda unit: 0),
    "inblock-plus1": (True, lambda unit: 1),
}


def shape_length(shape: str, units: Units) -> int | None:
    """The first prompt's length of sweep ``shape``; None when the shape
    does not exist for this geometry (an in-block boundary when the hit
    unit is the block)."""
    inblock, tail = SHAPES[shape]
    if inblock and units.hit >= units.block:
        return None
    base = FIRST_PROMPT_BLOCKS * units.block + (units.hit if inblock else 0)
    return base + tail(units.hit)


def random_tokens(rng: random.Random, token_ids: tuple[int, int], n: int) -> list[int]:
    low, high = token_ids
    return [rng.randrange(low, high) for _ in range(n)]


@dataclass
class Play:
    """What a case needs to play turns: where, what, and how to check."""

    servers: Sequence[RemoteOpenAIServer]
    binding: Binding
    deployment: Deployment
    mode: Mode
    units: Units
    logprob_atol: float | None


def play_turn(play: Play, turn: Turn, prompt: Sequence[int], salt: str) -> None:
    """Send ``prompt`` under ``salt`` (after the offload reset, if any) and
    again under a fresh salt, then check the turn."""
    turn.prompt, turn.salt = list(prompt), salt
    start = time.monotonic()
    servers, model = play.servers, play.binding.model
    if play.deployment.offload:
        reset_prefix_caches(servers)
        before = read_counters(servers[0])[EXTERNAL_HITS]
    turn.output = send(servers, model, prompt, salt, turn.problems)
    if play.deployment.offload and turn.output.cached_tokens > 0:
        after = _poll_counter(servers[0], EXTERNAL_HITS, lambda v: v > (before or 0))
        if before is None or after is None or after <= before:
            turn.problems.append(
                f"{turn.name}: cached {turn.output.cached_tokens} after the "
                f"device prefix cache was reset, but {EXTERNAL_HITS} did not "
                f"grow ({before} -> {after}): the hit did not come from the "
                f"offload tier"
            )
    # The recompute goes to the decoder alone, with a fresh salt and no
    # transfer: under P/D it computes the whole prompt itself, so a transfer
    # that corrupts the state cannot corrupt both sides alike.
    fresh = f"recompute-{uuid.uuid4().hex}"
    turn.recompute = complete(servers[-1], model, prompt, fresh)
    turn.seconds = time.monotonic() - start
    check_turn(turn, play.units, play.logprob_atol, play.deployment.compares_logprobs)


def planned_turn(play: Play, label: str, planned: PlannedTurn) -> Turn:
    """The :class:`Turn` of ``planned`` with its expected hit and bound for
    the case's geometry, drafter and deployment."""
    backoff = play.deployment.cache_backoff
    expected, bound = expectation(
        planned, play.units.hit, play.mode.drops_unit, backoff
    )
    return Turn(
        label,
        planned.index,
        planned.prompt_len,
        planned.prev_len,
        expected,
        bound=bound,
        resend=planned.resend,
        backoff=backoff,
    )


def run_conversations(
    play: Play,
    conversations: Sequence[Conversation],
    turns: list[Turn],
    concurrent: bool = False,
) -> None:
    """Play ``conversations`` (each under its own salt) turn by turn, as
    :func:`plan_turns` lays them out, appending to ``turns``. A later turn's
    prompt is the previous prompt, the previous output and random tokens.
    Concurrently, every conversation's turn is in flight at once (and its
    recompute right after), as a busy server sees them."""
    states = []
    for conv in conversations:
        rng = random.Random(conv.seed)
        prompt = random_tokens(rng, play.binding.token_ids, conv.first_len)
        salt = f"conversation-{uuid.uuid4().hex}"
        states.append((conv, rng, salt, prompt, plan_turns(conv.first_len)))
    for index in range(NUM_TURNS + 1):
        batch = []
        for conv, _, salt, prompt, plan in states:
            turn = planned_turn(play, conv.label, plan[index])
            if turn.prompt_len != len(prompt):
                raise AssertionError(f"{turn.name}: the plan and the prompt part")
            turns.append(turn)
            batch.append((turn, prompt, salt))
        if concurrent:
            with phase("requests"), ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(lambda args: play_turn(play, *args), batch))
        else:
            for args in batch:
                play_turn(play, *args)
        for i, ((conv, rng, salt, prompt, plan), (turn, _, _)) in enumerate(
            zip(states, batch)
        ):
            if index + 1 >= len(plan) or plan[index + 1].resend:
                continue  # the resend sends this prompt again
            assert turn.output is not None
            appended = turn.output.token_ids[:TURN_TOKENS]
            fill = random_tokens(
                rng, play.binding.token_ids, TURN_TOKENS - len(appended)
            )
            states[i] = (conv, rng, salt, prompt + appended + fill, plan)


# --- metrics reconciliation ------------------------------------------------


@dataclass
class Window:
    """Counters and usage ledgers of a case's servers at its start."""

    servers: Sequence[RemoteOpenAIServer]
    counters: list[dict[str, float | None]]
    ledgers: list[Ledger]


def _ledger(server: RemoteOpenAIServer) -> Ledger:
    return server.ledger if isinstance(server, Server) else Ledger()


def open_window(servers: Sequence[RemoteOpenAIServer]) -> Window:
    return Window(
        servers,
        [read_counters(server) for server in servers],
        [_ledger(server) for server in servers],
    )


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def expected_requests(num_servers: int, turns: Sequence["Turn"]) -> list[int]:
    """How many completions each server of a case must have finished: every
    turn's request goes through the deployment (a prefill leg on the
    prefiller, a decode leg on the decoder), and its recompute to the
    decoder alone, which computes the whole prompt itself."""
    recomputes = sum(1 for turn in turns if turn.recompute is not None)
    if num_servers == 1:
        return [len(turns) + recomputes]
    return [len(turns), len(turns) + recomputes]


def close_window(
    window: Window, mode: Mode, turns: Sequence["Turn"]
) -> tuple[dict, list[str]]:
    """Each server's counter deltas since :func:`open_window`, and every way
    they disagree with what its completions reported
    (:func:`counter_problems`) or with the route every request must take
    (:func:`expected_requests`, against vLLM's own request_success count)."""
    deltas, problems = {}, []
    drafts = 0.0
    routes = expected_requests(len(window.servers), turns)
    for index, server in enumerate(window.servers):
        spec = server.spec if isinstance(server, Server) else None
        name = spec.name if spec else f"server{index}"
        ledger = _ledger(server) - window.ledgers[index]
        before = window.counters[index]

        def check(
            now: dict, before=before, name=name, ledger=ledger, spec=spec, index=index
        ) -> list[str]:
            moved = {key: _delta(now[key], before[key]) for key in now}
            found = counter_problems(
                name,
                moved,
                ledger,
                prefix_caching=spec.prefix_caching if spec else True,
                connector=spec.connector if spec else False,
            )
            done = moved[REQUESTS_DONE] or 0.0
            if spec and ledger.requests != routes[index]:
                found.append(
                    f"{name} server: answered {ledger.requests} completions, "
                    f"expected {routes[index]} (each turn through the "
                    f"deployment, each recompute on the decoder alone)"
                )
            elif done != ledger.requests:
                found.append(
                    f"{name} server: {REQUESTS_DONE} moved by {done:g}, but it "
                    f"answered {ledger.requests} completions"
                )
            return found

        deadline = time.monotonic() + METRICS_SETTLE_SECONDS
        now = read_counters(server)
        while check(now) and time.monotonic() < deadline:
            time.sleep(METRICS_POLL_INTERVAL)
            now = read_counters(server)
        problems += check(now)
        moved = {key: _delta(now[key], before[key]) for key in now}
        deltas[name] = {
            "requests": ledger.requests,
            "usage_prompt_tokens": ledger.prompt_tokens,
            "usage_cached_tokens": ledger.cached_tokens,
            "engine_queries": ledger.queries,
            "engine_held": ledger.held,
            **moved,
        }
        drafts += moved[SPEC_DRAFTS] or 0.0
    if mode.spec is not None and drafts <= 0:
        problems.append(
            f"speculative mode, but {SPEC_DRAFTS} did not grow: the drafter "
            f"never ran, so the case would pass vacuously"
        )
    return deltas, problems


# --- cases -----------------------------------------------------------------


def format_table(case_id: str, units: Units | None, turns: Sequence[Turn]) -> str:
    """The turn table of one case."""
    geometry = f"hit unit {units.hit}, block {units.block}" if units else "no geometry"
    lines = [
        f"== {case_id}: {geometry}",
        f"{'conversation':<14} {'turn':>6} {'prompt':>6} {'expected':>8} "
        f"{'cached':>6} {'bound':>6} {'recompute':>9} {'tokens':>6} "
        f"{'max|dlp|':>9} {'s':>5}  verdict",
    ]
    for turn in turns:
        out, rec = turn.output, turn.recompute
        same = "same" if out and rec and out.token_ids == rec.token_ids else "DIFF"
        diff = turn.max_logprob_diff
        verdict = "FAIL" if turn.problems else "notice" if turn.notices else "ok"
        lines.append(
            f"{turn.conversation or '-':<14} "
            f"{'resend' if turn.resend else turn.index:>6} {turn.prompt_len:>6} "
            f"{turn.expected:>8} {out.cached_tokens if out else '-':>6} "
            f"{turn.bound:>6} {rec.cached_tokens if rec else '-':>9} "
            f"{same if rec else '-':>6} "
            f"{'-' if diff is None else f'{diff:.3g}':>9} {turn.seconds:>5.1f}  "
            f"{verdict}"
        )
    return "\n".join(lines)


@dataclass
class CaseRecord:
    """What one case observed, for its table, its JSON record and its
    verdict."""

    case_id: str
    units: Units | None = None
    turns: list[Turn] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    startup_seconds: list[float] = field(default_factory=list)
    reused: bool | None = None  # None: no servers (their start failed)
    seconds: float = 0.0
    phases: PhaseClock = field(default_factory=PhaseClock, repr=False)
    outcome: str = ""
    # The summary's word where a known-failure table judged the outcome:
    # known xfail, known refusal, or FAIL (stale table, XPASS); else outcome.
    verdict: str = ""
    play: Play | None = field(default=None, repr=False)  # for the reproducer

    def as_json(self) -> dict:
        def sample(s: Sample | None) -> dict | None:
            if s is None:
                return None
            return {
                "token_ids": s.token_ids,
                "token_logprobs": s.token_logprobs,
                "cached_tokens": s.cached_tokens,
                "prompt_tokens": s.prompt_tokens,
            }

        return {
            "case_id": self.case_id,
            "outcome": self.outcome,
            "seconds": round(self.seconds, 2),
            "phase_seconds": {
                name: round(seconds, 2) for name, seconds in self.phases.seconds.items()
            },
            "server_startup_seconds": [round(s, 2) for s in self.startup_seconds],
            "servers_reused": self.reused,
            "units": None if self.units is None else vars(self.units),
            "turns": [
                {
                    "conversation": t.conversation,
                    "turn": "resend" if t.resend else t.index,
                    "prompt_len": t.prompt_len,
                    "prev_len": t.prev_len,
                    "expected": t.expected,
                    "bound": t.bound,
                    "cached": t.output.cached_tokens if t.output else None,
                    "max_logprob_diff": t.max_logprob_diff,
                    "divergence": (
                        first_divergence(t.output, t.recompute)
                        if t.output and t.recompute
                        else None
                    ),
                    "seconds": round(t.seconds, 2),
                    "hit": sample(t.output),
                    "recompute": sample(t.recompute),
                    "problems": t.problems,
                    "notices": t.notices,
                    "salt": t.salt,
                    "prompt": t.prompt,
                }
                for t in self.turns
            ],
            "metrics_deltas": self.metrics,
            "problems": self.problems,
            "notices": self.notices,
            "serve": serve_info(
                self.play, MAX_TOKENS, NUM_LOGPROBS, PREFILL_KV_TRANSFER_PARAMS
            ),
        }


# Every case of the session, for the summary table the conftest prints.
SUMMARY: list[CaseRecord] = []


def report_folder(create: bool = True) -> Path:
    folder = Path(os.environ.get(REPORT_DIR_ENV, "hybrid-prefix-cache-report"))
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def reported_case(case_id: str) -> Iterator[CaseRecord]:
    """Print the case's turn table and write its JSON record however it
    ends; fail on any problem."""
    record = CaseRecord(case_id)
    start = time.monotonic()
    clock = _CLOCK.set(record.phases)
    try:
        yield record
    except BaseException as e:
        if isinstance(e, pytest.skip.Exception):
            record.outcome = "skipped"
        elif isinstance(e, pytest.xfail.Exception):
            record.outcome = "xfail"
        else:
            record.outcome = f"error: {type(e).__name__}"
            e.case_record = record  # for expect_known
        raise
    finally:
        _CLOCK.reset(clock)
        record.seconds = time.monotonic() - start
        problems = [p for turn in record.turns for p in turn.problems]
        problems += record.problems
        if not record.outcome:
            record.outcome = "FAIL" if problems else "pass"
        print("\n" + format_table(case_id, record.units, record.turns))
        for notice in [n for t in record.turns for n in t.notices] + record.notices:
            print(f"notice: {notice}")
        for problem in record.problems:
            print(f"problem: {problem}")
        SUMMARY.append(record)
        path = report_folder() / f"{case_id}.json"
        data = record.as_json()
        path.write_text(json.dumps(data, indent=1))
        update_reproducer(data, report_folder())  # <case_id>.repro.py on FAIL
    if problems:
        failure = AssertionError(f"{case_id}:\n" + "\n".join(problems))
        failure.case_record = record  # for expect_known
        raise failure


@contextlib.contextmanager
def serve_case(
    record: CaseRecord,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    pool: ServerPool = POOL,
) -> Iterator[Play]:
    """Get the case's servers from ``pool`` (started, or reused), record
    their checkpoint geometry, and reconcile their counters at the end. A
    case that ends in an exception, rather than in recorded problems, stops
    its servers: they may be what broke."""
    starts = pool.starts
    servers = pool.acquire(binding, deployment, mode)
    record.reused = pool.starts == starts
    if not record.reused:
        record.startup_seconds = [s.startup_seconds or 0.0 for s in servers]
    try:
        # The hit unit is the one of the instance that consults its prefix
        # cache: the prefiller under P/D.
        record.units = Units.from_cache_config(cache_config(servers[0]), mode)
        window = open_window(servers)
        atol = binding.logprob_atol
        if deployment.prefill is not None:
            atol = binding.pd_logprob_atol
        record.play = Play(servers, binding, deployment, mode, record.units, atol)
        yield record.play
        record.metrics, problems = close_window(window, mode, record.turns)
        record.problems += problems
    except (Exception, KeyboardInterrupt):
        # Not on pytest's skip/xfail outcomes: those leave servers sound.
        pool.close()
        raise


def run_case(
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    *,
    shapes: Sequence[str] = (),
    concurrent: bool = False,
    pool: ServerPool = POOL,
) -> CaseRecord:
    """Serve ``deployment`` in ``mode`` and check its conversations: the
    reference one, or one per sweep shape in ``shapes``, played one after
    another or (``concurrent``) all at once.

    The turn table is printed whether the case passes or fails.
    """
    with (
        reported_case(case_id) as record,
        serve_case(record, binding, deployment, mode, pool) as play,
    ):
        if shapes:
            lengths = {shape: shape_length(shape, play.units) for shape in shapes}
            conversations = [
                Conversation(shape, length, f"{case_id}-{shape}")
                for shape, length in lengths.items()
                if length is not None
            ]
            if not conversations:
                pytest.skip(
                    f"shapes {list(shapes)} need a hit unit below the block; this "
                    f"server has hit unit {play.units.hit}, block {play.units.block}"
                )
        else:
            conversations = [reference_conversation(play.units, case_id)]
        if concurrent:
            play.logprob_atol = binding.batched_logprob_atol
        run_conversations(play, conversations, record.turns, concurrent)
    return record


def run_resend(
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    prompt_len: int,
    pool: ServerPool = POOL,
) -> CaseRecord:
    """Send one prompt cold, resend it, and recompute it under a fresh salt.

    The cold request and the recompute hit nothing; the resend hits at least
    the prompt's own checkpoint (:func:`expected_resend`, on the instance that
    consults its cache).
    """
    with (
        reported_case(case_id) as record,
        serve_case(record, binding, deployment, mode, pool) as play,
    ):
        prompt = random_tokens(random.Random(case_id), binding.token_ids, prompt_len)
        salt = f"resend-{uuid.uuid4().hex}"
        cold = Turn("", 0, prompt_len, 0, 0, prompt=prompt, salt=salt)
        record.turns.append(cold)
        cold.output = send(play.servers, binding.model, prompt, salt, cold.problems)
        if cold.output.cached_tokens != 0:
            cold.problems.append(
                f"cold request: cached {cold.output.cached_tokens}, expected 0"
            )
        resend = planned_turn(play, "", PlannedTurn(1, prompt_len, prompt_len, True))
        record.turns.append(resend)
        play_turn(play, resend, prompt, salt)
    return record

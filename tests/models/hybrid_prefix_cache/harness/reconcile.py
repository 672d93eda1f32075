# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The counter rule: what a server's prefix-cache and request counters must
have moved by, given its completions' usage and routes. Pure."""

from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass

from tests.models.hybrid_prefix_cache.harness import compare, rules
from tests.models.hybrid_prefix_cache.harness.deployment import Deployment, Mode, Units

# Prometheus counters the oracle reconciles, by role.
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
REQUESTS_DONE = "vllm:request_success_total"
# One per first token sampled (v1/metrics/stats.py update_from_output).
FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"
COUNTERS = (
    PREFIX_QUERIES,
    PREFIX_HITS,
    EXTERNAL_QUERIES,
    EXTERNAL_HITS,
    NIXL_TRANSFERS,
    NIXL_BYTES,
    SPEC_DRAFTS,
    REQUESTS_DONE,
    FIRST_TOKENS,
)


@dataclass(frozen=True)
class Ledger:
    """What a server's counters must have moved by (:func:`ledger_entry`)."""

    requests: int = 0
    prompt_tokens: int = 0  # as usage reported them
    cached_tokens: int = 0  # as usage reported them
    queries: int = 0  # the prompt tokens the engine's scheduler saw
    held: int = 0  # of those, the tokens it did not compute (local + external)
    # what its KV connector's lookup saw (rules.pd_lookup_backoff)
    connector_queries: int = 0

    def __add__(self, other: "Ledger") -> "Ledger":
        return Ledger(*(a + b for a, b in zip(astuple(self), astuple(other))))


def ledger_entry(
    prompt_tokens: int, cached_tokens: int, kv_transfer_params: Mapping | None
) -> Ledger:
    """One completion's share of its server's counters, by role. Counted once
    at admission (v1/core/sched/scheduler.py Scheduler.schedule,
    KVCacheManager.record_prefix_cache_stats); a prefill leg's lookup misses
    the backoff, a decode leg holds all but it."""
    params = kv_transfer_params or {}
    queries, held, connector = prompt_tokens, cached_tokens, prompt_tokens
    if params.get("do_remote_decode"):
        queries = prompt_tokens - rules.pd_lookup_backoff()
        connector = prompt_tokens - rules.PD_PREFILL_BACKOFF
    elif params.get("do_remote_prefill"):
        held = prompt_tokens - rules.PD_PREFILL_BACKOFF
    return Ledger(1, prompt_tokens, cached_tokens, queries, held, connector)


def aborted_entry(prompt_tokens: int) -> Ledger:
    """An admitted cold request, then aborted: looked up and counted, but no
    success (v1/engine/output_processor.py OutputProcessor.abort_requests)."""
    return Ledger(queries=prompt_tokens, connector_queries=prompt_tokens)


def decoder_pulls(prompt_len: int, local_hit: float) -> float:
    """Tokens a P/D decoder pulls: the prompt less the backoff and its own hit
    (nixl/pull_scheduler.py NixlPullScheduler.get_num_new_matched_tokens)."""
    return max(prompt_len - rules.PD_PREFILL_BACKOFF - local_hit, 0)


def decoder_resend_hit(
    prompt_len: int, units: Units, mode: Mode, deployment: Deployment
) -> int:
    """A P/D resend's decoder hit: the last block end within the loaded KV and its
    checkpoint. Loaded KV is cached in full blocks (v1/core/sched/scheduler.py
    _update_waiting_for_remote_kv, single_type_kv_cache_manager.py cache_blocks); none
    without a prefix cache or with offload (vLLM #42547: hashed nothing)."""
    if not deployment.decode.prefix_caching or deployment.offload:
        return 0
    rule = mode.drafting(deployment.decode)
    end = rules.expected_resend(prompt_len, units.hit, rule.drops_unit, rule.lookahead)
    return min(prompt_len - rules.PD_PREFILL_BACKOFF, end) // units.block * units.block


def decoder_problems(
    prompt_len: int, local_hit: float, transfers: float, prefiller_hit: int
) -> list[str]:
    """A decode leg's faults: one NIXL transfer iff it pulls, a hit within its load."""
    pulled = prompt_len - rules.PD_PREFILL_BACKOFF
    problems = []
    if local_hit > pulled:
        problems.append(
            f"the decoder's own cache hit {local_hit:g} tokens, beyond the "
            f"{pulled} it loads of the {prompt_len}-token prompt"
        )
    expected = 1 if decoder_pulls(prompt_len, local_hit) else 0
    if transfers != expected:
        problems.append(
            f"the decoder's {NIXL_TRANSFERS} moved by {transfers:g}, expected "
            f"{expected}: its own cache hit {local_hit:g} of the {pulled} tokens "
            f"it loads (the prefiller hit {prefiller_hit})"
        )
    return problems


def counter_problems(
    name: str,
    moved: Mapping[str, float | None],
    ledger: Ledger,
    prefix_caching: bool,
    connector: bool,
) -> list[str]:
    """How a server's deltas ``moved`` disagree with its ``ledger``: queries
    (none without prefix caching: record_prefix_cache_stats skips them), local
    plus external hits against held, external queries against seen less hits."""
    value = {key: moved.get(key) or 0.0 for key in COUNTERS}
    problems = []
    queries = ledger.queries if prefix_caching else 0
    if value[PREFIX_QUERIES] != queries:
        problems.append(
            f"{name} server: {PREFIX_QUERIES} moved by {value[PREFIX_QUERIES]:g}, "
            f"but its engine saw {queries} prompt tokens in {ledger.requests} "
            f"completions (usage: {ledger.prompt_tokens})"
        )
    hits = value[PREFIX_HITS] + value[EXTERNAL_HITS]
    if hits != ledger.held:
        problems.append(
            f"{name} server: {PREFIX_HITS} ({value[PREFIX_HITS]:g}) plus "
            f"{EXTERNAL_HITS} ({value[EXTERNAL_HITS]:g}) moved by {hits:g}, but "
            f"its {ledger.requests} completions held {ledger.held} tokens (usage "
            f"reported {ledger.cached_tokens} cached): usage and the server's "
            f"own counters disagree"
        )
    external = ledger.connector_queries - value[PREFIX_HITS]
    if connector and value[EXTERNAL_QUERIES] != external:
        problems.append(
            f"{name} server: {EXTERNAL_QUERIES} moved by {value[EXTERNAL_QUERIES]:g}, "
            f"expected {external:g}: the tokens its engine saw less its local hits"
        )
    return problems


def expected_requests(num_servers: int, turns: Sequence[compare.Turn]) -> list[int]:
    """Completions per server: turns via the deployment, recomputes on the decoder."""
    through = alone = prefiller = 0
    for turn in turns:
        through += 1 + sum(s is not None for s in (turn.twin, turn.relay, turn.alone))
        alone += sum(s is not None for s in (turn.recompute, turn.control))
        alone += len(turn.more_controls)
        prefiller += turn.prefiller_alone is not None
    if num_servers == 1:
        return [through + alone]
    return [through + prefiller, through + alone]


def counter_deltas(
    now: Mapping[str, float | None], before: Mapping[str, float | None]
) -> dict[str, float | None]:
    """Each counter's move (None where not exported)."""
    return {
        key: None if now[key] is None or before[key] is None else now[key] - before[key]
        for key in now
    }

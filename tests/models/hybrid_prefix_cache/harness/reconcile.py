# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The counter rule: what a server's prefix-cache and request counters must
have moved by, given the usage its completions reported (:class:`Ledger`,
:func:`counter_problems`) and the route every request takes
(:func:`expected_requests`). Pure: the client reads ``/metrics`` and hands
the deltas here."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness.compare import Turn
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Deployment,
    Mode,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.rules import (
    PD_PREFILL_BACKOFF,
    expected_resend,
    pd_lookup_backoff,
)

# Prometheus counters the oracle reconciles, by role.
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
REQUESTS_DONE = "vllm:request_success_total"
# Requests that produced their first token (v1/metrics/loggers.py
# PrometheusStatLogger: one observation per IterationStats.
# time_to_first_tokens_iter entry, appended when a prefill's first token is
# sampled, v1/metrics/stats.py IterationStats.update_from_output).
FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"


@dataclass(frozen=True)
class Ledger:
    """What a server's prefix-cache counters must have moved by, summed
    over the completions it answered (see :func:`ledger_entry`)."""

    requests: int = 0
    prompt_tokens: int = 0  # as usage reported them
    cached_tokens: int = 0  # as usage reported them
    queries: int = 0  # the prompt tokens the engine's scheduler saw
    held: int = 0  # of those, the tokens it did not compute (local + external)
    # The prompt tokens its KV connector's lookup saw (where they differ from
    # ``queries``: a P/D prefill leg on 0.26, rules.pd_lookup_backoff).
    connector_queries: int = 0

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
    * a P/D prefill leg: the engine saw the prompt less what its lookup does
      not see (rules.pd_lookup_backoff), its connector the prompt less
      PD_PREFILL_BACKOFF (0.26 truncates the request in between), and it
      held the cached tokens;
    * a P/D decode leg: the engine saw the whole prompt, and held all but
      the PD_PREFILL_BACKOFF tokens (its own hit plus what NIXL loaded).
    """
    params = kv_transfer_params or {}
    queries, held, connector = prompt_tokens, cached_tokens, prompt_tokens
    if params.get("do_remote_decode"):
        queries = prompt_tokens - pd_lookup_backoff()
        connector = prompt_tokens - PD_PREFILL_BACKOFF
    elif params.get("do_remote_prefill"):
        held = prompt_tokens - PD_PREFILL_BACKOFF
    return Ledger(1, prompt_tokens, cached_tokens, queries, held, connector)


def aborted_entry(prompt_tokens: int) -> Ledger:
    """The share of its server's counters of a cold request that its client
    aborted once the scheduler had admitted it: its prompt was looked up and
    counted then (Scheduler.schedule, KVCacheManager.
    record_prefix_cache_stats), with nothing held, but it answered no
    completion, and vLLM counts no success for it
    (v1/engine/output_processor.py OutputProcessor.abort_requests drops the
    request's state without the finished-request stats that request_success
    counts)."""
    return Ledger(queries=prompt_tokens, connector_queries=prompt_tokens)


def decoder_pulls(prompt_len: int, local_hit: float) -> float:
    """The tokens a P/D decoder pulls from its prefiller: the prompt less
    PD_PREFILL_BACKOFF (which it computes itself) less its own hit
    (distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py
    NixlPullScheduler.get_num_new_matched_tokens, with base_scheduler.py
    _get_remote_prefill_token_count); nothing if that is not positive."""
    return max(prompt_len - PD_PREFILL_BACKOFF - local_hit, 0)


def decoder_resend_hit(
    prompt_len: int, units: Units, mode: Mode, deployment: Deployment
) -> int:
    """What a P/D resend's decoder hits in its own cache, from what its
    decode leg of the same prompt and salt cached:

    * once the KV of the prompt less PD_PREFILL_BACKOFF arrived, the whole
      blocks of it, so states at block ends only (v1/core/sched/scheduler.py
      Scheduler._update_waiting_for_remote_kv caches up to the loaded
      tokens; v1/core/single_type_kv_cache_manager.py
      SingleTypeKVCacheManager.cache_blocks caches only full blocks, and
      MambaManager._cache_partial_tail_block a state inside a block only
      where a chunk the instance computed itself ended);
    * nothing deeper from the backoff tokens it computes itself: they end at
      the prompt's end, past its checkpoint.

    Its lookup resumes at a state no deeper than the resent prompt's own
    checkpoint (rules.expected_resend, of the whole prompt, which it sees;
    with a drafter that drops a unit, the unit past the state is its proof):
    the last block end within both. A decoder that hashed nothing would hit
    0 (vLLM #42547). It hits nothing where it keeps no prefix cache
    (Instance.prefix_caching) or where its device cache is reset before
    every turn (Deployment.offload); it then pulls what it needs over NIXL,
    the first connector of its MultiConnector to match tokens
    (kv_connector/v1/multi_connector.py
    MultiConnector.get_num_new_matched_tokens)."""
    if not deployment.decode.prefix_caching or deployment.offload:
        return 0
    loaded = prompt_len - PD_PREFILL_BACKOFF
    rule = mode.drafting(deployment.decode)
    resend = expected_resend(prompt_len, units.hit, rule.drops_unit, rule.lookahead)
    deepest = min(loaded, resend)
    return deepest // units.block * units.block


def decoder_problems(
    prompt_len: int, local_hit: float, transfers: float, prefiller_hit: int
) -> list[str]:
    """Every way a P/D decoder's counters for one decode leg break the rule
    of its role, given its own prefix-cache hit (``local_hit``, its
    prefix_cache_hits delta) and its NIXL transfers (``transfers``):

    * it pulls from the prefiller what its own cache does not hold
      (:func:`decoder_pulls`): one transfer if that is anything, none if
      its own cache holds all of it;
    * its own hit lies within what it loads: it never exceeds that prompt.
    """
    pulled = prompt_len - PD_PREFILL_BACKOFF
    problems = []
    if local_hit > pulled:
        problems.append(
            f"the decoder's own cache hit {local_hit:g} tokens, beyond the "
            f"{pulled} it loads of the {prompt_len}-token prompt"
        )
    expected = 1 if decoder_pulls(prompt_len, local_hit) else 0
    if transfers != expected:
        why = (
            f"its own cache hit {local_hit:g} of the {pulled} tokens it loads"
            f" (the prefiller hit {prefiller_hit})"
        )
        problems.append(
            f"the decoder's {NIXL_TRANSFERS} moved by {transfers:g}, expected "
            f"{expected}: {why}"
        )
    return problems


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
    external = ledger.connector_queries - value(PREFIX_HITS)
    if connector and value(EXTERNAL_QUERIES) != external:
        problems.append(
            f"{name} server: {EXTERNAL_QUERIES} moved by "
            f"{value(EXTERNAL_QUERIES):g}, expected {external:g}: the tokens "
            f"its engine saw less its local hits"
        )
    return problems


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def expected_requests(num_servers: int, turns: Sequence["Turn"]) -> list[int]:
    """How many completions each server of a case must have finished: every
    turn's request, and under P/D its cold twin and its transfer relay, goes
    through the deployment (a prefill leg on the prefiller, a decode leg on
    the decoder); its recompute and its controls go to the decoder alone,
    which computes the whole prompt itself, and its prompt served whole to
    the prefiller alone."""
    through = sum(
        1 + (turn.twin is not None) + (turn.relay is not None) for turn in turns
    )
    alone = sum(
        (turn.recompute is not None)
        + (turn.control is not None)
        + len(turn.more_controls)
        for turn in turns
    )
    prefiller = sum(turn.prefiller_alone is not None for turn in turns)
    if num_servers == 1:
        return [through + alone]
    return [through + prefiller, through + alone]


def counter_deltas(
    now: Mapping[str, float | None], before: Mapping[str, float | None]
) -> dict[str, float | None]:
    """How far each counter moved from ``before`` to ``now`` (None for a
    counter the server does not export)."""
    return {key: _delta(now[key], before[key]) for key in now}


def server_problems(
    name: str,
    moved: Mapping[str, float | None],
    ledger: Ledger,
    *,
    prefix_caching: bool,
    connector: bool,
    route: int | None,
) -> list[str]:
    """Every way one server's counter deltas ``moved`` disagree with what its
    completions reported (:func:`counter_problems`) or with ``route``, the
    completions it must have answered (:func:`expected_requests`; None for a
    server the harness did not start, held to vLLM's own request_success
    count instead)."""
    found = counter_problems(
        name, moved, ledger, prefix_caching=prefix_caching, connector=connector
    )
    done = moved[REQUESTS_DONE] or 0.0
    if route is not None and ledger.requests != route:
        found.append(
            f"{name} server: answered {ledger.requests} completions, "
            f"expected {route} (each turn through the "
            f"deployment, each recompute on the decoder alone)"
        )
    elif done != ledger.requests:
        found.append(
            f"{name} server: {REQUESTS_DONE} moved by {done:g}, but it "
            f"answered {ledger.requests} completions"
        )
    return found


def server_deltas(ledger: Ledger, moved: Mapping[str, float | None]) -> dict:
    """One server's entry of a case's metrics deltas: its completions'
    ledger beside its counters' deltas."""
    return {
        "requests": ledger.requests,
        "usage_prompt_tokens": ledger.prompt_tokens,
        "usage_cached_tokens": ledger.cached_tokens,
        "engine_queries": ledger.queries,
        "engine_held": ledger.held,
        **moved,
    }


def drafter_problems(mode: Mode, drafts: float) -> list[str]:
    """A speculative mode whose servers drafted nothing (``drafts``, their
    SPEC_DRAFTS deltas summed) would pass vacuously."""
    if mode.spec is not None and drafts <= 0:
        return [
            f"speculative mode, but {SPEC_DRAFTS} did not grow: the drafter "
            f"never ran, so the case would pass vacuously"
        ]
    return []

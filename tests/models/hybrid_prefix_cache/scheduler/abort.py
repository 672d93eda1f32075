# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Requests aborted mid-prefill and retried, in replayed servers: the abort as the
API server sends it, after a chunk or with one in flight (:func:`play_abort_retry`),
and a retry admitted beside its original (:func:`play_overlapping_retry`)."""

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness import client, conversation, reconcile
from tests.models.hybrid_prefix_cache.scheduler.cell import ReplayCell
from tests.models.hybrid_prefix_cache.scheduler.play import hit_and_recompute
from tests.models.hybrid_prefix_cache.scheduler.servers import STEP_LIMIT, ReplayServer
from vllm.v1.request import RequestStatus


@dataclass(frozen=True)
class AbortRetry:
    prompt_len: int
    # Tokens computed by processed steps at the abort, and in flight.
    written: int
    in_flight: int
    hit: int
    recompute_hit: int


def play_abort_retry(
    cell: ReplayCell, servers: Sequence[ReplayServer], prompt_len: int
) -> AbortRetry:
    """A cold request aborted mid-prefill (Scheduler.finish_requests), then the same
    prompt and salt, and its recompute. Asynchronously (no P/D) the abort lands with
    the last checkpoint's chunk in flight (vLLM #56525), else after the first chunk."""
    seed = cell.cell_id
    prompt = conversation.random_tokens(random.Random(seed), cell.token_ids, prompt_len)
    salt = f"abort-{seed}"
    first = servers[0]
    sent = None if len(servers) == 1 else client.PREFILL_KV_TRANSFER_PARAMS
    aborted = first.submit(prompt, salt, 1 if sent else client.MAX_TOKENS, sent)
    loop = first.routed[aborted.request_id]
    # num_computed_tokens counts a step in flight.
    race = loop.depth > 1 and sent is None
    until = prompt_len if race else 1
    request = None
    while request is None or request.num_computed_tokens < until:
        assert first.step(), "the aborted request was never scheduled"
        request = loop.scheduler.requests.get(aborted.request_id)
        assert request is not None, "the request finished before it was aborted"
    # Scheduled in steps not processed yet (asynchronous scheduling keeps one).
    in_flight = sum(
        out.num_scheduled_tokens.get(aborted.request_id, 0) for out, _ in loop.queue
    )
    written = request.num_computed_tokens - in_flight
    assert written < prompt_len, "the abort did not land mid-prefill"
    loop.scheduler.finish_requests([aborted.request_id], RequestStatus.FINISHED_ABORTED)
    # Its prompt was looked up and counted at admission; it was cold.
    first.ledger += reconcile.ledger_entry(prompt_len, 0, sent)
    if not race:
        first.drain()
    _, hit, recomputed, _ = hit_and_recompute(
        servers, cell.deployment, prompt, salt, f"recompute-{seed}"
    )
    for server in servers:
        server.drain()
    return AbortRetry(prompt_len, written, in_flight, hit, recomputed)


@dataclass(frozen=True)
class OverlappingRetry:
    prompt_len: int
    # The original's tokens scheduled before the retry's first step, and at its abort.
    written: int
    aborted_at: int
    hit: int
    recompute_hit: int


def play_overlapping_retry(
    cell: ReplayCell, servers: Sequence[ReplayServer], prompt_len: int
) -> OverlappingRetry:
    """A retry sent while its original still prefills, then the original aborted,
    under one salt: the retry is admitted beside one of the original's chunks,
    maybe the one that writes the last checkpoint as it runs. Then its recompute."""
    seed, token_ids = cell.cell_id, cell.token_ids
    prompt = conversation.random_tokens(random.Random(seed), token_ids, prompt_len)
    salt = f"overlap-{seed}"
    first = servers[0]
    sent = None if len(servers) == 1 else client.PREFILL_KV_TRANSFER_PARAMS
    max_tokens = 1 if sent else client.MAX_TOKENS
    original = first.submit(prompt, salt, max_tokens, sent)
    loop = first.routed[original.request_id]
    # Round-robin under DP: a short request for each other engine.
    filler = conversation.random_tokens(random.Random(f"{seed}-pad"), token_ids, 8)
    pads = [
        first.submit(filler, f"pad-{seed}-{rank}", 1)
        for rank in range(1, len(first.loops))
    ]
    assert first.step(), "the original was never scheduled"
    retry = first.submit(prompt, salt, max_tokens, sent)
    assert first.routed[retry.request_id] is loop, "the retry went to another engine"
    scheduler = loop.scheduler
    for _ in range(STEP_LIMIT):
        state = scheduler.requests.get(original.request_id)
        written = state.num_computed_tokens if state is not None else prompt_len
        assert first.step(), "the retry was never scheduled"
        request = scheduler.requests.get(retry.request_id)
        # Scheduled, or finished (a one-token prefill leg).
        if request is None or request.status != RequestStatus.WAITING:
            break
    else:
        raise AssertionError(f"the retry was not scheduled in {STEP_LIMIT} steps")
    state = scheduler.requests.get(original.request_id)
    aborted = state is not None and not original.finished
    aborted_at = state.num_computed_tokens if aborted else prompt_len
    if aborted:
        scheduler.finish_requests([original.request_id], RequestStatus.FINISHED_ABORTED)
        # Its prompt was looked up and counted at admission; it was cold.
        first.ledger += reconcile.ledger_entry(prompt_len, 0, sent)
    first.finish(retry)
    assert retry.cached_tokens is not None
    hit = retry.cached_tokens
    # Under P/D, the decode leg of each prefill that finished.
    for completion in (retry,) if aborted else (original, retry):
        first.settle(completion, sent)
        if sent is not None:
            params = completion.kv_transfer_params
            servers[-1].complete(prompt, salt, kv_transfer_params=params)
    for pad in pads:
        first.settle(pad, None)
    first.drain()
    recompute = servers[-1].complete(prompt, f"recompute-{seed}").cached_tokens
    assert recompute is not None
    for server in servers:
        server.drain()
    return OverlappingRetry(prompt_len, written, aborted_at, hit, recompute)

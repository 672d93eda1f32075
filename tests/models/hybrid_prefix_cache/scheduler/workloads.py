# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workloads of :mod:`harness.workloads` played through replayed
servers: siblings of a shared prefix (:func:`play_siblings`), an abort
mid-prefill and its retry (:func:`play_abort_retry`) and a conversation
under eviction pressure (:func:`play_eviction`). The others (a small
budget, aligned prompts, a P/D resend, asynchronous scheduling) are the
conversations and resends of :mod:`scheduler.play` on other engines."""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.scheduler.play import _hit_and_recompute, send
from tests.models.hybrid_prefix_cache.scheduler.servers import (
    STEP_LIMIT,
    EngineLoop,
    ReplayServer,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.request import RequestStatus


@dataclass(frozen=True)
class Sibling:
    prompt_len: int
    hit: int
    recompute_hit: int


def play_siblings(
    servers: Sequence[ReplayServer],
    units: harness.Units,
    seed: str,
    token_ids: tuple[int, int],
) -> tuple[int, list[Sibling]]:
    """NUM_SIBLINGS requests of one salt that share a system prompt and
    then diverge, one after another, each followed by its recompute under a
    fresh salt: (the shared prefix's length, the siblings). The device
    caches are never reset here, under offload neither: a sibling finds the
    junction in the device cache, where its attention blocks hit past any
    Mamba state."""
    rng = random.Random(seed)
    shared = harness.random_tokens(rng, token_ids, harness.shared_prefix_length(units))
    tail = harness.sibling_tail_length(units)
    siblings = []
    for index in range(harness.NUM_SIBLINGS):
        prompt = shared + harness.random_tokens(rng, token_ids, tail)
        _, hit, _ = send(servers, prompt, f"siblings-{seed}")
        recompute = servers[-1].complete(prompt, f"recompute-{seed}-{index}")
        assert recompute.cached_tokens is not None
        siblings.append(Sibling(len(prompt), hit, recompute.cached_tokens))
    for server in servers:
        server.drain()
    return len(shared), siblings


def _in_flight(loop: EngineLoop, request_id: str) -> int:
    """Tokens of ``request_id`` scheduled in steps whose outputs the engine
    has not processed yet (asynchronous scheduling keeps one in flight)."""
    return sum(
        output.num_scheduled_tokens.get(request_id, 0) for output, _ in loop.queue
    )


@dataclass(frozen=True)
class AbortRetry:
    prompt_len: int
    # Tokens of the aborted request that steps with processed outputs had
    # computed when the client aborted it, and those still in flight.
    written: int
    in_flight: int
    hit: int
    recompute_hit: int


def play_abort_retry(
    servers: Sequence[ReplayServer],
    deployment: harness.Deployment,
    prompt_len: int,
    seed: str,
    token_ids: tuple[int, int],
) -> AbortRetry:
    """A cold request aborted by its client mid-prefill (on the prefiller
    under P/D, where the client sends first), as the API server aborts it
    (Scheduler.finish_requests with FINISHED_ABORTED); then at once the same
    prompt and salt again, and its recompute under a fresh salt.

    Under asynchronous scheduling, without P/D, the abort lands once the
    chunk that reaches the prompt's end, and so publishes its last
    checkpoint, is scheduled: that step is still in flight when the retry
    is scheduled (vLLM #56525's race). Under synchronous scheduling that
    chunk has run by then, so the abort lands after the first chunk
    instead. Under P/D it lands there too, and the retry waits until the
    prefiller's steps are done: a retry scheduled with the aborted
    request's step in flight left the replayed prefiller stepping forever
    (not yet told apart: vLLM's or the replay's stand-in transfer)."""
    prompt = harness.random_tokens(random.Random(seed), token_ids, prompt_len)
    salt = f"abort-{seed}"
    first = servers[0]
    sent = None if len(servers) == 1 else harness.PREFILL_KV_TRANSFER_PARAMS
    aborted = first.submit(prompt, salt, 1 if sent else harness.MAX_TOKENS, sent)
    loop = first.routed[aborted.request_id]
    # How far the prefill gets before the abort, counted as the scheduler
    # counts it (num_computed_tokens includes a step in flight).
    race = loop.depth > 1 and sent is None
    until = prompt_len if race else 1
    request = None
    while request is None or request.num_computed_tokens < until:
        assert first.step(), "the aborted request was never scheduled"
        request = loop.scheduler.requests.get(aborted.request_id)
        assert request is not None, "the request finished before it was aborted"
    in_flight = _in_flight(loop, aborted.request_id)
    written = request.num_computed_tokens - in_flight
    assert written < prompt_len, "the abort did not land mid-prefill"
    loop.scheduler.finish_requests([aborted.request_id], RequestStatus.FINISHED_ABORTED)
    # Its prompt was looked up and counted at admission; it was cold.
    first.ledger += harness.ledger_entry(prompt_len, 0, sent)
    if not race:
        first.drain()
    _, hit, recomputed, _ = _hit_and_recompute(
        servers, deployment, prompt, salt, f"recompute-{seed}"
    )
    for server in servers:
        server.drain()
    return AbortRetry(prompt_len, written, in_flight, hit, recomputed)


@dataclass(frozen=True)
class OverlappingRetry:
    prompt_len: int
    # Tokens of the original that steps scheduled before the step that
    # first scheduled the retry (they ran first), and how far the original
    # had got when it was aborted.
    written: int
    aborted_at: int
    hit: int
    recompute_hit: int


def play_overlapping_retry(
    servers: Sequence[ReplayServer],
    deployment: harness.Deployment,
    prompt_len: int,
    seed: str,
    token_ids: tuple[int, int],
) -> OverlappingRetry:
    """A client's retry sent while its original request is still
    prefilling, and then the original aborted (a client that times out and
    retries before its first connection is closed), both under one salt, on
    the prefiller under P/D, where the client sends first. The retry waits
    for the token budget that the original's chunks leave, so it is admitted
    beside one of them: beside the chunk cut at the prompt's last checkpoint
    (Scheduler._mamba_block_aligned_split), it is the step whose chunk
    publishes that state (MambaManager.cache_blocks) and writes it only as
    it runs. Then the retry's prefill finishes (its decode leg under P/D),
    and its recompute under a fresh salt."""
    prompt = harness.random_tokens(random.Random(seed), token_ids, prompt_len)
    salt = f"overlap-{seed}"
    first = servers[0]
    sent = None if len(servers) == 1 else harness.PREFILL_KV_TRANSFER_PARAMS
    max_tokens = 1 if sent else harness.MAX_TOKENS
    original = first.submit(prompt, salt, max_tokens, sent)
    loop = first.routed[original.request_id]
    # Under data parallelism requests go round-robin: the other engines get
    # a short request each, so that the retry reaches the original's engine.
    filler = harness.random_tokens(random.Random(f"{seed}-pad"), token_ids, 8)
    pads = [
        first.submit(filler, f"pad-{seed}-{rank}", 1)
        for rank in range(1, len(first.loops))
    ]
    assert first.step(), "the original was never scheduled"
    retry = first.submit(prompt, salt, max_tokens, sent)
    assert first.routed[retry.request_id] is loop, "the retry went to another engine"
    scheduler = loop.scheduler
    written = 0
    for _ in range(STEP_LIMIT):
        state = scheduler.requests.get(original.request_id)
        written = state.num_computed_tokens if state is not None else prompt_len
        assert first.step(), "the retry was never scheduled"
        request = scheduler.requests.get(retry.request_id)
        # Scheduled: running, or already finished (a prefill leg of one
        # token finishes in the step that schedules it).
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
        first.ledger += harness.ledger_entry(prompt_len, 0, sent)
    first.finish(retry)
    assert retry.cached_tokens is not None
    hit = retry.cached_tokens
    # What finished goes on as the client sends it: under P/D, the decode
    # leg of each prefill that finished (the prefiller holds its blocks for
    # the decoder until then).
    for completion in (retry,) if aborted else (original, retry):
        first.settle(completion, sent)
        if sent is not None:
            params = completion.kv_transfer_params
            servers[-1].complete(prompt, salt, kv_transfer_params=params)
    for pad in pads:
        first.settle(pad, None)
    first.drain()
    recompute = servers[-1].complete(prompt, f"recompute-{seed}")
    assert recompute.cached_tokens is not None
    for server in servers:
        server.drain()
    return OverlappingRetry(
        prompt_len, written, aborted_at, hit, recompute.cached_tokens
    )


def per_group_hits(server: ReplayServer, prompt: Sequence[int], salt: str) -> tuple:
    """Each KV cache group's own longest hit for ``prompt`` now, on the
    first engine of ``server``, as vLLM's per-group lookup finds it
    (HybridKVCacheCoordinator.find_longest_cache_hit_per_group on the
    request's block hashes, up to all but the last token)."""
    probe = server.request("probe", prompt, salt, SamplingParams(max_tokens=1))
    coordinator = server.scheduler.kv_cache_manager.coordinator
    _, hits = coordinator.find_longest_cache_hit_per_group(
        probe.block_hashes, probe.num_tokens - 1
    )
    return tuple(hits)


@dataclass(frozen=True)
class Eviction:
    prompt_len: int
    prev_len: int
    # Each group's own hit before the pressure requests and just before the
    # conversation's next turn, on the instance that consults its cache.
    held_before: tuple
    held: tuple
    # The next turn's hit (usage) and its local part (prefix_cache_hits).
    hit: int
    local_hit: int
    recompute_hit: int
    # The rounds of pressure requests sent before that turn.
    pressure: int
    # Under P/D, the decoder's own hit for that turn's decode leg (its
    # prefix_cache_hits delta, as harness.send reads it).
    decoder_hit: int | None = None


def play_eviction(
    servers: Sequence[ReplayServer],
    units: harness.Units,
    seed: str,
    token_ids: tuple[int, int],
) -> Eviction:
    """A conversation's first turn, short cold prompts under other salts
    until the first eviction reaches its blocks, then the conversation's second turn
    (its first prompt, output and fill) and its recompute, with each group's
    own hit looked up just before it. The device caches are never reset
    here, under offload neither: what the pool evicts is the workload."""
    rng = random.Random(seed)
    first_len = harness.reference_conversation(units, seed).first_len
    salt = f"eviction-{seed}"
    prompt = harness.random_tokens(rng, token_ids, first_len)
    output, _, _ = send(servers, prompt, salt)
    grown = harness.grown_prompt(rng, token_ids, prompt, output.token_ids)
    for server in servers:
        server.drain()
    held_before = per_group_hits(servers[0], grown, salt)
    # Short cold prompts under other salts, one at a time, until the first
    # eviction reaches the conversation's blocks: then some groups may have
    # lost their tail while another still holds a deeper state. Under data
    # parallelism the requests go round-robin over the engines, so they go
    # in rounds of one per engine, and the next turn goes back to the first,
    # where the conversation began.
    dp = len(servers[0].loops)
    filler = harness.eviction_filler(units)
    pressure = 0
    while pressure < harness.EVICTION_PRESSURE_REQUESTS:
        for rank in range(dp):
            other = harness.random_tokens(rng, token_ids, filler)
            send(servers, other, f"pressure-{seed}-{pressure}-{rank}")
        pressure += 1
        for server in servers:
            server.drain()
        if per_group_hits(servers[0], grown, salt) != held_before:
            break
    # The conversation's next request is the first engine's again.
    for rank in range(1, dp):
        send(servers, harness.random_tokens(rng, token_ids, filler), f"pad-{rank}")
    held = per_group_hits(servers[0], grown, salt)
    local_before = servers[0].moved[harness.PREFIX_HITS] or 0
    _, hit, decoder_hit = send(servers, grown, salt)
    local_hit = int((servers[0].moved[harness.PREFIX_HITS] or 0) - local_before)
    recompute = servers[-1].complete(grown, f"recompute-{seed}")
    assert recompute.cached_tokens is not None
    for server in servers:
        server.drain()
    return Eviction(
        len(grown),
        first_len,
        held_before,
        held,
        hit,
        local_hit,
        recompute.cached_tokens,
        pressure,
        decoder_hit,
    )


def sized_eviction(
    build: Callable[[int], Sequence[ReplayServer]],
    blocks: int,
    play: Callable[[Sequence[ReplayServer]], Eviction],
) -> tuple[int, Sequence[ReplayServer], Eviction]:
    """:func:`play_eviction` (as ``play``) on the servers ``build`` makes
    with a pool of ``blocks`` blocks, or of the fewest blocks above it that
    vLLM accepts and that admit the workload's requests: vLLM refuses a
    pool that cannot hold one request of the model's length
    (v1/core/kv_cache_utils.py check_enough_kv_cache_memory), and one that
    it accepts may still admit nothing into an empty engine (admission
    reserves more than a request's peak). The pool grows by a quarter each
    time. Returns the blocks played, their servers and what the play saw."""
    for _ in range(64):
        try:
            servers = build(blocks)
        except ValueError as e:
            if "To serve at least one request" not in str(e):
                raise
        else:
            try:
                return blocks, servers, play(servers)
            except AssertionError as e:
                if " 0 running, " not in str(e):
                    raise
                print(f"{blocks} blocks admit nothing: {e}")
        blocks += max(blocks // 4, 1)
    raise AssertionError(f"no pool up to {blocks} blocks admitted the requests")


def blocks_in_use(server: ReplayServer, prompt: Sequence[int], salt: str) -> int:
    """The most blocks of its first engine's pool that ``prompt`` held at
    once, from admission to its last token, as the control that sizes an
    eviction pool from the engine itself."""
    pool = server.scheduler.kv_cache_manager.block_pool
    free = least = pool.get_num_free_blocks()
    completion = server.submit(prompt, salt, harness.MAX_TOKENS)
    while not completion.finished:
        assert server.step(), "the sizing request stalled"
        least = min(least, pool.get_num_free_blocks())
    server.drain()
    return free - least

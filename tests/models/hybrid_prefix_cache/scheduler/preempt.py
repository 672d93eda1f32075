# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Requests preempted while they decode and resumed, in replayed servers:
what vLLM's scheduler did with them (:func:`play_preemption`), and the
smallest pool and fewest requests where it resumes one
(:func:`sized_preemption`)."""

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness.conversation import random_tokens
from tests.models.hybrid_prefix_cache.harness.rules import FIRST_PROMPT_TAIL
from tests.models.hybrid_prefix_cache.scheduler.servers import ReplayServer
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

# Pools tried, up to this many times the smallest vLLM accepts, and the most
# requests sent at once to each.
MAX_POOL_GROWTH = 4
MAX_REQUESTS = 8
# How vLLM refuses a pool too small (v1/core/kv_cache_utils.py).
POOL_REFUSALS = ("To serve at least one request", "No available memory for the cache")


@dataclass(frozen=True)
class Preemption:
    """What the replay saw: the preempted request's outputs when it was
    preempted, its resumed prefill's chunks and end, and each follow-up's
    hit and recompute hit (the resumed request's first)."""

    requests: int
    resumed: int
    preempted_at: int
    chunks: tuple[tuple[int, int], ...]
    prefill_end: int
    block: int
    hits: tuple[int, int]
    recompute_hits: tuple[int, int]


@dataclass(frozen=True)
class Unpreempted:
    """No decoding request was preempted; at most ``most_running`` requests
    ran at once."""

    most_running: int


def _watch(log: list) -> Callable[[Scheduler, SchedulerOutput], None]:
    """Log each step's running requests, preemptions and chunks as it is
    scheduled."""

    def watch(scheduler: Scheduler, output: SchedulerOutput) -> None:
        log.append(("running", len(scheduler.running)))
        for request_id in output.preempted_req_ids or ():
            request = scheduler.requests[request_id]
            log.append(("preempted", request_id, request.num_output_tokens, 0))
        for request_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            end = request.num_computed_tokens
            log.append(("chunk", request_id, end - count, end, request.num_tokens))

    return watch


@functools.lru_cache(maxsize=MAX_REQUESTS)
def _prompts(
    seed: str, token_ids: tuple[int, int], prompt_len: int, requests: int
) -> tuple[tuple[tuple[int, ...], ...], tuple]:
    """The requests' prompts drawn from ``seed`` as a real server's play draws
    them, and the generator's state after: the sizing replays them hundreds
    of times, and drawing them took most of its time."""
    rng = random.Random(seed)
    prompts = [random_tokens(rng, token_ids, prompt_len) for _ in range(requests)]
    return tuple(map(tuple, prompts)), rng.getstate()


def play_preemption(
    servers: Sequence[ReplayServer],
    prompt_len: int,
    max_tokens: int,
    requests: int,
    seed: str,
    token_ids: tuple[int, int],
    reverse: bool = False,
) -> Preemption | Unpreempted:
    """``requests`` requests at once on the first engine (pads between them
    under DP), request i at priority i, sent in order or (``reverse``) last
    first; then the follow-ups of the last one preempted while decoding and
    of the first, with recomputes."""
    prompts, state = _prompts(seed, token_ids, prompt_len, requests)
    server, rng = servers[0], random.Random()
    rng.setstate(state)
    loop, log = server.loops[0], []
    watch = _watch(log)
    loop.watchers.append(watch)
    filler = random_tokens(random.Random(f"{seed}-pad"), token_ids, 8)
    sent, pads = {}, []
    for index in reversed(range(requests)) if reverse else range(requests):
        salt = f"{seed}-{index}"
        sent[index] = server.submit(prompts[index], salt, max_tokens, None, index)
        pads += [
            server.submit(filler, f"pad-{index}-{rank}", 1)
            for rank in range(1, len(server.loops))
        ]
    for completion in sent.values():
        server.finish(completion)
    server.drain()
    loop.watchers.remove(watch)
    for completion in (*sent.values(), *pads):
        server.settle(completion, None)
    resumed = [e for e in log if e[0] == "preempted" and e[2] > 0]
    if not resumed:
        return Unpreempted(max(e[1] for e in log if e[0] == "running"))
    request_id = resumed[-1][1]
    after = log[log.index(resumed[-1]) :]
    chunks = [(e[2], e[3]) for e in after if e[:2] == ("chunk", request_id)]
    prefill_end = next(e[4] for e in after if e[:2] == ("chunk", request_id)) - 1
    chunks = [(s, e) for s, e in chunks if s < prefill_end]
    index = next(i for i, c in sent.items() if c.request_id == request_id)
    hits, recomputes = [], []
    for turn, done in enumerate((index, 0 if index else 1)):
        tail = random_tokens(rng, token_ids, FIRST_PROMPT_TAIL)
        prompt = [*sent[done].prompt, *sent[done].token_ids, *tail]
        hit = server.complete(prompt, f"{seed}-{done}")
        recompute = server.complete(prompt, f"recompute-{seed}-{turn}")
        hits.append(hit.cached_tokens or 0)
        recomputes.append(recompute.cached_tokens or 0)
    block = loop.scheduler.cache_config.block_size
    outputs = resumed[-1][2]
    return Preemption(
        requests,
        index,
        outputs,
        tuple(chunks),
        prefill_end,
        block,
        tuple(hits),
        tuple(recomputes),
    )


def sized_preemption(
    build: Callable[[int], Sequence[ReplayServer]],
    play: Callable[[Sequence[ReplayServer], int], Preemption | Unpreempted],
) -> tuple[int, Sequence[ReplayServer], Preemption | None]:
    """The smallest pool vLLM accepts (check_enough_kv_cache_memory), and the
    fewest requests at once, where a decoding request is preempted, resumed
    in more than one chunk, and its follow-up hits; else the first whose
    follow-up hits, or the first that preempted one at all. Where fewer
    requests ran at once than were sent and none was preempted, the pool
    admits no more: the next is tried."""
    found: tuple[int, Sequence[ReplayServer], Preemption | None] = (0, (), None)
    size, least = 0, None
    while least is None or size < MAX_POOL_GROWTH * least:
        size += 1
        try:
            build(size)
        except ValueError as e:
            if not any(refusal in str(e) for refusal in POOL_REFUSALS):
                raise
            continue
        least = least or size
        for requests in range(2, MAX_REQUESTS + 1):
            servers = build(size)
            replayed = play(servers, requests)
            if isinstance(replayed, Unpreempted):
                if replayed.most_running < requests:
                    break
                continue
            if len(replayed.chunks) > 1 and replayed.hits[0]:
                return size, servers, replayed
            better = found[2] is None or replayed.hits[0] and not found[2].hits[0]
            if better:
                found = (size, servers, replayed)
    return found

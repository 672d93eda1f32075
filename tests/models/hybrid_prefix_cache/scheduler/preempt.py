# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Requests preempted while they decode and resumed, in replayed servers
(:func:`play_preemption`), and the pool and fewest requests where vLLM's
scheduler resumes one (:func:`sized_preemption`)."""

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness.conversation import random_tokens
from tests.models.hybrid_prefix_cache.harness.rules import FIRST_PROMPT_TAIL
from tests.models.hybrid_prefix_cache.scheduler.servers import ReplayServer
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

# The most requests sent at once.
MAX_REQUESTS = 8
# How vLLM refuses a pool too small (v1/core/kv_cache_utils.py).
POOL_REFUSALS = ("To serve at least one request", "No available memory for the cache")


@dataclass(frozen=True)
class Preemption:
    """The preempted request's outputs when first preempted while decoding, the
    chunks of its resumed prefills and the first one's end, and each follow-up's
    hit and recompute hit (the resumed request's first)."""

    requests: int
    resumed: int
    preempted_at: int
    chunks: tuple[tuple[int, int], ...]
    prefill_end: int
    block: int
    hits: tuple[int, int]
    recompute_hits: tuple[int, int]

    @property
    def chunk_ends(self) -> tuple[int, ...]:
        return tuple(end for _, end in self.chunks)

    @property
    def last_checkpoint(self) -> int:
        """Where vLLM stops the resumed prefill whatever its split, with no drafter
        block drop nor lookahead hashes (Scheduler._mamba_block_aligned_split's
        last_cache_position, get_mamba_prefill_checkpoint_position)."""
        return self.prefill_end // self.block * self.block

    def output_cuts(self, prompt_len: int) -> tuple[int, ...]:
        """The resumed prefill's chunk ends inside its replayed outputs, short of its
        last checkpoint: where the budget cut it, vLLM #33706's trigger (a split of
        the prompt alone leaves such an end off a block)."""
        last = self.last_checkpoint
        return tuple(end for end in self.chunk_ends if prompt_len < end < last)


@dataclass(frozen=True)
class Unpreempted:
    """No decoding request was preempted; at most ``most_running`` requests ran
    at once, holding at most ``peak_blocks`` blocks (the null block included)."""

    most_running: int
    peak_blocks: int = 0


@functools.lru_cache(maxsize=MAX_REQUESTS)
def _prompts(
    seed: str, token_ids: tuple[int, int], prompt_len: int, requests: int
) -> tuple[tuple[tuple[int, ...], ...], tuple]:
    """The prompts drawn from ``seed`` as a real server's play draws them, and the
    generator's state after; cached, as the sizing replays them hundreds of times."""
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
    """``requests`` requests at once on the first engine (pads between them under
    DP), request i at priority i, in order or (``reverse``) last first; then the
    follow-ups of the last one preempted while decoding and of the first."""
    prompts, state = _prompts(seed, token_ids, prompt_len, requests)
    server, rng = servers[0], random.Random()
    rng.setstate(state)
    loop, log = server.loops[0], []

    def watch(scheduler: Scheduler, output: SchedulerOutput) -> None:
        # Each step's running requests and blocks held (allocation happens in
        # Scheduler.schedule: the step's peak), preemptions and chunks.
        pool = scheduler.kv_cache_manager.block_pool
        held = pool.num_gpu_blocks - pool.get_num_free_blocks()
        log.append(("running", len(scheduler.running), held))
        for request_id in output.preempted_req_ids or ():
            request = scheduler.requests[request_id]
            log.append(("preempted", request_id, request.num_output_tokens, 0))
        for request_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            end = request.num_computed_tokens
            log.append(("chunk", request_id, end - count, end, request.num_tokens))

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
    decoding = [e for e in log if e[0] == "preempted" and e[2] > 0]
    if not decoding:
        running = [e for e in log if e[0] == "running"]
        return Unpreempted(max(e[1] for e in running), max(e[2] for e in running))
    # The last request preempted while decoding, from its first such preemption on:
    # every resume's chunks wrote states, a second preemption mid-prefill included.
    request_id = decoding[-1][1]
    first = next(e for e in decoding if e[1] == request_id)
    own = [e for e in log[log.index(first) :] if e[:2] == ("chunk", request_id)]
    end = own[0][4] - 1  # its first resumed prefill's end
    chunks = tuple((e[2], e[3]) for e in own if e[2] < end)
    index = next(i for i, c in sent.items() if c.request_id == request_id)
    follow_ups = []
    for turn, done in enumerate((index, 0 if index else 1)):
        tail = random_tokens(rng, token_ids, FIRST_PROMPT_TAIL)
        prompt = [*sent[done].prompt, *sent[done].token_ids, *tail]
        hit = server.complete(prompt, f"{seed}-{done}").cached_tokens or 0
        recompute = server.complete(prompt, f"recompute-{seed}-{turn}").cached_tokens
        follow_ups.append((hit, recompute or 0))
    hits, recomputes = zip(*follow_ups)
    block = loop.scheduler.cache_config.block_size
    return Preemption(requests, index, first[2], chunks, end, block, hits, recomputes)


def pool_blocks(servers: Sequence[ReplayServer]) -> int:
    """The first engine's pool, its null block included."""
    return servers[0].scheduler.kv_cache_manager.block_pool.num_gpu_blocks


class _Pools:
    """Pools by the size ``build`` takes (not always blocks: a stated engine splits
    its bytes over a group's layers); None where vLLM refuses the pool."""

    def __init__(self, build: Callable, blocks_of: Callable) -> None:
        self.build, self.blocks_of = build, blocks_of
        self.blocks: dict[int, int | None] = {}
        # Servers built to read a pool and not played yet.
        self.fresh: dict[int, Sequence] = {}

    def __call__(self, size: int) -> int | None:
        if size not in self.blocks:
            try:
                servers = self.build(size)
            except ValueError as e:
                if not any(refusal in str(e) for refusal in POOL_REFUSALS):
                    raise
                self.blocks[size] = None
            else:
                self.blocks[size] = self.blocks_of(servers)
                self.fresh[size] = servers
        return self.blocks[size]

    def size_of(self, blocks: int) -> int | None:
        """The smallest size giving ``blocks`` blocks (None: vLLM refuses that pool)."""
        size = blocks
        while self(size) is None:
            size *= 2
            assert size < 2**20, f"vLLM refuses every pool up to {size}"
        # Sizes scale pools: scale to the ratio, then step to the smallest.
        size = -(-blocks * size // self(size))
        while (got := self(size)) is not None and got > blocks:
            size -= 1
        while got is not None and got < blocks:
            size += 1
            got = self(size)
        if got != blocks:
            return None
        while size > 1 and self(size - 1) == blocks:
            size -= 1
        return size


def sized_preemption(
    build: Callable[[int | None], Sequence[ReplayServer]],
    play: Callable[[Sequence[ReplayServer], int], Preemption | Unpreempted],
    tested: Callable[[Preemption], bool],
    blocks_of: Callable[[Sequence[ReplayServer]], int] = pool_blocks,
) -> tuple[int, Sequence[ReplayServer], Preemption | None]:
    """For the fewest requests at once (from 2), the largest pool where vLLM preempts
    a decoding request and the result ``tested`` takes; else the first whose follow-up
    hits, or the first that preempted one at all. ``build(None)`` never preempts; a
    block fewer than its run's peak fails that step's allocation
    (KVCacheManager.allocate_slots), so Scheduler.schedule preempts the running request
    of the largest (priority, arrival): the last, after the most outputs. Smaller pools
    follow a block at a time, down to one that preempts nothing after one did or runs
    fewer at once (a connector holding blocks for its stores moves the peak). Where
    even the large pool ran fewer at once, more requests are not tried."""
    found: tuple[int, Sequence[ReplayServer], Preemption | None] = (0, (), None)
    pools = _Pools(build, blocks_of)
    for requests in range(2, MAX_REQUESTS + 1):
        free = play(build(None), requests)
        assert isinstance(free, Unpreempted), (
            f"{requests} requests were preempted on a pool that should hold "
            f"them all: {free}"
        )
        if free.most_running < requests:
            break
        blocks, preempted = free.peak_blocks - 1, False
        while (size := pools.size_of(blocks)) is not None:
            servers = pools.fresh.pop(size, None) or build(size)
            replayed = play(servers, requests)
            if isinstance(replayed, Unpreempted):
                if preempted or replayed.most_running < requests:
                    break
            else:
                if tested(replayed):
                    return size, servers, replayed
                preempted = True
                if found[2] is None or replayed.hits[0] and not found[2].hits[0]:
                    found = (size, servers, replayed)
            blocks -= 1
    return found

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A conversation under eviction pressure: the hit never exceeds what every
KV cache group still holds, and the counters agree (vLLM #46453)."""

import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import Units, client, conversation, rules
from tests.models.hybrid_prefix_cache.harness.compare import Found, Turn
from tests.models.hybrid_prefix_cache.harness.reconcile import PREFIX_HITS
from tests.models.hybrid_prefix_cache.scheduler.play import send as replay_send
from tests.models.hybrid_prefix_cache.scheduler.servers import ReplayServer
from vllm.sampling_params import SamplingParams

# The pool holds this many requests' blocks; at most this many pressure
# requests follow.
EVICTION_POOL_REQUESTS = 2
EVICTION_PRESSURE_REQUESTS = 64


def eviction_filler(units: Units) -> int:
    return units.block + rules.FIRST_PROMPT_TAIL


def eviction_max_len(first_len: int, max_tokens: int) -> int:
    """The engine's model length: the workload's longest request. vLLM sizes no
    pool below one request of it (kv_cache_utils.py check_enough_kv_cache_memory)."""
    return first_len + rules.TURN_TOKENS + max_tokens


def eviction_args(max_model_len: int, kv_cache_bytes: int) -> tuple[str, ...]:
    """The servers' model length and pool (the CPU worker sizes it from these bytes)."""
    length, pool = str(max_model_len), str(kv_cache_bytes)
    return "--max-model-len", length, "--kv-cache-memory-bytes", pool


def eviction_problems(hit: int, per_group: tuple[int, ...]) -> list[str]:
    """Why ``hit`` exceeds the least that every group still holds (each group's own
    longest hit, looked up just before the request)."""
    held = min(per_group)
    if hit <= held:
        return []
    return [
        f"hit {hit} > {held}, the least that every group still holds (each "
        f"group's own longest hit: {list(per_group)}): the hit over-reports"
    ]


@dataclass(frozen=True)
class Eviction:
    """Each group's own hit for the next turn before and after the pressure, and
    vLLM's hit then (under P/D the prefiller's; the decoder's own for its leg)."""

    prompt_len: int
    prev_len: int
    held_before: tuple
    held: tuple
    hit: int
    local_hit: int
    recompute_hit: int
    pressure: int
    decoder_hit: int | None = None


def play(run: harness.WorkloadRun) -> harness.CaseRecord:
    """The first prompt, the replay's pressure requests (:func:`plan` sized the
    pool), then the second turn: it must hit what vLLM's scheduler hit in the
    replay, never more than the least every group still held."""
    __tracebackhide__ = True
    case_id, binding = run.case_id, run.binding
    # Sized in the session: a sizing that fails leaves its record too.
    with run.session() as case:
        args, replayed = plan(run)
        served = harness.with_serve_args(run.deployment, args)
        with case.serve(replace(run, deployment=served)) as p:
            send = functools.partial(client.send_checked, p.servers, binding.model)
            if replayed.held == replayed.held_before:
                case.add(
                    problem=f"eviction: the replay's {replayed.pressure} pressure "
                    f"requests evicted nothing of the conversation (each group held "
                    f"{list(replayed.held)} before and after them)"
                )
            # The replay's lengths, the case's own tokens.
            rng, tokens = random.Random(case_id), binding.token_ids
            first_len = conversation.reference_conversation(p.units, case_id).first_len
            prompt = conversation.random_tokens(rng, tokens, first_len)
            salt = conversation.fresh_salt("eviction")
            first = Turn("first", 0, first_len, 0, 0, prompt=prompt, salt=salt)
            case.add(first)
            first.output, found = send(prompt, salt)
            first.take(Found(tuple(found)))
            output = first.output.token_ids
            grown = conversation.grown_prompt(rng, tokens, prompt, output)
            filler = eviction_filler(p.units)
            for index in range(replayed.pressure):
                other = conversation.random_tokens(rng, tokens, filler)
                turn = Turn("pressure", index, filler, 0, 0, prompt=other)
                turn.salt = conversation.fresh_salt("pressure")
                case.add(turn)
                turn.output, found = send(other, turn.salt)
                turn.take(Found(tuple(found)))
            planned = rules.PlannedTurn(1, len(grown), first_len)
            turn = conversation.planned_turn(p, "evicted", planned)
            turn.expected, turn.bound = replayed.hit, min(replayed.held)
            case.add(turn)
            conversation.play_turn(p, turn, grown, salt)
            assert turn.output is not None
            hits = {"vLLM's scheduler, replayed": replayed.hit}
            hits[turn.name] = turn.output.cached_tokens
            for who, hit in hits.items():
                problems = eviction_problems(hit, replayed.held)
                turn.take(Found(tuple(f"{who}: {why}" for why in problems)))
            # Under P/D the decoder's pool is under the same pressure.
            decoder, decoder_hit = "", replayed.decoder_hit
            if decoder_hit is not None:
                decoder = f" (the decoder's own cache {decoder_hit})"
                if turn.output.decoder_hit != decoder_hit:
                    missed = (
                        f"{turn.name}: the decoder's own cache hit "
                        f"{turn.output.decoder_hit} for its decode leg, vLLM's "
                        f"scheduler replayed on its engine hit {decoder_hit}"
                    )
                    turn.take(Found((missed,)))
            conversation.finish_turns(p, case.turns)
            case.add(
                notice=f"{replayed.pressure} pressure requests of {filler} tokens; "
                f"replayed in-process, each group held {list(replayed.held_before)} "
                f"of the next turn before them and {list(replayed.held)} after, and "
                f"vLLM's scheduler hit {replayed.hit}{decoder}"
            )
            if not case.ok:
                pool = " ".join(args)
                detail = f"a pool of {pool}, {replayed.pressure} pressure requests"
                case.add(problem=WORKLOAD.failure(detail))
    assert case.record is not None
    return case.record


def plan(run: harness.WorkloadRun) -> tuple[tuple[str, ...], Eviction]:
    """The servers' arguments and the case as vLLM's own scheduler played it first on
    the engines they build in-process, in a pool grown until vLLM admits it."""
    in_process, seed = run.needs_in_process(), run.case_id
    units, token_ids = in_process.units(run.mode), run.binding.token_ids
    first_len = conversation.reference_conversation(units, seed).first_len
    max_len = eviction_max_len(first_len, client.MAX_TOKENS)
    servers = functools.partial(in_process.replay_servers, run.deployment, run.mode)
    sizing, played = servers(("--max-model-len", str(max_len)))
    per_block = sizing.block_bytes
    used = blocks_in_use(played[0], [token_ids[0]] * (max_len - 1), "size")
    blocks, _, replayed = sized_eviction(
        lambda blocks: servers(eviction_args(max_len, blocks * per_block))[1],
        EVICTION_POOL_REQUESTS * used + 1,
        lambda played: play_eviction(played, units, seed, token_ids),
    )
    return eviction_args(max_len, blocks * per_block), replayed


def per_group_hits(server: ReplayServer, prompt: Sequence[int], salt: str) -> tuple:
    """Each KV cache group's own longest hit for ``prompt`` now
    (HybridKVCacheCoordinator.find_longest_cache_hit_per_group)."""
    probe = server.request("probe", prompt, salt, SamplingParams(max_tokens=1))
    coordinator = server.scheduler.kv_cache_manager.coordinator
    _, hits = coordinator.find_longest_cache_hit_per_group(
        probe.block_hashes, probe.num_tokens - 1
    )
    return tuple(hits)


def play_eviction(
    servers: Sequence[ReplayServer], units: Units, seed: str, token_ids: tuple[int, int]
) -> Eviction:
    """A first turn, short cold prompts under other salts until an eviction reaches
    its blocks, then the second turn and its recompute, each group's own hit
    looked up just before it. No cache is reset: eviction is the workload."""
    rng, salt = random.Random(seed), f"eviction-{seed}"
    first_len = conversation.reference_conversation(units, seed).first_len
    prompt = conversation.random_tokens(rng, token_ids, first_len)
    output, _, _ = replay_send(servers, prompt, salt)
    grown = conversation.grown_prompt(rng, token_ids, prompt, output.token_ids)
    for server in servers:
        server.drain()
    held_before = per_group_hits(servers[0], grown, salt)
    # Until the first eviction reaches the conversation's blocks, in rounds
    # of one request per engine (round-robin under DP).
    dp, filler = len(servers[0].loops), eviction_filler(units)
    pressure = 0
    while pressure < EVICTION_PRESSURE_REQUESTS:
        for rank in range(dp):
            other = conversation.random_tokens(rng, token_ids, filler)
            replay_send(servers, other, f"pressure-{seed}-{pressure}-{rank}")
        pressure += 1
        for server in servers:
            server.drain()
        if per_group_hits(servers[0], grown, salt) != held_before:
            break
    # The conversation's next request is the first engine's again.
    for rank in range(1, dp):
        other = conversation.random_tokens(rng, token_ids, filler)
        replay_send(servers, other, f"pad-{rank}")
    held = per_group_hits(servers[0], grown, salt)
    local_before = servers[0].moved[PREFIX_HITS] or 0
    _, hit, decoder_hit = replay_send(servers, grown, salt)
    local_hit = int((servers[0].moved[PREFIX_HITS] or 0) - local_before)
    recompute = servers[-1].complete(grown, f"recompute-{seed}").cached_tokens
    assert recompute is not None
    for server in servers:
        server.drain()
    return Eviction(
        len(grown),
        first_len,
        held_before,
        held,
        hit,
        local_hit,
        recompute_hit=recompute,
        pressure=pressure,
        decoder_hit=decoder_hit,
    )


def sized_eviction(
    build: Callable[[int], Sequence[ReplayServer]],
    blocks: int,
    play: Callable[[Sequence[ReplayServer]], Eviction],
) -> tuple[int, Sequence[ReplayServer], Eviction]:
    """:func:`play_eviction` on a pool of ``blocks`` blocks, or of the fewest above
    it that vLLM accepts (check_enough_kv_cache_memory) and that admits the
    requests, growing by a quarter."""
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
    """The most blocks ``prompt`` held at once on the first engine, from admission
    to its last token."""
    pool = server.scheduler.kv_cache_manager.block_pool
    free = least = pool.get_num_free_blocks()
    completion = server.submit(prompt, salt, client.MAX_TOKENS)
    while not completion.finished:
        assert server.step(), "the sizing request stalled"
        least = min(least, pool.get_num_free_blocks())
    server.drain()
    return free - least


WORKLOAD = harness.Workload(
    "eviction",
    "under eviction, the hit never exceeds what every group still "
    "holds, and the counters agree",
    "v1/core/kv_cache_coordinator.py HybridKVCacheCoordinator."
    "find_longest_cache_hit_per_group, v1/core/kv_cache_manager.py "
    "KVCacheManager.get_computed_blocks_for_connector",
    play=play,
    own_servers=True,
)

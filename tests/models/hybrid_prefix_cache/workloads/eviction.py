# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A conversation under eviction pressure: the hit never exceeds what every
KV cache group still holds, and the counters agree (vLLM #46453)."""

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness.client import MAX_TOKENS, send_checked
from tests.models.hybrid_prefix_cache.harness.compare import Found, Turn
from tests.models.hybrid_prefix_cache.harness.conversation import (
    finish_turns,
    fresh_salt,
    grown_prompt,
    planned_turn,
    play_turn,
    random_tokens,
    reference_conversation,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Mode,
    Units,
    with_serve_args,
)
from tests.models.hybrid_prefix_cache.harness.reconcile import PREFIX_HITS
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import (
    FIRST_PROMPT_TAIL,
    TURN_TOKENS,
    PlannedTurn,
)
from tests.models.hybrid_prefix_cache.harness.workload import (
    InProcess,
    Workload,
    WorkloadRun,
)
from tests.models.hybrid_prefix_cache.scheduler.play import send as replay_send
from tests.models.hybrid_prefix_cache.scheduler.servers import ReplayServer
from vllm.sampling_params import SamplingParams

# The pool holds this many requests' blocks; at most this many pressure
# requests follow.
EVICTION_POOL_REQUESTS = 2
EVICTION_PRESSURE_REQUESTS = 64


def eviction_filler(units: Units) -> int:
    """A pressure request's length: a block and the reference tail."""
    return units.block + FIRST_PROMPT_TAIL


def eviction_max_len(first_len: int, max_tokens: int) -> int:
    """The engine's model length: the workload's longest request. vLLM sizes no
    pool below one request of it (kv_cache_utils.py check_enough_kv_cache_memory)."""
    return first_len + TURN_TOKENS + max_tokens


@dataclass(frozen=True)
class EvictionPlan:
    """A real server's eviction case as the replay played it on its engine: the
    arguments that size its pool, the pressure requests sent, each group's own
    hit for the next turn before and after them, and vLLM's hit then (under
    P/D the prefiller's, and the decoder's own for the decode leg)."""

    args: tuple[str, ...]
    pressure: int
    held_before: tuple[int, ...]
    held: tuple[int, ...]
    hit: int
    decoder_hit: int | None = None


def eviction_args(max_model_len: int, kv_cache_bytes: int) -> tuple[str, ...]:
    """The servers' model length and pool (the CPU worker sizes it from these bytes)."""
    return (
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
    )


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


def play(run: WorkloadRun) -> CaseRecord:
    """A conversation under eviction pressure on servers whose pool the
    replay sized (:func:`plan`): its first prompt, the replay's pressure
    requests, then its second turn, played as any turn. That turn must hit
    what vLLM's scheduler hit in the replay, never more than the least every
    group still held, and match its control bit for bit. Fails where the
    replay's pressure never reached the conversation."""
    __tracebackhide__ = True
    case_id, binding, mode = run.case_id, run.binding, run.mode
    # Sized in the session: a sizing that fails leaves its record too.
    with run.session() as case:
        plan_ = plan(run.needs_in_process(), binding, run.deployment, mode, case_id)
        served = with_serve_args(run.deployment, plan_.args)
        with case.serve(binding, served, mode, run.suite.pool) as play:
            if plan_.held == plan_.held_before:
                case.add(
                    problem=f"eviction: the replay's {plan_.pressure} pressure "
                    f"requests evicted nothing of the conversation (each group held "
                    f"{list(plan_.held)} before and after them)"
                )
            # The replay's lengths, the case's own tokens.
            rng, tokens = random.Random(case_id), binding.token_ids
            first_len = reference_conversation(play.units, case_id).first_len
            prompt = random_tokens(rng, tokens, first_len)
            salt = fresh_salt("eviction")
            first = Turn("first", 0, first_len, 0, 0, prompt=prompt, salt=salt)
            case.add(first)
            first.output, found = send_checked(
                play.servers, binding.model, prompt, salt
            )
            first.take(Found(tuple(found)))
            grown = grown_prompt(rng, tokens, prompt, first.output.token_ids)
            filler = eviction_filler(play.units)
            for index in range(plan_.pressure):
                other = random_tokens(rng, tokens, filler)
                pressure = Turn("pressure", index, filler, 0, 0, prompt=other)
                pressure.salt = fresh_salt("pressure")
                case.add(pressure)
                pressure.output, found = send_checked(
                    play.servers, binding.model, other, pressure.salt
                )
                pressure.take(Found(tuple(found)))
            turn = planned_turn(play, "evicted", PlannedTurn(1, len(grown), first_len))
            turn.expected, turn.bound = plan_.hit, min(plan_.held)
            case.add(turn)
            play_turn(play, turn, grown, salt)
            assert turn.output is not None
            hits = {
                "vLLM's scheduler, replayed": plan_.hit,
                turn.name: turn.output.cached_tokens,
            }
            for who, hit in hits.items():
                problems = eviction_problems(hit, plan_.held)
                turn.take(Found(tuple(f"{who}: {why}" for why in problems)))
            # Under P/D the decoder's pool is under the same pressure.
            if (
                plan_.decoder_hit is not None
                and turn.output.decoder_hit != plan_.decoder_hit
            ):
                missed = (
                    f"{turn.name}: the decoder's own cache hit "
                    f"{turn.output.decoder_hit} for its decode leg, vLLM's scheduler "
                    f"replayed on its engine hit {plan_.decoder_hit}"
                )
                turn.take(Found((missed,)))
            finish_turns(play, case.turns)
            decoder = (
                ""
                if plan_.decoder_hit is None
                else f" (the decoder's own cache {plan_.decoder_hit})"
            )
            case.add(
                notice=f"{plan_.pressure} pressure requests of {filler} tokens; "
                f"replayed in-process, each group held {list(plan_.held_before)} "
                f"of the next turn before them and {list(plan_.held)} after, and "
                f"vLLM's scheduler hit {plan_.hit}{decoder}"
            )
            if not case.ok:
                case.add(
                    problem=WORKLOAD.failure(
                        f"a pool of {' '.join(plan_.args)}, {plan_.pressure} "
                        f"pressure requests"
                    )
                )
    assert case.record is not None
    return case.record


def plan(
    in_process: InProcess,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    seed: str,
) -> EvictionPlan:
    """The eviction case replayed first through vLLM's own scheduler on the
    engines its servers' exact arguments build in-process: the model's length
    cut to the workload's longest request, a pool of EVICTION_POOL_REQUESTS
    times the most blocks one request held on the caching instance, grown
    until vLLM admits the requests (:func:`sized_eviction`), and the
    conversation played under pressure (:func:`play_eviction`)."""
    units = in_process.units(mode)
    max_len = eviction_max_len(
        reference_conversation(units, seed).first_len, MAX_TOKENS
    )

    def servers(args: tuple[str, ...]):
        return in_process.replay_servers(deployment, mode, args)

    sizing, played = servers(("--max-model-len", str(max_len)))
    per_block = sizing.block_bytes
    request = [binding.token_ids[0]] * (max_len - 1)
    used = blocks_in_use(played[0], request, "size")
    blocks, _, replayed = sized_eviction(
        lambda blocks: servers(eviction_args(max_len, blocks * per_block))[1],
        EVICTION_POOL_REQUESTS * used + 1,
        lambda played: play_eviction(played, units, seed, binding.token_ids),
    )
    return EvictionPlan(
        args=eviction_args(max_len, blocks * per_block),
        pressure=replayed.pressure,
        held_before=replayed.held_before,
        held=replayed.held,
        hit=replayed.hit,
        decoder_hit=replayed.decoder_hit,
    )


def per_group_hits(server: ReplayServer, prompt: Sequence[int], salt: str) -> tuple:
    """Each KV cache group's own longest hit for ``prompt`` now
    (HybridKVCacheCoordinator.find_longest_cache_hit_per_group)."""
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
    held_before: tuple
    held: tuple
    hit: int
    local_hit: int
    recompute_hit: int
    pressure: int
    decoder_hit: int | None = None


def play_eviction(
    servers: Sequence[ReplayServer],
    units: Units,
    seed: str,
    token_ids: tuple[int, int],
) -> Eviction:
    """A first turn, short cold prompts under other salts until an eviction reaches
    its blocks, then the second turn and its recompute, each group's own hit
    looked up just before it. No cache is reset: eviction is the workload."""
    rng = random.Random(seed)
    first_len = reference_conversation(units, seed).first_len
    salt = f"eviction-{seed}"
    prompt = random_tokens(rng, token_ids, first_len)
    output, _, _ = replay_send(servers, prompt, salt)
    grown = grown_prompt(rng, token_ids, prompt, output.token_ids)
    for server in servers:
        server.drain()
    held_before = per_group_hits(servers[0], grown, salt)
    # Until the first eviction reaches the conversation's blocks, in rounds
    # of one request per engine (round-robin under DP).
    dp = len(servers[0].loops)
    filler = eviction_filler(units)
    pressure = 0
    while pressure < EVICTION_PRESSURE_REQUESTS:
        for rank in range(dp):
            other = random_tokens(rng, token_ids, filler)
            replay_send(servers, other, f"pressure-{seed}-{pressure}-{rank}")
        pressure += 1
        for server in servers:
            server.drain()
        if per_group_hits(servers[0], grown, salt) != held_before:
            break
    # The conversation's next request is the first engine's again.
    for rank in range(1, dp):
        replay_send(servers, random_tokens(rng, token_ids, filler), f"pad-{rank}")
    held = per_group_hits(servers[0], grown, salt)
    local_before = servers[0].moved[PREFIX_HITS] or 0
    _, hit, decoder_hit = replay_send(servers, grown, salt)
    local_hit = int((servers[0].moved[PREFIX_HITS] or 0) - local_before)
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
    completion = server.submit(prompt, salt, MAX_TOKENS)
    while not completion.finished:
        assert server.step(), "the sizing request stalled"
        least = min(least, pool.get_num_free_blocks())
    server.drain()
    return free - least


WORKLOAD = Workload(
    "eviction",
    "under eviction, the hit never exceeds what every group still "
    "holds, and the counters agree",
    "v1/core/kv_cache_coordinator.py HybridKVCacheCoordinator."
    "find_longest_cache_hit_per_group, v1/core/kv_cache_manager.py "
    "KVCacheManager.get_computed_blocks_for_connector",
    play=play,
    own_servers=True,
)

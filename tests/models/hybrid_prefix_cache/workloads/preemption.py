# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Preemption: requests decode in a pool too small for all, so vLLM
preempts one and later resumes it, replaying its prompt and output as a
prefill. Its chunks must end on block boundaries, where the worker writes
the states their hashes name (vLLM #33706 split only new requests), so a
request that shares its prompt and output hits the rule's checkpoint and
matches its recompute."""

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness.cases import serve_case
from tests.models.hybrid_prefix_cache.harness.client import (
    MAX_TOKENS,
    complete,
    read_metrics,
)
from tests.models.hybrid_prefix_cache.harness.compare import Sample, Turn
from tests.models.hybrid_prefix_cache.harness.conversation import (
    finish_turns,
    fresh_salt,
    planned_turn,
    play_turn,
    random_tokens,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Mode,
    Units,
    with_serve_args,
)
from tests.models.hybrid_prefix_cache.harness.records import (
    CaseRecord,
    reported_case,
)
from tests.models.hybrid_prefix_cache.harness.rules import (
    FIRST_PROMPT_TAIL,
    PlannedTurn,
    hit_bound,
    prompt_end_checkpoint,
)
from tests.models.hybrid_prefix_cache.harness.workload import (
    InProcess,
    Workload,
    WorkloadRun,
)
from tests.models.hybrid_prefix_cache.scheduler.cell import ReplayCell, Setting
from tests.models.hybrid_prefix_cache.scheduler.judge import controls
from tests.models.hybrid_prefix_cache.scheduler.servers import (
    EngineLoop,
    ReplayServer,
)

# The prompts end this many tokens short of an attention block, so that each
# request needs a block more after as many decode steps.
SHORT_OF_BLOCK = 8
# Pools tried, up to this many times the smallest vLLM accepts, and the most
# requests sent at once to each.
MAX_POOL_GROWTH = 4
MAX_REQUESTS = 8
# How vLLM refuses a pool too small (v1/core/kv_cache_utils.py).
POOL_REFUSALS = ("To serve at least one request", "No available memory for the cache")
# Prometheus name of vLLM's preemption counter (v1/metrics/loggers.py).
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass(frozen=True)
class Shape:
    """Each request's prompt (three attention blocks, each ``dcp`` scheduler
    blocks under DCP, less SHORT_OF_BLOCK) and output (three times that), a
    budget of a block and a half (a replayed prefill takes several chunks),
    and the model's length: a follow-up and its output."""

    units: Units
    dcp: int = 1

    @property
    def prompt_len(self) -> int:
        return 3 * self.units.block * self.dcp - SHORT_OF_BLOCK

    @property
    def max_tokens(self) -> int:
        return 3 * SHORT_OF_BLOCK

    @property
    def budget(self) -> int:
        return self.units.block + self.units.block // 2

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.max_tokens + FIRST_PROMPT_TAIL + MAX_TOKENS

    def args(self, kv_cache_bytes: int | None = None) -> tuple[str, ...]:
        pool = (
            ("--kv-cache-memory-bytes", str(kv_cache_bytes)) if kv_cache_bytes else ()
        )
        budget, length = str(self.budget), str(self.max_len)
        return ("--max-num-batched-tokens", budget, "--max-model-len", length, *pool)


def shape_of(units: Units, deployment: Deployment) -> Shape:
    return Shape(units, max(deployment.instances[0].dcp, 1))


def chunk_problems(
    chunks: Sequence[tuple[int, int]], prefill_end: int, block: int, checkpoint: int
) -> list[str]:
    """A resumed request's prefill chunks (start, end) that end short of its
    prefill's end off a block boundary, where no state is filed: only the
    prompt's own checkpoint may end one there (_mamba_block_aligned_split)."""
    return [
        f"a chunk of the resumed prefill ended at {end}, inside block "
        f"{end // block} ({block} tokens), short of the prefill's end {prefill_end}"
        for start, end in chunks
        if end < prefill_end and end % block and end != checkpoint
    ]


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


def _observe(loop: EngineLoop, log: list) -> Callable[[], None]:
    """Record each step's preemptions and chunks; returns the undo."""
    scheduler = loop.scheduler
    schedule = scheduler.schedule

    def observed(*a, **kw):
        output = schedule(*a, **kw)
        for request_id in output.preempted_req_ids or ():
            request = scheduler.requests[request_id]
            log.append(("preempted", request_id, request.num_output_tokens, 0))
        for request_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            end = request.num_computed_tokens
            log.append(("chunk", request_id, end - count, end, request.num_tokens))
        return output

    scheduler.schedule = observed
    return lambda: setattr(scheduler, "schedule", schedule)


def play_preemption(
    servers: Sequence[ReplayServer], shape: Shape, requests: int, seed: str, token_ids
) -> Preemption | None:
    """``requests`` requests at once on the first engine (pads between them
    under DP), then the follow-ups of the last one preempted while decoding
    and of the first, with recomputes; None where no decoding request was
    preempted."""
    server, rng = servers[0], random.Random(seed)
    prompt_len, max_tokens = shape.prompt_len, shape.max_tokens
    loop, log = server.loops[0], []
    undo = _observe(loop, log)
    sent, pads = [], []
    for index in range(requests):
        prompt = random_tokens(rng, token_ids, prompt_len)
        sent.append(server.submit(prompt, f"{seed}-{index}", max_tokens))
        pads += [
            server.submit(random_tokens(rng, token_ids, 8), f"pad-{index}-{rank}", 1)
            for rank in range(1, len(server.loops))
        ]
    for completion in sent:
        server.finish(completion)
    server.drain()
    undo()
    for completion in (*sent, *pads):
        server.settle(completion, None)
    resumed = [e for e in log if e[0] == "preempted" and e[2] > 0]
    if not resumed:
        return None
    request_id = resumed[-1][1]
    after = log[log.index(resumed[-1]) :]
    chunks = [(e[2], e[3]) for e in after if e[:2] == ("chunk", request_id)]
    prefill_end = next(e[4] for e in after if e[:2] == ("chunk", request_id)) - 1
    chunks = [(s, e) for s, e in chunks if s < prefill_end]
    index = next(i for i, c in enumerate(sent) if c.request_id == request_id)
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
    play: Callable[[Sequence[ReplayServer], int], Preemption | None],
) -> tuple[int, Sequence[ReplayServer], Preemption | None]:
    """The smallest pool vLLM accepts (check_enough_kv_cache_memory), and the
    fewest requests at once, where a decoding request is preempted, resumed
    in more than one chunk, and its follow-up hits; else the last that
    preempted one at all."""
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
            if replayed is None:
                continue
            found = (size, servers, replayed)
            if len(replayed.chunks) > 1 and replayed.hits[0]:
                return found
    return found


def _rule(shape: Shape, mode: Mode, deployment: Deployment) -> int:
    """The bound of a follow-up: what its request computed (a replayed
    prefill files states past its prompt)."""
    stored = shape.prompt_len + shape.max_tokens - 1
    length = stored + 1 + FIRST_PROMPT_TAIL
    return hit_bound(stored - deployment.cache_backoff, length, shape.units.hit)


def problems_of(
    result: Preemption | None, shape: Shape, mode: Mode, deployment: Deployment
) -> list[str]:
    if result is None:
        return ["no pool tried preempted a decoding request: nothing tested"]
    units = shape.units
    checkpoint = prompt_end_checkpoint(shape.prompt_len, units.hit, mode.drops_unit)
    found = chunk_problems(result.chunks, result.prefill_end, result.block, checkpoint)
    bound = _rule(shape, mode, deployment)
    for who, hit in zip(("the resumed request's", "the other's"), result.hits):
        if hit > bound or hit % units.hit:
            found.append(f"{who} follow-up cached {hit}, beyond the bound {bound}")
    return found


def replay(cell: ReplayCell) -> None:
    """The pool from one request's peak up to the first where a decoding
    request is preempted; its resumed prefill's chunks, and the follow-ups
    of both requests, held to the rule."""
    for kda, alignment in cell.kda_checkpoints.items():
        engines = cell.engines(kda=alignment)
        units, _ = cell.servers_of(engines)
        shape = shape_of(units, cell.deployment)

        def build(blocks: int, alignment=alignment, shape=shape):
            setting = Setting(shape.budget, blocks, None, shape.max_len)
            return cell.servers_of(cell.engines(setting, alignment))[1]

        def replayed(servers, requests: int, shape=shape):
            seed, tokens = cell.cell_id, cell.token_ids
            return play_preemption(servers, shape, requests, seed, tokens)

        _, servers, result = sized_preemption(build, replayed)
        problems = problems_of(result, shape, cell.mode, cell.deployment)
        if result is not None:
            problems += controls(max(result.recompute_hits), servers)
        cell.fail(WORKLOAD, problems, f"{kda} {result}")


@dataclass(frozen=True)
class PreemptionPlan:
    shape: Shape
    args: tuple[str, ...]
    replayed: Preemption


def plan(
    in_process: InProcess,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    seed: str,
) -> PreemptionPlan:
    """The case replayed first on the engines its servers' exact arguments
    build in-process, sizing the pool (:func:`sized_preemption`)."""
    shape = shape_of(in_process.units(mode), deployment)
    sizing, _ = in_process.replay_servers(deployment, mode, shape.args())
    per_block = sizing.block_bytes

    def build(blocks: int):
        pool = shape.args(blocks * per_block)
        return in_process.replay_servers(deployment, mode, pool)[1]

    def replayed(servers, requests: int):
        return play_preemption(servers, shape, requests, seed, binding.token_ids)

    blocks, _, result = sized_preemption(build, replayed)
    assert result is not None, "the replay preempted no decoding request"
    return PreemptionPlan(shape, shape.args(blocks * per_block), result)


def play(run: WorkloadRun) -> CaseRecord:
    """The replay's requests at once (in its order) on servers whose pool it
    sized, then the follow-ups of the one it resumed and of another, played
    as turns: the hit the replay saw, and the recompute's output bit for
    bit. The server's preemption counter must have moved."""
    __tracebackhide__ = True
    binding, mode, deployment = run.binding, run.mode, run.deployment
    planned = plan(run.needs_in_process(), binding, deployment, mode, run.case_id)
    shape, replayed = planned.shape, planned.replayed
    served = with_serve_args(deployment, planned.args)
    with (
        reported_case(run.case_id, run.suite.records) as record,
        serve_case(record, binding, served, mode, run.suite.pool) as p,
    ):
        server, rng = p.servers[0], random.Random(run.case_id)
        before = _preemptions(server)
        salts = [fresh_salt("preempted") for _ in range(replayed.requests)]
        prompts = [
            random_tokens(rng, binding.token_ids, shape.prompt_len) for _ in salts
        ]
        samples: dict[int, Sample] = {}

        def send(index: int) -> None:
            samples[index] = complete(
                server,
                binding.model,
                prompts[index],
                salts[index],
                max_tokens=shape.max_tokens,
            )

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(salts))]
        for thread in threads:
            # In the replay's order: vLLM schedules first come, first served.
            thread.start()
            thread.join(timeout=0.05)
        for thread in threads:
            thread.join()
        moved = _preemptions(server) - before
        if moved < 1:
            record.problems.append(
                f"the server preempted nothing ({PREEMPTIONS} moved by {moved}), "
                f"where the replay preempted request {replayed.resumed} after "
                f"{replayed.preempted_at} outputs"
            )
        for index, sample in sorted(samples.items()):
            turn = Turn("request", index, shape.prompt_len, 0, 0, prompt=prompts[index])
            turn.salt, turn.output = salts[index], sample
            record.turns.append(turn)
        other = 0 if replayed.resumed else 1
        for index, hit in zip((replayed.resumed, other), replayed.hits):
            tail = random_tokens(rng, binding.token_ids, FIRST_PROMPT_TAIL)
            prompt = [*prompts[index], *samples[index].token_ids, *tail]
            # What this salt stored: the prompt and every computed output.
            stored = shape.prompt_len + shape.max_tokens - 1
            turn = planned_turn(p, "follow-up", PlannedTurn(index, len(prompt), stored))
            turn.expected = hit
            record.turns.append(turn)
            play_turn(p, turn, prompt, salts[index])
        finish_turns(p, record.turns)
        if not record.ok:
            record.problems.append(
                WORKLOAD.failure(
                    f"a pool of {' '.join(planned.args)}; the replay resumed request "
                    f"{replayed.resumed} of {replayed.requests}, preempted after "
                    f"{replayed.preempted_at} outputs, in chunks "
                    f"{list(replayed.chunks)}"
                )
            )
    return record


def _applies(deployment: Deployment, mode: Mode) -> bool:
    """Not under P/D (the decoder would replay a transfer), nor DCP or a
    drafter that reserves lookahead slots: there no pool the sizing tries
    preempts a decoding request (findings/preemption.md)."""
    rule = mode.drafting(deployment.instances[0])
    plain = deployment.prefill is None and deployment.instances[0].dcp <= 1
    return plain and not (rule.drops_unit or rule.lookahead)


def _preemptions(server) -> float:
    return sum(sample.value for sample in read_metrics(server).get(PREEMPTIONS, ()))


WORKLOAD = Workload(
    "preemption",
    "a request resumed after preemption files its states at block "
    "boundaries: a request that shares its prompt and output hits the "
    "rule's checkpoint and matches its recompute",
    "v1/core/sched/scheduler.py Scheduler._preempt_request and "
    "Scheduler._mamba_block_aligned_split (a resumed request's prefill "
    "replays its output tokens: request.num_tokens - 1)",
    play=play,
    replay=replay,
    applies=_applies,
    # Kimi-K3's 17k-token replays took minutes a cell, findings/preemption.md.
    tiers=("cpu",),
    own_servers=True,
)

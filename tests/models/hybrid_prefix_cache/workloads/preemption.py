# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Preemption: requests decode in a pool too small for all, so vLLM
preempts one and later resumes it, replaying its prompt and output as a
prefill. Its chunks must end on block boundaries, where the worker writes
the states their hashes name, so a request that shares its prompt and output
hits the rule's checkpoint and matches its recompute. Before vLLM #33706 the
split aligned the prompt's tokens only, which shows only where the budget
cuts the replay inside the output tokens: so the outputs run a block past
the prompt's, and the pool preempts the request after them. Request i is
sent at priority i under vLLM's priority policy, so which one is preempted
is the request's own property, not its arrival time (Scheduler.schedule
preempts the running request of the largest (priority, arrival_time))."""

import functools
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import (
    FIRST_PROMPT_TAIL,
    PlannedTurn,
)
from tests.models.hybrid_prefix_cache.harness.workload import (
    InProcess,
    Workload,
    WorkloadRun,
)
from tests.models.hybrid_prefix_cache.scheduler.preempt import (
    Preemption,
    play_preemption,
    sized_preemption,
)

# The prompts end this many decode steps short of an attention block, so that
# each request needs a block more after as many steps.
SHORT_OF_BLOCK = 8
# Prometheus name of vLLM's preemption counter (v1/metrics/loggers.py).
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass(frozen=True)
class Shape:
    """Each request's prompt (three attention blocks, each ``dcp`` scheduler
    blocks under DCP, less its slack) and output, a budget of a block and a
    half (a replayed prefill takes several chunks), and the model's length:
    a follow-up and its output. The slack is SHORT_OF_BLOCK steps of up to
    ``1 + spec`` tokens each, past the ``lookahead`` slots the scheduler
    allocates with every step (config/vllm.py
    VllmConfig.num_speculative_tokens, num_lookahead_tokens). ``restores``:
    a connector restores a preempted request's stored blocks (CPU offload).

    Where :attr:`cut`, the outputs run a block past the prompt's last, so the
    last request is preempted when it needs the block after them, and the
    budget cuts its replayed prefill inside them (``Preemption.output_cuts``)."""

    units: Units
    dcp: int = 1
    spec: int = 0
    lookahead: int = 0
    restores: bool = False

    @property
    def cut(self) -> bool:
        """Not where the resume restores every stored block: it replays no
        output before its last checkpoint. Nor with a drafter, whose slots
        run ahead: preempted that many tokens short of the block after the
        outputs, its last checkpoint is a block lower, and a pool that tight
        recycles its replayed checkpoints before its follow-up (measured:
        findings/preemption.md)."""
        return not (self.restores or self.spec or self.lookahead)

    @property
    def slack(self) -> int:
        return SHORT_OF_BLOCK * (1 + self.spec) + self.lookahead

    @property
    def prompt_len(self) -> int:
        return 3 * self.units.block * self.dcp - self.slack

    @property
    def max_tokens(self) -> int:
        """Three slacks; where cut, a block and two: request i decodes three
        steps (its prompt's chunks) after request i - 1, which then finishes
        while the last one's replay runs (a block a step), so that replay
        runs to its end at once. Preempted again mid-replay, it would replay
        from its own cached blocks and file their states anew."""
        return self.units.block * self.dcp * self.cut + (3 - self.cut) * self.slack

    @property
    def budget(self) -> int:
        return self.units.block + self.units.block // 2

    @property
    def lengths(self) -> tuple[int, int]:
        """Each request's prompt and output lengths."""
        return self.prompt_len, self.max_tokens

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.max_tokens + FIRST_PROMPT_TAIL + MAX_TOKENS

    def args(self, kv_cache_bytes: int | None = None) -> tuple[str, ...]:
        pool = (
            ("--kv-cache-memory-bytes", str(kv_cache_bytes)) if kv_cache_bytes else ()
        )
        budget, length = str(self.budget), str(self.max_len)
        return (
            *("--max-num-batched-tokens", budget, "--max-model-len", length),
            *("--scheduling-policy", "priority", *pool),
        )


def shape_of(units: Units, deployment: Deployment, config=None) -> Shape:
    """The shape for ``deployment``'s first instance, whose engine's
    ``config`` gives its drafter's tokens a step."""
    dcp, offload = max(deployment.instances[0].dcp, 1), deployment.offload
    if config is None:
        return Shape(units, dcp, restores=offload)
    spec, lookahead = config.num_speculative_tokens, config.num_lookahead_tokens
    return Shape(units, dcp, spec, lookahead, offload)


def tested(result: Preemption, shape: Shape) -> bool:
    """What the sizing looks for: a resume in more than one chunk (one where
    it restores every stored block) that leaves nothing untested."""
    return (len(result.chunks) > 1 or shape.restores) and not untested(result, shape)


def untested(result: Preemption | None, shape: Shape) -> str:
    """Why the sizing's result leaves nothing to test, or ""."""
    if result is None:
        return "no pool tried preempted a decoding request: nothing tested"
    # A resume that hits its own offloaded blocks may take one chunk: then
    # only its follow-up's hit is held.
    if not result.hits[0]:
        return "the resumed request's follow-up hit nothing: nothing tested"
    if shape.cut and not result.output_cuts(shape.prompt_len):
        return (
            f"no chunk of the resumed prefill ended inside its replayed outputs "
            f"({shape.prompt_len}, {result.last_checkpoint}) (chunk ends "
            f"{list(result.chunk_ends)}): nothing tested vLLM #33706's trigger"
        )
    return ""


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
    units = in_process.units(mode)
    args = shape_of(units, deployment).args()
    sizing, _ = in_process.replay_servers(deployment, mode, args)
    per_block = sizing.block_bytes
    shape = shape_of(units, deployment, sizing.vllm_config)

    def build(blocks: int | None):
        pool = shape.args(None if blocks is None else blocks * per_block)
        return in_process.replay_servers(deployment, mode, pool)[1]

    def replayed(servers, requests: int):
        tokens = binding.token_ids
        return play_preemption(servers, *shape.lengths, requests, seed, tokens)

    wanted = functools.partial(tested, shape=shape)
    blocks, _, result = sized_preemption(build, replayed, wanted)
    # Only what leaves nothing to test stops the case: the real servers show
    # what a misplaced chunk does to the state.
    missing = untested(result, shape)
    assert result is not None and not missing, WORKLOAD.failure(missing)
    return PreemptionPlan(shape, shape.args(blocks * per_block), result)


def _at_once(server, binding: Binding, shape: Shape, prompts, salts) -> list[Sample]:
    """The requests sent at once, request i at priority i, each decoding all
    its tokens as the replay's do."""

    def send(index: int) -> Sample:
        return complete(
            server,
            binding.model,
            prompts[index],
            salts[index],
            max_tokens=shape.max_tokens,
            ignore_eos=True,
            priority=index,
        )

    with ThreadPoolExecutor(len(salts)) as pool:
        return list(pool.map(send, range(len(salts))))


def play(run: WorkloadRun) -> CaseRecord:
    """The replay's requests at once on servers whose pool it sized, then the
    follow-ups of the one it resumed and of another, played as turns: the hit
    the replay saw, and the recompute's output bit for bit. The server's
    preemption counter must have moved."""
    __tracebackhide__ = True
    binding, mode, deployment = run.binding, run.mode, run.deployment
    with run.session() as case:
        planned = plan(run.needs_in_process(), binding, deployment, mode, run.case_id)
        shape, replayed = planned.shape, planned.replayed
        served = with_serve_args(deployment, planned.args)
        # Where the replay cut the resumed prefill: the real servers' own
        # chunks are not observable, only what they did to the state.
        case.add(notice=f"{WORKLOAD.name}: {_described(planned)}")
        with case.serve(binding, served, mode, run.suite.pool) as p:
            server, rng = p.servers[0], random.Random(run.case_id)
            salts = [fresh_salt("preempted") for _ in range(replayed.requests)]
            prompts = [
                random_tokens(rng, binding.token_ids, shape.prompt_len) for _ in salts
            ]
            before = _preemptions(server)
            samples = _at_once(server, binding, shape, prompts, salts)
            moved = _preemptions(server) - before
            if moved < 1:
                case.add(
                    problem=f"the server preempted nothing ({PREEMPTIONS} moved "
                    f"by {moved}), where the replay preempted request "
                    f"{replayed.resumed} after {replayed.preempted_at} outputs"
                )
            for index, sample in enumerate(samples):
                turn = Turn(
                    "request", index, shape.prompt_len, 0, 0, prompt=prompts[index]
                )
                turn.salt, turn.output = salts[index], sample
                case.add(turn)
            other = 0 if replayed.resumed else 1
            # What each salt stored: the prompt and every computed output.
            stored = shape.prompt_len + shape.max_tokens - 1
            for index, hit in zip((replayed.resumed, other), replayed.hits):
                tail = random_tokens(rng, binding.token_ids, FIRST_PROMPT_TAIL)
                prompt = [*prompts[index], *samples[index].token_ids, *tail]
                planned_ = PlannedTurn(index, len(prompt), stored)
                turn = planned_turn(p, "follow-up", planned_)
                turn.expected = hit
                case.add(turn)
                play_turn(p, turn, prompt, salts[index])
            finish_turns(p, case.turns)
            if not case.ok:
                case.add(problem=WORKLOAD.failure(_described(planned)))
    assert case.record is not None
    return case.record


def _described(planned: PreemptionPlan) -> str:
    replayed, prompt_len = planned.replayed, planned.shape.prompt_len
    return (
        f"a pool of {' '.join(planned.args)}; the replay resumed request "
        f"{replayed.resumed} of {replayed.requests}, preempted after "
        f"{replayed.preempted_at} outputs, in chunks {list(replayed.chunks)}; "
        f"ends inside its outputs ({prompt_len}, {replayed.last_checkpoint}): "
        f"{list(replayed.output_cuts(prompt_len)) or 'none'}"
    )


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
    own_servers=True,
)

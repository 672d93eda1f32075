# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A request vLLM preempts resumes by replaying its prompt and output as a prefill,
whose chunks must end on block boundaries (vLLM #33706: the split aligned the
prompt's tokens only), so that its follow-up hits the rule's checkpoint."""

import functools
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import Units, client, conversation, rules
from tests.models.hybrid_prefix_cache.harness.compare import Turn
from tests.models.hybrid_prefix_cache.scheduler import preempt

# The prompts end this many decode steps short of an attention block, so that
# each request needs a block more after as many steps.
SHORT_OF_BLOCK = 8
# Prometheus name of vLLM's preemption counter (v1/metrics/loggers.py).
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass(frozen=True)
class Shape:
    """Prompts of three attention blocks (``dcp`` scheduler blocks each) less a slack of
    SHORT_OF_BLOCK steps of ``1 + spec`` tokens past the ``lookahead`` slots the
    scheduler allocates a step (config/vllm.py VllmConfig.num_speculative_tokens,
    num_lookahead_tokens); a budget of a block and a half, so a replayed prefill takes
    several chunks. ``restores``: a connector restores a preempted request's stored
    blocks (CPU offload). Where :attr:`cut`, the outputs run a block past the prompt's,
    the pool preempts the last request at the block after them, and the budget cuts its
    replay inside them (``Preemption.output_cuts``): #33706's trigger."""

    units: Units
    dcp: int = 1
    spec: int = 0
    lookahead: int = 0
    restores: bool = False

    @property
    def cut(self) -> bool:
        """Not where the resume restores every stored block (it replays no output
        before its last checkpoint), nor with a drafter, whose slots run ahead: its
        last checkpoint is a block lower, and a pool that tight recycles its
        replayed checkpoints before its follow-up (findings/preemption.md)."""
        return not (self.restores or self.spec or self.lookahead)

    @property
    def slack(self) -> int:
        return SHORT_OF_BLOCK * (1 + self.spec) + self.lookahead

    @property
    def prompt_len(self) -> int:
        return 3 * self.units.block * self.dcp - self.slack

    @property
    def max_tokens(self) -> int:
        """Three slacks (request i decodes three steps, its prompt's chunks, after
        request i - 1); where cut, a block and two: request i - 1 then finishes
        while the last one's replay runs (a block a step), so that replay runs to
        its end at once, not preempted again to file its cached blocks anew."""
        return self.units.block * self.dcp * self.cut + (3 - self.cut) * self.slack

    @property
    def budget(self) -> int:
        return self.units.block + self.units.block // 2

    @property
    def lengths(self) -> tuple[int, int]:
        return self.prompt_len, self.max_tokens

    @property
    def max_len(self) -> int:
        return sum(self.lengths) + rules.FIRST_PROMPT_TAIL + client.MAX_TOKENS

    def args(self, kv_cache_bytes: int | None = None) -> tuple[str, ...]:
        budget, length = str(self.budget), str(self.max_len)
        args = ("--max-num-batched-tokens", budget, "--max-model-len", length)
        args += ("--scheduling-policy", "priority")
        if kv_cache_bytes:
            args += ("--kv-cache-memory-bytes", str(kv_cache_bytes))
        return args


def shape_of(units: Units, deployment: harness.Deployment, config=None) -> Shape:
    """For the first instance, whose engine's ``config`` gives its drafter's tokens."""
    dcp, offload = max(deployment.instances[0].dcp, 1), deployment.offload
    if config is None:
        return Shape(units, dcp, restores=offload)
    spec, lookahead = config.num_speculative_tokens, config.num_lookahead_tokens
    return Shape(units, dcp, spec, lookahead, offload)


def tested(result: preempt.Preemption, shape: Shape) -> bool:
    return (len(result.chunks) > 1 or shape.restores) and not untested(result, shape)


def untested(result: preempt.Preemption | None, shape: Shape) -> str:
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


def plan(run: harness.WorkloadRun) -> tuple[Shape, tuple[str, ...], preempt.Preemption]:
    """The servers' shape and arguments, from the case replayed first on the engines
    they build in-process, sizing the pool (:func:`preempt.sized_preemption`)."""
    in_process, deployment = run.needs_in_process(), run.deployment
    replay = functools.partial(in_process.replay_servers, deployment, run.mode)
    units = in_process.units(run.mode)
    sizing, _ = replay(shape_of(units, deployment).args())
    per_block = sizing.block_bytes
    shape = shape_of(units, deployment, sizing.vllm_config)

    def build(blocks: int | None):
        return replay(shape.args(None if blocks is None else blocks * per_block))[1]

    def replayed(servers, requests: int):
        played = (*shape.lengths, requests, run.case_id, run.binding.token_ids)
        return preempt.play_preemption(servers, *played)

    wanted = functools.partial(tested, shape=shape)
    blocks, _, result = preempt.sized_preemption(build, replayed, wanted)
    # Only what leaves nothing to test stops the case: the real servers show
    # what a misplaced chunk does to the state.
    missing = untested(result, shape)
    assert result is not None and not missing, WORKLOAD.failure(missing)
    return shape, shape.args(blocks * per_block), result


def play(run: harness.WorkloadRun) -> harness.CaseRecord:
    """The replay's requests at once on servers whose pool it sized, then the
    follow-ups of the one it resumed and of another, played as turns."""
    __tracebackhide__ = True
    binding = run.binding
    with run.session() as case:
        shape, args, replayed = plan(run)
        served = harness.with_serve_args(run.deployment, args)
        # Where the replay cut the resumed prefill: the real servers' own
        # chunks are not observable, only what they did to the state.
        cuts = list(replayed.output_cuts(shape.prompt_len)) or "none"
        described = (
            f"a pool of {' '.join(args)}; the replay resumed request "
            f"{replayed.resumed} of {replayed.requests}, preempted after "
            f"{replayed.preempted_at} outputs, in chunks {list(replayed.chunks)}; "
            f"ends inside its outputs ({shape.prompt_len}, "
            f"{replayed.last_checkpoint}): {cuts}"
        )
        case.add(notice=f"{WORKLOAD.name}: {described}")
        with case.serve(replace(run, deployment=served)) as p:
            server, rng = p.servers[0], random.Random(run.case_id)
            tokens, requests = binding.token_ids, range(replayed.requests)
            salts = [conversation.fresh_salt("preempted") for _ in requests]
            prompts = [
                conversation.random_tokens(rng, tokens, shape.prompt_len) for _ in salts
            ]
            # Request i at priority i: which one is preempted is its own property,
            # not its arrival time (Scheduler.schedule preempts the running request
            # of the largest (priority, arrival_time)). Each decodes all its tokens.
            send = functools.partial(
                client.complete, server, binding.model, max_tokens=shape.max_tokens
            )
            before = _preemptions(server)
            with ThreadPoolExecutor(len(salts)) as pool:
                futures = [
                    pool.submit(send, prompt, salt, ignore_eos=True, priority=index)
                    for index, (prompt, salt) in enumerate(zip(prompts, salts))
                ]
            samples = [future.result() for future in futures]
            moved = _preemptions(server) - before
            if moved < 1:
                case.add(
                    problem=f"the server preempted nothing ({PREEMPTIONS} moved "
                    f"by {moved}), where the replay preempted request "
                    f"{replayed.resumed} after {replayed.preempted_at} outputs"
                )
            for index, sample in enumerate(samples):
                turn = Turn("request", index, shape.prompt_len, 0, 0, output=sample)
                turn.prompt, turn.salt = prompts[index], salts[index]
                case.add(turn)
            other = 0 if replayed.resumed else 1
            # What each salt stored: the prompt and every computed output.
            stored = shape.prompt_len + shape.max_tokens - 1
            for index, hit in zip((replayed.resumed, other), replayed.hits):
                tail = conversation.random_tokens(rng, tokens, rules.FIRST_PROMPT_TAIL)
                prompt = [*prompts[index], *samples[index].token_ids, *tail]
                planned = rules.PlannedTurn(index, len(prompt), stored)
                turn = conversation.planned_turn(p, "follow-up", planned)
                turn.expected = hit
                case.add(turn)
                conversation.play_turn(p, turn, prompt, salts[index])
            conversation.finish_turns(p, case.turns)
            if not case.ok:
                case.add(problem=WORKLOAD.failure(described))
    assert case.record is not None
    return case.record


def _preemptions(server) -> float:
    return sum(s.value for s in client.read_metrics(server).get(PREEMPTIONS, ()))


WORKLOAD = harness.Workload(
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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workloads that vLLM's real hybrid prefix-cache bugs needed, beside
the growing conversation: each one's stable id, the property it holds, the
vLLM code its expectation is read from, and the pure arithmetic of that
expectation. Pure: no server, no clock, no vLLM import."""

from collections.abc import Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache.harness.compare import (
    PathNoise,
    Turn,
    compare,
    pairs_noise,
)
from tests.models.hybrid_prefix_cache.harness.deployment import Units
from tests.models.hybrid_prefix_cache.harness.rules import (
    FIRST_PROMPT_BLOCKS,
    FIRST_PROMPT_TAIL,
    TURN_TOKENS,
    prompt_end_checkpoint,
)


@dataclass(frozen=True)
class Workload:
    """One workload: its case id, the property it holds (said in every
    failure), and where in vLLM its expectation comes from."""

    name: str
    holds: str
    rule: str
    # On real servers, whether it needs servers of its own, started with
    # other arguments than its cell's (then its case starts them, after the
    # cell's other cases have used the cell's).
    own_servers: bool = False
    # On real servers, the requests it plays with their recomputes where it
    # plays no conversation of the cell's turns (its cost, Case.turns).
    turns: int | None = None


WORKLOADS = {
    workload.name: workload
    for workload in (
        Workload(
            "shared-prefix",
            "siblings reach their junction checkpoint",
            "v1/core/kv_cache_manager.py KVCacheManager.get_computed_blocks "
            "(shared_prefix_boundary: the longest single-group hit) and "
            "v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split "
            "(a chunk stops at the block-floored junction)",
        ),
        Workload(
            "abort-retry",
            "a retry after an abort matches its recompute",
            "v1/core/sched/scheduler.py Scheduler.finish_requests, "
            "v1/core/single_type_kv_cache_manager.py MambaManager.cache_blocks "
            "(a state is published when its chunk is scheduled), "
            "v1/engine/core.py EngineCore.step_with_batch_queue (the steps "
            "scheduled before the abort complete), MambaManager."
            "get_num_blocks_to_allocate (a retry admitted beside the original "
            "is held back from a state published in its own step, "
            "cached_blocks_this_step); on a real server, EngineCore.step (a "
            "synchronous engine runs the step it scheduled before it takes "
            "the abort)",
        ),
        Workload(
            "eviction",
            "under eviction, the hit never exceeds what every group still "
            "holds, and the counters agree",
            "v1/core/kv_cache_coordinator.py HybridKVCacheCoordinator."
            "find_longest_cache_hit_per_group, v1/core/kv_cache_manager.py "
            "KVCacheManager.get_computed_blocks_for_connector",
            # On real servers, a pool sized for the workload (its case's
            # servers start with other --kv-cache-memory-bytes).
            own_servers=True,
        ),
        Workload(
            "small-budget",
            "under a small budget, hits and outputs equal those under the "
            "default budget",
            "v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split "
            "(every chunk ends at or before last_cache_position)",
            own_servers=True,
        ),
        Workload(
            "aligned",
            "a prompt that ends on a block hits its previous prompt's "
            "checkpoint and matches its recompute",
            "v1/kv_cache_interface.py get_mamba_prefill_checkpoint_position",
        ),
        Workload(
            "pd-resend",
            "an exact resend under P/D hits its own checkpoint on the "
            "prefiller and is answered, and the decoder's counters follow the "
            "rule for its role",
            "distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py "
            "(the truncation in on_new_request), v1/kv_cache_interface.py "
            "get_mamba_prefill_checkpoint_position, nixl/pull_scheduler.py "
            "NixlPullScheduler.get_num_new_matched_tokens (the decoder pulls "
            "what its own cache does not hold)",
            # A cold request, then the resend with its recompute
            # (cases.run_resend).
            turns=2,
        ),
        Workload(
            "async",
            "conversations that join and leave between steps hit as they do "
            "with synchronous scheduling",
            "v1/core/sched/async_scheduler.py AsyncScheduler, "
            "v1/engine/core.py EngineCore.step_with_batch_queue",
        ),
        Workload(
            "sync",
            "conversations that join and leave between steps hit their "
            "checkpoints with synchronous scheduling",
            "v1/core/sched/scheduler.py Scheduler, v1/engine/core.py EngineCore.step",
        ),
    )
}

# The siblings: how many share the prefix, and its length in blocks. The
# first computes the prefix, the second finds the junction (its attention
# blocks hit deeper than any Mamba state) and stops its prefill there, and
# every later one resumes at the junction.
NUM_SIBLINGS = 4
SHARED_PREFIX_BLOCKS = 2.5


def shared_prefix_length(units: Units) -> int:
    """The shared system prompt: two and a half blocks, so it ends inside a
    block, where no sibling's own prompt-end checkpoint falls."""
    return int(SHARED_PREFIX_BLOCKS * units.block)


def sibling_tail_length(units: Units) -> int:
    """Each sibling's own text after the shared prefix: one block and the
    reference tail, so each sibling's prompt-end checkpoint lies past the
    shared prefix."""
    return units.block + FIRST_PROMPT_TAIL


def junction_checkpoint(prefix_len: int, units: Units, drops_unit: bool) -> int:
    """Where a sibling resumes once another found the junction: the shared
    prefix's own end checkpoint, at the block (the Mamba block in "align"
    mode), as if the prefix were a prompt.

    The junction a sibling pins is its longest single-group hit, the
    attention group's, under the drafter's drop
    (KVCacheManager.get_computed_blocks, HybridKVCacheCoordinator.
    find_longest_cache_hit); the scheduler floors it to the block before it
    stops a chunk there ("a sub-block junction's state is not separately
    cacheable", Scheduler._mamba_block_aligned_split, unless
    enable_mamba_shared_prefix_checkpoint, which no cell sets). That is the
    prefix's prompt-end checkpoint at the block
    (:func:`prompt_end_checkpoint`).
    """
    return prompt_end_checkpoint(prefix_len, units.block, drops_unit)


def abort_length(units: Units, budget: int) -> int:
    """A prompt whose prefill takes at least two steps under ``budget``
    tokens a step, so that an abort can land between them."""
    return (
        max(budget, FIRST_PROMPT_BLOCKS * units.block) + units.block + FIRST_PROMPT_TAIL
    )


# On a real server, the client gives up on a cold request of an
# abort_retry_length prompt after this fraction of the time that a cold
# request of it took there (measured first, on the same server). Where that
# abort did not land mid-prefill, the next of at most ABORT_ATTEMPTS tries
# gives up twice as late (the request was not yet admitted) or twice as
# early (it had produced its first token, or was answered).
ABORT_AFTER_FRACTION = 0.25
ABORT_ATTEMPTS = 4


def abort_retry_length(units: Units, budget: int) -> int:
    """The prompt of a real server's abort-retry case: its checkpoint ends
    the first prefill chunk under ``budget`` tokens a step, and the tail
    takes a second step, where an abort can land between them. The
    checkpoint is the last block boundary within the budget (in the hit
    unit's mode too, since a block is whole units), and the tail is the
    reference one, so Scheduler._mamba_block_aligned_split ends the first
    chunk there, at last_cache_position."""
    return budget // units.block * units.block + FIRST_PROMPT_TAIL


def abort_landing(
    queried: float, first_tokens: float, prompt_len: int, answered: int = 1
) -> str:
    """Where an abort landed, from what the server's counters moved by over
    the aborted request and the ``answered`` requests of the same
    ``prompt_len``-token prompt after it (its retry, and under P/D the
    retry's cold twin; each a lookup of that prompt): "mid-prefill" where
    the aborted request was admitted (its prompt counted by
    prefix_cache_queries at admission, Scheduler.schedule) and sampled no
    first token (time_to_first_token: only the answered ones'); "before
    admission" or "after the prefill" otherwise."""
    if queried < (answered + 1) * prompt_len:
        return "before admission"
    if first_tokens > answered:
        return "after the prefill"
    return "mid-prefill"


def abort_checkpoint(landed: str, prompt_len: int, units: Units, drops: bool) -> int:
    """What the retry of an :func:`abort_retry_length` prompt must hit,
    given where the abort landed (:func:`abort_landing`, or "answered"
    where the server answered before the client gave up): nothing where it
    was never admitted; else the prompt's checkpoint, which its first chunk
    published when it was scheduled (MambaManager.cache_blocks) and wrote
    as it ran, since a synchronous engine runs the step it scheduled before
    it takes the abort (EngineCore.step; Scheduler.finish_requests then
    frees the request's blocks, keeping their hashes). A retry that misses
    it lost what the aborted steps wrote; one past it, or apart from its
    recompute, resumed from a state no step wrote (vLLM #56525)."""
    if landed == "before admission":
        return 0
    return prompt_end_checkpoint(prompt_len, units.hit, drops)


def abort_problems(
    hit: int, written: int, in_flight: int, prompt_len: int, units: Units
) -> list[str]:
    """Why the retry's ``hit`` cannot be real, after an abort of a
    ``prompt_len``-token prompt of which steps with processed outputs had
    computed ``written`` tokens and a step still in flight ``in_flight``
    more. A recurrent state is published when its chunk is scheduled
    (MambaManager.cache_blocks), and the engine completes the steps it
    scheduled before the abort (EngineCore.step_with_batch_queue keeps its
    queue) before it runs the retry's; so the retry may resume from those
    tokens and no others. vLLM #56525 is the retry that loaded a state no
    step wrote."""
    problems = []
    if hit % units.hit:
        problems.append(f"retry cached {hit}, not a multiple of the hit unit")
    if hit > written + in_flight:
        problems.append(
            f"retry cached {hit} > the {written + in_flight} tokens the aborted "
            f"request's steps wrote ({written} processed, {in_flight} in flight, "
            f"of {prompt_len}): a published boundary was never written"
        )
    return problems


def overlap_problems(
    hit: int, written: int, prompt_len: int, units: Units
) -> list[str]:
    """Why a retry's ``hit`` cannot be real, when it was sent while its
    original was still prefilling and first scheduled in a step before which
    the original's steps had scheduled ``written`` tokens of the
    ``prompt_len``-token prompt. A step writes the recurrent states its
    chunks publish only as it runs, after it read the states its requests
    resume from, and steps run in the order they were scheduled; so the
    retry may resume from those ``written`` tokens and no others, not from a
    state its own step publishes (MambaManager.get_num_blocks_to_allocate
    holds a request back from one, cached_blocks_this_step). vLLM #56525 is
    the retry that loaded a state before the step that writes it."""
    problems = []
    if hit % units.hit:
        problems.append(f"retry cached {hit}, not a multiple of the hit unit")
    if hit > written:
        problems.append(
            f"retry cached {hit} > the {written} tokens of the {prompt_len}-token "
            f"prompt that the original's steps before the retry's own had "
            f"written: it resumed from a state its own step publishes"
        )
    return problems


def small_budgets(units: Units) -> tuple[int, ...]:
    """Prefill budgets below the default: half a block (chunks end inside
    blocks) and a block and a half (every chunk is cut back to a block)."""
    return (units.block // 2, units.block + units.block // 2)


def served_budget(units: Units) -> int:
    """The prefill budget of a real server's small-budget case: a block and
    a half, the budget of :func:`small_budgets` whose chunks the scheduler
    cuts back to a block (Scheduler._mamba_block_aligned_split: a chunk that
    does not end the prefill ends on a block, where the worker writes the
    state that the block's hash will name)."""
    return small_budgets(units)[-1]


# A branch off the small-budget conversation's first prompt: it shares this
# many blocks of it, then its own text.
BRANCH_SHARED_BLOCKS = 2.5


def branch_lengths(units: Units) -> tuple[int, int]:
    """The branch's shared prefix (two and a half blocks: it ends inside a
    block, short of the first prompt's own checkpoint) and its length (the
    reference tail past that)."""
    shared = int(BRANCH_SHARED_BLOCKS * units.block)
    return shared, shared + FIRST_PROMPT_TAIL


def branch_checkpoint(shared: int, units: Units, drops_unit: bool) -> int:
    """Where a branch off a prompt prefilled under :func:`served_budget`
    resumes: the last block boundary it shares with that prompt (less the
    drafter's unit), a state that the default budget never writes.

    Under that budget every chunk of the prompt ends on the next block
    (Scheduler._mamba_block_aligned_split cuts a chunk that does not end the
    prefill back to a block, and a budget under two blocks reaches only the
    next one), the worker writes the recurrent state at each chunk's end
    into that block, and with a retention interval of a block
    (:func:`small_budget_args`) MambaManager.cache_blocks names each such
    block by its hash; so each block boundary of the prompt holds its own
    state. vLLM #51113 named a block by a state written short of it."""
    checkpoint = shared // units.block * units.block
    return max(checkpoint - (units.hit if drops_unit else 0), 0)


def small_budget_args(units: Units) -> tuple[str, ...]:
    """The ``vllm serve`` arguments of a small-budget case's servers: a
    prefill budget of :func:`served_budget` tokens a step, and the recurrent
    states that its chunks write at block boundaries retained a block apart
    (config/cache.py prefix_cache_retention_interval: 0, the default, keeps
    only the prompts' own checkpoints), where a branch can resume from them
    (:func:`branch_checkpoint`)."""
    return (
        "--max-num-batched-tokens",
        str(served_budget(units)),
        "--prefix-cache-retention-interval",
        str(units.block),
    )


def budget_problems(
    turns: Sequence[Turn],
    defaults: Sequence[Turn],
    budget: int,
    logprob_atol: float | None,
    exact: bool = False,
) -> PathNoise | None:
    """Hold each turn played under a prefill budget of ``budget`` tokens
    (``turns``) to the same turn of the same conversation played under the
    default budget (``defaults``, on the cell's own servers): the same
    prompt, the same hit, and a hit's output within the noise that the two
    budgets' cold recomputes of each prompt show (their chunks end
    elsewhere). Where chunk ends do not change the arithmetic (``exact``:
    Binding.chunk_invariant), the hits are held to ``logprob_atol`` instead
    and the recomputes too, and no noise is measured. Appends to each turn's
    problems; returns the noise (None where none is measured)."""
    pairs = [
        (turn, turn.recompute, default.recompute)
        for turn, default in zip(turns, defaults)
        if turn.recompute is not None and default.recompute is not None
    ]
    if len(turns) != len(defaults):
        turns[-1].problems.append(
            f"{len(turns)} turns under a budget of {budget}, {len(defaults)} "
            f"under the default"
        )
    if exact:
        noise, tolerance = None, logprob_atol
        names = (f"recompute at budget {budget}", "recompute at the default budget")
        for turn, small, default in pairs:
            why = compare(turn, small, default, names, tolerance, True)
            if why:
                turn.problems.append(
                    f"{turn.name}: the cold recompute under a budget of {budget} "
                    f"differs from the one under the default budget, {why}: "
                    f"where a prefill's chunks end changes its arithmetic"
                )
    else:
        noise = pairs_noise([(small, default) for _, small, default in pairs])
        tolerance = None if noise is None else noise.held_to(logprob_atol)
    names = (f"hit at budget {budget}", "hit at the default budget")
    for turn, default in zip(turns, defaults):
        if turn.prompt != default.prompt:
            turn.problems.append(
                f"{turn.name}: its prompt is not the default budget's (an "
                f"earlier output parted from it)"
            )
            continue
        if turn.restored != default.restored:
            turn.problems.append(
                f"{turn.name}: cached {turn.restored} under a budget of {budget}, "
                f"{default.restored} under the default"
            )
        if turn.output is None or default.output is None:
            continue
        why = compare(turn, turn.output, default.output, names, tolerance, exact)
        if why:
            held = "exactly" if exact else f"{noise}, the two budgets' recomputes"
            turn.problems.append(
                f"{turn.name}: the hit, {turn.restored} tokens restored, differs "
                f"from the same hit under the default budget, {why} ({held})"
            )
    return noise


# Eviction: the pool holds at least this many times the blocks one request
# takes (more where vLLM asks for more); pressure requests (a block each)
# follow until one evicts part of the conversation's prefix, at most this
# many.
EVICTION_POOL_REQUESTS = 2
EVICTION_PRESSURE_REQUESTS = 64


def eviction_filler(units: Units) -> int:
    """A pressure request's length: a block and the reference tail."""
    return units.block + FIRST_PROMPT_TAIL


def eviction_max_len(first_len: int, max_tokens: int) -> int:
    """The model length of an eviction pool's engine: the workload's
    longest request, the conversation's second turn and its output. vLLM
    sizes no pool below one request of the model's length
    (v1/core/kv_cache_utils.py check_enough_kv_cache_memory), so the
    length is cut to what the workload sends."""
    return first_len + TURN_TOKENS + max_tokens


@dataclass(frozen=True)
class EvictionPlan:
    """A real server's eviction case, replayed first through vLLM's own
    scheduler on that server's engine, built in-process from exactly its
    arguments: the arguments that size its pool (``args``, laid over the
    cell's), how many pressure requests of :func:`eviction_filler` tokens
    the replay sent before the first eviction reached the conversation,
    each KV cache group's own hit for the conversation's next turn before
    and after them (HybridKVCacheCoordinator.find_longest_cache_hit_per_group),
    and the hit vLLM's scheduler then gave that turn; under P/D, the groups
    and the hit are the prefiller's, and ``decoder_hit`` is the decoder's
    own hit for that turn's decode leg (None without a decoder of its own)."""

    args: tuple[str, ...]
    pressure: int
    held_before: tuple[int, ...]
    held: tuple[int, ...]
    hit: int
    decoder_hit: int | None = None


def eviction_args(max_model_len: int, kv_cache_bytes: int) -> tuple[str, ...]:
    """The ``vllm serve`` arguments of an eviction case's servers: the
    workload's model length (:func:`eviction_max_len`) and a pool of
    ``kv_cache_bytes`` (the CPU worker sizes its pool from them)."""
    return (
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
    )


def eviction_problems(hit: int, per_group: tuple[int, ...]) -> list[str]:
    """Why ``hit`` exceeds what the groups still hold: each group's own
    longest hit (``per_group``, looked up just before the request) bounds
    the hit that every group can serve."""
    held = min(per_group)
    if hit <= held:
        return []
    return [
        f"hit {hit} > {held}, the least that every group still holds (each "
        f"group's own longest hit: {list(per_group)}): the hit over-reports"
    ]

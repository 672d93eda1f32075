# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the workloads' arithmetic (workloads.catalog()): what each
expects of vLLM, its server arguments and the problems it reports. No
server, any platform."""

import importlib
import pkgutil

import pytest

from tests.models.hybrid_prefix_cache import harness, workloads
from tests.models.hybrid_prefix_cache.harness import (
    Deployment,
    Instance,
)
from tests.models.hybrid_prefix_cache.harness.cases import Workload
from tests.models.hybrid_prefix_cache.harness.compare import (
    Sample,
    Turn,
    take_each,
)
from tests.models.hybrid_prefix_cache.scheduler.preempt import (
    POOL_REFUSALS,
    Preemption,
    Unpreempted,
    sized_preemption,
)
from tests.models.hybrid_prefix_cache.scheduler.replays import (
    abort_retry as abort_replay,
)
from tests.models.hybrid_prefix_cache.scheduler.replays import (
    preemption as preemption_replay,
)
from tests.models.hybrid_prefix_cache.workloads import (
    abort_retry,
    catalog,
    eviction,
    preemption,
    shared_prefix,
    small_budget,
)


@pytest.mark.parametrize(
    ("block", "hit", "drops", "junction"),
    [
        # Two and a half blocks shared: the junction floors to two blocks,
        # one lower where the drafter drops a unit, whatever the hit unit.
        (256, 256, False, 512),
        (256, 64, False, 512),
        (6144, 128, True, 6144),
        (5760, 5760, False, 11520),
    ],
)
def test_junction_checkpoint(block, hit, drops, junction):
    units = harness.Units(block=block, hit=hit)
    shared = shared_prefix.shared_prefix_length(units)
    assert shared % block == block // 2
    assert shared_prefix.junction_checkpoint(shared, units, drops) == junction
    assert shared_prefix.sibling_tail_length(units) > block


WORKLOADS = catalog()


def test_abort_problems_bound_what_the_steps_wrote():
    units = harness.Units(block=256, hit=64)
    assert abort_replay.abort_problems(512, 256, 256, 2341, units) == []
    (why,) = abort_replay.abort_problems(768, 256, 256, 2341, units)
    assert "a published boundary was never written" in why
    (why,) = abort_replay.abort_problems(100, 256, 0, 2341, units)
    assert "not a multiple of the hit unit" in why


def test_overlap_problems_bound_the_steps_before_the_retrys():
    units = harness.Units(block=256, hit=64)
    assert abort_replay.overlap_problems(2304, 2304, 2341, units) == []
    (why,) = abort_replay.overlap_problems(2304, 2048, 2341, units)
    assert "a state its own step publishes" in why
    (why,) = abort_replay.overlap_problems(100, 2048, 2341, units)
    assert "not a multiple of the hit unit" in why


def test_eviction_problems_take_the_least_group():
    assert eviction.eviction_problems(512, (768, 512, 512)) == []
    (why,) = eviction.eviction_problems(768, (768, 512, 768))
    assert "the least that every group still holds" in why


def test_an_eviction_servers_pool_and_pressure():
    units = harness.Units(block=256, hit=64)
    assert eviction.eviction_filler(units) == 256 + harness.rules.FIRST_PROMPT_TAIL
    # The conversation's second turn and its output.
    assert eviction.eviction_max_len(805, 8) == 805 + harness.rules.TURN_TOKENS + 8
    # Later arguments win: laid over the base --max-model-len and pool.
    assert eviction.eviction_args(1590, 123456) == (
        "--max-model-len",
        "1590",
        "--kv-cache-memory-bytes",
        "123456",
    )
    assert WORKLOADS["eviction"].own_servers


def test_abort_length_spans_two_steps():
    units = harness.Units(block=256, hit=256)
    assert abort_replay.abort_length(units, 2048) > 2048 + 256
    assert abort_replay.abort_length(units, 128) > 3 * 256
    assert small_budget.small_budgets(units) == (128, 384)


def test_a_real_servers_abort_lands_and_its_retry_resumes_from_the_checkpoint():
    units = harness.Units(block=256, hit=64)
    # The checkpoint ends the first chunk of a 2048-token budget.
    length = abort_retry.abort_retry_length(units, 2048)
    assert length == 2048 + harness.rules.FIRST_PROMPT_TAIL
    assert harness.rules.prompt_end_checkpoint(length, units.hit, False) == 2048
    # The aborted request and the retry each counted at admission; only the
    # retry's first token.
    assert abort_retry.abort_landing(2 * length, 1, length) == "mid-prefill"
    assert abort_retry.abort_landing(length, 1, length) == "before admission"
    assert abort_retry.abort_landing(2 * length, 2, length) == "after the prefill"
    # Under P/D the retry's cold twin is counted too.
    assert abort_retry.abort_landing(3 * length, 2, length, answered=2) == "mid-prefill"
    assert abort_retry.abort_landing(2 * length, 2, length, 2) == "before admission"
    assert abort_retry.abort_landing(3 * length, 3, length, 2) == "after the prefill"
    assert abort_retry.abort_checkpoint("before admission", length, units, False) == 0
    for landed in ("mid-prefill", "after the prefill", "answered"):
        assert abort_retry.abort_checkpoint(landed, length, units, False) == 2048
    assert abort_retry.abort_checkpoint("mid-prefill", length, units, True) == 1984
    # Counted at admission, with nothing held, and no completion answered.
    entry = harness.reconcile.aborted_entry(length)
    assert (entry.requests, entry.queries, entry.held) == (0, length, 0)


def test_small_budget_servers_and_branch():
    units = harness.Units(block=256, hit=64)
    assert small_budget.served_budget(units) == 384
    assert small_budget.small_budget_args(units) == (
        "--max-num-batched-tokens",
        "384",
        "--prefix-cache-retention-interval",
        "256",
    )
    # The branch shares two and a half blocks and resumes at the block.
    assert small_budget.branch_lengths(units) == (640, 677)
    assert small_budget.branch_checkpoint(640, units, False) == 512
    assert small_budget.branch_checkpoint(640, units, True) == 448
    plain = Deployment(decode=Instance(serve_args=("-O0",)))
    served = harness.with_serve_args(plain, ("--a", "1"))
    assert served.decode.serve_args == ("-O0", "--a", "1")
    assert served.prefill is None and plain.decode.serve_args == ("-O0",)
    pd = Deployment(prefill=Instance(), decode=Instance())
    served = harness.with_serve_args(pd, ("--b",))
    assert served.prefill.serve_args == served.decode.serve_args == ("--b",)
    pinned = harness.with_serve_env(pd, {"OMP_NUM_THREADS": "1"})
    assert pinned.prefill.env == pinned.decode.env == {"OMP_NUM_THREADS": "1"}
    assert pd.decode.env == {}


def _budget_turn(index: int, hit: Sample, recompute: Sample | None) -> Turn:
    return Turn("", index, 805, 0, 0, output=hit, recompute=recompute, prompt=[index])


def test_budget_problems_hold_turns_to_the_default():
    def sample(cached: int, shift: float = 0.0) -> Sample:
        return Sample([1, 2], "", [-1.0 + shift, -2.0], [{}, {}], 805, cached)

    defaults = [_budget_turn(0, sample(0), sample(0))]
    defaults.append(_budget_turn(1, sample(768), sample(0)))
    # Equal hits and outputs, and recomputes 1e-3 apart: a tolerance of 4e-3.
    small = [_budget_turn(0, sample(0), sample(0, 1e-3))]
    small.append(_budget_turn(1, sample(768, 3e-3), sample(0)))
    noise, found = small_budget.budget_problems(small, defaults, 384, 0.0)
    take_each(small, found)
    assert noise is not None and noise.pairs == 2
    assert noise.tolerance == pytest.approx(4e-3)
    assert not [p for turn in small for p in turn.problems]
    # Another hit, an output beyond the noise, another prompt.
    small = [_budget_turn(0, sample(0), sample(0, 1e-3))]
    small.append(_budget_turn(1, sample(512, 9e-3), sample(0)))
    take_each(small, small_budget.budget_problems(small, defaults, 384, 0.0)[1])
    (hit, apart) = small[1].problems
    assert "cached 512 under a budget of 384, 768 under the default" in hit
    assert "differs from the same hit under the default budget" in apart
    small = [
        _budget_turn(0, sample(0), sample(0)),
        _budget_turn(1, sample(768), sample(0)),
    ]
    small[1].prompt = [7]
    take_each(small, small_budget.budget_problems(small, defaults, 384, 0.0)[1])
    assert "its prompt is not the default budget's" in small[1].problems[0]


def test_budget_problems_where_chunk_ends_do_not_matter_are_exact():
    def sample(cached: int, shift: float = 0.0) -> Sample:
        return Sample([1, 2], "", [-1.0 + shift, -2.0], [{}, {}], 805, cached)

    defaults = [_budget_turn(0, sample(0), sample(0))]
    defaults.append(_budget_turn(1, sample(768), sample(0)))
    small = [_budget_turn(0, sample(0), sample(0))]
    small.append(_budget_turn(1, sample(768), sample(0)))
    noise, found = small_budget.budget_problems(small, defaults, 384, 0.0, exact=True)
    take_each(small, found)
    assert noise is None
    assert not [p for turn in small for p in turn.problems]
    # A recompute and a hit a rounding step off: no noise widens either.
    small = [_budget_turn(0, sample(0), sample(0, 2**-12))]
    small.append(_budget_turn(1, sample(768, 2**-12), sample(0)))
    _, found = small_budget.budget_problems(small, defaults, 384, 0.0, exact=True)
    take_each(small, found)
    assert (
        "where a prefill's chunks end changes its arithmetic" in (small[0].problems[0])
    )
    assert (
        "differs from the same hit under the default budget" in (small[1].problems[0])
    )
    assert small[1].problems[0].endswith("(exactly)")
    # Not exact and no recomputes to measure noise on: check_logprobs_close
    # decides, as before there was an exact mode.
    bare = [_budget_turn(0, sample(0), None), _budget_turn(1, sample(768), None)]
    noise, found = small_budget.budget_problems(bare, defaults, 384, 0.0)
    take_each(bare, found)
    assert noise is None
    assert {c.judged for turn in bare for c in turn.comparisons} == {
        "check_logprobs_close"
    }


def _preempted(chunks, hits, prefill_end=512) -> Preemption:
    return Preemption(2, 1, 137, tuple(chunks), prefill_end, 128, hits, (0, 0))


def test_preemption_problems_hold_chunks_and_follow_ups():
    """Block 128: 376-token prompts (8 short of a block), 144 outputs (a block
    and two slacks), preempted at the block after them: its replay ends at
    512, its last checkpoint. The follow-up's bound is what the request
    computed (519 tokens: 512)."""
    units, mode, plain = harness.Units(128, 128), harness.Mode(), Deployment()
    shape = preemption.shape_of(units, plain)
    assert shape.lengths == (376, 144) and shape.cut

    def problems(result):
        return preemption_replay.problems_of(result, shape, mode, plain)

    aligned = [(0, 128), (128, 256), (256, 384), (384, 512)]
    assert _preempted(aligned, (512, 0)).output_cuts(376) == (384,)
    assert problems(_preempted(aligned, (512, 0))) == []
    # vLLM #33706: the budget's cut inside the outputs left where it fell.
    split = problems(_preempted([*aligned[:2], (256, 447), (447, 512)], (512, 0)))
    assert split == [
        "a chunk of the resumed prefill ended at 447, inside block 3 (128 "
        "tokens), short of the prefill's end 512"
    ]
    # Preempted at the prompt's last block: no cut inside the outputs.
    (early,) = problems(_preempted(aligned[:3], (384, 0), prefill_end=384))
    assert "ended inside its replayed outputs (376, 384)" in early
    assert early.endswith("nothing tested vLLM #33706's trigger")
    assert "nothing tested" in problems(None)[0]
    assert "nothing tested" in problems(_preempted(aligned, (0, 0)))[0]
    assert "beyond the bound 512" in problems(_preempted(aligned, (640, 0)))[0]
    assert "off the unit 128" in problems(_preempted(aligned, (320, 0)))[0]


def test_preemption_shape_leaves_room_for_a_drafter():
    """The prompt ends SHORT_OF_BLOCK steps of a drafter's tokens, past its
    lookahead slots, short of a block; DCP multiplies the block. The outputs
    run a block further but with a drafter or under offload."""

    class Config:
        num_speculative_tokens, num_lookahead_tokens = 3, 3

    units = harness.Units(128, 128)
    drafted = preemption.shape_of(units, Deployment(), Config())
    assert drafted.slack == 8 * 4 + 3
    assert drafted.lengths == (384 - 35, 3 * 35) and not drafted.cut
    dcp = preemption.shape_of(units, Deployment(decode=Instance(tp=2, dcp=2)))
    assert dcp.lengths == (3 * 256 - 8, 256 + 16)
    offload = preemption.shape_of(units, Deployment(offload=True))
    assert offload.lengths == (376, 24) and offload.restores


def test_preemption_sizing_starts_one_block_short_of_the_peak():
    """The pool one block short of the most the requests held at once where
    none was preempted (two sizes a block, as a stated engine's layers),
    then smaller ones while they preempt; more requests where none was
    tested, vLLM refused the pool, or none preempted; else the first whose
    follow-up hits."""
    played = []

    def build(size: int | None) -> list:
        if size is None:
            return ["free"]
        if size < 12:
            raise ValueError(f"{POOL_REFUSALS[0]} ...")
        return [size // 2]

    one_chunk = _preempted([(256, 384)], (256, 0))
    no_hit = _preempted(aligned := [(0, 128), (128, 256), (256, 512)], (0, 0))
    chunks = _preempted(aligned, (384, 0))

    def sized(results, peak=lambda requests: 2 + 4 * requests, running=8):
        played.clear()

        def play(servers, requests: int):
            played.append((servers[0], requests))
            if servers[0] == "free":
                return Unpreempted(min(requests, running), peak(requests))
            return results(servers[0], requests)

        return sized_preemption(
            build, play, lambda r: r is chunks, blocks_of=lambda s: s[0]
        )

    def results(pool: int, requests: int):
        if requests == 2:
            return {9: no_hit, 8: one_chunk}.get(pool, Unpreempted(2))
        return chunks if pool == 13 else Unpreempted(requests)

    assert sized(results) == (26, [13], chunks)
    assert played == [("free", 2), (9, 2), (8, 2), (7, 2), ("free", 3), (13, 3)]
    # Never tested: the first whose follow-up hits, after every count.
    assert sized(lambda pool, n: no_hit if pool % 2 else one_chunk)[:2] == (16, [8])
    assert ("free", 8) in played and played[-1] == (6, 8)
    # A pool vLLM refuses, or fewer running at once: no more requests.
    assert sized(results, peak=lambda requests: 6) == (0, (), None)
    assert played == [("free", requests) for requests in range(2, 9)]
    assert sized(results, running=2)[2] is one_chunk
    assert played[-1] == ("free", 3)


def test_every_workload_module_is_in_the_catalog():
    """Each module of the workloads package defines a workload the catalog
    finds, and every workload says its property and the vLLM code behind it."""
    for info in pkgutil.iter_modules(workloads.__path__):
        module = importlib.import_module(f"{workloads.__name__}.{info.name}")
        defined = [v for v in vars(module).values() if isinstance(v, Workload)]
        assert defined and all(WORKLOADS[w.name] is w for w in defined), info.name
    for workload in WORKLOADS.values():
        assert workload.holds and ".py" in workload.rule, workload

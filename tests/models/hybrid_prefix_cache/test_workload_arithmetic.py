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
from tests.models.hybrid_prefix_cache.harness.compare import (
    Sample,
    Turn,
)
from tests.models.hybrid_prefix_cache.harness.workload import Workload
from tests.models.hybrid_prefix_cache.scheduler.preempt import (
    POOL_REFUSALS,
    Preemption,
    Unpreempted,
    sized_preemption,
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
    assert abort_retry.abort_problems(512, 256, 256, 2341, units) == []
    (why,) = abort_retry.abort_problems(768, 256, 256, 2341, units)
    assert "a published boundary was never written" in why
    (why,) = abort_retry.abort_problems(100, 256, 0, 2341, units)
    assert "not a multiple of the hit unit" in why


def test_overlap_problems_bound_the_steps_before_the_retrys():
    units = harness.Units(block=256, hit=64)
    assert abort_retry.overlap_problems(2304, 2304, 2341, units) == []
    (why,) = abort_retry.overlap_problems(2304, 2048, 2341, units)
    assert "a state its own step publishes" in why
    (why,) = abort_retry.overlap_problems(100, 2048, 2341, units)
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
    assert abort_retry.abort_length(units, 2048) > 2048 + 256
    assert abort_retry.abort_length(units, 128) > 3 * 256
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
    noise = small_budget.budget_problems(small, defaults, 384, 0.0)
    assert noise is not None and noise.pairs == 2
    assert noise.tolerance == pytest.approx(4e-3)
    assert not [p for turn in small for p in turn.problems]
    # Another hit, an output beyond the noise, another prompt.
    small = [_budget_turn(0, sample(0), sample(0, 1e-3))]
    small.append(_budget_turn(1, sample(512, 9e-3), sample(0)))
    small_budget.budget_problems(small, defaults, 384, 0.0)
    (hit, apart) = small[1].problems
    assert "cached 512 under a budget of 384, 768 under the default" in hit
    assert "differs from the same hit under the default budget" in apart
    small = [
        _budget_turn(0, sample(0), sample(0)),
        _budget_turn(1, sample(768), sample(0)),
    ]
    small[1].prompt = [7]
    small_budget.budget_problems(small, defaults, 384, 0.0)
    assert "its prompt is not the default budget's" in small[1].problems[0]


def test_budget_problems_where_chunk_ends_do_not_matter_are_exact():
    def sample(cached: int, shift: float = 0.0) -> Sample:
        return Sample([1, 2], "", [-1.0 + shift, -2.0], [{}, {}], 805, cached)

    defaults = [_budget_turn(0, sample(0), sample(0))]
    defaults.append(_budget_turn(1, sample(768), sample(0)))
    small = [_budget_turn(0, sample(0), sample(0))]
    small.append(_budget_turn(1, sample(768), sample(0)))
    assert small_budget.budget_problems(small, defaults, 384, 0.0, exact=True) is None
    assert not [p for turn in small for p in turn.problems]
    # A recompute and a hit a rounding step off: no noise widens either.
    small = [_budget_turn(0, sample(0), sample(0, 2**-12))]
    small.append(_budget_turn(1, sample(768, 2**-12), sample(0)))
    small_budget.budget_problems(small, defaults, 384, 0.0, exact=True)
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
    assert small_budget.budget_problems(bare, defaults, 384, 0.0) is None
    assert {c.judged for turn in bare for c in turn.comparisons} == {
        "check_logprobs_close"
    }


def _preempted(chunks, hits, prefill_end=384) -> Preemption:
    return Preemption(2, 1, 9, tuple(chunks), prefill_end, 128, hits, (0, 0))


def test_preemption_problems_hold_chunks_and_follow_ups():
    """Block 128: 376-token prompts (8 short of a block), 24 outputs; the
    follow-up's bound is what the request computed (399 tokens: 384)."""
    units, mode, plain = harness.Units(128, 128), harness.Mode(), Deployment()
    shape = preemption.shape_of(units, plain)
    assert shape.lengths == (376, 24)

    def problems(result):
        return preemption.problems_of(result, shape, mode, plain)

    aligned = [(0, 128), (128, 256), (256, 384)]
    assert problems(_preempted(aligned, (384, 0))) == []
    # vLLM #33706: the resumed prefill split by the budget alone.
    (split,) = problems(_preempted([(0, 191), (191, 384)], (256, 0)))
    assert "ended at 191, inside block 1" in split
    assert "nothing tested" in problems(None)[0]
    assert "nothing tested" in problems(_preempted(aligned, (0, 0)))[0]
    assert "beyond the bound 384" in problems(_preempted(aligned, (512, 0)))[0]
    assert "off the unit 128" in problems(_preempted(aligned, (320, 0)))[0]


def test_preemption_shape_leaves_room_for_a_drafter():
    """The prompt ends SHORT_OF_BLOCK steps of a drafter's tokens, past its
    lookahead slots, short of a block; DCP multiplies the block."""

    class Config:
        num_speculative_tokens, num_lookahead_tokens = 3, 3

    units = harness.Units(128, 128)
    drafted = preemption.shape_of(units, Deployment(), Config())
    assert drafted.slack == 8 * 4 + 3
    assert drafted.lengths == (384 - 35, 3 * 35)
    dcp = preemption.shape_of(units, Deployment(decode=Instance(tp=2, dcp=2)))
    assert dcp.prompt_len == 3 * 256 - 8


def test_preemption_sizing_takes_the_first_resumed_in_chunks():
    """Pools below 3 blocks are refused; where one request at a time runs,
    more requests are not tried; a resume in one chunk is kept only until
    one in several chunks shows, else the first whose follow-up hits."""
    played = []

    def build(size: int) -> list:
        if size < 3:
            raise ValueError(f"{POOL_REFUSALS[0]} ...")
        return [size]

    def sized(results):
        played.clear()

        def play(servers, requests: int):
            played.append((servers[0], requests))
            return results(servers[0], requests)

        return sized_preemption(build, play)

    one_chunk = _preempted([(256, 384)], (256, 0))
    no_hit = _preempted([(256, 384)], (0, 0))
    chunks = _preempted([(0, 128), (128, 384)], (384, 0))

    def results(size: int, requests: int):
        if size == 3:
            return Unpreempted(1)
        if size == 4:
            return no_hit if requests == 2 else one_chunk
        return chunks if requests == 3 else Unpreempted(requests)

    assert sized(results) == (5, [5], chunks)
    assert played[:2] == [(3, 2), (4, 2)]
    assert played[-2:] == [(5, 2), (5, 3)]
    # Never in several chunks: the first whose follow-up hits.
    assert sized(lambda size, n: no_hit if n == 2 else one_chunk)[:2] == (3, [3])
    assert sized(lambda size, n: no_hit if n == 2 else one_chunk)[2] is one_chunk


def test_every_workload_module_is_in_the_catalog():
    """Each module of the workloads package defines a workload the catalog
    finds, and every workload says its property and the vLLM code behind it."""
    for info in pkgutil.iter_modules(workloads.__path__):
        module = importlib.import_module(f"{workloads.__name__}.{info.name}")
        defined = [v for v in vars(module).values() if isinstance(v, Workload)]
        assert defined and all(WORKLOADS[w.name] is w for w in defined), info.name
    for workload in WORKLOADS.values():
        assert workload.holds and ".py" in workload.rule, workload

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workloads of the ``workloads`` package, replayed through vLLM's own
scheduler for every cell of the CPU tier's matrix where they apply (the
Kimi-K3 matrix's: ``kimi_k3/test_prefix_cache_scheduler.py``), in seconds and
without a device: ``test_<workload>[cpu-<deployment>-<mode>]``, each a
shim over the workload's replay (``scheduler.replays``). Each failure names
the property its workload holds."""

import pytest

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness.cases import Workload
from tests.models.hybrid_prefix_cache.replay_cells import CPU
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell
from tests.models.hybrid_prefix_cache.scheduler.replays import catalog
from tests.models.hybrid_prefix_cache.workloads import catalog as workloads

pytestmark = pytest.mark.skip_global_cleanup

REPLAYS = catalog()


def replay(name: str, cell_id: str, model, binding, *variant: str) -> None:
    __tracebackhide__ = True
    CPU.cell(cell_id, model, binding).replay(REPLAYS[name], *variant)


@pytest.mark.parametrize("cell_id", CPU.params(REPLAYS["shared-prefix"]))
def test_shared_prefix(tiny_model, cpu_binding, cell_id: str) -> None:
    replay("shared-prefix", cell_id, tiny_model, cpu_binding)


@pytest.mark.parametrize("scheduling", REPLAYS["abort-retry"].variants)
@pytest.mark.parametrize("cell_id", CPU.params(REPLAYS["abort-retry"]))
def test_abort_retry(tiny_model, cpu_binding, cell_id: str, scheduling: str) -> None:
    replay("abort-retry", cell_id, tiny_model, cpu_binding, scheduling)


@pytest.mark.parametrize("cell_id", CPU.params(REPLAYS["eviction"]))
def test_eviction(tiny_model, cpu_binding, cell_id: str) -> None:
    replay("eviction", cell_id, tiny_model, cpu_binding)


@pytest.mark.parametrize("cell_id", CPU.params(REPLAYS["small-budget"]))
def test_small_budget(tiny_model, cpu_binding, cell_id: str) -> None:
    replay("small-budget", cell_id, tiny_model, cpu_binding)


@pytest.mark.parametrize("cell_id", CPU.params(REPLAYS["aligned"]))
def test_aligned(tiny_model, cpu_binding, cell_id: str) -> None:
    replay("aligned", cell_id, tiny_model, cpu_binding)


@pytest.mark.parametrize("cell_id", CPU.params(REPLAYS["pd-resend"]))
def test_pd_resend(tiny_model, cpu_binding, cell_id: str) -> None:
    replay("pd-resend", cell_id, tiny_model, cpu_binding)


@pytest.mark.parametrize("cell_id", CPU.params(REPLAYS["preemption"]))
def test_preemption(tiny_model, cpu_binding, cell_id: str) -> None:
    replay("preemption", cell_id, tiny_model, cpu_binding)


@pytest.mark.parametrize("scheduling", ["async", "sync"])
@pytest.mark.parametrize("cell_id", CPU.params(REPLAYS["async"]))
def test_scheduling(tiny_model, cpu_binding, cell_id: str, scheduling: str) -> None:
    replay(scheduling, cell_id, tiny_model, cpu_binding)


def test_every_replay_has_its_test() -> None:
    """A workload with a replay is run here: a shim per workload; and every
    replay replays a workload of the ``workloads`` package."""
    tested = {name.removeprefix("test_").replace("_", "-") for name in globals()}
    tested |= {"async", "sync"}
    untested = [w for w in REPLAYS if w not in tested]
    assert not untested, f"no test_<workload> replays {untested}"
    strays = {
        w: r.workload for w, r in REPLAYS.items() if workloads().get(w) != r.workload
    }
    assert not strays, f"replays of no workload of the catalog: {strays}"


def test_a_replay_judges_its_known_failure() -> None:
    """A listed replay that fails with its evidence xfails; one that fails
    otherwise is a stale table, never an xfail, however the failure arrives
    (a problem, or an assertion of the replay)."""

    def replayed(problem: str, raised: bool):
        def replay(cell: ReplayCell) -> None:
            assert not raised, problem
            cell.fail(workload, [problem], "")

        workload = Workload("w", "it holds", "rule")
        return Replay(workload, replay)

    entry = harness.Known("xfail", "a bug", evidence="hit 0,")
    cell = ReplayCell("c", "cpu", None, None, (0, 1), None, known={"w": entry})
    for raised in (False, True):
        with pytest.raises(pytest.xfail.Exception, match="a bug"):
            cell.replay(replayed("turn 1: hit 0, expected 128", raised))
        with pytest.raises(pytest.fail.Exception, match="update the table"):
            cell.replay(replayed("turn 1: hit 64, expected 128", raised))
    with pytest.raises(pytest.fail.Exception, match="XPASS"):
        cell.replay(Replay(Workload("w", "it holds", "rule"), lambda cell: None))

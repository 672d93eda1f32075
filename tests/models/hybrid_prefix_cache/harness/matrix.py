# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A binding's matrix, built the same way for every tier (:class:`Matrix`):
its cases (deployments x modes, and in the sweep cells the tail sweep and
its concurrent case), its known-failure table (one entry list per case or
cell, each with evidence), and its pytest params, marked so that tests that
need the same servers run one after another (:func:`servers_mark`,
:func:`group_by_servers`) and, split across parallel jobs, share a job and
balance the jobs by cost (:func:`case_seconds`, :func:`shard_by_cost`)."""

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import pytest

from tests.models.hybrid_prefix_cache.harness.cases import (
    Suite,
    run_case,
    run_workload,
)
from tests.models.hybrid_prefix_cache.harness.conversation import SHAPES
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Known,
    Mode,
    Units,
    select_known,
)
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import NUM_TURNS
from tests.models.hybrid_prefix_cache.harness.workloads import WORKLOADS

# Tests marked with the same key need the same servers; the plugin puts
# them next to each other so that the server pool can reuse them.
SERVERS_MARK = "hybrid_servers"
# The id suffix of a sweep cell's case that plays its shapes at once.
CONCURRENT = "concurrent"


# What a test costs, for splitting a module's tests across parallel jobs, in
# seconds per server process it runs through (a P/D cell runs through two),
# from the 4xB200 measurement that .buildkite/test_areas/models_basic.yaml
# states: a server start of 70-90 s, a played turn with its recompute of
# (5136 s - 32 starts x 80 s) / (32 cases x 3 turns) = 27 s, and the settling
# of the counters at the end of a case of up to 15 s.
START_SECONDS = 80
TURN_SECONDS = 27
SETTLE_SECONDS = 15
# A matrix case plays its growing turns, then an exact resend.
CASE_TURNS = NUM_TURNS + 1


def case_seconds(servers: int, turns: int, start: bool = True) -> int:
    """The cost of a test that plays ``turns`` turns through ``servers``
    server processes, starting them (``start``) or reusing those of the test
    before it."""
    per_server = turns * TURN_SECONDS + SETTLE_SECONDS
    return servers * (per_server + (START_SECONDS if start else 0))


def servers_mark(key: str, seconds: int | None = None) -> pytest.MarkDecorator:
    """Tests marked with the same ``key`` need the same servers; ``seconds``
    is a test's cost (:func:`case_seconds`), which :func:`shard_by_cost`
    needs of every test it splits."""
    # The Kimi-K3 module makes its marks as it is imported, which is before
    # pytest reads its pytest_plugins and so before the plugin registers the
    # marker: no warning that it is unknown.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        mark = getattr(pytest.mark, SERVERS_MARK)
    return mark(key) if seconds is None else mark(key, seconds=seconds)


def group_by_servers(items: list) -> None:
    """Reorder ``items`` in place so that those marked with the same
    servers key run one after another, where the first of them was."""

    def key(item) -> str | None:
        mark = item.get_closest_marker(SERVERS_MARK)
        return None if mark is None else mark.args[0]

    groups: dict[str, list] = {}
    for item in items:
        if key(item) is not None:
            groups.setdefault(key(item), []).append(item)
    ordered, placed = [], set()
    for item in items:
        k = key(item)
        if k is None:
            ordered.append(item)
        elif k not in placed:
            placed.add(k)
            ordered.extend(groups[k])
    items[:] = ordered


def shard_by_cost(items: list, shard: int, shards: int) -> list | None:
    """The items of job ``shard`` of ``shards`` (in their order), or None
    when an item carries no cost (see :func:`servers_mark`).

    Tests that need the same servers stay in one job (a split would start
    those servers again in another); whole groups go, most costly first, to
    the job with the least cost so far (ties: the lower job, so that every
    job computes the same split)."""
    groups: dict[str, list] = {}
    for index, item in enumerate(items):
        mark = item.get_closest_marker(SERVERS_MARK)
        if mark is None or "seconds" not in mark.kwargs:
            return None
        groups.setdefault(mark.args[0], []).append(
            (index, item, mark.kwargs["seconds"])
        )
    load = [0] * shards
    chosen: set[int] = set()
    by_cost = sorted(groups.values(), key=lambda g: (-sum(s for _, _, s in g), g[0][0]))
    for group in by_cost:
        job = min(range(shards), key=lambda j: (load[j], j))
        load[job] += sum(seconds for _, _, seconds in group)
        if job == shard:
            chosen.update(index for index, _, _ in group)
    return [item for index, item in enumerate(items) if index in chosen]


@dataclass(frozen=True)
class Case:
    """One case of a matrix, by the names of its deployment and mode."""

    deployment: str
    mode: str
    shape: str | None = None  # a sweep shape, or None for the reference
    concurrent: bool = False  # every shape of the cell at once
    workload: str | None = None  # a workload of harness.WORKLOADS
    # Its conversation's growing turns, and whether a resend follows them
    # (plan_turns).
    num_turns: int = NUM_TURNS
    resend: bool = True

    @property
    def turns(self) -> int:
        """The requests it plays with their recomputes: its growing turns,
        and the resend if it has one, or its workload's own count."""
        if self.workload is not None and WORKLOADS[self.workload].turns:
            return WORKLOADS[self.workload].turns
        return self.num_turns + self.resend

    @property
    def cell(self) -> str:
        return f"{self.deployment}-{self.mode}"

    @property
    def case_id(self) -> str:
        suffix = self.workload or self.shape
        suffix = suffix or (CONCURRENT if self.concurrent else None)
        return self.cell if suffix is None else f"{self.cell}-{suffix}"


@dataclass(frozen=True)
class Matrix:
    """A binding's matrix: its literal ``deployments`` and ``modes`` dicts,
    its known failures (``known``, by case id or by cell; a case without
    entries of its own takes its cell's), the ``sweep`` cells that also
    run every sweep shape alone and all of them at once, and the cells that
    also run each workload (``workloads``: a workload of harness.WORKLOADS
    to its cells), on the cell's servers, or after the cell's other cases on
    servers of their own where the workload needs them
    (``Workload.own_servers``, :meth:`servers_key`); a workload played as a
    conversation plays ``workload_turns`` growing turns and no resend where
    given (fewer than a cell's, to cost less than the servers' start).

    Every known entry must name a case (checked at construction); a test
    passes :meth:`known_for` to ``run_case``, so a listed case must fail
    with the entry's evidence, and a fix shows as a strict XPASS.
    """

    deployments: Mapping[str, Deployment]
    modes: Mapping[str, Mode]
    known: Mapping[str, Sequence[Known]] = field(default_factory=dict)
    sweep: tuple[str, ...] = ()
    workloads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    workload_turns: Mapping[str, int] = field(default_factory=dict)
    # Whether a concurrent case starts servers of its own (its binding's
    # batch_invariant_env).
    batch_servers: bool = False
    cases: dict[str, Case] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cases", self._build())
        unknown = sorted(set(self.known) - set(self.cases))
        if unknown:
            raise ValueError(f"known failures name no case of the matrix: {unknown}")
        cells = {case.cell for case in self.cases.values()}
        stray = sorted(
            {cell for cells_ in self.workloads.values() for cell in cells_} - cells
        )
        if stray:
            raise ValueError(f"workloads name no cell of the matrix: {stray}")
        if set(self.workload_turns) - set(self.workloads):
            raise ValueError("workload_turns names a workload the matrix does not run")

    def _workload_cases(self, cell: Case, own_servers: bool) -> list[Case]:
        """The workload cases of ``cell`` that run on its servers, or
        (``own_servers``) on servers of their own."""
        cases = []
        for workload, cells in self.workloads.items():
            if cell.cell not in cells:
                continue
            if WORKLOADS[workload].own_servers != own_servers:
                continue
            case = Case(cell.deployment, cell.mode, workload=workload)
            turns = self.workload_turns.get(workload)
            if turns is not None:
                case = replace(case, num_turns=turns, resend=False)
            cases.append(case)
        return cases

    def _build(self) -> dict[str, Case]:
        """Every case, in an order that lets consecutive cases share their
        servers: each cell, its workloads and its sweep, then the workloads
        that start servers of their own."""
        cases = {}
        for deployment in self.deployments:
            for mode_name, mode in self.modes.items():
                cell = Case(deployment, mode_name)
                cell_cases = [cell, *self._workload_cases(cell, False)]
                if cell.cell in self.sweep:
                    for shape, (inblock, _) in SHAPES.items():
                        # A boundary inside a block needs a unit below the
                        # block.
                        if not inblock or mode.prefix_match_unit is not None:
                            cell_cases.append(Case(deployment, mode_name, shape))
                    cell_cases.append(Case(deployment, mode_name, concurrent=True))
                cell_cases += self._workload_cases(cell, True)
                cases.update((case.case_id, case) for case in cell_cases)
        return cases

    def servers_key(self, case_id: str) -> str:
        """What the case's servers are known by: its cell's, or its own for
        a workload, or a concurrent case, that starts servers of its own."""
        case = self.cases[case_id]
        if case.workload is not None and WORKLOADS[case.workload].own_servers:
            return case.case_id
        if case.concurrent and self.batch_servers:
            return case.case_id
        return case.cell

    def served(self, case_id: str) -> tuple[Deployment, Mode]:
        case = self.cases[case_id]
        return self.deployments[case.deployment], self.modes[case.mode]

    def known_for(self, case_id: str) -> tuple[Known, ...]:
        """The known failures of a case that hold for the vLLM under test:
        its own, or its cell's."""
        case = self.cases[case_id]
        entries = self.known.get(case_id, self.known.get(case.cell, ()))
        return tuple(known for known in entries if known.holds())

    def run(
        self,
        suite: Suite,
        case_id: str,
        binding: Binding,
        deployment: Deployment,
        mode: Mode,
    ) -> CaseRecord:
        """``case_id`` played on ``suite``'s servers as ``deployment`` in
        ``mode`` (as served: the matrix's own, or a binding's variant of
        them), held to its known failures: its cell's conversation
        (run_case), or its workload (run_workload) with the turns the matrix
        gives it."""
        __tracebackhide__ = True
        case, known = self.cases[case_id], self.known_for(case_id)
        if case.workload is None:
            return run_case(suite, case_id, binding, deployment, mode, known=known)
        return run_workload(
            suite,
            case_id,
            binding,
            deployment,
            mode,
            case.workload,
            known,
            num_turns=case.num_turns,
            resend=case.resend,
        )

    def concurrent_shapes(self, case_id: str, units: Units | None) -> tuple[str, ...]:
        """The sweep shapes a concurrent case plays at once where its
        servers resolve to ``units``: those of its cell that pass alone
        there. A shape that fails alone is left out, not expected to fail:
        in a batch, whether it fails depends on how the batch happens to
        split the prefills, and its own case already holds it to its
        evidence."""
        case = self.cases[case_id]
        if not case.concurrent:
            return ()
        return tuple(
            shape
            for shape in SHAPES
            if f"{case.cell}-{shape}" in self.cases
            and select_known(self.known_for(f"{case.cell}-{shape}"), units) is None
        )

    def params(
        self,
        device_marks: Callable[[int], list] | None = None,
        skip: Callable[[str], str | None] | None = None,
    ) -> list:
        """One ``pytest.param(case_id)`` per case, marked with its cell's
        servers key; ``device_marks(n)`` gives the marks of a case that needs
        ``n`` > 1 devices, and ``skip(case_id)`` why this machine cannot run
        it, if so."""
        params = []
        for case_id, case in self.cases.items():
            deployment = self.deployments[case.deployment]
            # The cell's first case starts its servers, and its sweep and
            # workloads reuse them; a workload with servers of its own
            # starts those.
            key = self.servers_key(case_id)
            start = case.case_id in (case.cell, key)
            seconds = case_seconds(len(deployment.instances), case.turns, start)
            marks = [servers_mark(key, seconds)]
            devices = deployment.num_devices
            if device_marks is not None and devices > 1:
                marks += device_marks(devices)
            reason = None if skip is None else skip(case_id)
            if reason is not None:
                marks.append(pytest.mark.skip(reason=reason))
            params.append(pytest.param(case_id, id=case_id, marks=marks))
        return params

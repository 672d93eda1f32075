# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A binding's matrix (:class:`Matrix`): its cases, known failures and pytest
params, grouped by servers and split across parallel jobs by cost."""

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import pytest

from tests.models.hybrid_prefix_cache.harness import deployment, rules
from tests.models.hybrid_prefix_cache.harness.cases import (
    Workload,
    WorkloadRun,
    run_case,
)
from tests.models.hybrid_prefix_cache.harness.conversation import SHAPES
from tests.models.hybrid_prefix_cache.harness.deployment import Deployment, Mode, Units
from tests.models.hybrid_prefix_cache.harness.known import judge_confirmed_elsewhere
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord

# Tests with the same key need the same servers; the plugin runs them together.
SERVERS_MARK = "hybrid_servers"
# Seconds per server process, for sharding (4xB200: findings/b200-case-costs.md).
START_SECONDS = 80
TURN_SECONDS = 27
SETTLE_SECONDS = 15
# A matrix case plays its growing turns, then an exact resend.
CASE_TURNS = rules.NUM_TURNS + 1


def case_seconds(servers: int, turns: int, start: bool = True) -> int:
    """The cost of ``turns`` turns through ``servers`` processes, started or reused."""
    per_server = turns * TURN_SECONDS + SETTLE_SECONDS
    return servers * (per_server + (START_SECONDS if start else 0))


def servers_mark(key: str, seconds: int | None = None) -> pytest.MarkDecorator:
    """``seconds``: a test's cost (:func:`case_seconds`) for :func:`shard_by_cost`."""
    # Kimi-K3 marks its tests on import, before the plugin registers the marker.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        mark = getattr(pytest.mark, SERVERS_MARK)
    return mark(key) if seconds is None else mark(key, seconds=seconds)


def group_by_servers(items: list) -> None:
    """Reorder ``items`` in place: the same servers key runs together, first-come."""
    first: dict[str, int] = {}
    ranks = []
    for index, item in enumerate(items):
        mark = item.get_closest_marker(SERVERS_MARK)
        ranks.append(index if mark is None else first.setdefault(mark.args[0], index))
    items[:] = [item for _, item in sorted(zip(ranks, items), key=lambda p: p[0])]


def shard_by_cost(items: list, shard: int, shards: int) -> list | None:
    """Job ``shard``'s items in order, or None if one has no cost: servers groups go
    whole, costliest first, to the least loaded job (ties: the lower, so jobs agree)."""
    groups: dict[str, list] = {}
    for index, item in enumerate(items):
        mark = item.get_closest_marker(SERVERS_MARK)
        if mark is None or "seconds" not in mark.kwargs:
            return None
        groups.setdefault(mark.args[0], []).append((index, mark.kwargs["seconds"]))
    load = [0] * shards
    chosen: set[int] = set()
    for group in sorted(groups.values(), key=lambda g: (-sum(s for _, s in g), g[0])):
        job = load.index(min(load))
        load[job] += sum(seconds for _, seconds in group)
        if job == shard:
            chosen.update(index for index, _ in group)
    return [item for index, item in enumerate(items) if index in chosen]


@dataclass(frozen=True)
class Case:
    """One case of a matrix, by the names of its deployment and mode."""

    deployment: str
    mode: str
    shape: str | None = None  # a sweep shape, or None for the reference
    concurrent: bool = False  # every shape of the cell at once
    # likewise at the servers' threads (paths.check_prefill_steps)
    restores: bool = False
    workload: str | None = None  # a workload of the matrix's catalog
    # Its growing turns, and whether a resend follows them (plan_turns).
    num_turns: int = rules.NUM_TURNS
    resend: bool = True
    # Its workload's own request count (Workload.turns), and servers.
    fixed_turns: int | None = None
    own_servers: bool = False

    @property
    def turns(self) -> int:
        """The requests it plays with their recomputes."""
        return self.fixed_turns or self.num_turns + self.resend

    @property
    def cell(self) -> str:
        return f"{self.deployment}-{self.mode}"

    @property
    def at_once(self) -> bool:
        return self.concurrent or self.restores

    @property
    def case_id(self) -> str:
        batch = "concurrent" if self.concurrent else "batched-restores"
        suffix = self.workload or self.shape or (batch if self.at_once else None)
        return self.cell if suffix is None else f"{self.cell}-{suffix}"


@dataclass(frozen=True)
class Matrix:
    """``deployments`` x ``modes``; ``known`` failures by case id or cell, each naming a
    case (the scheduler tier's, ``Known.replayed``, any catalog workload on a cell);
    ``sweep`` cells play every sweep shape alone and at once (under batch_invariant_env,
    on servers of their own where ``batch_servers``; and at the servers' threads);
    each of ``workloads`` plays on its cells, on their servers or its own, with
    ``workload_turns`` turns and no resend."""

    deployments: Mapping[str, Deployment]
    modes: Mapping[str, Mode]
    known: Mapping[str, Sequence[deployment.Known]] = field(default_factory=dict)
    sweep: tuple[str, ...] = ()
    workloads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    workload_turns: Mapping[str, int] = field(default_factory=dict)
    # Every workload a matrix may name, by name (the workloads package).
    catalog: Mapping[str, Workload] = field(default_factory=dict)
    batch_servers: bool = False
    cases: dict[str, Case] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if missing := sorted(set(self.workloads) - set(self.catalog)):
            raise ValueError(f"workloads not in the catalog: {missing}")
        # Every case, ordered so consecutive ones share servers: each cell, its
        # workloads and sweep, then the workloads with servers of their own.
        cases = {}
        for deployment_name in self.deployments:
            for mode_name, mode in self.modes.items():
                cell = Case(deployment_name, mode_name)
                loads = [
                    self._workload_case(cell, name)
                    for name, cells in self.workloads.items()
                    if cell.cell in cells
                ]
                cell_cases = [cell, *(c for c in loads if not c.own_servers)]
                if cell.cell in self.sweep:
                    for shape, (inblock, _) in SHAPES.items():
                        # A boundary inside a block needs a unit below it.
                        if not inblock or mode.prefix_match_unit is not None:
                            cell_cases.append(replace(cell, shape=shape))
                    cell_cases.append(replace(cell, concurrent=True))
                    cell_cases.append(replace(cell, restores=True))
                cell_cases += [c for c in loads if c.own_servers]
                cases.update((case.case_id, case) for case in cell_cases)
        object.__setattr__(self, "cases", cases)
        cells = {case.cell for case in cases.values()}
        replayed = {f"{cell}-{name}" for cell in cells for name in self.catalog}
        if unknown := sorted(
            key
            for key, entries in self.known.items()
            if key not in cases
            and (key not in replayed or not all(k.replayed for k in entries))
        ):
            raise ValueError(f"known failures name no case of the matrix: {unknown}")
        if stray := sorted(set().union(*self.workloads.values()) - cells):
            raise ValueError(f"workloads name no cell of the matrix: {stray}")
        if set(self.workload_turns) - set(self.workloads):
            raise ValueError("workload_turns names a workload the matrix does not run")

    def _workload_case(self, cell: Case, name: str) -> Case:
        spec, turns = self.catalog[name], self.workload_turns.get(name)
        case = replace(
            cell, workload=name, fixed_turns=spec.turns, own_servers=spec.own_servers
        )
        return case if turns is None else replace(case, num_turns=turns, resend=False)

    def servers_key(self, case_id: str) -> str:
        """Its servers' key: its cell's, or its own where it starts its own."""
        case = self.cases[case_id]
        if case.own_servers or (case.concurrent and self.batch_servers):
            return case.case_id
        return case.cell

    def served(self, case_id: str) -> tuple[Deployment, Mode]:
        case = self.cases[case_id]
        return self.deployments[case.deployment], self.modes[case.mode]

    def known_for(self, case_id: str) -> tuple[deployment.Known, ...]:
        """The known failures of a case (its own, or its cell's) that hold here."""
        entries = self.known.get(case_id, self.known.get(self.cases[case_id].cell, ()))
        return tuple(k for k in entries if k.holds() and not k.replayed)

    def replayed_known(self, cell: str) -> dict[str, deployment.Known]:
        """The scheduler tier's known failures of ``cell`` that hold here."""
        return {
            name: known
            for name in self.catalog
            for known in self.known.get(f"{cell}-{name}", ())
            if known.holds() and known.replayed
        }

    def run(self, run: WorkloadRun) -> CaseRecord:
        """``run.case_id`` played as served, held to its known failures: its cell's
        conversation or its workload's play, with the case's turns."""
        __tracebackhide__ = True
        case, known = self.cases[run.case_id], self.known_for(run.case_id)
        verdicts = {record.case_id: record.verdict for record in run.suite.records}
        judge_confirmed_elsewhere(known, verdicts)
        run = replace(run, known=known, num_turns=case.num_turns, resend=case.resend)
        if case.workload is not None:
            spec = self.catalog[case.workload]
            assert spec.play is not None, f"{spec.name} has no real-server play"
            return spec.play(run)
        shapes: tuple[str, ...] = (case.shape,) if case.shape else ()
        if case.at_once:
            units = None if run.in_process is None else run.in_process.units(run.mode)
            shapes = self.concurrent_shapes(run.case_id, units)
            if not shapes:
                pytest.skip(f"every sweep shape of {case.cell} fails alone at {units}")
        return run_case(run, shapes, case.concurrent, case.restores)

    def concurrent_shapes(self, case_id: str, units: Units | None) -> tuple[str, ...]:
        """The cell's shapes that pass alone at ``units``; one failing alone is left
        out, as batched it fails or not as prefills split (its case holds it)."""
        case = self.cases[case_id]
        if not case.at_once:
            return ()
        return tuple(
            shape
            for shape in SHAPES
            if f"{case.cell}-{shape}" in self.cases
            and deployment.select_known(self.known_for(f"{case.cell}-{shape}"), units)
            is None
        )

    def params(
        self,
        device_marks: Callable[[int], list] | None = None,
        skip: Callable[[str], str | None] | None = None,
    ) -> list:
        """A ``pytest.param(case_id)`` per case, marked with its servers key, with
        ``device_marks(n)`` on ``n`` > 1 devices, skipped where ``skip`` says why."""
        params = []
        for case_id, case in self.cases.items():
            deployed = self.deployments[case.deployment]
            # The cell's first case starts its servers and the rest reuse them,
            # except a workload with servers of its own.
            key = self.servers_key(case_id)
            start = case.case_id in (case.cell, key)
            seconds = case_seconds(len(deployed.instances), case.turns, start)
            marks = [servers_mark(key, seconds)]
            if device_marks is not None and deployed.num_devices > 1:
                marks += device_marks(deployed.num_devices)
            if skip is not None and (reason := skip(case_id)) is not None:
                marks.append(pytest.mark.skip(reason=reason))
            params.append(pytest.param(case_id, id=case_id, marks=marks))
        return params

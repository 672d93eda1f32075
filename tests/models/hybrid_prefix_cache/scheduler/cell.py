# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A matrix cell as the scheduler tier replays it (:class:`ReplayCell`): its engines
under a workload's :class:`Setting`, its servers, and its verdicts held to the tier's
known failures; a binding's matrix as the tier's cells (:class:`ReplayTier`)."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness.cases import Workload
from tests.models.hybrid_prefix_cache.harness.deployment import Binding
from tests.models.hybrid_prefix_cache.scheduler import judge, play
from tests.models.hybrid_prefix_cache.scheduler.engine import Engine
from tests.models.hybrid_prefix_cache.scheduler.servers import ReplayServer, servers_for


@dataclass(frozen=True)
class Replay:
    """A workload's replay in the scheduler tier (``scheduler.replays``): the
    cells it applies to, and its extra parameter (sync and async scheduling)."""

    workload: Workload
    run: Callable[..., None]
    variants: tuple[str, ...] = ()
    applies: Callable[[harness.Deployment, harness.Mode], bool] = lambda d, m: True


@dataclass(frozen=True)
class Setting:
    """What a workload changes in an engine (None: as the tier's servers run)."""

    budget: int | None = None
    num_blocks: int | None = None
    async_scheduling: bool | None = None
    max_model_len: int | None = None
    policy: str | None = None  # --scheduling-policy


# Builds a cell's engines under a setting and one of its KDA checkpoint alignments; a
# tier's BuildFor makes one of its fixtures: tiny_hybrid.TinyHybrid, the CPU binding.
Build = Callable[[Setting, int | None], list[Engine]]
BuildFor = Callable[[Any, Binding | None, harness.Deployment, harness.Mode], Build]
Alignments = Mapping[str, int | None]
Plays = Callable[[harness.Units], list[harness.conversation.Conversation]]


@dataclass(frozen=True)
class ReplayCell:
    """``known``: the tier's known failures by workload; ``plans``: the (turns, resend)
    its matrix gives a workload case."""

    cell_id: str
    tier: str
    deployment: harness.Deployment
    mode: harness.Mode
    token_ids: tuple[int, int]
    build: Build
    kda_checkpoints: Alignments = field(default_factory=lambda: {"": None})
    known: Mapping[str, harness.Known] = field(default_factory=dict)
    plans: Mapping[str, tuple[int, bool]] = field(default_factory=dict)

    def engines(
        self, setting: Setting | None = None, kda: int | None = None
    ) -> list[Engine]:
        """Skips where vLLM turns asynchronous scheduling down in-process: VllmConfig's
        validation for a drafter (config/vllm.py), or the CPU platform
        (platforms/cpu.py CpuPlatform.check_and_update_config)."""
        setting = setting or Setting()
        try:
            engines = self.build(setting, kda)
        except ValueError as e:
            lines = str(e).splitlines()
            refusal = next((x for x in lines if "async scheduling" in x.lower()), None)
            if not setting.async_scheduling or refusal is None:
                raise
            pytest.skip(
                f"vLLM refuses asynchronous scheduling with this drafter "
                f"({self.mode.spec}); confirmed in-process: {refusal.strip()!r}"
            )
        if setting.async_scheduling and not any(e.async_scheduling for e in engines):
            assert self.tier == "cpu", f"{self.tier}: asynchronous scheduling refused"
            pytest.skip(
                "vLLM's CPU platform turns asynchronous scheduling off "
                "(platforms/cpu.py CpuPlatform.check_and_update_config); confirmed "
                "in-process: --async-scheduling resolves to async_scheduling=False"
            )
        return engines

    def servers_of(
        self, engines: Sequence[Engine]
    ) -> tuple[harness.Units, list[ReplayServer]]:
        units = judge.check_geometry(engines[0], self.mode)
        return units, servers_for(engines, self.deployment, self.token_ids)

    def fail(self, workload: Workload, problems: Sequence[str], detail: str) -> None:
        """Fail naming the workload's property, judged by the tier's known failures."""
        if not problems:
            return
        case_id = f"{self.cell_id}-{workload.name}"
        text = f"{case_id}: {workload.holds} (vLLM: {workload.rule}):\n"
        text += "\n".join(problems)
        known = self.known.get(workload.name)
        if known is not None:
            judgment = harness.known.judge_failure(
                case_id, known, text, problems=problems
            )
            if judgment.verdict != harness.known.STALE:
                judgment.enact()
            # Not an AssertionError: replay() would judge it again.
            text = judgment.message
        pytest.fail(f"{text}\n{detail}", pytrace=False)

    def replay(self, replay: Replay, *variant: str) -> None:
        """Every assertion of the replay (a stalled engine, a refused request)
        fails naming the property; a listed case that passes is an XPASS."""
        __tracebackhide__ = True
        workload = replay.workload
        try:
            replay.run(self, *variant)
        except AssertionError as e:
            self.fail(workload, [f"{type(e).__name__}: {e}"], "")
        known = self.known.get(workload.name)
        if known is not None:
            harness.known.judge_pass(f"{self.cell_id}-{workload.name}", known).enact()

    def play_conversations(
        self, engines: Sequence[Engine], conversations: Plays, concurrent: bool = False
    ) -> tuple[list[play.TurnResult], list[str], list[str]]:
        """``conversations`` of the units the engines resolve, played through the
        cell's servers: their results, turn table and problems (judge.case_problems)."""
        units, servers = self.servers_of(engines)
        results = play.play_conversations(
            servers, self.deployment, conversations(units), self.token_ids, concurrent
        )
        rows, problems = judge.case_problems(
            servers, results, units, self.mode, self.deployment
        )
        return results, rows, problems


@dataclass(frozen=True)
class ReplayTier:
    """How a cell's engines are built, the KDA checkpoint alignments each replays, its
    token ids (None: the binding's); known failures are ``Matrix.replayed_known``'s."""

    name: str
    matrix: harness.Matrix
    build: BuildFor
    token_ids: tuple[int, int] | None = None
    kda_checkpoints: Alignments = field(default_factory=lambda: {"": None})

    def cells(self) -> dict[str, tuple[str, str]]:
        """(deployment, mode) by cell id, ``<tier>-<deployment>-<mode>``."""
        return {
            f"{self.name}-{name}-{mode}": (name, mode)
            for name in self.matrix.deployments
            for mode in self.matrix.modes
        }

    def params(self, replay: Replay) -> list:
        return [
            pytest.param(cell_id, id=cell_id)
            for cell_id, (name, mode) in self.cells().items()
            if replay.applies(self.matrix.deployments[name], self.matrix.modes[mode])
        ]

    def cell(self, cell_id: str, model: Any, binding: Binding | None) -> ReplayCell:
        """``cell_id`` of :meth:`cells`, built on ``model`` or ``binding``'s servers."""
        name, mode_name = self.cells()[cell_id]
        deployment = self.matrix.deployments[name]
        mode = self.matrix.modes[mode_name]
        cell = f"{name}-{mode_name}"
        token_ids = self.token_ids
        if token_ids is None:
            assert binding is not None, f"{self.name}: its tokens are a binding's"
            token_ids = binding.token_ids
        return ReplayCell(
            cell_id,
            self.name,
            deployment,
            mode,
            token_ids,
            self.build(model, binding, deployment, mode),
            self.kda_checkpoints,
            self.matrix.replayed_known(cell),
            {
                case.workload: (case.num_turns, case.resend)
                for case in self.matrix.cases.values()
                if case.cell == cell and case.workload is not None
            },
        )

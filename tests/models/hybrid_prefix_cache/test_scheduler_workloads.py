# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The workloads that vLLM's real hybrid prefix-cache bugs needed
(harness.WORKLOADS), replayed through vLLM's own scheduler for every cell of
both matrices where they apply, in seconds and without a device.

Each case is ``test_<workload>[<tier>-<deployment>-<mode>]``; each failure names
the property its workload holds. The cells and their engines are the
scheduler tier's (test_scheduler_conformance.py): the Kimi-K3 matrix at its
stated B200 geometry (with both KDA prefill checkpoints), the CPU tier's at
the geometry vLLM resolves here.
"""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest

from tests.models.hybrid_prefix_cache import cpu_binding as cpu
from tests.models.hybrid_prefix_cache import cpu_known, harness, scheduler
from tests.models.hybrid_prefix_cache import test_scheduler_conformance as tier
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid
from tests.models.kimi_k3 import test_prefix_cache as kimi

pytestmark = pytest.mark.skip_global_cleanup

tiny_model = tier.tiny_model
cpu_binding = tier.cpu_binding


@dataclass(frozen=True)
class Setting:
    """What a workload changes in an instance's engine: the prefill budget,
    the pool's blocks, and whether it schedules asynchronously (None: as
    the tier's servers run)."""

    budget: int | None = None
    num_blocks: int | None = None
    async_scheduling: bool | None = None
    max_model_len: int | None = None


@dataclass(frozen=True)
class Cell:
    tier: str
    deployment: harness.Deployment
    mode: harness.Mode
    token_ids: tuple[int, int]

    @property
    def pd(self) -> bool:
        return self.deployment.prefill is not None


def _cells() -> dict[str, tuple[str, str, str]]:
    cells = {}
    for tier_name, deployments, modes in (
        ("kimi", kimi.DEPLOYMENTS, kimi.MODES),
        ("cpu", cpu.DEPLOYMENTS, cpu.MODES),
    ):
        for name in deployments:
            for mode_name in modes:
                cells[f"{tier_name}-{name}-{mode_name}"] = (tier_name, name, mode_name)
    return cells


CELLS = _cells()


def _params(applies: Callable[[harness.Deployment], bool] = lambda d: True) -> list:
    params = []
    for cell_id, (tier_name, name, _) in CELLS.items():
        deployments = kimi.DEPLOYMENTS if tier_name == "kimi" else cpu.DEPLOYMENTS
        if applies(deployments[name]):
            params.append(pytest.param(cell_id, id=cell_id))
    return params


def cell_of(cell_id: str, binding: harness.Binding) -> Cell:
    tier_name, name, mode_name = CELLS[cell_id]
    if tier_name == "kimi":
        deployment, mode = kimi.DEPLOYMENTS[name], kimi.MODES[mode_name]
        return Cell(tier_name, deployment, mode, kimi.BINDING.token_ids)
    deployment, mode = cpu.DEPLOYMENTS[name], cpu.MODES[mode_name]
    return Cell(tier_name, deployment, mode, binding.token_ids)


def engines_of(
    cell: Cell,
    model: TinyHybrid,
    binding: harness.Binding,
    setting: Setting | None = None,
    kda_checkpoint: int | None = None,
) -> list[scheduler.Engine]:
    """The engines of ``cell``'s servers under ``setting``, as the
    scheduler tier builds them (a configuration vLLM refuses skips with the
    CPU tier's reason)."""
    setting = setting or Setting()
    if cell.tier == "kimi":
        settings = dict(tier.KIMI_SETTINGS)
        if setting.budget is not None:
            settings["max_num_batched_tokens"] = setting.budget
        if setting.num_blocks is not None:
            settings["num_blocks"] = setting.num_blocks
        if setting.async_scheduling is not None:
            settings["async_scheduling"] = setting.async_scheduling
        if setting.max_model_len is not None:
            settings["max_model_len"] = setting.max_model_len
        engines = []
        for instance in cell.deployment.instances:
            block = tier.kimi_geometry(instance, cell.mode)
            if isinstance(block, str):
                pytest.skip(block)
            geometry = scheduler.StatedGeometry(block, kda_checkpoint)
            engines.append(
                scheduler.stated_engine(
                    str(model.path), geometry, instance, cell.mode, **settings
                )
            )
        return engines
    extra: list[str] = []
    if setting.budget is not None:
        extra += ["--max-num-batched-tokens", str(setting.budget)]
    if setting.async_scheduling is not None:
        flag = "async-scheduling" if setting.async_scheduling else "no-async-scheduling"
        extra.append(f"--{flag}")
    if setting.max_model_len is not None:
        extra += ["--max-model-len", str(setting.max_model_len)]
    engines = tier.cpu_engines(binding, cell.deployment, cell.mode, extra)
    if setting.num_blocks is not None:
        # The CPU worker sizes its pool from --kv-cache-memory-bytes: the
        # same bytes per block, for num_blocks blocks.
        per_block = [
            engine.vllm_config.cache_config.kv_cache_memory_bytes
            // engine.kv_cache_config.num_blocks
            for engine in engines
        ]
        engines = tier.cpu_engines(
            binding,
            cell.deployment,
            cell.mode,
            extra,
            memory=[setting.num_blocks * size for size in per_block],
        )
    return engines


def kda_checkpoints(cell: Cell) -> dict[str, int | None]:
    """Both KDA prefill checkpoints for a Kimi-K3 cell; one run on CPU."""
    return tier.KDA_CHECKPOINTS if cell.tier == "kimi" else {"": None}


def servers_of(cell: Cell, engines: Sequence[scheduler.Engine]):
    units = tier.check_geometry(engines[0], cell.mode)
    return units, scheduler.servers_for(engines, cell.deployment, cell.token_ids)


def counter_problems(servers: Sequence[scheduler.ReplayServer]) -> list[str]:
    return [p for server in servers for p in server.counter_problems()]


def controls(
    recompute_hit: int, servers: Sequence[scheduler.ReplayServer]
) -> list[str]:
    """What every workload holds besides its property: its recompute under
    a fresh salt hits nothing, and each server's counters obey the rule."""
    found = [f"the recompute hit {recompute_hit}"] if recompute_hit else []
    return found + counter_problems(servers)


# What vLLM's scheduler does not do of a workload, by (workload, cell): the
# reason, the evidence its failure must show, and the releases it holds for.
# Found by these cases; the GPU tier cannot show them on CPU.
KNOWN: dict[tuple[str, str], harness.Known] = {
    ("aligned", "kimi-dcp2-offload-partial"): harness.Known(
        "xfail",
        "DCP2 with CPU offload in partial mode: after a first prompt that "
        "ends exactly on a block (three blocks), the next turn, its "
        "device cache reset, restores nothing from the host where the "
        "prompt's checkpoint one hit unit inside its last block should be; "
        "the same prompt's checkpoint is restored without DCP "
        "(kimi-offload-partial) and after an unaligned prompt (the "
        "reference turns, as on B200). The offload scheduler's store of "
        "that state under DCP (offloading/scheduler.py) is where to look",
        evidence="exact turn 1: vLLM's scheduler hits 0,",
        # 0.34.0's scheduler restores it (a strict XPASS there).
        releases=kimi.HOST_LOSS_RELEASES,
    ),
}


def known_of(workload: str, cell_id: str) -> harness.Known | None:
    """The :data:`KNOWN` entry of a case, where it holds for the vLLM under
    test."""
    known = KNOWN.get((workload, cell_id))
    return known if known is not None and known.holds() else None


def fail(workload: str, cell_id: str, problems: Sequence[str], detail: str) -> None:
    """Fail naming the property the workload holds; a failure listed in
    :data:`KNOWN` xfails where its evidence shows (and fails as stale where
    it does not)."""
    if not problems:
        return
    what = harness.WORKLOADS[workload]
    text = f"{cell_id}-{workload}: {what.holds} (vLLM: {what.rule}):\n" + "\n".join(
        problems
    )
    known = known_of(workload, cell_id)
    if known is not None and known.evidence in text:
        pytest.xfail(f"{known.reason} (seen: {known.evidence!r})")
    if known is not None:
        text = f"listed as {known.reason}, but without {known.evidence!r}: {text}"
    pytest.fail(f"{text}\n{detail}", pytrace=False)


def holds(workload: str | None = None):
    """A workload's test, whose every assertion (a replayed engine that
    stalled, a request vLLM refused) fails naming the property it holds;
    None: the workload is the test's ``scheduling`` parameter."""

    def decorate(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            try:
                return test(*args, **kwargs)
            except AssertionError as e:
                name = workload or kwargs["scheduling"]
                fail(name, kwargs["cell_id"], [f"{type(e).__name__}: {e}"], "")

        return run

    return decorate


def passed(workload: str, cell_id: str) -> None:
    """A case that passed: a strict XPASS where :data:`KNOWN` lists it."""
    known = known_of(workload, cell_id)
    if known is not None:
        pytest.fail(
            f"[XPASS(strict)] {cell_id}-{workload} is listed as {known.reason} "
            f"but passed: remove it from KNOWN",
            pytrace=False,
        )


# --- shared-prefix ---------------------------------------------------------------


@pytest.mark.parametrize("cell_id", _params())
@holds("shared-prefix")
def test_shared_prefix(tiny_model, cpu_binding, cell_id: str) -> None:
    """Siblings that share a system prompt ending inside a block, then
    diverge: the first computes it, the second finds the junction (its
    attention blocks hit past any Mamba state) and caches the state there,
    every later one resumes at the junction's checkpoint
    (harness.junction_checkpoint)."""
    cell = cell_of(cell_id, cpu_binding)
    for kda, alignment in kda_checkpoints(cell).items():
        engines = engines_of(cell, tiny_model, cpu_binding, kda_checkpoint=alignment)
        units, servers = servers_of(cell, engines)
        shared, siblings = scheduler.play_siblings(
            servers, units, cell_id, cell.token_ids
        )
        junction = harness.junction_checkpoint(shared, units, cell.mode.drops_unit)
        problems = []
        for index, sibling in enumerate(siblings):
            name = f"sibling {index} ({sibling.prompt_len} tokens)"
            bound = harness.hit_bound(shared, sibling.prompt_len, units.hit)
            if sibling.hit > bound or sibling.hit % units.hit:
                problems.append(
                    f"{name}: cached {sibling.hit}, beyond the shared "
                    f"{shared}-token prefix's bound {bound}"
                )
            if index == 0 and sibling.hit:
                problems.append(f"{name}: the first sibling cached {sibling.hit}")
            if index >= 2 and sibling.hit != junction:
                problems.append(
                    f"{name}: cached {sibling.hit}, not the junction checkpoint "
                    f"{junction} of the shared {shared}-token prefix (block "
                    f"{units.block}, drafter drops a unit: {cell.mode.drops_unit})"
                    + junction_lookup(servers[0])
                )
            if sibling.recompute_hit:
                problems.append(f"{name}: the recompute hit {sibling.recompute_hit}")
        problems += counter_problems(servers)
        hits = [sibling.hit for sibling in siblings]
        fail(
            "shared-prefix",
            cell_id,
            problems,
            f"{kda} hits {hits}, junction {junction}, hit unit {units.hit}",
        )


def junction_lookup(server: scheduler.ReplayServer) -> str:
    """What the failure says of a scheduler whose local lookup goes through
    its connector: KVCacheManager.get_computed_blocks_for_connector looks up
    each group alone and reports no shared-prefix boundary."""
    connector = server.scheduler.connector
    if connector is not None and connector.supports_divergent_local_hybrid_hits:
        return (
            f"; its {type(connector).__name__} takes the per-group lookup "
            f"(get_computed_blocks_for_connector), which detects no "
            f"shared-prefix junction"
        )
    return ""


# --- abort-retry ------------------------------------------------------------------


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("cell_id", _params())
@holds("abort-retry")
def test_abort_retry(tiny_model, cpu_binding, cell_id: str, scheduling: str) -> None:
    """A client aborts a cold prefill after its first chunk was scheduled,
    then retries: the retry never resumes past what the aborted request's
    steps wrote (harness.abort_problems), its recompute hits nothing, and
    the counters count the aborted request once. Under asynchronous
    scheduling the abort lands with a step in flight. Then a retry sent
    while the original still prefills, and the original aborted after it:
    the retry never resumes from a state that its own step publishes
    (harness.overlap_problems)."""
    cell = cell_of(cell_id, cpu_binding)
    setting = Setting(async_scheduling=scheduling == "async")
    for kda, alignment in kda_checkpoints(cell).items():
        engines = async_engines(cell, tiny_model, cpu_binding, setting, alignment)
        units, servers = servers_of(cell, engines)
        budget = engines[0].vllm_config.scheduler_config.max_num_batched_tokens
        prompt_len = harness.abort_length(units, budget)
        result = scheduler.play_abort_retry(
            servers, cell.deployment, prompt_len, cell_id, cell.token_ids
        )
        problems = harness.abort_problems(
            result.hit, result.written, result.in_flight, prompt_len, units
        )
        problems += controls(result.recompute_hit, servers)
        fail("abort-retry", cell_id, problems, f"{kda} {result}")
        # The retry sent while the original still prefills, then the abort.
        units, servers = servers_of(cell, engines)
        overlap = scheduler.play_overlapping_retry(
            servers, cell.deployment, prompt_len, cell_id, cell.token_ids
        )
        problems = harness.overlap_problems(
            overlap.hit, overlap.written, prompt_len, units
        )
        problems += controls(overlap.recompute_hit, servers)
        fail("abort-retry", cell_id, problems, f"{kda} {overlap}")


def async_engines(
    cell: Cell,
    model: TinyHybrid,
    binding: harness.Binding,
    setting: Setting,
    kda_checkpoint: int | None,
) -> list[scheduler.Engine]:
    """:func:`engines_of`, where asynchronous scheduling asked of the CPU
    platform is confirmed refused in-process: CpuPlatform.
    check_and_update_config (platforms/cpu.py) sets it off ("async
    scheduling is not required on CPU"), so the server would schedule
    synchronously."""
    try:
        engines = engines_of(cell, model, binding, setting, kda_checkpoint)
    except ValueError as e:
        # VllmConfig's validation (config/vllm.py), before the platform's;
        # each release words it its own way.
        lines = str(e).splitlines()
        refusal = next((x for x in lines if "async scheduling" in x.lower()), None)
        if not setting.async_scheduling or refusal is None:
            raise
        pytest.skip(
            f"vLLM refuses asynchronous scheduling with this drafter "
            f"({cell.mode.spec}); confirmed in-process: {refusal.strip()!r}"
        )
    if setting.async_scheduling and not any(e.async_scheduling for e in engines):
        assert cell.tier == "cpu", f"{cell.tier}: asynchronous scheduling was refused"
        pytest.skip(
            "vLLM's CPU platform turns asynchronous scheduling off "
            "(platforms/cpu.py CpuPlatform.check_and_update_config); confirmed "
            "in-process: --async-scheduling resolves to async_scheduling=False"
        )
    return engines


# --- eviction ----------------------------------------------------------------------


@pytest.mark.parametrize("cell_id", _params())
@holds("eviction")
def test_eviction(tiny_model, cpu_binding, cell_id: str) -> None:
    """A pool that holds EVICTION_POOL_REQUESTS requests' blocks (measured
    on the engine itself), a conversation's first turn, pressure from other
    prompts, then its second turn: its local hit never exceeds the least
    that every group still holds (each group's own lookup just before it),
    the counters agree, and the pressure did evict (else the workload would
    not test anything)."""
    cell = cell_of(cell_id, cpu_binding)
    for kda, alignment in kda_checkpoints(cell).items():
        engines = engines_of(cell, tiny_model, cpu_binding, kda_checkpoint=alignment)
        units, servers = servers_of(cell, engines)
        length = harness.reference_conversation(units, "").first_len
        # The model's length is cut to the workload's longest request
        # (harness.eviction_max_len), and one request is measured at that
        # length.
        max_len = harness.eviction_max_len(length, harness.MAX_TOKENS)
        sizing = [cell.token_ids[0]] * (max_len - 1)
        used = scheduler.blocks_in_use(servers[0], sizing, "size")

        def build(blocks: int, alignment=alignment, max_len=max_len):
            setting = Setting(num_blocks=blocks, max_model_len=max_len)
            engines = engines_of(cell, tiny_model, cpu_binding, setting, alignment)
            return servers_of(cell, engines)[1]

        def play(servers, units=units) -> scheduler.Eviction:
            return scheduler.play_eviction(servers, units, cell_id, cell.token_ids)

        blocks, servers, result = scheduler.sized_eviction(
            build, harness.EVICTION_POOL_REQUESTS * used + 1, play
        )
        problems = harness.eviction_problems(result.local_hit, result.held)
        if result.held == result.held_before:
            problems.append(
                f"nothing was evicted: every group holds {list(result.held)} "
                f"before and after the pressure ({blocks} blocks for {used} a "
                f"request)"
            )
        problems += controls(result.recompute_hit, servers)
        fail("eviction", cell_id, problems, f"{kda} {result}")


# --- small-budget, aligned, async and sync: conversations on other engines --------


def play_reference(
    cell: Cell,
    engines: Sequence[scheduler.Engine],
    conversations: Callable[[harness.Units], list[harness.Conversation]],
    concurrent: bool = False,
) -> tuple[harness.Units, list, list[scheduler.TurnResult]]:
    units, servers = servers_of(cell, engines)
    results = scheduler.play_conversations(
        servers, cell.deployment, conversations(units), cell.token_ids, concurrent
    )
    return units, servers, results


@pytest.mark.parametrize("cell_id", _params())
@holds("small-budget")
def test_small_budget(tiny_model, cpu_binding, cell_id: str) -> None:
    """The reference conversation under each of harness.small_budgets: its
    hits equal those under the default budget turn by turn, and the
    harness's expectation."""
    cell = cell_of(cell_id, cpu_binding)
    for kda, alignment in kda_checkpoints(cell).items():
        engines = engines_of(cell, tiny_model, cpu_binding, kda_checkpoint=alignment)
        units = tier.check_geometry(engines[0], cell.mode)

        def reference(units):
            return [harness.reference_conversation(units, cell_id)]

        _, _, default = play_reference(cell, engines, reference)
        for budget in harness.small_budgets(units):
            setting = Setting(budget)
            small = engines_of(cell, tiny_model, cpu_binding, setting, alignment)
            units, servers, results = play_reference(cell, small, reference)
            problems = [
                f"turn {a.planned.index}: cached {b.hit} under a budget of "
                f"{budget}, {a.hit} under the default"
                for a, b in zip(default, results)
                if a.hit != b.hit
            ]
            rows, wrong = tier.case_problems(
                servers, results, units, cell.mode, cell.deployment
            )
            problems += wrong
            detail = f"{kda} budget {budget}\n" + "\n".join(rows)
            fail("small-budget", cell_id, problems, detail)


@pytest.mark.parametrize("cell_id", _params())
@holds("aligned")
def test_aligned(tiny_model, cpu_binding, cell_id: str) -> None:
    """A conversation whose first prompt ends exactly on a block (sweep
    shape "exact"): every turn hits the harness's expectation. Where the
    cell's matrix plays its aligned case otherwise (the Kimi-K3 matrix: the
    aligned prompt and the next turn, no resend), that conversation too."""
    cell = cell_of(cell_id, cpu_binding)
    tier_name, name, mode_name = CELLS[cell_id]
    matrix = kimi.MATRIX if tier_name == "kimi" else cpu_known.MATRIX
    case = matrix.cases.get(f"{name}-{mode_name}-aligned")
    plans = {(harness.NUM_TURNS, True)}
    if case is not None:
        plans.add((case.num_turns, case.resend))
    for kda, alignment in kda_checkpoints(cell).items():
        for num_turns, resend in sorted(plans, reverse=True):
            engines = engines_of(
                cell, tiny_model, cpu_binding, kda_checkpoint=alignment
            )
            seed = f"{cell_id}-aligned"
            if (num_turns, resend) != (harness.NUM_TURNS, True):
                seed += f"-{num_turns}-turns"

            def aligned(units, seed=seed, num_turns=num_turns, resend=resend):
                length = harness.shape_length("exact", units)
                return [harness.Conversation("exact", length, seed, num_turns, resend)]

            units, servers, results = play_reference(cell, engines, aligned)
            rows, problems = tier.case_problems(
                servers, results, units, cell.mode, cell.deployment
            )
            plan = f"{num_turns} turns" + (" and a resend" if resend else "")
            detail = f"{kda} {plan}\n" + "\n".join(rows)
            fail("aligned", cell_id, problems, detail)
    passed("aligned", cell_id)


@pytest.mark.parametrize("cell_id", _params(lambda d: d.prefill is not None))
@holds("pd-resend")
def test_pd_resend(tiny_model, cpu_binding, cell_id: str) -> None:
    """Exact resends through the P/D pair: of a prompt that ends on a block,
    of one whose part the prefiller sees (the prompt less the deployment's
    cache backoff, nixl/base_scheduler.py _truncate_request_for_prefill)
    ends on a block, so that every block of it is cached there, and of the
    reference one. Each is answered and hits its own checkpoint on the
    prefiller (harness.expected_resend of the prompt the prefiller sees),
    and the decoder's own cache hits what the rule of its role says
    (harness.decoder_resend_hit), as the real-server case holds it."""
    cell = cell_of(cell_id, cpu_binding)
    for kda, alignment in kda_checkpoints(cell).items():
        engines = engines_of(cell, tiny_model, cpu_binding, kda_checkpoint=alignment)
        units, _ = servers_of(cell, engines)
        aligned = harness.shape_length("exact", units)
        lengths = (
            aligned,
            aligned + cell.deployment.cache_backoff,
            harness.reference_conversation(units, "").first_len,
        )
        for prompt_len in lengths:
            units, servers = servers_of(cell, engines)
            results = scheduler.play_resend(
                servers, cell.deployment, prompt_len, cell_id, cell.token_ids
            )
            rows, problems = tier.case_problems(
                servers, results, units, cell.mode, cell.deployment
            )
            resend = results[-1]
            expected = harness.decoder_resend_hit(
                prompt_len, units, cell.mode, cell.deployment
            )
            if resend.decoder_hit != expected:
                problems.append(
                    f"resend of {prompt_len} tokens: the decoder's own cache hit "
                    f"{resend.decoder_hit}, its role's rule says {expected} "
                    f"(harness.decoder_resend_hit)"
                )
            fail("pd-resend", cell_id, problems, f"{kda}\n" + "\n".join(rows))


@pytest.mark.parametrize("scheduling", ["async", "sync"])
@pytest.mark.parametrize("cell_id", _params())
@holds()
def test_scheduling(tiny_model, cpu_binding, cell_id: str, scheduling: str) -> None:
    """Two conversations of different shapes (the reference and a first
    prompt one token past the blocks) under asynchronous or synchronous
    scheduling; on one server without offload they run at once, so that
    requests join and leave between steps. Every turn hits the harness's
    expectation."""
    cell = cell_of(cell_id, cpu_binding)
    setting = Setting(async_scheduling=scheduling == "async")
    concurrent = not cell.pd and not cell.deployment.offload
    for kda, alignment in kda_checkpoints(cell).items():
        engines = async_engines(cell, tiny_model, cpu_binding, setting, alignment)
        depth = engines[0].vllm_config.max_concurrent_batches
        assert (depth > 1) == setting.async_scheduling, (scheduling, depth)

        def two(units):
            return [
                harness.reference_conversation(units, f"{cell_id}-reference"),
                harness.Conversation(
                    "plus1", harness.shape_length("plus1", units), f"{cell_id}-plus1"
                ),
            ]

        units, servers, results = play_reference(cell, engines, two, concurrent)
        rows, problems = tier.case_problems(
            servers, results, units, cell.mode, cell.deployment
        )
        fail(scheduling, cell_id, problems, f"{kda} depth {depth}\n" + "\n".join(rows))

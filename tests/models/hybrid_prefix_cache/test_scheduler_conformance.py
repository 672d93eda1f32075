# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every cell's expectations, checked against vLLM's own scheduler in seconds.

The end-to-end tiers hold each turn's hit to the harness's reading of vLLM
(``harness.expectation``) and each server's counters to the harness's counter
rule (``harness.counter_problems``). This tier replays the same conversations
through vLLM's real scheduling objects in-process (the ``scheduler`` package:
the real ``Scheduler`` and ``KVCacheManager``, the real scheduler side of
each KV connector, stand-in workers) and requires, per turn, vLLM's hit to
EQUAL the expected hit (and to respect the bound), the recompute to hit
nothing, and, per server, the counters that vLLM's own ``PrefixCacheStats``
move to obey the counter rule. It covers:

* every cell of the Kimi-K3 matrix (``kimi.DEPLOYMENTS`` x ``kimi.MODES``)
  and its exact resends, with the B200 geometry stated in
  ``kimi.KIMI_BLOCKS`` (the GPU tier cannot run here); its Mooncake resend is
  listed and skips, naming what it would need;
* every case of the CPU tier (``cpu_known.MATRIX``: deployments x modes,
  the tail sweep, the concurrent conversations), with the geometry vLLM
  resolves for the tiny model on this machine.

No server is started and no device is needed.
"""

from collections.abc import Sequence
from math import lcm
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache import cpu_binding as cpu
from tests.models.hybrid_prefix_cache import cpu_known, harness, scheduler
from tests.models.hybrid_prefix_cache.tiny_hybrid import (
    TinyHybrid,
    write_tiny_hybrid,
)
from tests.models.kimi_k3 import test_prefix_cache as kimi

# Only scheduler-side objects are built: no distributed state or device
# memory for tests/conftest.py's per-test cleanup (a full gc.collect each)
# to free.
pytestmark = pytest.mark.skip_global_cleanup

# --- Kimi-K3 on B200 -------------------------------------------------------------

# What the GPU servers run with that the scheduler reads: vLLM's default
# --max-num-batched-tokens for the API server on a GPU of 160 GB or more
# (EngineArgs.get_batch_defaults: B200, MI355), the matrix's --max-num-seqs,
# asynchronous scheduling (vLLM's default on CUDA with DSpark or without a
# drafter), a context longer than any prompt here, and enough blocks that
# nothing is evicted (as on a B200).
KIMI_SETTINGS = {
    "max_model_len": 32768,
    "max_num_batched_tokens": 16384,
    "max_num_seqs": 8,
    "async_scheduling": True,
    "num_blocks": 2048,
}
# Kimi-K3's KDA prefill saves the prompt's checkpoint inside the last chunk
# with FlashKDA (alignment 16) and needs a chunk split for it with the Triton
# prefill (no internal checkpoint): kda_prefill_checkpoint_alignment. Which
# one a B200 picks depends on the installed kernels, so every Kimi cell is
# replayed with both and must agree with the harness with both.
KDA_CHECKPOINTS = {"flashkda": 16, "triton": None}


def kimi_geometry(instance: harness.Instance, mode: harness.Mode) -> int | str:
    """The stated block of ``instance`` in ``mode`` (kimi.stated_block), or
    why there is none."""
    return kimi.stated_block(instance, mode)


def kimi_engines(
    model: Path,
    deployment: harness.Deployment,
    mode: harness.Mode,
    kda_checkpoint: int | None,
) -> list[scheduler.Engine]:
    engines = []
    for instance in deployment.instances:
        block = kimi_geometry(instance, mode)
        if isinstance(block, str):
            pytest.skip(block)
        geometry = scheduler.StatedGeometry(block, kda_checkpoint)
        engines.append(
            scheduler.stated_engine(
                str(model), geometry, instance, mode, **KIMI_SETTINGS
            )
        )
    return engines


# --- the CPU tier ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> TinyHybrid:
    """The CPU tier's model, written once; also the stand-in ModelConfig of
    the Kimi-K3 scheduler (its checkpoint is not here)."""
    return write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid"))


@pytest.fixture(scope="module")
def cpu_binding(tiny_model: TinyHybrid) -> harness.Binding:
    return cpu.cpu_binding(tiny_model)


# A drafter whose rule depends on the release and on the KV connector (the
# unit drop of 0.32, the lookahead hashes of 0.33 without a connector and of
# 0.34 behind one that declares them): MTP, on the tiny model with its MTP
# layer. No CPU server drafts (cpu_known._SPEC), so its cells are the
# scheduler tier's alone, on the CPU tier's deployments and geometry.
MTP = {"method": "mtp", "num_speculative_tokens": 2}
MTP_MODES = {
    "block-mtp": harness.Mode(spec=MTP),
    "partial-mtp": harness.Mode(prefix_match_unit=cpu.PARTIAL_UNIT, spec=MTP),
}


@pytest.fixture(scope="module")
def mtp_binding(tmp_path_factory) -> harness.Binding:
    """The CPU tier's binding of the tiny model with its MTP layer."""
    model = write_tiny_hybrid(tmp_path_factory.mktemp("tiny-mtp"), "mtp")
    return cpu.cpu_binding(model)


def cpu_engines(
    binding: harness.Binding,
    deployment: harness.Deployment,
    mode: harness.Mode,
    extra: Sequence[str] = (),
    memory: Sequence[int] | None = None,
) -> list[scheduler.Engine]:
    """Each server's engine, from exactly the arguments and environment the
    CPU tier starts it with (harness.server_specs), then ``extra``
    arguments and, per server, ``memory`` bytes of KV cache (a later
    argument wins, as on the command line); a configuration that vLLM
    refuses in-process, as the server does, skips with the CPU tier's own
    reason."""
    engines = []
    specs = harness.server_specs(binding, deployment, mode)
    for index, spec in enumerate(specs):
        args = [*spec.args, *extra]
        if memory is not None:
            args += ["--kv-cache-memory-bytes", str(memory[index])]
        try:
            engines.append(scheduler.cpu_engine(spec.model, args, dict(spec.env)))
        except Exception as e:
            unsupported = [
                known
                for entries in cpu_known.KNOWN.values()
                for known in entries
                if known.kind == "unsupported" and known.evidence in str(e)
            ]
            if not unsupported:
                raise
            pytest.skip(
                f"vLLM refuses this configuration in-process as its server "
                f"does ({unsupported[0].reason}; confirmed: "
                f"{unsupported[0].evidence!r})"
            )
    return engines


# --- the checks ------------------------------------------------------------------


def check_geometry(engine: scheduler.Engine, mode: harness.Mode) -> harness.Units:
    """The harness's reading of the server's cache_config_info labels must
    give the hit unit the engine aligns hits to."""
    units = scheduler.units_of(engine, mode)
    geometry = engine.geometry
    assert units.hit == engine.hit_unit, (
        f"the harness reads hit unit {units.hit} from block_size="
        f"{geometry.attention_block}, mamba_block_size={geometry.mamba_block}, "
        f"prefix_match_unit={mode.prefix_match_unit}, but vLLM aligns hits to "
        f"{engine.hit_unit} (cache_hit_alignment_tokens)"
    )
    return units


def turn_problems(
    results: Sequence[scheduler.TurnResult],
    units: harness.Units,
    mode: harness.Mode,
    deployment: harness.Deployment,
) -> tuple[list[str], list[str]]:
    """(the turn table, every way a turn disagrees with the harness)."""
    backoff = deployment.cache_backoff
    rule = mode.drafting(deployment.instances[0])
    rows = [
        f"{'conversation':<14} {'turn':>6} {'prompt':>6} {'vLLM hit':>8} "
        f"{'expected':>8} {'bound':>6} {'recompute':>9}"
    ]
    problems = []
    for result in results:
        turn = result.planned
        expected, bound = harness.expectation(
            turn, units.hit, rule.drops_unit, backoff, rule.lookahead
        )
        what = "resend" if turn.resend else f"turn {turn.index}"
        name = f"{result.conversation} {what}".strip()
        rows.append(
            f"{result.conversation or '-':<14} "
            f"{'resend' if turn.resend else turn.index:>6} {turn.prompt_len:>6} "
            f"{result.hit:>8} {expected:>8} {bound:>6} "
            f"{'-' if result.recompute_hit is None else result.recompute_hit:>9}"
        )
        if result.hit != expected:
            problems.append(
                f"{name}: vLLM's scheduler hits {result.hit}, the harness expects "
                f"{expected} (prompt {turn.prompt_len}, previous {turn.prev_len}, "
                f"hit unit {units.hit}, drafter {rule}, "
                f"backoff {backoff})"
            )
        prev_seen = max(turn.prev_len - backoff, 0)
        why = harness.impossible_hit(
            result.hit, prev_seen, turn.prompt_len - backoff, units.hit
        )
        if why or result.hit > bound:
            problems.append(f"{name}: beyond the harness's bound {bound}: {why}")
        if result.recompute_hit not in (None, 0):
            problems.append(
                f"{name}: the recompute under a fresh salt hit {result.recompute_hit}"
            )
    return rows, problems


def case_problems(
    servers: Sequence[scheduler.ReplayServer],
    results: Sequence[scheduler.TurnResult],
    units: harness.Units,
    mode: harness.Mode,
    deployment: harness.Deployment,
) -> tuple[list[str], list[str]]:
    """(the turn table, every way the case disagrees with the harness): its
    turns (:func:`turn_problems`), each server's counters, and the
    completions the harness routes to each server."""
    rows, problems = turn_problems(results, units, mode, deployment)
    turns = []
    for result in results:
        turn = harness.Turn(
            result.conversation, result.planned.index, result.planned.prompt_len, 0, 0
        )
        if result.recompute_hit is not None:
            # Only whether there was one matters to expected_requests.
            turn.recompute = harness.Sample([], "", [], [], 0, 0)
        turns.append(turn)
    routes = harness.expected_requests(len(servers), turns)
    for server, route in zip(servers, routes):
        problems += server.counter_problems()
        if server.ledger.requests != route:
            problems.append(
                f"{server.name} server answered {server.ledger.requests} "
                f"completions, the harness routes {route} to it"
            )
    return rows, problems


def check_case(
    case_id: str,
    servers: Sequence[scheduler.ReplayServer],
    results: Sequence[scheduler.TurnResult],
    units: harness.Units,
    mode: harness.Mode,
    deployment: harness.Deployment,
) -> None:
    rows, problems = case_problems(servers, results, units, mode, deployment)
    table = "\n".join(rows)
    counters = "\n".join(
        f"{server.name}: {server.ledger} moved {server.moved}" for server in servers
    )
    print(f"\n== {case_id}: hit unit {units.hit}, block {units.block}\n{table}")
    assert not problems, (
        f"{case_id}:\n" + "\n".join(problems) + f"\n{table}\n{counters}"
    )


# --- Kimi-K3 -----------------------------------------------------------------------


def _kimi_params() -> list:
    return [
        pytest.param(name, mode_name, id=f"{name}-{mode_name}")
        for name in kimi.DEPLOYMENTS
        for mode_name in kimi.MODES
    ]


def _drafter_params() -> list:
    return [
        pytest.param(tier, name, id=f"{tier}-{name}")
        for tier, modes in (
            ("kimi", kimi.MODES),
            ("cpu", cpu.MODES),
            ("mtp", MTP_MODES),
        )
        for name, mode in modes.items()
        if mode.spec is not None
    ]


@pytest.mark.parametrize(("tier", "mode_name"), _drafter_params())
def test_drop_rule_is_the_schedulers(
    tiny_model, mtp_binding, cpu_binding, tier, mode_name
):
    """The harness reads what a drafter changes from vLLM's config and, for
    the lookahead hashes, from the connector's own declaration
    (harness.drafting); vLLM's scheduler must then do it: Scheduler.__init__
    sets use_eagle_block_drop (off where it hashes lookahead tokens) and
    hands it to the KVCacheManager, whose lookups drop the unit, and from
    0.33 num_hash_lookahead_tokens. A scheduler that ignores the config, or
    a config that stops honouring a connector's declaration, fails here by
    name; so does a Kimi-K3 drafter whose rule is not the one its binding
    states for the release under test."""
    if tier == "kimi":
        mode = kimi.MODES[mode_name]
        deployments = kimi.DEPLOYMENTS
        stated = kimi.drafter_rule()
        for name, deployment in deployments.items():
            for instance in deployment.instances:
                got = mode.drafting(instance)
                assert got == stated, (
                    f"kimi {name} {mode_name}: vLLM {harness.release_under_test()} "
                    f"answers {got} for {mode.spec['method']}, the binding states "
                    f"{stated} for this release (kimi.DRAFTER_RULES)"
                )
    else:
        modes = cpu.MODES if tier == "cpu" else MTP_MODES
        mode = modes[mode_name]
        deployments = cpu.DEPLOYMENTS
    binding = mtp_binding if tier == "mtp" else cpu_binding
    for name, deployment in deployments.items():
        try:
            if tier == "kimi":
                engines = kimi_engines(tiny_model.path, deployment, mode, None)
            else:
                engines = cpu_engines(binding, deployment, mode)
        except pytest.skip.Exception as e:
            print(f"{tier} {name} {mode_name}: not built ({e.msg})")
            continue
        for engine, instance in zip(engines, deployment.instances):
            rule = mode.drafting(instance)
            vllm_scheduler = engine.scheduler()
            connector = (instance.kv_config or {}).get("kv_connector")
            what = f"{tier} {name} {mode_name} (connector {connector})"
            # Before 0.32 (0.26) the scheduler's flag was use_eagle.
            drops = getattr(
                vllm_scheduler, "use_eagle_block_drop", vllm_scheduler.use_eagle
            )
            assert drops == rule.drops_unit, (
                f"{what}: the harness reads {rule}, vLLM's scheduler drops {drops}"
            )
            assert vllm_scheduler.kv_cache_manager.use_eagle == rule.drops_unit, (
                f"{what}: the KV cache manager's lookups drop "
                f"{vllm_scheduler.kv_cache_manager.use_eagle}, the harness reads "
                f"{rule}"
            )
            hashed = getattr(vllm_scheduler, "num_hash_lookahead_tokens", 0)
            assert hashed == rule.lookahead, (
                f"{what}: vLLM's scheduler hashes {hashed} lookahead tokens, "
                f"the harness reads {rule}"
            )


@pytest.mark.parametrize(("deployment_name", "mode_name"), _kimi_params())
def test_kimi_cell(tiny_model, deployment_name: str, mode_name: str) -> None:
    deployment = kimi.DEPLOYMENTS[deployment_name]
    mode = kimi.MODES[mode_name]
    case_id = f"{deployment_name}-{mode_name}"
    for kda, alignment in KDA_CHECKPOINTS.items():
        engines = kimi_engines(tiny_model.path, deployment, mode, alignment)
        units = check_geometry(engines[0], mode)
        servers = scheduler.servers_for(engines, deployment, kimi.BINDING.token_ids)
        conversation = harness.reference_conversation(units, case_id)
        results = scheduler.play_conversations(
            servers, deployment, [conversation], kimi.BINDING.token_ids
        )
        check_case(f"{case_id} ({kda})", servers, results, units, mode, deployment)


@pytest.mark.parametrize("prompt_len", kimi.RESEND_LENGTHS, ids=lambda n: f"resend-{n}")
def test_kimi_resend(tiny_model, prompt_len: int) -> None:
    """kimi.test_exact_resend: cold, then the resend, which hits the prompt's
    own checkpoint (harness.expected_resend)."""
    deployment = kimi.DEPLOYMENTS["plain"]
    mode = kimi.MODES[kimi.RESEND_MODE]
    case_id = f"plain-{kimi.RESEND_MODE}-resend-{prompt_len}"
    for kda, alignment in KDA_CHECKPOINTS.items():
        engines = kimi_engines(tiny_model.path, deployment, mode, alignment)
        units = check_geometry(engines[0], mode)
        servers = scheduler.servers_for(engines, deployment, kimi.BINDING.token_ids)
        results = scheduler.play_resend(
            servers, deployment, prompt_len, case_id, kimi.BINDING.token_ids
        )
        resend = results[-1]
        rule = mode.drafting(deployment.decode)
        expected = harness.expected_resend(
            prompt_len, units.hit, rule.drops_unit, rule.lookahead
        )
        assert resend.hit == expected, (
            f"{case_id} ({kda}): vLLM's scheduler hits {resend.hit} on the "
            f"resend, harness.expected_resend gives {expected}"
        )
        check_case(f"{case_id} ({kda})", servers, results, units, mode, deployment)


def test_kimi_mooncake_resend() -> None:
    """kimi.test_mooncake_store_resend (MOONCAKE_DEPLOYMENT, 7449 tokens)."""
    connector = kimi.MOONCAKE_DEPLOYMENT.decode.kv_config["kv_connector"]
    pytest.skip(
        f"{connector}'s hit is its worker's lookup in a MooncakeDistributedStore: "
        f"the scheduler side asks the worker over ZMQ (LookupKeyClient, "
        f"mooncake/store/scheduler.py) and the worker (MooncakeStoreWorker) "
        f"needs the Mooncake transfer engine and a master; no stand-in for "
        f"the store here (resend of {kimi.MOONCAKE_RESEND_LENGTH} tokens "
        f"unchecked)"
    )


# --- the CPU tier --------------------------------------------------------------------


@pytest.mark.parametrize(
    "case_id",
    # The workload cases are test_scheduler_workloads.py's, for every cell.
    [c for c, case in cpu_known.MATRIX.cases.items() if case.workload is None],
)
def test_cpu_case(cpu_binding: harness.Binding, case_id: str) -> None:
    case = cpu_known.MATRIX.cases[case_id]
    deployment, mode = cpu_known.MATRIX.served(case_id)
    engines = cpu_engines(cpu_binding, deployment, mode)
    units = check_geometry(engines[0], mode)
    if case.shape is not None:
        shapes: Sequence[str] = (case.shape,)
    else:
        shapes = cpu_known.MATRIX.concurrent_shapes(case_id, units)
    conversations = [
        harness.Conversation(shape, length, f"{case_id}-{shape}")
        for shape in shapes
        if (length := harness.shape_length(shape, units)) is not None
    ]
    if shapes and not conversations:
        pytest.skip(
            f"shapes {list(shapes)} need a hit unit below the block; vLLM "
            f"resolves hit unit {units.hit}, block {units.block}"
        )
    if not shapes:
        conversations = [harness.reference_conversation(units, case_id)]
    servers = scheduler.servers_for(engines, deployment, cpu_binding.token_ids)
    results = scheduler.play_conversations(
        servers,
        deployment,
        conversations,
        cpu_binding.token_ids,
        concurrent=case.concurrent,
    )
    check_case(case_id, servers, results, units, mode, deployment)


@pytest.mark.parametrize("mode_name", MTP_MODES)
@pytest.mark.parametrize("deployment_name", cpu.DEPLOYMENTS)
def test_mtp_cell(mtp_binding: harness.Binding, deployment_name: str, mode_name: str):
    """Every CPU deployment's reference conversation and resend with MTP
    drafts (MTP_MODES), where what the drafter changes depends on the
    release and the connector: each turn must hit what the harness reads
    for the instance that consults its cache (harness.drafting)."""
    case_id = f"mtp-{deployment_name}-{mode_name}"
    deployment, mode = cpu.DEPLOYMENTS[deployment_name], MTP_MODES[mode_name]
    engines = cpu_engines(mtp_binding, deployment, mode)
    units = check_geometry(engines[0], mode)
    servers = scheduler.servers_for(engines, deployment, mtp_binding.token_ids)
    conversation = harness.reference_conversation(units, case_id)
    results = scheduler.play_conversations(
        servers, deployment, [conversation], mtp_binding.token_ids
    )
    check_case(case_id, servers, results, units, mode, deployment)


@pytest.mark.parametrize("retention", ["dense", "default"])
@pytest.mark.parametrize("mode_name", ["block", "partial"])
def test_decode_checkpoint(cpu_binding: harness.Binding, mode_name: str, retention):
    """A first prompt that ends two tokens short of a block, so that its
    decode computes past the block boundary: the next turn hits that
    boundary where the Mamba group keeps every block's state (a retention
    interval of one scheduler block), and the prompt's own checkpoint under
    vLLM's default retention (harness.decode_checkpoint)."""
    deployment, mode = cpu.DEPLOYMENTS["plain"], cpu.MODES[mode_name]
    block = cpu_engines(cpu_binding, deployment, mode)[0].geometry.scheduler_block
    interval = block if retention == "dense" else 0
    extra = ["--prefix-cache-retention-interval", str(interval)]
    engines = cpu_engines(cpu_binding, deployment, mode, extra)
    units = check_geometry(engines[0], mode)
    first_len = (harness.FIRST_PROMPT_BLOCKS + 1) * block - 2
    case_id = f"decode-{mode_name}-{retention}"
    conversation = harness.Conversation(case_id, first_len, case_id, 2, resend=False)
    servers = scheduler.servers_for(engines, deployment, cpu_binding.token_ids)
    results = scheduler.play_conversations(
        servers, deployment, [conversation], cpu_binding.token_ids
    )
    drafter = mode.drafting(deployment.decode)
    decoded = harness.MAX_TOKENS - 1
    rows, problems = [], counter_problems(servers)
    for result in results:
        planned = result.planned
        expected, stored = harness.decoded_expectation(
            planned.prev_len, units.hit, drafter, decoded, block, interval
        )
        if not planned.prev_len:
            expected, stored = 0, 0
        why = harness.impossible_hit(result.hit, stored, planned.prompt_len, units.hit)
        rows.append((planned.prompt_len, result.hit, expected, stored))
        if result.hit != expected or why or result.recompute_hit:
            problems.append(
                f"turn {planned.index} ({planned.prompt_len} tokens, the previous "
                f"{planned.prev_len} and {decoded} decoded): vLLM's scheduler hits "
                f"{result.hit}, the harness expects {expected} under retention "
                f"interval {interval} (block {block}) {why}; recompute hit "
                f"{result.recompute_hit}"
            )
    print(f"\n== {case_id}: (prompt, hit, expected, stored) {rows}")
    assert not problems, "\n".join(problems)


def counter_problems(servers: Sequence[scheduler.ReplayServer]) -> list[str]:
    return [p for server in servers for p in server.counter_problems()]


def test_cpu_geometry(cpu_binding: harness.Binding) -> None:
    """cpu_binding.resolved_geometry, which the CPU tier can hold against a
    real server's vllm:cache_config_info: the plain deployment's blocks do
    not depend on the mode, and hits land on the mode's prefix match unit
    where it is below the Mamba block, else on the scheduler block."""
    geometries = {
        name: cpu.resolved_geometry(cpu_binding, mode)
        for name, mode in cpu.MODES.items()
    }
    blocks = {(g.attention_block, g.mamba_block) for g in geometries.values()}
    assert len(blocks) == 1, geometries
    for name, geometry in geometries.items():
        unit = cpu.MODES[name].prefix_match_unit
        partial = unit is not None and unit < geometry.mamba_block
        expected = unit if partial else geometry.scheduler_block
        assert geometry.hit_unit == expected, (name, geometry)
        assert geometry.scheduler_block == lcm(
            geometry.attention_block, geometry.mamba_block
        ), (name, geometry)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every cell's expectations, checked against vLLM's own scheduler in seconds.

The end-to-end tiers hold each turn's hit to the harness's reading of vLLM
(``harness.rules.expectation``) and each server's counters to the harness's counter
rule (``harness.reconcile.counter_problems``). This tier replays the same conversations
through vLLM's real scheduling objects in-process (the ``scheduler`` package:
the real ``Scheduler`` and ``KVCacheManager``, the real scheduler side of
each KV connector, stand-in workers) and requires, per turn, vLLM's hit to
EQUAL the expected hit (and to respect the bound), the recompute to hit
nothing, and, per server, the counters that vLLM's own ``PrefixCacheStats``
move to obey the counter rule. It covers (the Kimi-K3 matrix's cells:
``kimi_k3/test_prefix_cache_scheduler.py``):

* every case of the CPU tier (``cpu_known.MATRIX``: deployments x modes,
  the tail sweep, the concurrent conversations), with the geometry vLLM
  resolves for the tiny model on this machine.

No server is started and no device is needed.
"""

from collections.abc import Sequence
from math import lcm

import pytest

from tests.models.hybrid_prefix_cache import cpu_binding as cpu
from tests.models.hybrid_prefix_cache import cpu_known, harness, scheduler
from tests.models.hybrid_prefix_cache.replay_cells import cpu_engines
from tests.models.hybrid_prefix_cache.scheduler.judge import (
    check_case,
    check_drafter,
    check_geometry,
    counter_problems,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid

# Only scheduler-side objects are built: no distributed state or device
# memory for tests/conftest.py's per-test cleanup (a full gc.collect each)
# to free.
pytestmark = pytest.mark.skip_global_cleanup

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


# --- the checks ------------------------------------------------------------------


def _drafter_params() -> list:
    return [
        pytest.param(tier, name, id=f"{tier}-{name}")
        for tier, modes in (("cpu", cpu.MODES), ("mtp", MTP_MODES))
        for name, mode in modes.items()
        if mode.spec is not None
    ]


@pytest.mark.parametrize(("tier", "mode_name"), _drafter_params())
def test_drop_rule_is_the_schedulers(mtp_binding, cpu_binding, tier, mode_name):
    """The harness reads what a drafter changes from vLLM's config and, for
    the lookahead hashes, from the connector's own declaration
    (harness.rules.drafting); vLLM's scheduler must then do it
    (scheduler.judge.check_drafter). A scheduler that ignores the config, or
    a config that stops honouring a connector's declaration, fails here by
    name."""
    mode = (cpu.MODES if tier == "cpu" else MTP_MODES)[mode_name]
    binding = mtp_binding if tier == "mtp" else cpu_binding
    for name, deployment in cpu.DEPLOYMENTS.items():
        try:
            engines = cpu_engines(binding, deployment, mode)
        except pytest.skip.Exception as e:
            print(f"{tier} {name} {mode_name}: not built ({e.msg})")
            continue
        check_drafter(engines, deployment, mode, f"{tier} {name} {mode_name}")


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
        harness.conversation.Conversation(shape, length, f"{case_id}-{shape}")
        for shape in shapes
        if (length := harness.conversation.shape_length(shape, units)) is not None
    ]
    if shapes and not conversations:
        pytest.skip(
            f"shapes {list(shapes)} need a hit unit below the block; vLLM "
            f"resolves hit unit {units.hit}, block {units.block}"
        )
    if not shapes:
        conversations = [harness.conversation.reference_conversation(units, case_id)]
    servers = scheduler.servers_for(engines, deployment, cpu_binding.token_ids)
    results = scheduler.play_conversations(
        servers,
        deployment,
        conversations,
        cpu_binding.token_ids,
        concurrent=case.at_once,
    )
    check_case(case_id, servers, results, units, mode, deployment)


@pytest.mark.parametrize("mode_name", MTP_MODES)
@pytest.mark.parametrize("deployment_name", cpu.DEPLOYMENTS)
def test_mtp_cell(mtp_binding: harness.Binding, deployment_name: str, mode_name: str):
    """Every CPU deployment's reference conversation and resend with MTP
    drafts (MTP_MODES), where what the drafter changes depends on the
    release and the connector: each turn must hit what the harness reads
    for the instance that consults its cache (harness.rules.drafting)."""
    case_id = f"mtp-{deployment_name}-{mode_name}"
    deployment, mode = cpu.DEPLOYMENTS[deployment_name], MTP_MODES[mode_name]
    engines = cpu_engines(mtp_binding, deployment, mode)
    units = check_geometry(engines[0], mode)
    servers = scheduler.servers_for(engines, deployment, mtp_binding.token_ids)
    conversation = harness.conversation.reference_conversation(units, case_id)
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
    vLLM's default retention (harness.rules.decode_checkpoint)."""
    deployment, mode = cpu.DEPLOYMENTS["plain"], cpu.MODES[mode_name]
    block = cpu_engines(cpu_binding, deployment, mode)[0].geometry.scheduler_block
    interval = block if retention == "dense" else 0
    extra = ["--prefix-cache-retention-interval", str(interval)]
    engines = cpu_engines(cpu_binding, deployment, mode, extra)
    units = check_geometry(engines[0], mode)
    first_len = (harness.rules.FIRST_PROMPT_BLOCKS + 1) * block - 2
    case_id = f"decode-{mode_name}-{retention}"
    conversation = harness.conversation.Conversation(
        case_id, first_len, case_id, 2, resend=False
    )
    servers = scheduler.servers_for(engines, deployment, cpu_binding.token_ids)
    results = scheduler.play_conversations(
        servers, deployment, [conversation], cpu_binding.token_ids
    )
    drafter = mode.drafting(deployment.decode)
    decoded = harness.client.MAX_TOKENS - 1
    rows, problems = [], counter_problems(servers)
    for result in results:
        planned = result.planned
        expected, stored = harness.rules.decoded_expectation(
            planned.prev_len, units.hit, drafter, decoded, block, interval
        )
        if not planned.prev_len:
            expected, stored = 0, 0
        why = harness.rules.impossible_hit(
            result.hit, stored, planned.prompt_len, units.hit
        )
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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Kimi-K3 matrix checked against vLLM's own scheduler, in seconds and on
any machine: every cell's reference conversation and the exact resends at the
B200 geometry the binding states (``kimi.KIMI_BLOCKS``; the GPU tier cannot
run here), its drafters' rule, and the workloads of the ``workloads`` package
on every cell where they apply (``test_<workload>[kimi-<deployment>-<mode>]``);
and the expectations it is held to reproduce what B200 served.
The harness's scheduler tier (``hybrid_prefix_cache/scheduler``) replays them
through the real ``Scheduler`` and ``KVCacheManager`` with stand-in workers;
``hybrid_prefix_cache/test_scheduler_conformance.py`` says what it requires.
No server is started and no device is needed."""

import pytest

from tests.models.hybrid_prefix_cache import harness, scheduler
from tests.models.hybrid_prefix_cache.harness.rules import expectation, plan_turns
from tests.models.hybrid_prefix_cache.scheduler.judge import (
    check_case,
    check_drafter,
    check_geometry,
)
from tests.models.hybrid_prefix_cache.scheduler.replays import catalog
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid, write_tiny_hybrid
from tests.models.kimi_k3 import prefix_cache_binding as kimi
from tests.models.kimi_k3.prefix_cache_replay import KDA_CHECKPOINTS, KIMI, kimi_engines

# Only scheduler-side objects are built: no distributed state or device
# memory for tests/conftest.py's per-test cleanup to free.
pytestmark = pytest.mark.skip_global_cleanup

REPLAYS = catalog()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> TinyHybrid:
    """The tiny hybrid model, whose config stands in for Kimi-K3's
    ModelConfig (scheduler.stated_engine)."""
    return write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid"))


@pytest.mark.parametrize(
    "mode_name", [m for m, mode in kimi.MODES.items() if mode.spec is not None]
)
def test_drop_rule_is_the_schedulers(tiny_model, mode_name: str) -> None:
    """Every drafter mode's rule is the one the binding states for the release
    under test (kimi.DRAFTER_RULES), and vLLM's scheduler does it
    (scheduler.judge.check_drafter)."""
    mode = kimi.MODES[mode_name]
    stated = kimi.drafter_rule()
    for name, deployment in kimi.DEPLOYMENTS.items():
        for instance in deployment.instances:
            got = mode.drafting(instance)
            assert got == stated, (
                f"kimi {name} {mode_name}: vLLM "
                f"{harness.rules.release_under_test()} "
                f"answers {got} for {mode.spec['method']}, the binding states "
                f"{stated} for this release (kimi.DRAFTER_RULES)"
            )
        try:
            engines = kimi_engines(tiny_model.path, deployment, mode, None)
        except pytest.skip.Exception as e:
            print(f"kimi {name} {mode_name}: not built ({e.msg})")
            continue
        check_drafter(engines, deployment, mode, f"kimi {name} {mode_name}")


@pytest.mark.parametrize(
    ("deployment_name", "mode_name"),
    [
        pytest.param(name, mode_name, id=f"{name}-{mode_name}")
        for name in kimi.DEPLOYMENTS
        for mode_name in kimi.MODES
    ],
)
def test_kimi_cell(tiny_model, deployment_name: str, mode_name: str) -> None:
    deployment = kimi.DEPLOYMENTS[deployment_name]
    mode = kimi.MODES[mode_name]
    case_id = f"{deployment_name}-{mode_name}"
    for kda, alignment in KDA_CHECKPOINTS.items():
        engines = kimi_engines(tiny_model.path, deployment, mode, alignment)
        units = check_geometry(engines[0], mode)
        servers = scheduler.servers_for(engines, deployment, kimi.BINDING.token_ids)
        conversation = harness.conversation.reference_conversation(units, case_id)
        results = scheduler.play_conversations(
            servers, deployment, [conversation], kimi.BINDING.token_ids
        )
        check_case(f"{case_id} ({kda})", servers, results, units, mode, deployment)


@pytest.mark.parametrize("prompt_len", kimi.RESEND_LENGTHS, ids=lambda n: f"resend-{n}")
def test_kimi_resend(tiny_model, prompt_len: int) -> None:
    """kimi.test_exact_resend: cold, then the resend, which hits the prompt's
    own checkpoint (harness.rules.expected_resend)."""
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
        expected = harness.rules.expected_resend(
            prompt_len, units.hit, rule.drops_unit, rule.lookahead
        )
        assert resend.hit == expected, (
            f"{case_id} ({kda}): vLLM's scheduler hits {resend.hit} on the "
            f"resend, harness.rules.expected_resend gives {expected}"
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


# --- what B200 served, under the rules the scheduler is held to ---------------------


# Real B200 turn tables, from the PR this project started from: per case,
# the hit unit and (prompt, cached) of its three growing turns. That PR ran
# vLLM 0.32, whose rule drops a unit for DSpark (B200_DROPS_UNIT).
B200_TURNS = {
    # PMU 128; block 2944 under DCP2, so the first prompt is 3 * 2944 + 37.
    "dcp2-offload-partial": (128, [(8869, 0), (9646, 8832), (10423, 9600)]),
    # PMU 128, DSpark; block 6144, so the first prompt is 3 * 6144 + 37.
    "pd-offload-partial-dspark": (128, [(18469, 0), (19246, 18304), (20023, 19072)]),
}
B200_DROPS_UNIT = {"dcp2-offload-partial": False, "pd-offload-partial-dspark": True}


def _b200_table(case_id: str, drops_unit: bool) -> list[tuple[int, int]]:
    """(prompt, expected hit) of the case's first turns, from the harness's
    own plan of the conversation and its deployment (the P/D prefiller sees
    each prompt one token short), under the drop rule ``drops_unit``."""
    unit, seen = B200_TURNS[case_id]
    deployment, _ = kimi.MATRIX.served(case_id)
    plan = plan_turns(seen[0][0])
    return [
        (turn.prompt_len, expectation(turn, unit, drops_unit, backoff)[0])
        for turn in plan[: len(seen)]
        for backoff in [deployment.cache_backoff]
    ]


@pytest.mark.parametrize("case_id", B200_TURNS)
def test_b200_turn_tables(case_id: str):
    """The expectation functions reproduce what B200 served under the rule
    of the vLLM it ran; under the installed vLLM's rule, the table is
    printed, and equals B200's where the rule is the same."""
    _, mode = kimi.MATRIX.served(case_id)
    assert _b200_table(case_id, B200_DROPS_UNIT[case_id]) == B200_TURNS[case_id][1]
    installed = _b200_table(case_id, mode.drops_unit)
    print(f"{case_id} under the installed vLLM's rule: {installed}")
    if mode.drops_unit == B200_DROPS_UNIT[case_id]:
        assert installed == B200_TURNS[case_id][1]
    else:
        assert all(a >= b for (_, a), (_, b) in zip(installed, B200_TURNS[case_id][1]))


def test_b200_plain_block_checkpoint():
    """On main without the fix, plain-block served 0 at its second turn
    where 17280 was expected: block mode with a 5760-token hit unit."""
    plan = plan_turns(3 * 5760 + 37)
    assert expectation(plan[1], 5760, drops_unit=False)[0] == 17280


# --- the workloads, on every Kimi-K3 cell where they apply --------------------------


def replay(name: str, cell_id: str, model: TinyHybrid, *variant: str) -> None:
    __tracebackhide__ = True
    KIMI.cell(cell_id, model, None).replay(REPLAYS[name], *variant)


@pytest.mark.parametrize("cell_id", KIMI.params(REPLAYS["shared-prefix"]))
def test_shared_prefix(tiny_model, cell_id: str) -> None:
    replay("shared-prefix", cell_id, tiny_model)


@pytest.mark.parametrize("scheduling", REPLAYS["abort-retry"].variants)
@pytest.mark.parametrize("cell_id", KIMI.params(REPLAYS["abort-retry"]))
def test_abort_retry(tiny_model, cell_id: str, scheduling: str) -> None:
    replay("abort-retry", cell_id, tiny_model, scheduling)


@pytest.mark.parametrize("cell_id", KIMI.params(REPLAYS["eviction"]))
def test_eviction(tiny_model, cell_id: str) -> None:
    replay("eviction", cell_id, tiny_model)


@pytest.mark.parametrize("cell_id", KIMI.params(REPLAYS["small-budget"]))
def test_small_budget(tiny_model, cell_id: str) -> None:
    replay("small-budget", cell_id, tiny_model)


@pytest.mark.parametrize("cell_id", KIMI.params(REPLAYS["aligned"]))
def test_aligned(tiny_model, cell_id: str) -> None:
    replay("aligned", cell_id, tiny_model)


@pytest.mark.parametrize("cell_id", KIMI.params(REPLAYS["pd-resend"]))
def test_pd_resend(tiny_model, cell_id: str) -> None:
    replay("pd-resend", cell_id, tiny_model)


@pytest.mark.parametrize("cell_id", KIMI.params(REPLAYS["preemption"]))
def test_preemption(tiny_model, cell_id: str) -> None:
    replay("preemption", cell_id, tiny_model)


@pytest.mark.parametrize("scheduling", ["async", "sync"])
@pytest.mark.parametrize("cell_id", KIMI.params(REPLAYS["async"]))
def test_scheduling(tiny_model, cell_id: str, scheduling: str) -> None:
    replay(scheduling, cell_id, tiny_model)


def test_every_replay_has_its_test() -> None:
    """Every workload with a replay is run on the Kimi-K3 cells too."""
    tested = {name.removeprefix("test_").replace("_", "-") for name in globals()}
    untested = [w for w in REPLAYS if w not in tested | {"async", "sync"}]
    assert not untested, f"no test_<workload> replays {untested} on Kimi-K3 cells"

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The 4xB200 step's shards: each case once, by cost, servers together."""

import re

import pytest
from prefix_cache_ci_area import (
    MATRIX_MODULE,
    SHARDED_KEY,
    _pytest_commands,
    _step,
    _unsharded,
    in_matrix,
)
from prefix_cache_ci_collect import collect_in_process

from tests.models.hybrid_prefix_cache.harness import (
    case_seconds,
)
from tests.models.hybrid_prefix_cache.harness.matrix import (
    CASE_TURNS,
)
from tests.models.kimi_k3 import prefix_cache_binding as kimi

# No distributed state or device in-process: skip vLLM's global cleanup.
pytestmark = pytest.mark.skip_global_cleanup


def test_shards_select_every_matrix_case_once():
    step = _step(SHARDED_KEY)
    (argv,) = _pytest_commands(step)
    assert MATRIX_MODULE in argv
    everything = collect_in_process(_unsharded(argv))
    # Every matrix case (cells and workload cases), the resends, Mooncake's.
    assert len(everything) == len(kimi.MATRIX.cases) + len(kimi.RESEND_LENGTHS) + 1
    assert all(in_matrix(node) for node in everything)
    jobs = step.get("parallelism")
    if not jobs:
        # One job runs everything unless vLLM's generator shards it.
        assert step.get("automatic_shard"), f"{SHARDED_KEY} runs as one job"
        return
    shards = [collect_in_process(argv, shard=(i, jobs)) for i in range(jobs)]
    assert all(shards), "a shard selects nothing"
    for i, shard in enumerate(shards):
        assert not set(shard) & set().union(*shards[i + 1 :]), i
    assert sorted(sum(shards, [])) == sorted(everything)


# The balance check's cost model, in one-server cells: a P/D cell runs two
# servers; a resend is two requests on running servers; Mooncake's starts one.
PD_CELL, ONE_SERVER_CELL, RESEND, MOONCAKE = 2.0, 1.0, 0.25, 0.75


def _cost_and_servers(node: str) -> tuple[float, str]:
    """A matrix test's cost and the key of the servers it runs on."""
    name = node.split("::", 1)[1]
    if name.startswith("test_prefix_cache["):
        case = kimi.MATRIX.cases[name[len("test_prefix_cache[") : -1]]
        pd = kimi.DEPLOYMENTS[case.deployment].prefill is not None
        if case.workload is not None:
            # Its turns on its cell's running servers, in one-server cells.
            servers = 2 if pd else 1
            seconds = case_seconds(servers, case.turns, start=False)
            return seconds / case_seconds(1, CASE_TURNS), case.cell
        return (PD_CELL if pd else ONE_SERVER_CELL), case.cell
    if name.startswith("test_exact_resend["):
        return RESEND, f"plain-{kimi.RESEND_MODE}"
    assert name == "test_mooncake_store_resend", name
    return MOONCAKE, "mooncake"


def test_shards_balance_cost_and_keep_servers_together():
    """pytest-shard's hash of the node ids put 19 of the 31 tests, 9 of the
    12 P/D cells, in one of 2 shards; the harness's plugin splits them by
    cost instead. Each job's cost is within one one-server cell of an even
    split, P/D cells are spread evenly, and tests that share servers share
    a job."""
    step = _step(SHARDED_KEY)
    jobs = step.get("parallelism")
    if not jobs:
        pytest.skip(
            "no pytest-shard jobs: vLLM's generator shards this step "
            "(test_automatic_shard_gets_a_command_it_can_shard)"
        )
    (argv,) = _pytest_commands(step)
    shards = [collect_in_process(argv, shard=(i, jobs)) for i in range(jobs)]
    costs = [sum(_cost_and_servers(node)[0] for node in shard) for shard in shards]
    assert max(costs) <= sum(costs) / jobs + ONE_SERVER_CELL, costs
    pd = [sum(_cost_and_servers(n)[0] == PD_CELL for n in shard) for shard in shards]
    assert max(pd) - min(pd) <= 1, pd
    where: dict[str, set[int]] = {}
    for i, shard in enumerate(shards):
        for node in shard:
            where.setdefault(_cost_and_servers(node)[1], set()).add(i)
    split = {servers: jobs for servers, jobs in where.items() if len(jobs) > 1}
    assert not split, f"tests that share servers run in several jobs: {split}"


def test_automatic_shard_gets_a_command_it_can_shard():
    """Under automatic_shard (0.33.0's form), vLLM's pipeline generator
    collects the step's pytest commands and plans shards from main's timings
    of each test, cutting only between tests in collection order; it refuses
    a pytest command with shell syntax or pytest-shard's flags and then runs
    the step as one job (ci-infra's buildkite/pipeline_generator/
    runtime_shard.py, split_commands and plan). So: plain pytest commands,
    and tests that share servers next to each other in collection order."""
    step = _step(SHARDED_KEY)
    if not step.get("automatic_shard"):
        pytest.skip("pytest-shard jobs (test_shards_balance_...)")
    assert "parallelism" not in step
    commands = step["commands"]
    first = next(i for i, c in enumerate(commands) if c.startswith("pytest "))
    for command in commands[first:]:
        assert command.startswith("pytest "), command
        assert not re.search(r"[;&|<>`$]", command), command
        assert "--shard-id" not in command and "--num-shards" not in command
    (argv,) = _pytest_commands(step)
    order = [_cost_and_servers(node)[1] for node in collect_in_process(argv)]
    runs = [key for i, key in enumerate(order) if i == 0 or order[i - 1] != key]
    assert len(runs) == len(set(runs)), f"servers apart in collection: {runs}"

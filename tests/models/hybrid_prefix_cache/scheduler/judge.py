# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A replayed case judged against the harness: the geometry the harness
reads, each turn's hit against its expectation, each server's counters."""

from collections.abc import Sequence

from tests.models.hybrid_prefix_cache.harness import compare, reconcile, rules
from tests.models.hybrid_prefix_cache.harness.deployment import Deployment, Mode, Units
from tests.models.hybrid_prefix_cache.harness.problems import Problem
from tests.models.hybrid_prefix_cache.scheduler.engine import Engine
from tests.models.hybrid_prefix_cache.scheduler.play import TurnResult
from tests.models.hybrid_prefix_cache.scheduler.servers import ReplayServer


def check_geometry(engine: Engine, mode: Mode) -> Units:
    """The harness's reading of cache_config_info must give the engine's hit unit."""
    geometry = engine.geometry
    labels = {
        "block_size": str(geometry.attention_block),
        "mamba_block_size": str(geometry.mamba_block),
    }
    if mode.prefix_match_unit is not None:
        cache = engine.vllm_config.cache_config
        labels["prefix_match_unit"] = str(cache.prefix_match_unit)
    units = Units.from_cache_config(labels, mode)
    assert units.hit == engine.hit_unit, (
        f"the harness reads hit unit {units.hit} from block_size="
        f"{geometry.attention_block}, mamba_block_size={geometry.mamba_block}, "
        f"prefix_match_unit={mode.prefix_match_unit}, but vLLM aligns hits to "
        f"{engine.hit_unit} (cache_hit_alignment_tokens)"
    )
    return units


def case_problems(
    servers: Sequence[ReplayServer],
    results: Sequence[TurnResult],
    units: Units,
    mode: Mode,
    deployment: Deployment,
) -> tuple[list[str], list[str]]:
    """(the turn table, every way the case disagrees with the harness): its turns,
    each server's counters and the completions the harness routes to it."""
    backoff = deployment.cache_backoff
    rule = mode.drafting(deployment.instances[0])
    rows = [
        f"{'conversation':<14} {'turn':>6} {'prompt':>6} {'vLLM hit':>8} "
        f"{'expected':>8} {'bound':>6} {'recompute':>9}"
    ]
    problems = []
    turns = []
    for result in results:
        turn, label = result.planned, result.conversation
        expected, bound = rules.expectation(
            turn, units.hit, rule.drops_unit, backoff, rule.lookahead
        )
        what = "resend" if turn.resend else f"turn {turn.index}"
        name = f"{label} {what}".strip()
        rows.append(
            f"{label or '-':<14} "
            f"{'resend' if turn.resend else turn.index:>6} {turn.prompt_len:>6} "
            f"{result.hit:>8} {expected:>8} {bound:>6} "
            f"{'-' if result.recompute_hit is None else result.recompute_hit:>9}"
        )
        if result.hit != expected:
            why = (
                f"{name}: vLLM's scheduler hits {result.hit}, the harness expects "
                f"{expected} (prompt {turn.prompt_len}, previous {turn.prev_len}, "
                f"hit unit {units.hit}, drafter {rule}, backoff {backoff})"
            )
            problems.append(
                Problem(why, "scheduler-hit", name, hit=result.hit, expected=expected)
            )
        prev_seen = max(turn.prev_len - backoff, 0)
        why = rules.impossible_hit(
            result.hit, prev_seen, turn.prompt_len - backoff, units.hit
        )
        if why or result.hit > bound:
            problems.append(f"{name}: beyond the harness's bound {bound}: {why}")
        if result.recompute_hit not in (None, 0):
            problems.append(
                f"{name}: the recompute under a fresh salt hit {result.recompute_hit}"
            )
        turns.append(compare.Turn(label, turn.index, turn.prompt_len, 0, 0))
        if result.recompute_hit is not None:
            # Only whether there was one matters to expected_requests.
            turns[-1].recompute = compare.Sample([], "", [], [], 0, 0)
    routes = reconcile.expected_requests(len(servers), turns)
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
    servers: Sequence[ReplayServer],
    results: Sequence[TurnResult],
    units: Units,
    mode: Mode,
    deployment: Deployment,
) -> None:
    rows, problems = case_problems(servers, results, units, mode, deployment)
    table = "\n".join(rows)
    moved = "\n".join(f"{s.name}: {s.ledger} moved {s.moved}" for s in servers)
    print(f"\n== {case_id}: hit unit {units.hit}, block {units.block}\n{table}")
    assert not problems, f"{case_id}:\n" + "\n".join(problems) + f"\n{table}\n{moved}"


def counter_problems(servers: Sequence[ReplayServer]) -> list[str]:
    return [p for server in servers for p in server.counter_problems()]


def controls(recompute_hit: int, servers: Sequence[ReplayServer]) -> list[str]:
    """What every workload holds besides its property: its recompute under
    a fresh salt hits nothing, and each server's counters obey the rule."""
    found = [f"the recompute hit {recompute_hit}"] if recompute_hit else []
    return found + counter_problems(servers)


def check_drafter(
    engines: Sequence[Engine], deployment: Deployment, mode: Mode, what: str
) -> None:
    """Each engine's scheduler does what harness.rules.drafting reads of its drafter:
    Scheduler.__init__ sets use_eagle_block_drop (off where it hashes lookahead
    tokens) for the KVCacheManager, and from 0.33 num_hash_lookahead_tokens."""
    for engine, instance in zip(engines, deployment.instances):
        rule = mode.drafting(instance)
        sched = engine.scheduler()
        where = f"{what} (connector {(instance.kv_config or {}).get('kv_connector')})"
        # Before 0.32 (0.26) the scheduler's flag was use_eagle.
        drops = getattr(sched, "use_eagle_block_drop", sched.use_eagle)
        assert drops == rule.drops_unit, (
            f"{where}: the harness reads {rule}, vLLM's scheduler drops {drops}"
        )
        assert sched.kv_cache_manager.use_eagle == rule.drops_unit, (
            f"{where}: the KV cache manager's lookups drop "
            f"{sched.kv_cache_manager.use_eagle}, the harness reads {rule}"
        )
        hashed = getattr(sched, "num_hash_lookahead_tokens", 0)
        assert hashed == rule.lookahead, (
            f"{where}: vLLM's scheduler hashes {hashed} lookahead tokens, "
            f"the harness reads {rule}"
        )

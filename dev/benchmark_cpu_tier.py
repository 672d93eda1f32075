"""Benchmark of the CPU tier's server lifecycle, in one run (not a test).

Run it through the suite, which provisions and lays our files over the vLLM
checkout first:

    dev/suite.sh benchmark [--repeats N]

It reports, from one run on this machine (speed is only compared within the
run, as ratios, since these machines are noisy):

* the start time of one CPU server (to /health) with the tier's settings
  (``-O0``, rank in the engine process), without ``-O0``, and with the
  default executor, as medians of ``--repeats`` starts;
* a P/D pair started one after the other and both at once, side by side;
* the wall time of the reference conversation on a plain and on a P/D
  deployment (servers already up), and their ratio;
* how many server starts the CPU-tier matrix needs with and without reuse.
"""

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache import test_cpu_tier as tier
from tests.models.hybrid_prefix_cache.harness import (
    Deployment,
    Mode,
    ServerPool,
    run_case,
    server_specs,
    start_servers,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid


def _start_seconds(specs, binding, concurrent: bool) -> list[float]:
    servers = start_servers(specs, binding.startup_timeout, concurrent)
    try:
        return [s.startup_seconds or 0.0 for s in servers]
    finally:
        harness.RemoteOpenAIServer.shutdown_many(servers)


def _matrix_starts() -> tuple[int, int]:
    """Server starts of the runnable CPU-tier cases without and with reuse
    (consecutive cases with equal servers share them)."""
    without = with_reuse = 0
    previous = None
    for case_id, case in tier.CASES.items():
        deployment = tier.DEPLOYMENTS[case.deployment]
        if any(k.kind == "unsupported" for k in tier.known_entries(case_id)):
            continue
        if tier._ranks(deployment) > tier.CORES:
            continue
        servers = len(deployment.instances)
        without += servers
        key = (case.deployment, case.mode)
        if key != previous:
            with_reuse += servers
        previous = key
    return without, with_reuse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="hybrid-pc-bench-"))
    model = write_tiny_hybrid(folder)
    # The tier's own binding; the pair-start comparison below passes its
    # policy explicitly, and server starts are never inside a case's timing.
    binding = replace(tier.cpu_binding(model), startup_timeout=600.0)
    compiled = replace(
        binding, base_args=tuple(a for a in binding.base_args if a != "-O0")
    )
    plain = tier.DEPLOYMENTS["plain"]
    default_executor = Deployment()
    rows = []
    for label, b, deployment in (
        ("tier settings (-O0, rank in engine)", binding, plain),
        ("-O0, default executor", binding, default_executor),
        ("compiled, rank in engine", compiled, plain),
    ):
        specs = server_specs(b, deployment, Mode())
        times = [_start_seconds(specs, b, False)[0] for _ in range(args.repeats)]
        rows.append((label, times))
        print(f"start, {label}: {[f'{t:.1f}' for t in times]}", flush=True)

    pd_specs = server_specs(binding, tier.DEPLOYMENTS["pd"], Mode())
    started = time.monotonic()
    sequential = _start_seconds(pd_specs, binding, False)
    sequential_wall = time.monotonic() - started
    started = time.monotonic()
    concurrent = _start_seconds(pd_specs, binding, True)
    concurrent_wall = time.monotonic() - started

    walls = {}
    for name in ("plain", "pd"):
        pool = ServerPool()
        try:
            deployment = tier.DEPLOYMENTS[name]
            pool.acquire(binding, deployment, Mode())  # start outside the timing
            started = time.monotonic()
            run_case(f"bench-{name}-block", binding, deployment, Mode(), pool=pool)
            walls[name] = time.monotonic() - started
        finally:
            pool.close()
    without, with_reuse = _matrix_starts()

    print("\n== CPU-tier lifecycle benchmark (one run; compare within it)")
    for label, times in rows:
        print(
            f"server start, {label:<36} median {statistics.median(times):6.1f} s "
            f"({', '.join(f'{t:.1f}' for t in times)})"
        )
    print(
        f"P/D pair, one after the other: {sequential_wall:6.1f} s wall "
        f"(prefill {sequential[0]:.1f} s, decode {sequential[1]:.1f} s)"
    )
    print(
        f"P/D pair, both at once:        {concurrent_wall:6.1f} s wall "
        f"(prefill {concurrent[0]:.1f} s, decode {concurrent[1]:.1f} s); "
        f"at once / one after the other = {concurrent_wall / sequential_wall:.2f}"
    )
    print(
        f"reference conversation, servers up: plain {walls['plain']:.1f} s, "
        f"P/D {walls['pd']:.1f} s, P/D / plain = {walls['pd'] / walls['plain']:.2f}"
    )
    print(
        f"server starts of the runnable CPU-tier cases: {without} without reuse, "
        f"{with_reuse} with reuse"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
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

With ``--phases REPORT_DIR [REPORT_DIR]`` it runs nothing and prints where a
finished session's time went instead, side by side for two (before and
after), from the session.json and case records the suite writes to its
report folder (``HYBRID_PC_REPORT_DIR``): collection, fixtures, each case's
server starts and stops, requests, metric reads and waits, cache resets and
the rest of its checks, the confirmations of known failures, and the other
tests by module.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from tests.models.hybrid_prefix_cache import cpu_binding as tier
from tests.models.hybrid_prefix_cache import cpu_known, harness
from tests.models.hybrid_prefix_cache.harness import (
    Deployment,
    Mode,
    Suite,
    WorkloadRun,
    run_case,
    server_specs,
)
from tests.models.hybrid_prefix_cache.harness.servers import (
    start_servers,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid
from tests.utils import RemoteOpenAIServer


def _start_seconds(specs, binding, concurrent: bool) -> list[float]:
    servers = start_servers(specs, replace(binding, concurrent_start=concurrent))
    try:
        return [s.startup_seconds or 0.0 for s in servers]
    finally:
        RemoteOpenAIServer.shutdown_many(servers)


def _matrix_starts() -> tuple[int, int]:
    """Server starts of the runnable CPU-tier cases without and with reuse
    (consecutive cases with equal servers share them)."""
    without = with_reuse = 0
    previous = None
    matrix = cpu_known.MATRIX
    for case_id, case in matrix.cases.items():
        known = matrix.known_for(case_id)
        if any(k.confirmed_by or k.at_config for k in known):
            continue
        if cpu_known.core_shortage(case_id):
            continue
        servers = len(matrix.served(case_id)[0].instances)
        without += servers
        if case.cell != previous:
            with_reuse += servers
        previous = case.cell
    return without, with_reuse


CPU_TIER_TEST = "tests/models/hybrid_prefix_cache/test_cpu_tier.py::test_prefix_cache"


def phase_seconds(folder: Path) -> Counter:
    """Seconds of a finished session by phase (see the module docstring)."""
    session = json.loads((folder / "session.json").read_text())
    # Each record by the test that ran it (records written before they named
    # it: by the CPU tier's test of that case id).
    records = {}
    for path in folder.glob("*.json"):
        if path.name != "session.json":
            record = json.loads(path.read_text())
            test = record.get("test") or f"{CPU_TIER_TEST}[{record['case_id']}]"
            records[test] = record
    phases: Counter = Counter(collection=session["collection_seconds"])
    for nodeid, test in session["tests"].items():
        phases["fixtures"] += test.get("setup", 0.0) + test.get("teardown", 0.0)
        call = test.get("call", 0.0)
        record = records.get(nodeid)
        if test.get("outcome") in ("skipped", "xfailed"):
            phases["confirmations of known failures"] += call
        elif record is not None:
            spent = record.get("phase_seconds", {})
            for name in harness.clock.PHASES:
                phases[f"cases: {name}"] += spent.get(name, 0.0)
            phases["cases: checks and the rest"] += call - sum(spent.values())
        else:
            phases[f"other tests: {nodeid.split('::')[0].rsplit('/', 1)[-1]}"] += call
    phases["pytest itself"] = session["seconds"] - sum(phases.values())
    phases["session"] = session["seconds"]
    return phases


def print_phases(folders: list[Path]) -> None:
    runs = [phase_seconds(folder) for folder in folders]
    names = sorted({name for run in runs for name in run}, key=_phase_order)
    print(f"{'phase':<52}" + "".join(f"{f.name[-18:]:>20}" for f in folders))
    for name in names:
        print(f"{name:<52}" + "".join(f"{run[name]:>19.1f}s" for run in runs))


def _phase_order(name: str) -> tuple[int, str]:
    first = ("collection", "fixtures", "cases", "confirm", "other", "pytest")
    rank = next((i for i, p in enumerate(first) if name.startswith(p)), len(first))
    return rank, name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phases", nargs="+", type=Path, metavar="REPORT_DIR")
    args = parser.parse_args()
    if args.phases:
        print_phases(args.phases)
        return 0
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
        suite = Suite()
        try:
            deployment = tier.DEPLOYMENTS[name]
            # Start outside the timing.
            suite.pool.acquire(binding, deployment, Mode())
            started = time.monotonic()
            run = WorkloadRun(suite, f"bench-{name}-block", binding, deployment, Mode())
            record = run_case(run)
            walls[name] = time.monotonic() - started
            assert record.ok, record.explain()
        finally:
            suite.close()
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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL's progress thread in the CPU tier's P/D servers
(cpu_binding.NIXL_PROGRESS, nixl_progress/sitecustomize.py): an agent built
as vLLM's NIXL worker builds it keeps a core busy with NIXL's own config
(the control), and sleeps with the tier's environment; both are watched
over the same window as a thread that only spins (the calibrator), so that
a busy machine takes from all three alike."""

import os
import subprocess
import sys
import textwrap

from tests.models.hybrid_prefix_cache.cpu_binding import CPU_ONLY, NIXL_PROGRESS
from tests.models.hybrid_prefix_cache.harness.servers import (
    layered_env,
)

pytestmark = CPU_ONLY

# How long the agent's threads are watched, once it is built and settled.
WATCH_SECONDS = 2.0
# The control spins: its threads keep busy at least half as much as a thread
# that does nothing but spin, watched over the same window (the calibrator:
# whatever else the machine runs takes from both alike). The tier's agent
# must use at most SLEEPING_FRACTION of what the control used.
SPIN_LOAD = 0.5
SLEEPING_FRACTION = 0.1

# The cores a process's threads kept busy over the watched window, from
# /proc; each process starts its window when the parent says "go" on stdin,
# so that all of them are watched over the same time.
WATCH = textwrap.dedent(
    f"""
    import os, sys, time

    def busy():
        ticks = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{{task}}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    time.sleep(0.5)
    print("ready", flush=True)
    sys.stdin.readline()
    before, start = busy(), time.monotonic()
    time.sleep({WATCH_SECONDS})
    print("load", (busy() - before) / (time.monotonic() - start), flush=True)
    """
)
# Builds the agent as vLLM does (distributed/kv_transfer/kv_connector/v1/
# nixl/base_worker.py NixlConnectorWorker.__init__, UCX alone: num_threads
# from the extra config, default 4, and telemetry), then watches it while
# the main thread sleeps.
AGENT = (
    textwrap.dedent(
        """
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

    config = nixl_agent_config(num_threads=4, capture_telemetry=True)
    agent = NixlWrapper("probe", config)
    """
    )
    + WATCH
)
# A thread that only spins, watched alike.
SPINNER = (
    textwrap.dedent(
        """
    import threading

    def spin():
        while True:
            pass

    threading.Thread(target=spin, daemon=True).start()
    """
    )
    + WATCH
)


def loads(runs: dict[str, tuple[str, dict[str, str]]]) -> dict[str, tuple]:
    """(the cores each process's threads kept busy, its stderr), by name,
    for processes ``runs`` (name: script, environment) watched together."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (script, env) in runs.items()
    }
    try:
        for name, proc in procs.items():
            # NIXL logs to stdout too: read up to the process's own line.
            for line in proc.stdout:
                if line.strip() == "ready":
                    break
            else:
                _, err = proc.communicate(timeout=60)
                raise AssertionError(f"the {name} process failed:\n{err[-3000:]}")
        for proc in procs.values():
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"the {name} process failed:\n{err[-3000:]}"
            load = [line for line in out.splitlines() if line.startswith("load ")]
            assert load, f"the {name} process printed no load:\n{out}\n{err}"
            results[name] = (float(load[-1].split()[1]), err)
        return results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_tiers_nixl_progress_thread_sleeps() -> None:
    inherited = dict(os.environ)
    found = loads(
        {
            "control": (AGENT, inherited),
            "tier": (AGENT, layered_env(inherited, NIXL_PROGRESS)),
            "spinner": (SPINNER, inherited),
        }
    )
    (control, _), (tier, stderr), (spinner, _) = (
        found["control"],
        found["tier"],
        found["spinner"],
    )
    print(
        f"over the same {WATCH_SECONDS} s: a spinning thread kept {spinner:.3f} of "
        f"a core busy, the NIXL agent's threads {control:.3f} with NIXL's own "
        f"config, {tier:.3f} with the tier's"
    )
    assert control >= SPIN_LOAD * spinner, (
        f"with NIXL's own config the agent's threads kept {control:.2f} of a core "
        f"busy, where a spinning thread kept {spinner:.2f}: its progress thread no "
        f"longer spins, and cpu_binding.NIXL_PROGRESS may no longer be needed"
    )
    assert "progress thread poll delay" in stderr, (
        f"nixl_progress/sitecustomize.py did not set the agent's delay:\n{stderr}"
    )
    assert tier <= SLEEPING_FRACTION * control, (
        f"with the tier's environment ({NIXL_PROGRESS}) the agent's threads kept "
        f"{tier:.3f} of a core busy, against {control:.2f} with NIXL's own config"
    )

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL's progress thread in the CPU tier's P/D servers
(cpu_binding.NIXL_PROGRESS, nixl_progress/sitecustomize.py): an agent built
as vLLM's NIXL worker builds it keeps a core busy with NIXL's own config
(the control, in the same run), and sleeps with the tier's environment."""

import os
import subprocess
import sys
import textwrap

from tests.models.hybrid_prefix_cache.cpu_binding import CPU_ONLY, NIXL_PROGRESS
from tests.models.hybrid_prefix_cache.harness import layered_env

pytestmark = CPU_ONLY

# How long the agent's threads are watched, once it is built and settled.
WATCH_SECONDS = 2.0
# The control spins: its threads are busy at least half the time. The tier's
# agent must use at most this fraction of what the control used.
SPIN_LOAD = 0.5
SLEEPING_FRACTION = 0.1

# Builds the agent as vLLM does (distributed/kv_transfer/kv_connector/v1/
# nixl/base_worker.py NixlConnectorWorker.__init__, UCX alone: num_threads
# from the extra config, default 4, and telemetry), then prints the cores
# its threads kept busy, from /proc, while the main thread sleeps.
AGENT = textwrap.dedent(
    f"""
    import os, time
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

    config = nixl_agent_config(num_threads=4, capture_telemetry=True)
    agent = NixlWrapper("probe", config)

    def busy():
        ticks = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{{task}}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    time.sleep(0.5)
    before, start = busy(), time.monotonic()
    time.sleep({WATCH_SECONDS})
    print("load", (busy() - before) / (time.monotonic() - start))
    """
)


def agent_load(env: dict[str, str]) -> tuple[float, str]:
    """The cores a NIXL agent's threads kept busy, and the process's
    stderr, in a Python with ``env``."""
    done = subprocess.run(
        [sys.executable, "-c", AGENT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"the NIXL agent failed:\n{done.stderr[-3000:]}"
    load = [line for line in done.stdout.splitlines() if line.startswith("load ")]
    assert load, f"the NIXL agent printed no load:\n{done.stdout}\n{done.stderr}"
    return float(load[-1].split()[1]), done.stderr


def test_the_tiers_nixl_progress_thread_sleeps() -> None:
    inherited = dict(os.environ)
    control, _ = agent_load(inherited)
    assert control >= SPIN_LOAD, (
        f"with NIXL's own config the agent's threads kept {control:.2f} of a core "
        f"busy: its progress thread no longer spins, and cpu_binding.NIXL_PROGRESS "
        f"may no longer be needed"
    )
    tier, stderr = agent_load(layered_env(inherited, NIXL_PROGRESS))
    print(
        f"NIXL agent threads: {control:.3f} of a core busy with NIXL's own "
        f"config, {tier:.3f} with the tier's"
    )
    assert "progress thread poll delay" in stderr, (
        f"nixl_progress/sitecustomize.py did not set the agent's delay:\n{stderr}"
    )
    assert tier <= SLEEPING_FRACTION * control, (
        f"with the tier's environment ({NIXL_PROGRESS}) the agent's threads kept "
        f"{tier:.3f} of a core busy, against {control:.2f} with NIXL's own config"
    )

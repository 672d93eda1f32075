# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Mooncake store's master for the Kimi-K3 module's store case, and the
client config that points the store's servers at it."""

import contextlib
import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache.harness import ServerPool
from tests.models.kimi_k3 import prefix_cache_binding as kimi
from vllm.utils.network_utils import get_open_port


def _not_listening(port: int, proc: subprocess.Popen, timeout: float) -> str:
    """Why ``proc`` is not listening on ``port`` after at most ``timeout``, or ""."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"mooncake_master exited with {proc.returncode}"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return ""
        time.sleep(0.2)
    return f"mooncake_master did not listen on {port} in {timeout} s"


@contextlib.contextmanager
def mooncake_master(folder: Path, pool: ServerPool) -> Iterator[str]:
    """A real ``mooncake_master`` on a free port, and a client config for it in
    ``folder``. On exit the store's servers in ``pool`` stop first: the pool would
    keep them running against a dead master until the session ends."""
    master = shutil.which("mooncake_master")
    if master is None:
        # install-kv-connectors.sh installs Mooncake in this module's step: fail.
        pytest.fail(
            "mooncake_master is not on PATH: run "
            ".buildkite/scripts/install-kv-connectors.sh first",
            pytrace=False,
        )
    port, metrics_port = get_open_port(), get_open_port()
    args = [master, f"--port={port}", f"--metrics_port={metrics_port}"]
    args += ["--enable_metric_reporting=false"]
    args += [f"--default_kv_lease_ttl={kimi.MOONCAKE_LEASE_TTL_MS}"]
    log_path = folder / "mooncake_master.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        if why := _not_listening(port, proc, timeout=60):
            raise RuntimeError(f"{why}\n{log_path.read_text(errors='replace')}")
        config = {
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": f"127.0.0.1:{port}",
            "protocol": kimi.MOONCAKE_PROTOCOL,
            "device_name": kimi.MOONCAKE_DEVICE,
            "global_segment_size": "4GB",
            "local_buffer_size": "1GB",
        }
        (folder / "mooncake.json").write_text(json.dumps(config))
        yield str(folder / "mooncake.json")
    finally:
        try:
            pool.close()
        finally:
            proc.kill()
            proc.wait(timeout=30)

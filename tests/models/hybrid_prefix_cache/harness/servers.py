# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Server lifecycle: ``vllm serve`` processes with their logs, a deployment's
servers, their reuse across cases (:class:`ServerPool`). No global state."""

import contextlib
import os
import random
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.models.hybrid_prefix_cache.harness import clock, deployment, reconcile
from tests.models.hybrid_prefix_cache.harness.deployment import Binding, Mode
from tests.utils import RemoteOpenAIServer, _sanitize_pythonpath_env
from vllm.platforms import current_platform
from vllm.utils.network_utils import get_open_port

try:
    from tests.utils import _redact_sensitive_cli_args
except ImportError:  # a release whose tests/utils.py has none (0.26)

    def _redact_sensitive_cli_args(args):
        secret = ("key", "token", "secret", "password")
        shown, hide = [], False
        for arg in args:
            name, equals, _ = arg.partition("=")
            if hide and not arg.startswith("-"):
                shown.append("***")
                hide = False
                continue
            hide = arg.startswith("--") and any(s in name.lower() for s in secret)
            shown.append(f"{name}=***" if hide and equals else arg)
            hide = hide and not equals
        return shown


LOG_TAIL_LINES = 60
# where records and server logs go
REPORT_DIR_ENV = "HYBRID_PC_REPORT_DIR"


def report_folder(create: bool = True) -> Path:
    folder = Path(os.environ.get(REPORT_DIR_ENV, "hybrid-prefix-cache-report"))
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    return folder


class ServerError(AssertionError):
    """A server failed to start, died or did not answer; ``log``: its whole log."""

    def __init__(self, message: str, log: str = "", log_path: Path | None = None):
        super().__init__(message)
        self.log, self.log_path = log, log_path


@dataclass(frozen=True)
class ServerSpec:
    """What makes one ``vllm serve`` process; server reuse keys on it."""

    name: str
    model: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # A NIXL instance needs its own side-channel port, drawn at start.
    side_channel_port: bool = False
    prefix_caching: bool = True
    connector: bool = False


def internal_port_base() -> int:
    """A free VLLM_PORT below the ephemeral range: ports from it get taken first."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(10000, max(low - 200, 10001))
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("", port))
            return port
    return get_open_port()


def server_specs(
    binding: Binding, deployed: deployment.Deployment, mode: Mode
) -> tuple[ServerSpec, ...]:
    """The servers of ``deployed`` in ``mode``, prefiller first."""
    pd = deployed.prefill is not None
    names = ("prefill", "decode") if pd else ("serve",)
    specs = []
    ranges = deployment.device_ranges(deployed)
    for name, instance, devices in zip(names, deployed.instances, ranges):
        env = {**binding.env, **instance.env}
        if deployed.offload:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        if pd:
            # Hybrid models transfer their conv state in the DS layout.
            env["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
            if binding.visible_devices_env is not None:
                env[binding.visible_devices_env] = ",".join(map(str, devices))
        args = tuple(deployment.server_args(binding, instance, mode))
        served = (name, binding.model, args, tuple(sorted(env.items())), pd)
        connector = instance.kv_config is not None
        specs.append(ServerSpec(*served, instance.prefix_caching, connector))
    return tuple(specs)


def layered_env(inherited: Mapping[str, str], own: Mapping[str, str]) -> dict[str, str]:
    """``own`` over ``inherited``; PYTHONPATH prepended (may hold the vLLM tested)."""
    env = {**inherited, **own}
    paths = [own.get("PYTHONPATH"), inherited.get("PYTHONPATH")]
    if own.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    return env


class Server(RemoteOpenAIServer):
    """``vllm serve`` logged to a file, health-waited by its caller, in ``launched``."""

    def __init__(
        self,
        spec: ServerSpec,
        startup_timeout: float,
        port: int | None = None,
        launched: list["Server"] | None = None,
    ) -> None:
        self.spec, self.startup_timeout = spec, startup_timeout
        logs = report_folder() / "server-logs"
        logs.mkdir(exist_ok=True)
        self.log_path = logs / f"{spec.name}-{uuid.uuid4().hex[:8]}.log"
        self.launched = time.monotonic()
        self.startup_seconds: float | None = None
        # Every completion it answered (book_answer), for the counter windows.
        self._answers: list[reconcile.Ledger] = []
        self._answers_lock = threading.Lock()
        # Every process seen in the server's group while it ran.
        self.seen_pids: set[int] = set()
        self._launched = launched
        env = dict(spec.env)
        if spec.side_channel_port:
            # Below the ephemeral range too: one from it was taken before NIXL bound it,
            # and 0.34.0 waited for ever (nixl/base_scheduler.py ready_event.wait()).
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(internal_port_base())
        env.setdefault("VLLM_PORT", str(internal_port_base()))
        args = list(spec.args) + ([] if port is None else ["--port", str(port)])
        super().__init__(
            spec.model,
            args,
            env_dict=env,
            auto_port=port is None,
            max_wait_seconds=startup_timeout,
        )

    def _start_server(
        self, model: str, vllm_serve_args: list[str], env_dict: dict[str, str] | None
    ) -> None:
        # Overridden: RemoteOpenAIServer takes no log file, and replaces PYTHONPATH.
        # The test process may have initialized a device; never fork it.
        inherited = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
        env = layered_env(inherited, env_dict or {})
        _sanitize_pythonpath_env(env)
        command = ["vllm", "serve", model, *vllm_serve_args]
        # Secrets hidden here and in failures, as RemoteOpenAIServer._start_server does.
        self.command = _redact_sensitive_cli_args(command)
        print(f"[{self.spec.name}] {' '.join(self.command)}  (log: {self.log_path})")
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed by the copier
        try:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # Its own process group, so the whole tree can be killed.
                start_new_session=True,
            )
        except BaseException:
            log.close()
            raise
        self.seen_pids.add(self.proc.pid)
        if self._launched is not None:
            self._launched.append(self)
        threading.Thread(
            target=self._copy_output, args=(log,), daemon=True, name="server-log"
        ).start()

    def _copy_output(self, log) -> None:
        prefix = f"[{self.spec.name}] ".encode()
        assert self.proc.stdout is not None
        with log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                with contextlib.suppress(OSError):
                    os.write(1, prefix + line)

    def _wait_for_server(self, *, url: str, timeout: float) -> None:
        # Overridden, no public switch: start_servers() waits, for several at once.
        self.health_url = url

    def _get_gpu_memory_used(self) -> float | None:
        # Overridden, no public switch: RemoteVLLMServer waits at exit for the whole
        # GPU's memory, which dev/gpu/run_tier.sh lanes share; count this server's own.
        if not current_platform.is_cuda():
            return None
        held = 0
        try:
            from vllm.third_party import pynvml

            pynvml.nvmlInit()
            try:
                for i in range(pynvml.nvmlDeviceGetCount()):
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        if proc.pid in self.seen_pids:
                            held += proc.usedGpuMemory or 0
            finally:
                pynvml.nvmlShutdown()
        except Exception as e:  # NVML missing or refused: the helper's own
            print(f"[{self.spec.name}] no per-process GPU memory ({e})")
            return super()._get_gpu_memory_used()
        return float(held)

    def book_answer(self, entry: reconcile.Ledger) -> None:
        with self._answers_lock:
            self._answers.append(entry)

    def answers(self) -> int:
        """A mark for :meth:`answered_since`."""
        with self._answers_lock:
            return len(self._answers)

    def answered_since(self, mark: int) -> reconcile.Ledger:
        with self._answers_lock:
            return sum(self._answers[mark:], reconcile.Ledger())

    def pids(self) -> list[int]:
        # RemoteVLLMServer lists a process group only in a private helper.
        pids = self._find_pgid_members(self.proc.pid)
        self.seen_pids.update(pids)
        return pids

    def error(self, what: str) -> ServerError:
        try:
            log = self.log_path.read_text(errors="replace")
            tail = "\n".join(log.splitlines()[-LOG_TAIL_LINES:])
        except OSError as e:
            log, tail = "", f"(no log: {e})"
        in_use = "Address already in use" in tail or "address already in use" in tail
        hint = f" (port {self.port} is already in use)" if in_use else ""
        message = (
            f"the {self.spec.name} server {what}{hint}.\n"
            f"command: {' '.join(self.command)}\n"
            f"last {LOG_TAIL_LINES} lines of {self.log_path}:\n{tail}"
        )
        return ServerError(message, log, self.log_path)


def wait_healthy(servers: Sequence[Server]) -> None:
    """Wait for /health on every server; raise with the failing one's log."""
    pending = [server for server in servers if server.startup_seconds is None]
    while pending:
        for server in list(pending):
            if (code := server.proc.poll()) is not None:
                raise server.error(f"exited with code {code} during startup")
            try:
                healthy = requests.get(server.health_url, timeout=5).status_code == 200
            except requests.RequestException:
                healthy = False
            if healthy:
                server.startup_seconds = time.monotonic() - server.launched
                server.pids()
                print(f"[{server.spec.name}] healthy in {server.startup_seconds:.1f} s")
                pending.remove(server)
            elif time.monotonic() - server.launched > server.startup_timeout:
                raise server.error(
                    f"did not become healthy within {server.startup_timeout:.0f} s"
                )
        if pending:
            time.sleep(0.5)


def start_servers(
    specs: Sequence[ServerSpec], binding: Binding, launched: list[Server] | None = None
) -> list[Server]:
    """Start ``specs`` and wait until healthy; on failure stop all started."""
    servers: list[Server] = []
    try:
        for spec in specs:
            servers.append(Server(spec, binding.startup_timeout, launched=launched))
            if not binding.concurrent_start:
                wait_healthy(servers[-1:])
        wait_healthy(servers)
    except BaseException:
        RemoteOpenAIServer.shutdown_many(servers)
        raise
    return servers


@contextlib.contextmanager
def serve(
    binding: Binding,
    deployed: deployment.Deployment,
    mode: Mode,
    launched: list[Server] | None = None,
) -> Iterator[list[Server]]:
    servers = start_servers(server_specs(binding, deployed, mode), binding, launched)
    try:
        yield servers
    finally:
        RemoteOpenAIServer.shutdown_many(servers)


class ServerPool:
    """Reuses the last deployment's servers; ``launched``: every server it started."""

    def __init__(self) -> None:
        self._specs: tuple[ServerSpec, ...] | None = None
        self._servers: list[Server] = []
        self.launched: list[Server] = []
        self.starts = self.reuses = 0

    def acquire(
        self, binding: Binding, deployed: deployment.Deployment, mode: Mode
    ) -> list[Server]:
        specs = server_specs(binding, deployed, mode)
        alive = all(server.proc.poll() is None for server in self._servers)
        if specs == self._specs and alive:
            self.reuses += 1
            return self._servers
        self.close()
        with clock.phase("start"):
            servers = start_servers(specs, binding, self.launched)
        self._specs, self._servers = specs, servers
        self.starts += len(servers)
        return servers

    def close(self) -> None:
        servers, self._servers, self._specs = self._servers, [], None
        with clock.phase("stop"):
            RemoteOpenAIServer.shutdown_many(servers)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fault injection for the harness's server lifecycle, on real CPU servers.

Every fault must end with a clear message (quoting the server's log where
there is one) and with none of the processes the test started left alive:
a server that exits during startup, one killed mid-turn, a startup that
outlasts its timeout, an assertion failure inside a case, Ctrl-C of pytest
or its SIGTERM (Buildkite's cancel), and a port already in use. No fault
waits on a guess of how fast this machine is: each is triggered by what the
server is seen doing, or hangs by construction.
"""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.cpu_binding import (
    CPU_ONLY,
    DEPLOYMENTS,
    cpu_binding,
)
from tests.models.hybrid_prefix_cache.harness import (
    Binding,
    Mode,
    Suite,
    WorkloadRun,
    server_specs,
)
from tests.models.hybrid_prefix_cache.harness.client import (
    complete,
    max_model_len,
    read_counters,
)
from tests.models.hybrid_prefix_cache.harness.reconcile import (
    FIRST_TOKENS,
)
from tests.models.hybrid_prefix_cache.harness.servers import (
    Server,
    ServerError,
    serve,
    start_servers,
)
from tests.models.hybrid_prefix_cache.harness.session import CaseSession
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid

# Real CPU servers, with the CPU tier's binding.
pytestmark = CPU_ONLY

# The CPU tier's own settings and plain deployment (cpu_binding.py).
PLAIN = DEPLOYMENTS["plain"]
# How long processes may take to go once their server was stopped.
EXIT_GRACE_SECONDS = 30.0


@pytest.fixture(scope="module")
def binding(tmp_path_factory) -> Binding:
    model = write_tiny_hybrid(tmp_path_factory.mktemp("tiny-hybrid"))
    return replace(cpu_binding(model), concurrent_start=False)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def assert_no_leftovers(servers, pids=()) -> None:
    """None of the processes seen in ``servers``' groups (and ``pids``) is
    still alive, after a grace period for them to exit."""
    watched = set(pids)
    for server in servers:
        watched |= server.seen_pids
        watched |= set(server._find_pgid_members(server.proc.pid))
    assert watched, "no process was recorded: the check would be vacuous"
    deadline = time.monotonic() + EXIT_GRACE_SECONDS
    while (alive := sorted(p for p in watched if _alive(p))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert not alive, f"processes left behind: {alive} of {sorted(watched)}"


def test_server_exits_during_startup(binding, tmp_path):
    launched: list[Server] = []
    # No config.json in the model folder; a secret in the arguments.
    secret = ("--api-key", "not-to-be-printed")
    broken = replace(binding, model=str(tmp_path), base_args=binding.base_args + secret)
    with (
        pytest.raises(ServerError, match="exited with code") as error,
        serve(broken, PLAIN, Mode(), launched),
    ):
        pytest.fail("an empty model folder served")
    assert "last 60 lines of" in str(error.value)
    assert str(tmp_path) in str(error.value)
    assert "--api-key ***" in str(error.value)
    assert secret[1] not in str(error.value).split("last 60 lines of")[0]
    assert_no_leftovers(launched)


# A server whose startup hangs, by construction: its interpreter blocks
# before vLLM is imported (as on a hung import or file system), so that no
# machine is fast enough to start it within any timeout.
HANG_AT_START = "import time\n\ntime.sleep(3600)\n"


def test_startup_timeout(binding, tmp_path):
    launched: list[Server] = []
    (tmp_path / "sitecustomize.py").write_text(HANG_AT_START)
    hung = replace(
        binding,
        startup_timeout=5.0,
        env={**binding.env, "PYTHONPATH": str(tmp_path)},
    )
    started = time.monotonic()
    with (
        pytest.raises(ServerError, match="did not become healthy within 5 s"),
        serve(hung, PLAIN, Mode(), launched),
    ):
        pytest.fail("a server whose interpreter sleeps at start became healthy")
    assert time.monotonic() - started < 5.0 + EXIT_GRACE_SECONDS + 20
    assert_no_leftovers(launched)


def test_port_already_in_use(binding):
    (spec,) = server_specs(binding, PLAIN, Mode())
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        launched: list[Server] = []
        with pytest.raises(ServerError, match=f"port {port} is already in use"):
            server = Server(spec, binding.startup_timeout, port, launched)
            try:
                harness.servers.wait_healthy([server])
            finally:
                Server.shutdown_many([server])
    assert_no_leftovers(launched)


def kill_once_generating(
    server: Server, first_tokens: float, seen: list, stop: threading.Event
) -> None:
    """SIGKILL ``server``'s process group as soon as its counters show a
    first token beyond ``first_tokens`` (vLLM counts it when the request's
    first token is out: v1/metrics/loggers.py, time_to_first_token), and
    record in ``seen`` the count that triggered it; give up once ``stop``
    is set."""
    while not stop.is_set() and server.proc.poll() is None:
        count = read_counters(server)[FIRST_TOKENS]
        if count is not None and count > first_tokens:
            seen.append(count)
            os.killpg(server.proc.pid, signal.SIGKILL)
            return


def test_server_killed_mid_turn(binding):
    """The server is killed once it is seen generating the completion, not
    after a delay: the completion may run to the longest the server allows
    (its max_model_len, from /v1/models) and ignores EOS, so that it takes
    that many engine steps to end, against one /metrics read to kill it."""
    launched: list[Server] = []
    prompt = list(range(2, 200))
    seen: list[float] = []
    stop = threading.Event()
    with (
        pytest.raises(ServerError, match="exited with code -9") as error,
        serve(binding, PLAIN, Mode(), launched) as (server,),
    ):
        server.pids()
        longest = max_model_len(server) - len(prompt)
        before = read_counters(server)[FIRST_TOKENS]
        assert before is not None, f"the server exports no {FIRST_TOKENS}"
        killer = threading.Thread(
            target=kill_once_generating, args=(server, before, seen, stop), daemon=True
        )
        killer.start()
        try:
            sample = complete(
                server,
                binding.model,
                prompt,
                "kill",
                max_tokens=longest,
                ignore_eos=True,
            )
        finally:
            stop.set()
            killer.join()
        pytest.fail(
            f"the completion of {len(sample.token_ids)} tokens was answered "
            f"before the kill (first tokens seen: {seen})"
        )
    assert seen, "the server was not killed by the test"
    assert "did not answer a completion" in str(error.value)
    assert_no_leftovers(launched)


def test_assertion_failure_in_a_case(binding):
    suite = Suite()
    case = CaseSession("assertion-failure")
    with (
        pytest.raises(AssertionError, match="injected"),
        case.serve(WorkloadRun(suite, case.case_id, binding, PLAIN, Mode())) as play,
    ):
        for server in play.servers:
            server.pids()
        raise AssertionError("injected")
    (server,) = suite.pool.launched
    assert server.proc.poll() is not None, "the case's server is still running"
    assert_no_leftovers([server])


# The child pytest's module: it serves the model named in the environment,
# writes the servers' pids into the file named there, and waits for a signal;
# a second test marks that the session went on.
WAIT_FOR_A_SIGNAL = """
    import os
    import time
    from pathlib import Path

    from tests.models.hybrid_prefix_cache.cpu_binding import DEPLOYMENTS, cpu_binding
    from tests.models.hybrid_prefix_cache.harness import Mode
    from tests.models.hybrid_prefix_cache.harness.servers import serve
    from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid


    def test_wait_for_a_signal():
        model = TinyHybrid(Path(os.environ["HYBRID_PC_CTRL_C_MODEL"]), 2, 3)
        with serve(cpu_binding(model), DEPLOYMENTS["plain"], Mode()) as servers:
            pids = sorted(pid for server in servers for pid in server.pids())
            pid_file = Path(os.environ["HYBRID_PC_CTRL_C_PID_FILE"])
            pid_file.write_text(" ".join(map(str, pids)))
            time.sleep(600)


    def test_the_next_case():
        Path(os.environ["HYBRID_PC_CTRL_C_PID_FILE"] + ".next").touch()
"""


SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM}


def _waiting_session(folder: Path, model: str) -> tuple[subprocess.Popen, Path]:
    """A child pytest in ``folder`` that serves ``model``, writes its servers'
    pids to ``folder/pids`` and waits for a signal; its output goes to a file
    (nothing reads it before it ends)."""
    folder.mkdir()
    child = folder / "test_child.py"
    child.write_text(textwrap.dedent(WAIT_FOR_A_SIGNAL))
    # It imports the harness as tests.models... from the checkout this file
    # is in, and its plugin.
    checkout = Path(__file__).resolve().parents[3]
    pythonpath = os.pathsep.join(
        filter(None, (str(checkout), os.environ.get("PYTHONPATH")))
    )
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath,
        "HYBRID_PC_CTRL_C_MODEL": model,
        "HYBRID_PC_CTRL_C_PID_FILE": str(folder / "pids"),
        "HYBRID_PC_REPORT_DIR": str(folder / "report"),
    }
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
    command += ["-p", "tests.models.hybrid_prefix_cache.harness.plugin", str(child)]
    with open(folder / "output.txt", "w") as output:
        proc = subprocess.Popen(
            command,
            cwd=folder,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return proc, folder


@pytest.fixture(scope="module")
def waiting_sessions(binding, tmp_path_factory):
    """One waiting child session per signal, started at once: each test then
    signals its own."""
    root = tmp_path_factory.mktemp("signals")
    sessions = {name: _waiting_session(root / name, binding.model) for name in SIGNALS}
    yield sessions
    for proc, _ in sessions.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name", SIGNALS)
def test_a_signal_ends_the_session(waiting_sessions, name):
    """Ctrl-C, and Buildkite's cancel (SIGTERM), end the whole session: its
    servers stop, nothing is left, and no later test starts (vLLM's
    RemoteVLLMServer alone turns SIGTERM into the running test's failure)."""
    proc, folder = waiting_sessions[name]
    pid_file, output_file = folder / "pids", folder / "output.txt"
    try:
        deadline = time.monotonic() + 300
        while not pid_file.exists() or not pid_file.read_text():
            assert proc.poll() is None, (
                f"the child pytest ended: {output_file.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, "the child's server did not start"
            time.sleep(0.5)
        pids = [int(p) for p in pid_file.read_text().split()]
        proc.send_signal(SIGNALS[name])
        # A guard against a hang, not a measure: vLLM's own shutdown bounds it.
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = output_file.read_text().splitlines()
    assert proc.returncode != 0, "\n".join(lines[-60:])
    pytest.LineMatcher(lines).fnmatch_lines(["*! KeyboardInterrupt !*"])
    assert not Path(f"{pid_file}.next").exists(), (
        "the session went on to the next test:\n" + "\n".join(lines[-60:])
    )
    assert_no_leftovers([], pids)


def test_concurrent_start_stops_the_others_when_one_fails(binding, tmp_path):
    """Two servers started at once; one cannot start: the other is stopped
    at once, and the error is the failing one's."""
    launched: list[Server] = []
    good = server_specs(binding, PLAIN, Mode())[0]
    bad = replace(good, name="broken", model=str(tmp_path))
    started = time.monotonic()
    with pytest.raises(ServerError, match="the broken server exited"):
        at_once = replace(binding, startup_timeout=300.0, concurrent_start=True)
        start_servers([good, bad], at_once, launched)
    # The good one did not get to finish its startup.
    assert [s.spec.name for s in launched] == ["serve", "broken"]
    assert launched[0].startup_seconds is None
    assert time.monotonic() - started < 300
    assert_no_leftovers(launched)

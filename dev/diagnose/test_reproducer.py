# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The reproducer generator's plumbing: a script generated from a synthetic
record compiles, names what it needs, and, run against a stub HTTP server
(a stand-in for the plumbing only: it proves nothing of vLLM), sends the
recorded prompts in the recorded order and judges the answers as the suite
does. And its command writes it next to a failing case's record."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import reproducer

from tests.models.hybrid_prefix_cache import harness, tiny_hybrid

UNIT = 16
PREFILL_PARAMS = {"do_remote_decode": True, "remote_host": None}


def recorded_turn(conversation, index, prompt, prev_len, salt, problems=()):
    expected = 0 if prev_len == 0 else (prev_len - 1) // UNIT * UNIT
    bound = min(prev_len, len(prompt) - 1) // UNIT * UNIT
    return {
        "conversation": conversation,
        "turn": index,
        "prompt_len": len(prompt),
        "prev_len": prev_len,
        "expected": expected,
        "bound": bound,
        "cached": 0 if problems else expected,
        "max_logprob_diff": 0.0,
        "divergence": "",
        "hit": {"token_ids": [1, 2]},
        "recompute": {"token_ids": [1, 2]},
        "problems": list(problems),
        "notices": [],
        "salt": salt,
        "prompt": list(prompt),
    }


def synthetic_record(pd=False, offload=False) -> dict:
    """Conversation "a" fails its turn 1 (its turn 2 passes); conversation
    "b" passes."""
    a0 = list(range(100, 140))
    a1 = a0 + list(range(200, 230))
    a2 = a1 + list(range(300, 330))
    b0 = list(range(500, 545))
    lost = "a turn 1: cached 0 < expected checkpoint 32 of the previous 40-token prompt"
    turns = [
        recorded_turn("a", 0, a0, 0, "conversation-a"),
        recorded_turn("b", 0, b0, 0, "conversation-b"),
        recorded_turn("a", 1, a1, len(a0), "conversation-a", [lost]),
        recorded_turn("b", 1, b0 + [7] * 20, len(b0), "conversation-b"),
        recorded_turn("a", 2, a2, len(a1), "conversation-a"),
    ]
    servers = [
        {
            "name": "serve",
            "args": [
                "--enable-prompt-tokens-details",
                "-O0",
                "--kv-transfer-config",
                '{"kv_connector": "X"}',
            ],
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"},
            "side_channel_port": pd,
        }
    ]
    if pd:
        servers = [dict(servers[0], name="prefill"), dict(servers[0], name="decode")]
    return {
        "case_id": "sweep-partial",
        "outcome": "FAIL",
        "units": {"block": 256, "hit": UNIT},
        "turns": turns,
        "problems": [],
        "serve": {
            "model": "/tmp/tiny-hybrid0",
            "servers": servers,
            "pd": pd,
            "offload": offload,
            "logprob_atol": 0.0,
            "compares_logprobs": True,
            "max_tokens": 4,
            "logprobs": 5,
            "prefill_kv_transfer_params": PREFILL_PARAMS if pd else None,
            "vllm_version": "0.32.0",
            "vllm_file": "/repo/.vllm-overlay/abc/vllm/__init__.py",
        },
    }


class StubServer:
    """Answers /v1/models and /v1/completions like a server with a prefix
    cache per salt (hits on UNIT boundaries of the previous prompts), and
    ``/reset_prefix_cache``. ``mode``: "healthy", "lost" (never hits) or
    "drift" (a hit moves the sampled logprobs). Records every request."""

    def __init__(self, mode="healthy", role="serve"):
        self.mode, self.role, self.requests, self.stored = mode, role, [], {}
        self.resets = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.reply({"data": [{"id": "/served/model"}]})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                if self.path.startswith("/reset_prefix_cache"):
                    stub.resets += 1
                    self.reply({"success": stub.resets % 2 == 0})
                    return
                stub.requests.append(body)
                self.reply(stub.complete(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def complete(self, body):
        prompt, salt = body["prompt"], body["cache_salt"]
        cached = 0
        for earlier in self.stored.get(salt, []):
            common = 0
            while common < min(len(prompt), len(earlier)) and (
                prompt[common] == earlier[common]
            ):
                common += 1
            cached = max(cached, min(common, len(prompt) - 1) // UNIT * UNIT)
        self.stored.setdefault(salt, []).append(prompt)
        if self.mode == "lost":
            cached = 0
        tokens = [(sum(prompt) + i) % 97 for i in range(body["max_tokens"])]
        shift = 0.01 if self.mode == "drift" and cached else 0.0
        reply = {
            "choices": [
                {
                    "text": "",
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in tokens],
                        "token_logprobs": [-0.5 + shift for _ in tokens],
                        "top_logprobs": [{f"token_id:{t}": -0.5} for t in tokens],
                    },
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        if self.role == "prefill":
            reply["kv_transfer_params"] = {"from": "prefill", "n": len(prompt)}
        return reply

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def stubs():
    made = []

    def make(*args, **kwargs):
        made.append(StubServer(*args, **kwargs))
        return made[-1]

    yield make
    for stub in made:
        stub.close()


def run_script(tmp_path, record, *args, **render_kwargs):
    script = tmp_path / f"{record['case_id']}.repro.py"
    script.write_text(reproducer.render(record, **render_kwargs))
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_the_marker_is_the_one_tiny_hybrid_writes(tmp_path):
    assert reproducer.TINY_MODEL_MARKER == tiny_hybrid.MARKER
    assert reproducer.TINY_MODEL_MODULE == tiny_hybrid.MODULE
    for variant in ("", "wide-kv"):
        (tmp_path / tiny_hybrid.MARKER).write_text(
            f"written by\n{tiny_hybrid.write_command(variant)}\n"
        )
        expected = f" --variant {variant}" if variant else ""
        assert reproducer.tiny_model_args(tmp_path) == expected
    assert reproducer.tiny_model_args(tmp_path / "elsewhere") is None


def test_the_plan_replays_the_failing_turn_after_its_predecessors():
    record = synthetic_record()
    (conversation,) = reproducer.replay_plan(record)
    assert conversation["salt"] == "conversation-a"
    assert [(t["name"], t["check"]) for t in conversation["turns"]] == [
        ("a turn 0", False),
        ("a turn 1", True),
    ]
    assert conversation["turns"][1]["prompt"] == record["turns"][2]["prompt"]
    # A case that failed only on its counters replays and checks every turn.
    for turn in record["turns"]:
        turn["problems"] = []
    record["problems"] = ["the prefiller's counter moved by 3"]
    plan = reproducer.replay_plan(record)
    assert [len(c["turns"]) for c in plan] == [3, 2]
    assert all(t["check"] for c in plan for t in c["turns"])


def test_the_script_compiles_and_names_what_it_needs():
    text = reproducer.render(
        synthetic_record(),
        tiny_model=" --variant wide-kv",
        checkout="/co/vllm-0.32.0",
        python="/venv/bin/python",
    )
    compile(text, "sweep-partial.repro.py", "exec")
    doc = text.split('r"""', 1)[1].split('"""', 1)[0]
    unwrapped = " ".join(doc.replace("\\\n", " ").split())
    assert "a turn 1: cached 0 < expected checkpoint 32" in unwrapped
    assert "    cd /co/vllm-0.32.0\n" in doc
    assert "tiny_hybrid MODEL_DIR --variant wide-kv\n" in doc
    assert (
        "    /venv/bin/python -m tests.models.hybrid_prefix_cache.tiny_hybrid MODEL_DIR"
        in doc
    )
    # The server's real arguments and environment, the overlay it ran.
    assert "VLLM_CPU_OMP_THREADS_BIND=0" in doc
    assert "PYTHONPATH=/repo/.vllm-overlay/abc" in doc
    assert "vllm serve MODEL_DIR --enable-prompt-tokens-details -O0" in unwrapped
    assert """--kv-transfer-config '{"kv_connector": "X"}' --port 8000""" in unwrapped
    assert "conversation a (a turn 0, a turn 1 (checked))" in unwrapped
    assert "python sweep-partial.repro.py --url http://localhost:8000" in doc
    assert "import requests" in text and "harness" not in text.split('"""', 2)[2]
    other = reproducer.render(synthetic_record())
    assert "/tmp/tiny-hybrid0; put its path in place of MODEL_DIR" in other


@pytest.mark.parametrize(
    "mode, status, expected",
    [
        ("healthy", 0, "not reproduced: all 1 checked turns pass"),
        ("lost", 1, "problem: cached 0 < expected checkpoint 32 (hit unit 16)"),
        ("drift", 1, "problem: sampled logprobs differ from the recompute by 0.01 > 0"),
    ],
)
def test_the_script_replays_and_judges(tmp_path, stubs, mode, status, expected):
    stub = stubs(mode)
    record = synthetic_record()
    result = run_script(tmp_path, record, "--url", stub.url + "/")
    assert result.returncode == status, result.stdout + result.stderr
    assert expected in result.stdout
    assert "a turn 0: replayed (40 tokens)" in result.stdout
    if status:
        assert "reproduced: 1 of 1 checked turns FAIL, as in the suite" in result.stdout
    # The recorded prompts, in order: turn 0 and turn 1 under one fresh salt
    # made from the recorded one, then turn 1's recompute under another.
    sent = [(r["prompt"], r["cache_salt"]) for r in stub.requests]
    a0, a1 = record["turns"][0]["prompt"], record["turns"][2]["prompt"]
    assert [p for p, _ in sent] == [a0, a1, a1]
    assert sent[0][1] == sent[1][1] and sent[0][1].startswith("conversation-a-replay-")
    assert sent[2][1].startswith("recompute-")
    assert {r["model"] for r in stub.requests} == {"/served/model"}
    assert {r["max_tokens"] for r in stub.requests} == {4}


def test_exact_salts(tmp_path, stubs):
    stub = stubs()
    run_script(tmp_path, synthetic_record(), "--url", stub.url, "--exact-salts")
    assert stub.requests[0]["cache_salt"] == "conversation-a"


def test_pd_goes_through_the_prefiller_and_recomputes_on_the_decoder(tmp_path, stubs):
    prefill, decode = stubs("lost", role="prefill"), stubs()
    record = synthetic_record(pd=True)
    doc = reproducer.render(record)
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=5600" in doc and "--port 8001" in doc
    args = ["--prefill-url", prefill.url, "--decode-url", decode.url]
    result = run_script(tmp_path, record, *args)
    # The hit is the prefiller's (which lost it), not the decoder's.
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cached 0 < expected checkpoint 32" in result.stdout
    assert [r["max_tokens"] for r in prefill.requests] == [1, 1]
    assert all(r["kv_transfer_params"] == PREFILL_PARAMS for r in prefill.requests)
    got = [r.get("kv_transfer_params") for r in decode.requests]
    assert got == [{"from": "prefill", "n": 40}, {"from": "prefill", "n": 70}, None]
    assert decode.requests[2]["cache_salt"].startswith("recompute-")
    missing = run_script(tmp_path, record, "--prefill-url", prefill.url)
    assert missing.returncode == 2 and "give --prefill-url and --decode-url" in (
        missing.stderr
    )


def test_offload_resets_before_every_turn(tmp_path, stubs):
    stub = stubs()
    result = run_script(tmp_path, synthetic_record(offload=True), "--url", stub.url)
    assert result.returncode == 0, result.stdout + result.stderr
    # Two turns; the stub answers success=false once before each success.
    assert stub.resets == 4


def test_no_server(tmp_path):
    result = run_script(tmp_path, synthetic_record(), "--url", "http://127.0.0.1:9")
    assert result.returncode == 1 and "no server at http://127.0.0.1:9" in result.stderr


def test_serve_info():
    spec = harness.servers.ServerSpec(
        name="prefill",
        model="/m",
        args=("--enable-prefix-caching",),
        env=(("VLLM_SSM_CONV_STATE_LAYOUT", "DS"),),
        side_channel_port=True,
    )
    deployment = harness.Deployment(prefill=harness.Instance())
    play = SimpleNamespace(
        servers=[SimpleNamespace(spec=spec), SimpleNamespace(spec=spec)],
        binding=SimpleNamespace(model="/m"),
        deployment=deployment,
        # The P/D case's path tolerance, which a reproducer's hit and
        # recompute on the decoder alone are held to.
        recompute_atol=7.9e-3,
    )
    info = harness.records.serve_info(play)
    assert info["servers"][0] == {
        "name": "prefill",
        "args": ["--enable-prefix-caching"],
        "env": {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"},
        "side_channel_port": True,
    }
    assert (info["pd"], info["offload"], info["logprob_atol"]) == (True, False, 7.9e-3)
    assert (
        info["prefill_kv_transfer_params"] == harness.client.PREFILL_KV_TRANSFER_PARAMS
    )
    assert info["vllm_file"].endswith("vllm/__init__.py")
    assert harness.records.serve_info(None) is None


def sample(tokens, cached):
    return harness.compare.Sample(
        token_ids=tokens,
        text="",
        token_logprobs=[-0.5] * len(tokens),
        top_logprobs=[{t: -0.5} for t in tokens],
        prompt_tokens=40,
        cached_tokens=cached,
    )


def test_its_command_writes_it_next_to_a_failing_record(tmp_path, monkeypatch, capsys):
    """The harness writes the record and names the command; the command
    writes the reproducer beside it, and removes a stale one of a case that
    passes now."""
    monkeypatch.setenv(harness.servers.REPORT_DIR_ENV, str(tmp_path))
    summary: list[harness.CaseRecord] = []
    stale = tmp_path / "sweep-partial.repro.py"
    stale.write_text("stale")
    with harness.session.case_session("sweep-partial", summary) as passing:
        passing.units = harness.Units(block=256, hit=UNIT)
    record_path = tmp_path / "sweep-partial.json"
    assert reproducer.main([str(record_path)]) == 0
    assert not stale.exists()  # the case passes now
    with harness.session.case_session("sweep-partial", summary) as case:
        case.units = harness.Units(block=256, hit=UNIT)
        turn = harness.compare.Turn(
            "", 1, 40, 40, 32, bound=32, prompt=[5] * 40, salt="s-1"
        )
        turn.output, turn.recompute = sample([1, 2], 0), sample([1, 2], 0)
        turn.problems.append("turn 1: cached 0 < expected checkpoint 32")
        case.turns.append(turn)
    assert [r.outcome for r in summary] == ["pass", "FAIL"]
    record, rec = summary
    assert record.ok and not rec.ok
    assert "turn 1: cached 0 < expected checkpoint 32" in rec.explain()
    assert f"dev/suite.sh reproduce {record_path}" in capsys.readouterr().out
    assert not stale.exists()  # written by the command only
    data = json.loads(record_path.read_text())
    assert (data["turns"][0]["salt"], data["turns"][0]["prompt"]) == ("s-1", [5] * 40)
    assert data["serve"] is None  # no servers in this test
    assert reproducer.main([str(record_path)]) == 0
    text = stale.read_text()
    compile(text, str(stale), "exec")
    assert "turn 1: cached 0 < expected checkpoint 32" in text
    assert "(unknown: the record names no server)" in text

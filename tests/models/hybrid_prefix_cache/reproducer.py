# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A self-contained reproducer for every failing case.

Next to the JSON record of a case whose outcome is FAIL, the harness writes
``<case_id>.repro.py`` (:func:`update_reproducer`): a script that needs only
``requests`` and a running server. It holds the token-id prompts and salts
of the failing turns and of the turns before them under the same salt, and
names in its docstring the model and the ``vllm serve`` command line of each
server (the case's ``ServerSpec.args`` and environment). It replays those
turns under a fresh salt, so that the prefix cache holds what it held, then
sends each failing turn again under another fresh salt, and prints the
suite's verdict: the hit against the expected checkpoint and the bound, the
recompute's hit (none), and the tokens and sampled logprobs of the hit
against the recompute's, within the case's tolerance.

The script uses nothing of the harness at run time; what it needs of the
case is the record (:meth:`CaseRecord.as_json`, whose ``serve`` entry comes
from :func:`serve_info`).
"""

import os
import pprint
import shlex
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

# The file tiny_hybrid.write_tiny_hybrid leaves in the model it writes
# (tiny_hybrid.MARKER; test_reproducer.py checks that the two agree).
TINY_MODEL_MARKER = "hybrid-prefix-cache-tiny-model.txt"
TINY_MODEL_MODULE = "tests.models.hybrid_prefix_cache.tiny_hybrid"
FIRST_PORT = 8000
FIRST_SIDE_CHANNEL_PORT = 5600


def serve_info(
    play, max_tokens: int, num_logprobs: int, prefill_kv_transfer_params: Mapping
) -> dict | None:
    """What a reproducer needs of a case's servers and requests, from its
    :class:`~harness.Play` (None: the case got no servers)."""
    if play is None:
        return None
    specs = [s.spec for s in play.servers if getattr(s, "spec", None) is not None]
    pd = play.deployment.prefill is not None
    vllm = sys.modules.get("vllm")
    return {
        "model": play.binding.model,
        "servers": [
            {
                "name": spec.name,
                "args": list(spec.args),
                "env": dict(spec.env),
                "side_channel_port": spec.side_channel_port,
            }
            for spec in specs
        ],
        "pd": pd,
        "offload": play.deployment.offload,
        "logprob_atol": play.recompute_atol,
        "compares_logprobs": play.deployment.compares_logprobs,
        "max_tokens": max_tokens,
        "logprobs": num_logprobs,
        "prefill_kv_transfer_params": dict(prefill_kv_transfer_params) if pd else None,
        "vllm_version": getattr(vllm, "__version__", None),
        "vllm_file": getattr(vllm, "__file__", None),
    }


def _turn_name(turn: Mapping) -> str:
    what = "resend" if turn["turn"] == "resend" else f"turn {turn['turn']}"
    return f"{turn['conversation']} {what}".strip()


def replay_plan(record: Mapping) -> list[dict]:
    """The conversations to replay: per salt, its turns up to the last one
    to check, in the order they were played. The turns to check are the
    failing ones, or every turn when the case failed only on case-level
    checks (counters)."""
    turns = [t for t in record["turns"] if t.get("prompt")]
    to_check = [t for t in turns if t["problems"]] or turns
    checked = {id(t) for t in to_check}
    plan = []
    for salt in dict.fromkeys(t["salt"] for t in to_check):
        same_salt = [t for t in turns if t["salt"] == salt]
        last = max(i for i, t in enumerate(same_salt) if id(t) in checked)
        plan.append(
            {
                "label": same_salt[0]["conversation"],
                "salt": salt,
                "turns": [
                    {
                        "name": _turn_name(t),
                        "prompt_len": t["prompt_len"],
                        "expected": t["expected"],
                        "bound": t["bound"],
                        "check": id(t) in checked,
                        "recompute": t.get("recompute") is not None,
                        "recorded_cached": t["cached"],
                        "recorded_problems": t["problems"],
                        "prompt": t["prompt"],
                    }
                    for t in same_salt[: last + 1]
                ],
            }
        )
    return plan


def _command(words: list[str], indent: str) -> str:
    """A shell command, quoted and wrapped at about 80 columns."""
    lines, line = [], ""
    for word in map(shlex.quote, words):
        if line and len(line) + len(word) > 72:
            lines.append(line)
            line = ""
        line += (" " if line else "") + word
    lines.append(line)
    return indent + f" \\\n{indent}    ".join(lines)


def serve_commands(serve: Mapping | None) -> list[str]:
    """The ``vllm serve`` command of each server, model as MODEL_DIR."""
    if not serve or not serve["servers"]:
        return ["    (unknown: the record names no server)"]
    vllm_file = serve.get("vllm_file") or ""
    pythonpath = None
    if vllm_file and "site-packages" not in vllm_file:
        pythonpath = str(Path(vllm_file).parent.parent)
    commands = []
    for i, server in enumerate(serve["servers"]):
        env = dict(server["env"])
        if pythonpath:
            # The server's own entries (cpu_binding.NIXL_PROGRESS) first, as
            # harness.layered_env lays them.
            own = env.get("PYTHONPATH")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (own, pythonpath)))
        if server.get("side_channel_port"):
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(FIRST_SIDE_CHANNEL_PORT + i)
        words = [f"{k}={v}" for k, v in env.items()]
        words += ["vllm", "serve", "MODEL_DIR", *server["args"]]
        words += ["--port", str(FIRST_PORT + i)]
        commands.append(f"    # {server['name']}\n" + _command(words, "    "))
    return commands


def _docstring(
    record: Mapping,
    plan: list[dict],
    tiny_model: str | None,
    checkout: str,
    python: str,
) -> str:
    serve = record.get("serve") or {}
    case_id = record["case_id"]
    units = record.get("units") or {}
    failing = [t for t in record["turns"] if t["problems"]]
    lines = [
        f"Reproducer of the failing hybrid prefix-cache case {case_id}.",
        "",
        f"Written by the suite from the case's record ({case_id}.json). The case",
        f"had hit unit {units.get('hit')} and block {units.get('block')}, and "
        f"failed with:",
        "",
    ]
    problems = [p for t in failing for p in t["problems"]] + list(record["problems"])
    lines += [
        textwrap.fill(p, 76, initial_indent="    ", subsequent_indent="      ")
        for p in problems[:12]
    ]
    if len(problems) > 12:
        lines.append(f"    ... and {len(problems) - 12} more (see {case_id}.json)")
    if not failing:
        lines += [
            "",
            "No turn failed: the case failed on case-level checks (the servers'",
            "counters), which this script does not make. It replays every turn.",
        ]
    model = serve.get("model", "(unknown)")
    lines += ["", "MODEL"]
    if tiny_model is not None:
        lines += [
            f"The CPU tier's tiny Qwen3-Next model (the suite served {model}).",
            "Write it into MODEL_DIR from a vLLM checkout with this suite's",
            "tests/ laid over it:",
            "",
            f"    cd {shlex.quote(checkout)}",
            f"    {shlex.quote(python)} -m {TINY_MODEL_MODULE} MODEL_DIR{tiny_model}",
        ]
    else:
        lines += [f"{model}; put its path in place of MODEL_DIR below."]
    version = serve.get("vllm_version") or "?"
    server = (
        f"The suite ran vLLM {version} from {serve.get('vllm_file') or '?'}. "
        f"Start the server(s) as it did"
    )
    if any("PYTHONPATH=" in c for c in serve_commands(serve)):
        server += " (PYTHONPATH: that vLLM, e.g. the overlay of --vllm-source)"
    lines += [
        "",
        "SERVER",
        textwrap.fill(server + ":", 76, break_on_hyphens=False),
        "",
        *serve_commands(serve),
        "",
        "RUN",
    ]
    if serve.get("pd"):
        run = f"--prefill-url http://localhost:{FIRST_PORT} "
        run += f"--decode-url http://localhost:{FIRST_PORT + 1}"
    else:
        run = f"--url http://localhost:{FIRST_PORT}"
    lines += [f"    python {case_id}.repro.py {run}", ""]
    replayed = "; ".join(
        (f"conversation {c['label']} (" if c["label"] else "the conversation (")
        + ", ".join(
            t["name"] + (" (checked)" if t["check"] else "") for t in c["turns"]
        )
        + ")"
        for c in plan
    )
    about = (
        f"It replays {replayed}, one request at a time, each conversation under a "
        f"fresh salt made from the recorded one (--exact-salts: the recorded one), "
        f"then sends every checked turn again under another fresh salt and prints "
        f"the suite's verdict. Exit status 1: the failure reproduced; 0: it did "
        f"not. A case that played its conversations at once may need that load "
        f"to fail; the servers' counters are not checked here."
    )
    lines.append(textwrap.fill(about, 76, break_on_hyphens=False))
    text = "\n".join(lines).replace('"""', "'''")
    return f'r"""{text}\n"""'


def render(
    record: Mapping,
    *,
    tiny_model: str | None = None,
    checkout: str = "<vLLM checkout>",
    python: str = "python",
) -> str:
    """The reproducer script of a failing case's record."""
    plan = replay_plan(record)
    serve = record.get("serve") or {}
    units = record.get("units") or {}
    case = {
        "case_id": record["case_id"],
        "hit_unit": units.get("hit"),
        "logprob_atol": serve.get("logprob_atol"),
        "compares_logprobs": serve.get("compares_logprobs", True),
        "pd": bool(serve.get("pd")),
        "offload": bool(serve.get("offload")),
        "max_tokens": serve.get("max_tokens", 8),
        "logprobs": serve.get("logprobs", 5),
        "prefill_kv_transfer_params": serve.get("prefill_kv_transfer_params"),
        "conversations": plan,
    }
    literal = pprint.pformat(case, width=88, compact=True, sort_dicts=False)
    docstring = _docstring(record, plan, tiny_model, checkout, python)
    return TEMPLATE.replace("__DOCSTRING__", docstring).replace("__CASE__", literal)


def tiny_model_args(model: Path) -> str | None:
    """What follows OUT_DIR in the command that wrote ``model`` (" --variant
    V", or ""), if the tiny-model writer wrote it; None otherwise."""
    marker = model / TINY_MODEL_MARKER
    if not marker.is_file():
        return None
    for line in marker.read_text().splitlines():
        if TINY_MODEL_MODULE in line and " OUT_DIR" in line:
            return line.split(" OUT_DIR", 1)[1].rstrip()
    return ""


def reproducer_path(folder: Path, case_id: str) -> Path:
    return folder / f"{case_id}.repro.py"


def update_reproducer(record: Mapping, folder: Path) -> Path | None:
    """Write the reproducer of a FAIL record into ``folder``, or remove a
    stale one of a case that no longer fails. The script's path, if any. A
    reproducer that cannot be written is reported, never in the way of the
    case's own verdict."""
    path = reproducer_path(folder, record["case_id"])
    try:
        if record["outcome"] != "FAIL" or not replay_plan(record):
            path.unlink(missing_ok=True)
            return None
        model = (record.get("serve") or {}).get("model") or ""
        text = render(
            record,
            tiny_model=tiny_model_args(Path(model)) if model else None,
            checkout=os.getcwd(),
            python=sys.executable,
        )
        path.write_text(text)
        path.chmod(0o755)
    except Exception as e:
        print(f"notice: no reproducer for {record['case_id']}: {type(e).__name__}: {e}")
        return None
    print(f"reproducer: {path}")
    return path


TEMPLATE = '''\
#!/usr/bin/env python3
__DOCSTRING__

import argparse
import sys
import time
import uuid

import requests

CASE = __CASE__

TIMEOUT = 600
TOKEN_ID_PREFIX = "token_id:"


def post(url, path, body=None, params=None):
    try:
        response = requests.post(
            f"{url}/{path}", json=body, params=params, timeout=TIMEOUT
        )
    except requests.RequestException as e:
        sys.exit(f"{url} did not answer {path}: {type(e).__name__}: {e}")
    if response.status_code != 200:
        text = response.text[:2000]
        sys.exit(f"{url}/{path} answered {response.status_code}: {text}")
    return response.json()


def served_model(url):
    try:
        response = requests.get(f"{url}/v1/models", timeout=60)
        response.raise_for_status()
    except requests.RequestException as e:
        sys.exit(f"no server at {url}: {type(e).__name__}: {e}")
    return response.json()["data"][0]["id"]


def complete(url, model, prompt, salt, max_tokens, kv_transfer_params=None):
    """A greedy completion of the token-id prompt under the salt."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": CASE["logprobs"],
        "cache_salt": salt,
        "return_tokens_as_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    data = post(url, "v1/completions", body)
    choice, usage = data["choices"][0], data["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        sys.exit(
            f"{url} reports no usage.prompt_tokens_details.cached_tokens: "
            "serve with --enable-prompt-tokens-details"
        )
    logprobs = choice["logprobs"]
    return {
        "tokens": [int(t.removeprefix(TOKEN_ID_PREFIX)) for t in logprobs["tokens"]],
        "logprobs": list(logprobs["token_logprobs"]),
        "prompt_tokens": usage["prompt_tokens"],
        "cached": cached,
        "kv_transfer_params": data.get("kv_transfer_params"),
    }


def send(urls, model, prompt, salt):
    """A turn: to the server, or under P/D to the prefiller (whose prefix
    cache is consulted: its hit is the turn's) and then to the decoder,
    which pulls the prefiller's KV."""
    if len(urls) == 1:
        return complete(urls[0], model, prompt, salt, CASE["max_tokens"])
    params = CASE["prefill_kv_transfer_params"]
    prefill = complete(urls[0], model, prompt, salt, 1, params)
    if not prefill["kv_transfer_params"]:
        sys.exit(f"the prefiller {urls[0]} returned no kv_transfer_params")
    decode = complete(
        urls[1], model, prompt, salt, CASE["max_tokens"], prefill["kv_transfer_params"]
    )
    return {**decode, "cached": prefill["cached"]}


def reset_prefix_caches(urls):
    """Drop the device prefix caches, keeping the offloaded one, so that a
    hit must come from the offload tier (serve with VLLM_SERVER_DEV_MODE=1)."""
    for url in urls:
        for _ in range(120):
            if post(url, "reset_prefix_cache", params={"reset_external": "false"}).get(
                "success"
            ):
                break
            time.sleep(0.5)
        else:
            sys.exit(f"{url}/reset_prefix_cache kept answering success=false")


def check(turn, hit, recompute):
    """The suite's verdict on one turn: its problems and its notices."""
    problems, notices = [], []
    unit, cached = CASE["hit_unit"], hit["cached"]
    for sample, what in ((hit, "hit"), (recompute, "recompute")):
        if sample is not None and sample["prompt_tokens"] != turn["prompt_len"]:
            problems.append(
                f"the {what} reports {sample['prompt_tokens']} prompt tokens, "
                f"sent {turn['prompt_len']}"
            )
    if cached < turn["expected"]:
        problems.append(
            f"cached {cached} < expected checkpoint {turn['expected']} (hit unit "
            f"{unit}): a checkpoint was lost"
            + (" (no hit at all)" if not cached else "")
        )
    if cached > turn["bound"] or (unit and cached % unit):
        problems.append(
            f"impossible hit, over-reported: cached {cached} (bound {turn['bound']}, "
            f"hit unit {unit})"
        )
    elif cached > turn["expected"]:
        notices.append(f"cached {cached} is above the expected {turn['expected']}")
    if recompute is None:
        return problems, notices
    if recompute["cached"] != 0:
        problems.append(
            f"the recompute under a fresh cache_salt reported {recompute['cached']} "
            f"cached tokens, expected 0"
        )
    if not CASE["compares_logprobs"]:
        return problems, notices
    atol = CASE["logprob_atol"]
    pairs = list(zip(hit["tokens"], recompute["tokens"]))
    diverged = [i for i, (a, b) in enumerate(pairs) if a != b]
    if diverged or len(hit["tokens"]) != len(recompute["tokens"]):
        i = diverged[0] if diverged else len(pairs)
        where = f"first diverging token at index {i}: hit {hit['tokens'][i:i + 1]}, "
        where += f"recompute {recompute['tokens'][i:i + 1]}"
        if atol is not None:
            problems.append(f"output differs from the recompute: {where}")
        else:
            notices.append(f"{where} (the suite lets check_logprobs_close decide)")
        return problems, notices
    pairs = zip(hit["logprobs"], recompute["logprobs"])
    diff = max((abs(a - b) for a, b in pairs), default=0.0)
    if atol is not None and diff > atol:
        problems.append(
            f"sampled logprobs differ from the recompute by {diff:.3g} > {atol:g}, "
            f"with the same tokens: the restored state is wrong"
        )
    return problems, notices


def main():
    parser = argparse.ArgumentParser(
        description=f"Replay the failing turns of {CASE['case_id']}."
    )
    parser.add_argument("--url", default="http://localhost:8000", help="the server")
    parser.add_argument("--prefill-url", help="P/D: the prefiller")
    parser.add_argument("--decode-url", help="P/D: the decoder")
    parser.add_argument(
        "--exact-salts",
        action="store_true",
        help="use the recorded salts (on a server that never saw them)",
    )
    args = parser.parse_args()
    if CASE["pd"]:
        if not (args.prefill_url and args.decode_url):
            parser.error("this case ran under P/D: give --prefill-url and --decode-url")
        urls = [args.prefill_url, args.decode_url]
    else:
        urls = [args.url]
    urls = [url.rstrip("/") for url in urls]
    model = served_model(urls[-1])
    checked = failed = 0
    for conversation in CASE["conversations"]:
        salt = conversation["salt"]
        if not args.exact_salts:
            salt = f"{salt}-replay-{uuid.uuid4().hex[:8]}"
        for turn in conversation["turns"]:
            if CASE["offload"]:
                reset_prefix_caches(urls)
            hit = send(urls, model, turn["prompt"], salt)
            if not turn["check"]:
                print(
                    f"{turn['name']}: replayed ({turn['prompt_len']} tokens), cached "
                    f"{hit['cached']} (the suite saw {turn['recorded_cached']})"
                )
                continue
            recompute = None
            if turn["recompute"]:
                fresh = f"recompute-{uuid.uuid4().hex}"
                recompute = complete(
                    urls[-1], model, turn["prompt"], fresh, CASE["max_tokens"]
                )
            problems, notices = check(turn, hit, recompute)
            checked += 1
            failed += bool(problems)
            print(
                f"{turn['name']}: {'FAIL' if problems else 'ok'}: {turn['prompt_len']} "
                f"tokens, cached {hit['cached']} (expected {turn['expected']}, bound "
                f"{turn['bound']})"
            )
            for problem in problems:
                print(f"  problem: {problem}")
            for notice in notices:
                print(f"  notice: {notice}")
            for problem in turn["recorded_problems"]:
                print(f"  the suite saw: {problem}")
    if failed:
        print(f"reproduced: {failed} of {checked} checked turns FAIL, as in the suite")
        return 1
    print(f"not reproduced: all {checked} checked turns pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

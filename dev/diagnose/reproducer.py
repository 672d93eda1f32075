# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``<case_id>.repro.py`` beside a FAIL record: a script needing only
``requests`` and running servers, which replays the failing turns' salts
under fresh ones and prints the suite's verdict. Built from the record alone,
by ``dev/suite.sh reproduce RECORD.json...``, so the suite never loads it."""

import argparse
import json
import os
import pprint
import shlex
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

from reproducer_script import TEMPLATE

# tiny_hybrid.MARKER and MODULE (test_reproducer.py holds them equal)
TINY_MODEL_MARKER = "hybrid-prefix-cache-tiny-model.txt"
TINY_MODEL_MODULE = "tests.models.hybrid_prefix_cache.tiny_hybrid"
FIRST_PORT = 8000
FIRST_SIDE_CHANNEL_PORT = 5600


def _turn_name(turn: Mapping) -> str:
    what = "resend" if turn["turn"] == "resend" else f"turn {turn['turn']}"
    return f"{turn['conversation']} {what}".strip()


def replay_plan(record: Mapping) -> list[dict]:
    """Per salt, its turns up to the last failing one (all, where only
    case-level checks failed)."""
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
            # the server's own entries first, as harness.layered_env
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
    """What followed OUT_DIR when tiny_hybrid wrote ``model``; None if not."""
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
    """Write a FAIL record's reproducer into ``folder``, or remove a stale
    one where the record passed (None)."""
    path = reproducer_path(folder, record["case_id"])
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
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("records", nargs="+", type=Path, help="<case_id>.json")
    args = parser.parse_args(argv)
    for path in args.records:
        written = update_reproducer(json.loads(path.read_text()), path.parent)
        print(f"{path}: " + (f"reproducer {written}" if written else "passed"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

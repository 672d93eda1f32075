# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The source of a failing case's ``<case_id>.repro.py`` (reproducer.render
fills in __DOCSTRING__ and __CASE__): it needs only ``requests``."""

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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Requests to servers: completions through a deployment (:func:`send`),
prefix-cache resets and ``/metrics`` reads."""

import contextlib
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.models.hybrid_prefix_cache.harness import clock, reconcile, rules
from tests.models.hybrid_prefix_cache.harness.compare import NUM_LOGPROBS, Sample
from tests.models.hybrid_prefix_cache.harness.servers import Server

MAX_TOKENS = 8
TOKEN_ID_PREFIX = "token_id:"
REQUEST_TIMEOUT = 600.0
# Metrics and cache resets: a loaded machine can stall them as long as a
# request (findings/control-timeouts.md).
CONTROL_TIMEOUT = REQUEST_TIMEOUT
# An offload deployment's prefix-cache reset answers success=false while
# blocks are still held (e.g. by in-flight offload transfers); retry.
RESET_ATTEMPTS = 120
RESET_INTERVAL = 0.5
# Counters are exported after the engine step that moved them; poll before failing.
METRICS_SETTLE_SECONDS = 15.0
METRICS_POLL_INTERVAL = 0.25
# A P/D prefill leg asks the prefiller to keep the KV for a remote decoder.
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@clock.phase("reset")
def reset_prefix_caches(servers: Sequence[Server]) -> None:
    """Drop the device prefix caches, not the offloaded one: next hits come from it."""
    for server in servers:
        url = server.url_for("reset_prefix_cache")
        for _ in range(RESET_ATTEMPTS):
            response = requests.post(
                url, params={"reset_external": "false"}, timeout=CONTROL_TIMEOUT
            )
            response.raise_for_status()
            if response.json().get("success"):
                break
            time.sleep(RESET_INTERVAL)
        else:
            raise AssertionError(
                f"{url} kept answering success=false for "
                f"{RESET_ATTEMPTS * RESET_INTERVAL:.0f} s"
            )


def read_metrics(server: Server) -> dict[str, list]:
    with clock.phase("metrics"):
        response = requests.get(server.url_for("metrics"), timeout=CONTROL_TIMEOUT)
    response.raise_for_status()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def read_counters(server: Server) -> dict[str, float | None]:
    """The reconciled counters summed over engines; None where not exported."""
    samples = read_metrics(server)
    return {
        name: sum(s.value for s in samples[name]) if name in samples else None
        for name in reconcile.COUNTERS
    }


def max_model_len(server: Server) -> int:
    response = requests.get(server.url_for("v1/models"), timeout=CONTROL_TIMEOUT)
    response.raise_for_status()
    return int(response.json()["data"][0]["max_model_len"])


def cache_config(server: Server) -> dict[str, str]:
    """The labels of the server's ``vllm:cache_config_info`` metric."""
    samples = read_metrics(server).get("vllm:cache_config_info")
    if not samples:
        raise AssertionError(f"{server.url_root} exports no vllm:cache_config_info")
    return dict(samples[0].labels)


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise AssertionError(f"token {token!r} is not in the token-id form")
    return int(token.removeprefix(TOKEN_ID_PREFIX))


def complete(
    server: Server, model: str, prompt: Sequence[int], salt: str, **options: Any
) -> Sample:
    """:func:`give_up`'s completion (its keyword ``options``), never given up."""
    sample = give_up(server, model, prompt, salt, None, **options)
    assert sample is not None
    return sample


def give_up(
    server: Server,
    model: str,
    prompt: Sequence[int],
    salt: str,
    after: float | None,
    *,
    max_tokens: int = MAX_TOKENS,
    kv_transfer_params: dict | None = None,
    ignore_eos: bool = False,
    priority: int = 0,
) -> Sample | None:
    """A greedy completion of ``prompt`` (token ids) under ``salt`` (``ignore_eos``: of
    ``max_tokens`` tokens whatever it samples; ``priority``: for ``--scheduling-policy
    priority``), booked on ``server`` for its case's counter window; None where the
    client gave up after ``after`` seconds (None: never) by closing the connection, on
    which vLLM aborts it (entrypoints/serve/utils/api_utils.py with_cancellation)."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": NUM_LOGPROBS,
        "cache_salt": salt,
        "return_tokens_as_token_ids": True,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if priority:
        body["priority"] = priority
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    url = server.url_for("v1/completions")
    timeout = REQUEST_TIMEOUT if after is None else (CONTROL_TIMEOUT, after)
    try:
        with clock.phase("requests"):
            response = requests.post(url, json=body, timeout=timeout)
    except requests.RequestException as e:
        if after is not None and isinstance(e, requests.ReadTimeout):
            return None
        failure = f"did not answer a completion ({type(e).__name__}: {e})"
    else:
        code, text = response.status_code, response.text[:2000]
        failure = "" if code == 200 else f"answered a completion with {code}: {text}"
    if failure:
        # a server that just died may take a moment to be reaped
        with contextlib.suppress(subprocess.TimeoutExpired):
            failure += f"; the server exited with code {server.proc.wait(timeout=2)}"
        raise server.error(failure)
    data = response.json()
    choice, usage = data["choices"][0], data["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        raise AssertionError(
            "the server reports no usage.prompt_tokens_details.cached_tokens; "
            "serve with --enable-prompt-tokens-details"
        )
    entry = reconcile.ledger_entry(usage["prompt_tokens"], cached, kv_transfer_params)
    server.book_answer(entry)
    logprobs = choice["logprobs"]
    return Sample(
        token_ids=[_token_id(t) for t in logprobs["tokens"]],
        text=choice["text"],
        token_logprobs=list(logprobs["token_logprobs"]),
        top_logprobs=[
            {_token_id(t): lp for t, lp in top.items()}
            for top in logprobs["top_logprobs"]
        ],
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=cached,
        kv_transfer_params=data.get("kv_transfer_params"),
    )


def poll_counters(
    server: Server, name: str, done: Callable[[float], bool]
) -> dict[str, float | None]:
    """The counters once ``name`` meets ``done`` or is not exported, or time is up."""
    deadline = time.monotonic() + METRICS_SETTLE_SECONDS
    with clock.phase("metrics"):
        while True:
            counters = read_counters(server)
            value = counters[name]
            if value is None or done(value) or time.monotonic() > deadline:
                return counters
            time.sleep(METRICS_POLL_INTERVAL)


def send(
    servers: Sequence[Server], model: str, prompt: Sequence[int], salt: str
) -> Sample:
    """One turn's request through the deployment. Under P/D (prefiller, decoder) the
    decoder pulls the prefiller's KV over the connector; the hit is the prefiller's."""
    return send_checked(servers, model, prompt, salt, check=False)[0]


def send_checked(
    servers: Sequence[Server], model: str, prompt: Sequence[int], salt: str, check=True
) -> tuple[Sample, list[str]]:
    """:func:`send`, one request at a time, and (``check``) its problems: under P/D the
    decoder must count a NIXL transfer and report the prefiller's hit as cached."""
    if len(servers) == 1:
        return complete(servers[0], model, prompt, salt), []
    prefiller, decoder = servers
    params = PREFILL_KV_TRANSFER_PARAMS
    prefill = complete(
        prefiller, model, prompt, salt, max_tokens=1, kv_transfer_params=params
    )
    if not prefill.kv_transfer_params:
        raise AssertionError(
            f"the prefiller {prefiller.url_root} returned no kv_transfer_params"
        )
    before = read_counters(decoder) if check else {}
    decode = complete(
        decoder, model, prompt, salt, kv_transfer_params=prefill.kv_transfer_params
    )
    sample = replace(decode, cached_tokens=prefill.cached_tokens)
    if not check:
        return sample, []
    hit = prefill.cached_tokens
    problems, decoder_hit = _decoder_leg(decoder, before, len(prompt), hit)
    reported = rules.decoder_reported_cached(len(prompt), hit)
    if decode.cached_tokens != reported:
        problems.append(
            f"the decoder reports {decode.cached_tokens} cached tokens, "
            f"the prefiller hit {hit}, and vLLM's rule "
            f"(rules.decoder_reported_cached) gives {reported}"
        )
    return replace(sample, decoder_hit=decoder_hit), problems


def _decoder_leg(
    decoder: Server, before: dict[str, float | None], prompt_len: int, prefill_hit: int
) -> tuple[list[str], int | None]:
    """The decoder's own hit on the decode leg and its role's faults
    (:func:`reconcile.decoder_problems`), polled for: exported after the engine step."""
    hits, transfers = reconcile.PREFIX_HITS, reconcile.NIXL_TRANSFERS
    if before.get(transfers) is None or before.get(hits) is None:
        return [f"the decoder exports no {transfers} or {hits}"], None
    if decoder.spec.prefix_caching:
        queries = reconcile.PREFIX_QUERIES
        seen = (before[queries] or 0.0) + prompt_len
        now = poll_counters(decoder, queries, lambda v: v >= seen)
    else:
        now = read_counters(decoder)
    local_hit = (now[hits] or 0.0) - before[hits]
    if reconcile.decoder_pulls(prompt_len, local_hit):
        now = poll_counters(decoder, transfers, lambda v: v > before[transfers])
    moved = (now[transfers] or 0.0) - before[transfers]
    found = reconcile.decoder_problems(prompt_len, local_hit, moved, prefill_hit)
    return found, int(local_hit)

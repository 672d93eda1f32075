# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model-agnostic harness for prefix-cache tests of hybrid models.

Hybrid models (linear attention or Mamba layers beside attention layers) can
only reuse a prefix at a checkpoint, where vLLM saved the recurrent state.
A growing conversation must therefore hit at least the last checkpoint of the
previous prompt on every turn, and the output must equal a recompute of the
same prompt under a fresh ``cache_salt``.

This module knows nothing about any model. A tier binds it to one: a
:class:`Binding` says which model to serve and how, frozen dataclasses say
what to deploy (:class:`Deployment` of :class:`Instance`) and how to match
(:class:`Mode`), and :func:`run_case` does the rest.
"""

import contextlib
import json
import random
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from math import lcm

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.models.utils import check_logprobs_close
from tests.utils import RemoteOpenAIServer
from vllm.utils.network_utils import get_open_port

# The conversation: the first prompt spans FIRST_PROMPT_BLOCKS blocks plus an
# unaligned tail; every later turn appends TURN_TOKENS tokens (the previous
# output, then random token ids).
NUM_TURNS = 3
FIRST_PROMPT_BLOCKS = 3
FIRST_PROMPT_TAIL = 37
TURN_TOKENS = 777
MAX_TOKENS = 8
NUM_LOGPROBS = 5
TOKEN_ID_PREFIX = "token_id:"
REQUEST_TIMEOUT = 600.0
# An offload deployment's prefix-cache reset answers success=false while
# blocks are still held (e.g. by in-flight offload transfers); retry.
RESET_ATTEMPTS = 120
RESET_INTERVAL = 0.5
# Environment of every instance of a P/D deployment: hybrid models transfer
# their conv state in the DS layout.
PD_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
# The prefill leg of a P/D request asks the prefiller to keep the KV for a
# remote decoder.
PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class Mode:
    """How prefixes are matched: by block, or by a finer prefix match unit,
    with or without speculative decoding."""

    prefix_match_unit: int | None = None
    spec: Mapping | None = None

    def args(self) -> list[str]:
        args = []
        if self.prefix_match_unit is not None:
            args += ["--prefix-match-unit", str(self.prefix_match_unit)]
        if self.spec is not None:
            args += ["--speculative-config", json.dumps(self.spec)]
        return args


@dataclass(frozen=True)
class Instance:
    """One ``vllm serve`` process and the devices it owns."""

    tp: int = 1
    dp: int = 1
    dcp: int = 1
    expert_parallel: bool = False
    kv_config: Mapping | None = field(default=None, hash=False)
    prefix_caching: bool = True

    @property
    def num_devices(self) -> int:
        return self.tp * self.dp

    def args(self) -> list[str]:
        args = []
        if self.tp > 1:
            args += ["--tensor-parallel-size", str(self.tp)]
        if self.dp > 1:
            args += ["--data-parallel-size", str(self.dp)]
        if self.dcp > 1:
            args += ["--decode-context-parallel-size", str(self.dcp)]
        if self.expert_parallel:
            args.append("--enable-expert-parallel")
        if self.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_config)]
        caching = "--enable-prefix-caching" if self.prefix_caching else None
        args.append(caching or "--no-enable-prefix-caching")
        return args


@dataclass(frozen=True)
class Deployment:
    """The instances of one case: a decoder, optionally fed by a prefiller.

    ``offload`` means the hit must come from the CPU offload tier: the
    instances' GPU prefix caches are reset before every turn.
    """

    decode: Instance = Instance()
    prefill: Instance | None = None
    offload: bool = False

    @property
    def instances(self) -> tuple[Instance, ...]:
        if self.prefill is None:
            return (self.decode,)
        return (self.prefill, self.decode)

    @property
    def num_devices(self) -> int:
        return sum(instance.num_devices for instance in self.instances)

    @property
    def compares_logprobs(self) -> bool:
        """Whether a hit's logprobs can be held to the recompute's.

        Under P/D with different TP sizes, prefiller and decoder hold
        differently sharded (and, with dummy weights, different) weights.
        """
        return self.prefill is None or self.prefill.tp == self.decode.tp


def device_ranges(deployment: Deployment) -> list[range]:
    """Disjoint, contiguous device ids for each instance, in order."""
    ranges, start = [], 0
    for instance in deployment.instances:
        ranges.append(range(start, start + instance.num_devices))
        start += instance.num_devices
    return ranges


@dataclass(frozen=True)
class Binding:
    """What a tier binds the harness to.

    ``token_ids`` is the half-open range random prompt ids are drawn from.
    ``logprob_atol`` bounds the difference between the sampled tokens'
    logprobs of a cache hit and of its recompute; None where no tolerance
    has been measured on the platform (``check_logprobs_close`` still
    applies).
    """

    model: str
    base_args: tuple[str, ...]
    token_ids: tuple[int, int]
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    startup_timeout: float = 600.0
    logprob_atol: float | None = 0.0
    # The variable that gives a P/D instance its own devices, or None where
    # instances share the machine (the CPU backend).
    visible_devices_env: str | None = "CUDA_VISIBLE_DEVICES"


def matrix_params(
    deployments: Mapping[str, Deployment],
    modes: Mapping[str, Mode],
    known_failures: Mapping[str, str],
    device_marks: Callable[[int], list] | None = None,
) -> list:
    """One ``pytest.param(deployment, mode)`` per cell, id
    ``<deployment>-<mode>``.

    A cell listed in ``known_failures`` (id -> reason) is a strict xfail, so
    that a fix upstream shows as XPASS. ``device_marks(n)`` gives the marks
    of a cell that needs ``n`` > 1 devices.
    """
    ids = {f"{d}-{m}" for d in deployments for m in modes}
    unknown = sorted(set(known_failures) - ids)
    if unknown:
        raise ValueError(f"known failures name no case of the matrix: {unknown}")
    params = []
    for dep_name, deployment in deployments.items():
        for mode_name, mode in modes.items():
            case_id = f"{dep_name}-{mode_name}"
            marks = []
            if device_marks is not None and deployment.num_devices > 1:
                marks += device_marks(deployment.num_devices)
            if case_id in known_failures:
                marks.append(
                    pytest.mark.xfail(reason=known_failures[case_id], strict=True)
                )
            params.append(pytest.param(deployment, mode, id=case_id, marks=marks))
    return params


def server_args(binding: Binding, instance: Instance, mode: Mode) -> list[str]:
    """The ``vllm serve`` arguments (after the model) of one instance."""
    return [*binding.base_args, *instance.args(), *mode.args()]


def expected_resend(prompt_len: int, unit: int) -> int:
    """The hit of an exact resend of a ``prompt_len``-token prompt: its own
    last checkpoint, strictly inside the prompt (also with a drafter that
    keeps the trailing unit's state, such as DSpark)."""
    return (prompt_len - 1) // unit * unit


def expected_cached(prev_len: int, unit: int, spec: bool) -> int:
    """The last checkpoint of a previous prompt of ``prev_len`` tokens.

    vLLM saves state at every ``unit`` boundary strictly inside the prompt
    (the last prompt token is always recomputed to produce logits). With
    speculative decoding the hit is one unit lower: the last unit's state may
    include rejected lookahead tokens and is not reused.
    """
    hit = (prev_len - 1) // unit * unit if prev_len > 0 else 0
    if spec:
        hit -= unit
    return max(hit, 0)


def impossible_hit(cached: int, prev_len: int, prompt_len: int, unit: int) -> str:
    """Why ``cached`` cannot be a real hit, or "" if it can.

    A hit lands on a ``unit`` boundary, cannot reach past what this salt's
    earlier requests stored (the previous prompt), and always leaves at
    least the last prompt token to compute.
    """
    if cached % unit:
        return f"cached {cached} is not a multiple of the hit unit {unit}"
    if cached > prev_len:
        return f"cached {cached} exceeds the previous prompt's {prev_len} tokens"
    if cached >= prompt_len:
        return f"cached {cached} leaves nothing of the {prompt_len}-token prompt"
    return ""


# --- serving ---------------------------------------------------------------


def instance_env(
    binding: Binding, deployment: Deployment, devices: range
) -> dict[str, str]:
    """The environment of one instance of ``deployment``."""
    env = dict(binding.env)
    if deployment.offload:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes POST /reset_prefix_cache
    if deployment.prefill is not None:
        env.update(PD_ENV)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(get_open_port())
        if binding.visible_devices_env is not None:
            env[binding.visible_devices_env] = ",".join(map(str, devices))
    return env


@contextlib.contextmanager
def serve(
    binding: Binding, deployment: Deployment, mode: Mode
) -> Iterator[list[RemoteOpenAIServer]]:
    """Serve every instance of ``deployment`` (prefiller first); shut them
    down together."""
    servers: list[RemoteOpenAIServer] = []
    try:
        for instance, devices in zip(deployment.instances, device_ranges(deployment)):
            server = RemoteOpenAIServer(
                binding.model,
                server_args(binding, instance, mode),
                env_dict=instance_env(binding, deployment, devices),
                max_wait_seconds=binding.startup_timeout,
            )
            servers.append(server)
        yield servers
    finally:
        RemoteOpenAIServer.shutdown_many(servers)


def reset_prefix_caches(servers: Sequence[RemoteOpenAIServer]) -> None:
    """Drop every server's device prefix cache, keeping the offloaded one,
    so that the next hit must come from the CPU tier."""
    for server in servers:
        url = server.url_for("reset_prefix_cache")
        for _ in range(RESET_ATTEMPTS):
            response = requests.post(
                url, params={"reset_external": "false"}, timeout=60
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


def read_metrics(server: RemoteOpenAIServer) -> dict[str, list]:
    """The server's Prometheus samples, by sample name."""
    response = requests.get(server.url_for("metrics"), timeout=30)
    response.raise_for_status()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def cache_config(server: RemoteOpenAIServer) -> dict[str, str]:
    """The labels of the server's ``vllm:cache_config_info`` metric."""
    samples = read_metrics(server).get("vllm:cache_config_info")
    if not samples:
        raise AssertionError(f"{server.url_root} exports no vllm:cache_config_info")
    return dict(samples[0].labels)


@dataclass(frozen=True)
class Units:
    """The checkpoint geometry a server reports."""

    block: int  # lcm of the attention and Mamba block sizes
    hit: int  # the finest boundary a hit can land on

    @classmethod
    def from_cache_config(cls, labels: Mapping[str, str], mode: Mode) -> "Units":
        block = lcm(int(labels["block_size"]), int(labels["mamba_block_size"]))
        if mode.prefix_match_unit is None:
            return cls(block=block, hit=block)
        reported = labels.get("prefix_match_unit")
        if reported != str(mode.prefix_match_unit):
            raise AssertionError(
                f"server reports prefix_match_unit={reported!r}, "
                f"expected {mode.prefix_match_unit}"
            )
        return cls(block=block, hit=mode.prefix_match_unit)


# --- the conversation ------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One completion: its greedy tokens, logprobs and prompt usage."""

    token_ids: list[int]
    text: str
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    prompt_tokens: int
    cached_tokens: int
    kv_transfer_params: dict | None = None

    def as_tokens_text_logprobs(self) -> tuple:
        return (self.token_ids, self.text, self.top_logprobs)


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise AssertionError(f"token {token!r} is not in the token-id form")
    return int(token.removeprefix(TOKEN_ID_PREFIX))


def complete(
    server: RemoteOpenAIServer,
    model: str,
    prompt: Sequence[int],
    salt: str,
    *,
    max_tokens: int = MAX_TOKENS,
    kv_transfer_params: dict | None = None,
) -> Sample:
    """A greedy completion of ``prompt`` (token ids) under ``salt``."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": NUM_LOGPROBS,
        "cache_salt": salt,
        "return_tokens_as_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    url = server.url_for("v1/completions")
    response = requests.post(url, json=body, timeout=REQUEST_TIMEOUT)
    if response.status_code != 200:
        raise AssertionError(
            f"{url} answered {response.status_code}: {response.text[:2000]}"
        )
    data = response.json()
    choice, usage = data["choices"][0], data["usage"]
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is None:
        raise AssertionError(
            "the server reports no usage.prompt_tokens_details.cached_tokens; "
            "serve with --enable-prompt-tokens-details"
        )
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
        cached_tokens=details["cached_tokens"],
        kv_transfer_params=data.get("kv_transfer_params"),
    )


def send(
    servers: Sequence[RemoteOpenAIServer],
    model: str,
    prompt: Sequence[int],
    salt: str,
) -> Sample:
    """One turn's request through the deployment.

    With a prefiller (``servers`` = prefiller, decoder), the prefiller
    computes the prompt and keeps its KV for the decoder; the decoder then
    pulls it over the KV connector and generates. The hit is the
    prefiller's: that is where the prefix cache is consulted.
    """
    if len(servers) == 1:
        return complete(servers[0], model, prompt, salt)
    prefiller, decoder = servers
    prefill = complete(
        prefiller,
        model,
        prompt,
        salt,
        max_tokens=1,
        kv_transfer_params=PREFILL_KV_TRANSFER_PARAMS,
    )
    if not prefill.kv_transfer_params:
        raise AssertionError(
            f"the prefiller {prefiller.url_root} returned no kv_transfer_params"
        )
    decode = complete(
        decoder,
        model,
        prompt,
        salt,
        kv_transfer_params=prefill.kv_transfer_params,
    )
    return replace(decode, cached_tokens=prefill.cached_tokens)


@dataclass
class Turn:
    index: int
    prompt_len: int
    prev_len: int
    expected: int
    output: Sample | None = None
    recompute: Sample | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def max_logprob_diff(self) -> float | None:
        if self.output is None or self.recompute is None:
            return None
        if self.output.token_ids != self.recompute.token_ids:
            return None
        pairs = zip(self.output.token_logprobs, self.recompute.token_logprobs)
        return max((abs(a - b) for a, b in pairs), default=0.0)


def check_turn(
    turn: Turn,
    units: Units,
    logprob_atol: float | None,
    compare_logprobs: bool = True,
) -> None:
    """Record in ``turn.problems`` every way this turn is wrong."""
    out, rec = turn.output, turn.recompute
    assert out is not None and rec is not None
    name = f"turn {turn.index}"
    for sample, what in ((out, "hit"), (rec, "recompute")):
        if sample.prompt_tokens != turn.prompt_len:
            turn.problems.append(
                f"{name}: the {what} reports {sample.prompt_tokens} prompt "
                f"tokens, sent {turn.prompt_len}"
            )
    if rec.cached_tokens != 0:
        turn.problems.append(
            f"{name}: the recompute under a fresh cache_salt reported "
            f"{rec.cached_tokens} cached tokens, expected 0 (is cache_salt "
            f"ignored?)"
        )
    if out.cached_tokens < turn.expected:
        turn.problems.append(
            f"{name}: cached {out.cached_tokens} < expected checkpoint "
            f"{turn.expected} of the previous {turn.prev_len}-token prompt "
            f"(hit unit {units.hit}): a checkpoint was lost"
        )
    why = impossible_hit(out.cached_tokens, turn.prev_len, turn.prompt_len, units.hit)
    if why:
        turn.problems.append(f"{name}: impossible hit: {why}")
    if not compare_logprobs:
        return
    try:
        check_logprobs_close(
            outputs_0_lst=[rec.as_tokens_text_logprobs()],
            outputs_1_lst=[out.as_tokens_text_logprobs()],
            name_0=f"{name} recompute",
            name_1=f"{name} cache hit",
        )
    except AssertionError as e:
        turn.problems.append(f"{name}: output differs from the recompute: {e}")
        return
    diff = turn.max_logprob_diff
    if logprob_atol is not None and diff is not None and diff > logprob_atol:
        turn.problems.append(
            f"{name}: sampled logprobs differ from the recompute by {diff:.3g} "
            f"> {logprob_atol:g}, with the same tokens: the restored state is "
            f"wrong"
        )


def play_turn(
    turn: Turn,
    servers: Sequence[RemoteOpenAIServer],
    binding: Binding,
    deployment: Deployment,
    units: Units,
    prompt: Sequence[int],
    salt: str,
) -> None:
    """Send ``prompt`` under ``salt`` (after the offload reset, if any) and
    again under a fresh salt, then check the turn."""
    if deployment.offload:
        reset_prefix_caches(servers)
    turn.output = send(servers, binding.model, prompt, salt)
    fresh = f"recompute-{uuid.uuid4().hex}"
    turn.recompute = send(servers, binding.model, prompt, fresh)
    check_turn(turn, units, binding.logprob_atol, deployment.compares_logprobs)


def random_tokens(rng: random.Random, token_ids: tuple[int, int], n: int) -> list[int]:
    low, high = token_ids
    return [rng.randrange(low, high) for _ in range(n)]


def run_conversation(
    servers: Sequence[RemoteOpenAIServer],
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    units: Units,
    seed: str,
    turns: list[Turn],
) -> None:
    """Run the conversation against ``servers``, appending to ``turns``."""
    rng = random.Random(seed)
    salt = f"conversation-{uuid.uuid4().hex}"
    first_len = FIRST_PROMPT_BLOCKS * units.block + FIRST_PROMPT_TAIL
    prompt = random_tokens(rng, binding.token_ids, first_len)
    prev_len = 0
    for index in range(NUM_TURNS):
        expected = expected_cached(prev_len, units.hit, mode.spec is not None)
        turn = Turn(index, len(prompt), prev_len, expected)
        turns.append(turn)
        play_turn(turn, servers, binding, deployment, units, prompt, salt)
        prev_len = len(prompt)
        appended = turn.output.token_ids[:TURN_TOKENS]
        fill = random_tokens(rng, binding.token_ids, TURN_TOKENS - len(appended))
        prompt = prompt + appended + fill


def format_table(case_id: str, units: Units | None, turns: Sequence[Turn]) -> str:
    """The turn table of one case."""
    geometry = f"hit unit {units.hit}, block {units.block}" if units else "no geometry"
    lines = [
        f"== {case_id}: {geometry}",
        f"{'turn':>4} {'prompt':>6} {'expected':>8} {'cached':>6} "
        f"{'recompute':>9} {'tokens':>6} {'max|dlp|':>9}  verdict",
    ]
    for turn in turns:
        out, rec = turn.output, turn.recompute
        same = "same" if out and rec and out.token_ids == rec.token_ids else "DIFF"
        diff = turn.max_logprob_diff
        lines.append(
            f"{turn.index:>4} {turn.prompt_len:>6} {turn.expected:>8} "
            f"{out.cached_tokens if out else '-':>6} "
            f"{rec.cached_tokens if rec else '-':>9} {same if rec else '-':>6} "
            f"{'-' if diff is None else f'{diff:.3g}':>9}  "
            f"{'FAIL' if turn.problems else 'ok'}"
        )
    return "\n".join(lines)


@dataclass
class CaseRecord:
    """What one case observed, for its table and its verdict."""

    case_id: str
    units: Units | None = None
    turns: list[Turn] = field(default_factory=list)


@contextlib.contextmanager
def reported_case(case_id: str) -> Iterator[CaseRecord]:
    """Print the case's turn table however it ends; fail on any problem."""
    record = CaseRecord(case_id)
    try:
        yield record
    finally:
        print("\n" + format_table(case_id, record.units, record.turns))
    problems = [p for turn in record.turns for p in turn.problems]
    assert not problems, f"{case_id}:\n" + "\n".join(problems)


@contextlib.contextmanager
def serve_case(
    record: CaseRecord, binding: Binding, deployment: Deployment, mode: Mode
) -> Iterator[list[RemoteOpenAIServer]]:
    """Serve the case and record its checkpoint geometry."""
    with serve(binding, deployment, mode) as servers:
        # The hit unit is the one of the instance that consults its prefix
        # cache: the prefiller under P/D.
        record.units = Units.from_cache_config(cache_config(servers[0]), mode)
        yield servers


def run_case(
    case_id: str, binding: Binding, deployment: Deployment, mode: Mode
) -> None:
    """Serve ``deployment`` in ``mode`` and check the conversation.

    The turn table is printed whether the case passes or fails.
    """
    with (
        reported_case(case_id) as record,
        serve_case(record, binding, deployment, mode) as servers,
    ):
        assert record.units is not None
        run_conversation(
            servers, binding, deployment, mode, record.units, case_id, record.turns
        )


def run_resend(
    case_id: str,
    binding: Binding,
    deployment: Deployment,
    mode: Mode,
    prompt_len: int,
) -> None:
    """Send one prompt cold, resend it, and recompute it under a fresh salt.

    The cold request and the recompute hit nothing; the resend hits exactly
    the prompt's own last checkpoint (:func:`expected_resend`).
    """
    with (
        reported_case(case_id) as record,
        serve_case(record, binding, deployment, mode) as servers,
    ):
        assert record.units is not None
        prompt = random_tokens(random.Random(case_id), binding.token_ids, prompt_len)
        salt = f"resend-{uuid.uuid4().hex}"
        cold = Turn(0, prompt_len, 0, 0)
        record.turns.append(cold)
        cold.output = send(servers, binding.model, prompt, salt)
        if cold.output.cached_tokens != 0:
            cold.problems.append(
                f"cold request: cached {cold.output.cached_tokens}, expected 0"
            )
        expected = expected_resend(prompt_len, record.units.hit)
        resend = Turn(1, prompt_len, prompt_len, expected)
        record.turns.append(resend)
        play_turn(resend, servers, binding, deployment, record.units, prompt, salt)
        if resend.output.cached_tokens > expected:
            resend.problems.append(
                f"resend: cached {resend.output.cached_tokens}, expected "
                f"exactly {expected}"
            )

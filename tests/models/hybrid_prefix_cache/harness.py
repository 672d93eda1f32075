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
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from math import lcm

from prometheus_client.parser import text_string_to_metric_families

from tests.models.utils import check_logprobs_close
from tests.utils import RemoteOpenAIServer

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


@dataclass(frozen=True)
class Binding:
    """What a tier binds the harness to.

    ``token_ids`` is the half-open range random prompt ids are drawn from.
    ``logprob_atol`` bounds the difference between the sampled tokens'
    logprobs of a cache hit and of its recompute.
    """

    model: str
    base_args: tuple[str, ...]
    token_ids: tuple[int, int]
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    startup_timeout: float = 600.0
    logprob_atol: float = 0.0


def server_args(binding: Binding, instance: Instance, mode: Mode) -> list[str]:
    """The ``vllm serve`` arguments (after the model) of one instance."""
    return [*binding.base_args, *instance.args(), *mode.args()]


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


@contextlib.contextmanager
def serve(
    binding: Binding, deployment: Deployment, mode: Mode
) -> Iterator[list[RemoteOpenAIServer]]:
    """Serve every instance of ``deployment``; shut them down together."""
    servers: list[RemoteOpenAIServer] = []
    try:
        for instance in deployment.instances:
            server = RemoteOpenAIServer(
                binding.model,
                server_args(binding, instance, mode),
                env_dict=dict(binding.env),
                max_wait_seconds=binding.startup_timeout,
            )
            servers.append(server)
        yield servers
    finally:
        RemoteOpenAIServer.shutdown_many(servers)


def read_metrics(server: RemoteOpenAIServer) -> dict[str, list]:
    """The server's Prometheus samples, by sample name."""
    with urllib.request.urlopen(server.url_for("metrics"), timeout=30) as response:
        text = response.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
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

    def as_tokens_text_logprobs(self) -> tuple:
        return (self.token_ids, self.text, self.top_logprobs)


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise AssertionError(f"token {token!r} is not in the token-id form")
    return int(token.removeprefix(TOKEN_ID_PREFIX))


def complete(client, model: str, prompt: Sequence[int], salt: str) -> Sample:
    """A greedy completion of ``prompt`` (token ids) under ``salt``."""
    response = client.completions.create(
        model=model,
        prompt=list(prompt),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=NUM_LOGPROBS,
        extra_body={"cache_salt": salt, "return_tokens_as_token_ids": True},
    )
    choice, usage = response.choices[0], response.usage
    details = usage.prompt_tokens_details
    if details is None or details.cached_tokens is None:
        raise AssertionError(
            "the server reports no usage.prompt_tokens_details.cached_tokens; "
            "serve with --enable-prompt-tokens-details"
        )
    logprobs = choice.logprobs
    return Sample(
        token_ids=[_token_id(t) for t in logprobs.tokens],
        text=choice.text,
        token_logprobs=list(logprobs.token_logprobs),
        top_logprobs=[
            {_token_id(t): lp for t, lp in top.items()} for top in logprobs.top_logprobs
        ],
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=details.cached_tokens,
    )


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


def check_turn(turn: Turn, units: Units, logprob_atol: float) -> None:
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
    if diff is not None and diff > logprob_atol:
        turn.problems.append(
            f"{name}: sampled logprobs differ from the recompute by {diff:.3g} "
            f"> {logprob_atol:g}, with the same tokens: the restored state is "
            f"wrong"
        )


def random_tokens(rng: random.Random, token_ids: tuple[int, int], n: int) -> list[int]:
    low, high = token_ids
    return [rng.randrange(low, high) for _ in range(n)]


def run_conversation(
    server: RemoteOpenAIServer,
    binding: Binding,
    mode: Mode,
    units: Units,
    seed: str,
    turns: list[Turn],
) -> None:
    """Run the conversation against ``server``, appending to ``turns``."""
    rng = random.Random(seed)
    client = server.get_client()
    salt = f"conversation-{uuid.uuid4().hex}"
    first_len = FIRST_PROMPT_BLOCKS * units.block + FIRST_PROMPT_TAIL
    prompt = random_tokens(rng, binding.token_ids, first_len)
    prev_len = 0
    for index in range(NUM_TURNS):
        expected = expected_cached(prev_len, units.hit, mode.spec is not None)
        turn = Turn(index, len(prompt), prev_len, expected)
        turns.append(turn)
        turn.output = complete(client, binding.model, prompt, salt)
        fresh = f"recompute-{uuid.uuid4().hex}"
        turn.recompute = complete(client, binding.model, prompt, fresh)
        check_turn(turn, units, binding.logprob_atol)
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


def run_case(
    case_id: str, binding: Binding, deployment: Deployment, mode: Mode
) -> None:
    """Serve ``deployment`` in ``mode`` and check the conversation.

    The turn table is printed whether the case passes or fails.
    """
    if deployment.prefill is not None or deployment.offload:
        raise NotImplementedError(f"{case_id}: P/D and offload are not wired yet")
    turns: list[Turn] = []
    units = None
    try:
        with serve(binding, deployment, mode) as servers:
            (server,) = servers
            units = Units.from_cache_config(cache_config(server), mode)
            run_conversation(server, binding, mode, units, case_id, turns)
    finally:
        print("\n" + format_table(case_id, units, turns))
    problems = [p for turn in turns for p in turn.problems]
    assert not problems, f"{case_id}:\n" + "\n".join(problems)

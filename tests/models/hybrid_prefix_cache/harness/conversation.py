# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Conversations: their shapes and random prompts, and how a case plays
them turn by turn against its servers (:func:`play_waves`)."""

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from random import Random

from tests.models.hybrid_prefix_cache.harness import client, compare, paths, rules
from tests.models.hybrid_prefix_cache.harness.clock import phase
from tests.models.hybrid_prefix_cache.harness.compare import Turn
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Mode,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.reconcile import EXTERNAL_HITS
from tests.models.hybrid_prefix_cache.harness.servers import Server


@dataclass(frozen=True)
class Conversation:
    label: str
    first_len: int
    seed: str
    num_turns: int = rules.NUM_TURNS
    resend: bool = True


def reference_conversation(units: Units, seed: str) -> Conversation:
    first_len = rules.FIRST_PROMPT_BLOCKS * units.block + rules.FIRST_PROMPT_TAIL
    return Conversation("", first_len, seed)


# Tail-sweep shapes: (one more hit unit, inside a block; tail from the unit).
SHAPES: dict[str, tuple[bool, Callable[[int], int]]] = {
    "exact": (False, lambda unit: 0),
    "plus1": (False, lambda unit: 1),
    "tail37": (False, lambda unit: 37 % unit),
    "half-plus1": (False, lambda unit: unit // 2 + 1),
    "unit-minus1": (False, lambda unit: unit - 1),
    "inblock-exact": (True, lambda unit: 0),
    "inblock-plus1": (True, lambda unit: 1),
}


def shape_length(shape: str, units: Units) -> int | None:
    """The first prompt's length of ``shape``; None if the geometry lacks it."""
    inblock, tail = SHAPES[shape]
    if inblock and units.hit >= units.block:
        return None
    base = rules.FIRST_PROMPT_BLOCKS * units.block + (units.hit if inblock else 0)
    return base + tail(units.hit)


def random_tokens(rng: Random, token_ids: tuple[int, int], n: int) -> list[int]:
    return [rng.randrange(*token_ids) for _ in range(n)]


def grown_prompt(
    rng: Random, tokens: tuple[int, int], prompt: Sequence[int], output: Sequence[int]
) -> list[int]:
    """``prompt``, then its ``output`` and random ``tokens``, TURN_TOKENS in all."""
    appended = list(output[: rules.TURN_TOKENS])
    fill = random_tokens(rng, tokens, rules.TURN_TOKENS - len(appended))
    return [*prompt, *appended, *fill]


@dataclass
class Play:
    """What a case needs to play turns. ``batched`` turns are held to their recompute
    alone where the server is batch-invariant, else to batched twins within ``noise``;
    with ``prefill_step`` (the servers' own threads), the first turn goes alone and
    later hits are held on their prefill step (harness/paths.py check_prefill_steps)."""

    servers: Sequence[Server]
    binding: Binding
    deployment: Deployment
    mode: Mode
    units: Units
    logprob_atol: float | None
    batched: bool = False
    prefill_step: bool = False
    noise: paths.PathNoise | None = None
    # salts that resumed inside a block (Turn.mid_block)
    off_block_salts: set[str] = field(default_factory=set)

    @property
    def drafting(self) -> rules.Drafting:
        """The drafter's effect where the cache is consulted (the prefiller)."""
        return self.mode.drafting(self.deployment.instances[0])

    @property
    def invariant(self) -> bool:
        """Batched on servers that compute each request as alone."""
        invariant_env = self.binding.batch_invariant_env is not None
        return self.batched and not self.prefill_step and invariant_env

    @property
    def recompute_atol(self) -> float | None:
        """``logprob_atol`` on one path, else the case's path tolerance."""
        if self.noise is None:
            return self.logprob_atol
        return self.noise.held_to(self.logprob_atol)


def fresh_salt(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex}"


def send_turn(play: Play, turn: Turn, prompt: Sequence[int], salt: str) -> None:
    """Send ``prompt`` under ``salt``, then a cold twin the way the hit went (P/D,
    or a batch), unless the recompute is already its same-path control."""
    turn.prompt, turn.salt = list(prompt), salt
    turn.batched, turn.invariant = play.batched, play.invariant
    turn.prefill_step = play.prefill_step
    start = time.monotonic()
    servers, model, hits = play.servers, play.binding.model, EXTERNAL_HITS
    if play.deployment.offload:
        client.reset_prefix_caches(servers)
        before = client.read_counters(servers[0])[hits]
    turn.output, found = client.send_checked(servers, model, prompt, salt)
    turn.take(compare.Found(tuple(found)))
    if play.binding.exact_on_blocks:
        # an off-grid resume's rounding carries into the salt's later states
        if turn.output.cached_tokens % (play.binding.exact_grid or play.units.block):
            play.off_block_salts.add(salt)
        turn.mid_block = salt in play.off_block_salts
    if play.deployment.offload and turn.output.cached_tokens > 0:
        grown = client.poll_counters(servers[0], hits, lambda v: v > (before or 0))
        after = grown[hits]
        if before is None or after is None or after <= before:
            missed = (
                f"{turn.name}: cached {turn.output.cached_tokens} after the device "
                f"prefix cache was reset, but {hits} did not grow ({before} "
                f"-> {after}): the hit did not come from the offload tier"
            )
            turn.take(compare.Found((missed,)))
    if len(servers) > 1 or (play.batched and not (play.invariant or play.prefill_step)):
        twin_salt = fresh_salt("twin")
        if play.batched:  # sent at once: no transfer is the twin's alone
            turn.twin = client.send(servers, model, prompt, twin_salt)
        else:
            turn.twin, found = client.send_checked(servers, model, prompt, twin_salt)
            turn.take(compare.Found(tuple(found)))
    turn.seconds += time.monotonic() - start


def recompute_turn(play: Play, turn: Turn) -> None:
    """Recompute on the decoder alone (a bad transfer cannot corrupt both sides), send
    the transfer's exact counterparts or the decode-against-prefill control; check."""
    start = time.monotonic()
    servers, model, prompt = play.servers, play.binding.model, turn.prompt
    decoder, compares = servers[-1], play.deployment.compares_logprobs
    turn.recompute = client.complete(decoder, model, prompt, fresh_salt("recompute"))
    same = play.binding.exact_across_instances and play.deployment.same_instances
    if relays := same and compares:
        relayed = paths.relay_prompt(turn)
        turn.relay = client.send(servers, model, relayed, fresh_salt("relay"))
        turn.prefiller_alone = client.complete(
            servers[0], model, prompt, fresh_salt("prefiller")
        )
    if (len(servers) > 1 and not relays) or turn.mid_block:
        # the recompute's second logprob, from the prefill path instead of a
        # reloaded state: the noise a P/D decoder or a mid-block resume adds
        extended = [*prompt, turn.recompute.token_ids[0]]
        turn.control = client.complete(decoder, model, extended, fresh_salt("control"))
    turn.seconds += time.monotonic() - start
    atol, drops_unit = play.logprob_atol, play.drafting.drops_unit
    found = compare.check_turn(turn, play.units, atol, compares, drops_unit)
    turn.take(found + paths.check_transfer(turn, atol))


def play_turn(play: Play, turn: Turn, prompt: Sequence[int], salt: str) -> None:
    send_turn(play, turn, prompt, salt)
    recompute_turn(play, turn)


def finish_turns(play: Play, turns: Sequence[Turn]) -> None:
    """Measure the case's path noise with the further cold controls it needs, on
    the decoder alone, then hold cross-path comparisons to it."""
    compares = play.deployment.compares_logprobs
    if play.prefill_step:
        compare.take_each(turns, paths.check_prefill_steps(turns, compares))
        return
    decoder, model = play.servers[-1], play.binding.model
    for turn, shift in paths.control_shifts(turns):
        assert turn.recompute is not None
        start = time.monotonic()
        extended = [*turn.prompt, *turn.recompute.token_ids[:shift]]
        control = client.complete(decoder, model, extended, fresh_salt("control"))
        turn.more_controls.append(control)
        turn.seconds += time.monotonic() - start
    play.noise, found = paths.check_paths(turns, play.logprob_atol, compares)
    compare.take_each(turns, found)


def planned_turn(play: Play, label: str, planned: rules.PlannedTurn) -> Turn:
    """The :class:`Turn` of ``planned`` with its expected hit and bound."""
    backoff, rule = play.deployment.cache_backoff, play.drafting
    expected, bound = rules.expectation(
        planned, play.units.hit, rule.drops_unit, backoff, rule.lookahead
    )
    turn = Turn(label, planned.index, planned.prompt_len, planned.prev_len, expected)
    turn.bound, turn.resend, turn.backoff = bound, planned.resend, backoff
    return turn


def play_waves(
    play: Play, conversations: Sequence[Conversation], turns: list[Turn]
) -> Iterator[int]:
    """Play ``conversations``, each under its own salt, turn by turn into ``turns``,
    yielding each wave's index after it: the caller may stop there. Batched, a wave
    is in flight at once, recomputes after. With ``Play.prefill_step`` the first
    wave goes one by one (a batched cold prefill may part from itself alone:
    findings/batch-noise-cpu.md), and each prompt goes alone too after its wave."""
    token_ids = play.binding.token_ids
    rngs = [Random(conv.seed) for conv in conversations]
    prompts = [
        random_tokens(rng, token_ids, conv.first_len)
        for rng, conv in zip(rngs, conversations)
    ]
    salts = [fresh_salt("conversation") for _ in conversations]
    alone_salts = [fresh_salt("alone") for _ in conversations]
    plans = [
        rules.plan_turns(c.first_len, c.num_turns, c.resend) for c in conversations
    ]
    if len({len(plan) for plan in plans}) > 1:
        raise ValueError("conversations played together must have as many turns")
    for index in range(len(plans[0])):
        batch = []
        for conv, plan, prompt, salt in zip(conversations, plans, prompts, salts):
            turn = planned_turn(play, conv.label, plan[index])
            if turn.prompt_len != len(prompt):
                raise AssertionError(f"{turn.name}: the plan and the prompt part")
            turns.append(turn)
            batch.append((turn, prompt, salt))
        wave = replace(play, batched=False) if play.prefill_step and not index else play
        if wave.batched:
            with phase("requests"), ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(lambda args, p=wave: send_turn(p, *args), batch))
            for turn, _, _ in batch:
                recompute_turn(wave, turn)
        else:
            for args in batch:
                play_turn(wave, *args)
        if play.prefill_step:
            # under a salt whose earlier turns went alone too: the hit's counterpart
            # on its checkpoint and chunks (harness/paths.py check_prefill_steps)
            for (turn, prompt, _), salt in zip(batch, alone_salts):
                start = time.monotonic()
                turn.alone = client.send(play.servers, play.binding.model, prompt, salt)
                turn.seconds += time.monotonic() - start
        yield index
        for i, ((turn, prompt, _), plan) in enumerate(zip(batch, plans)):
            # the next prompt grows, unless it is this one's resend
            if index + 1 < len(plan) and not plan[index + 1].resend:
                assert turn.output is not None
                out = turn.output.token_ids
                prompts[i] = grown_prompt(rngs[i], token_ids, prompt, out)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Conversations: their shapes and random prompts, and how a case plays
them turn by turn against its servers (:func:`run_conversations`)."""

import random
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tests.models.hybrid_prefix_cache.harness.client import (
    complete,
    poll_counter,
    read_counters,
    reset_prefix_caches,
    send,
)
from tests.models.hybrid_prefix_cache.harness.clock import phase
from tests.models.hybrid_prefix_cache.harness.compare import (
    PathNoise,
    Turn,
    check_paths,
    check_turn,
    control_shifts,
)
from tests.models.hybrid_prefix_cache.harness.deployment import (
    Binding,
    Deployment,
    Mode,
    Units,
)
from tests.models.hybrid_prefix_cache.harness.reconcile import EXTERNAL_HITS
from tests.models.hybrid_prefix_cache.harness.rules import (
    FIRST_PROMPT_BLOCKS,
    FIRST_PROMPT_TAIL,
    NUM_TURNS,
    TURN_TOKENS,
    Drafting,
    PlannedTurn,
    expectation,
    plan_turns,
)
from tests.models.hybrid_prefix_cache.harness.servers import Server
from tests.models.hybrid_prefix_cache.harness.transfer import (
    check_transfer,
    relay_prompt,
)


@dataclass(frozen=True)
class Conversation:
    """A growing conversation: its label, the first prompt's length and
    the seed of its random tokens."""

    label: str
    first_len: int
    seed: str
    # Its growing turns, and whether an exact resend follows them
    # (harness.plan_turns).
    num_turns: int = NUM_TURNS
    resend: bool = True


def reference_conversation(units: Units, seed: str) -> Conversation:
    """The reference shape: three blocks and an unaligned tail."""
    return Conversation("", FIRST_PROMPT_BLOCKS * units.block + FIRST_PROMPT_TAIL, seed)


# Tail-sweep shapes: the first prompt is FIRST_PROMPT_BLOCKS blocks, plus one
# hit unit when the boundary should fall inside a block ("inblock"), plus a
# tail past that last boundary, given as a function of the hit unit.
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
    """The first prompt's length of sweep ``shape``; None when the shape
    does not exist for this geometry (an in-block boundary when the hit
    unit is the block)."""
    inblock, tail = SHAPES[shape]
    if inblock and units.hit >= units.block:
        return None
    base = FIRST_PROMPT_BLOCKS * units.block + (units.hit if inblock else 0)
    return base + tail(units.hit)


def random_tokens(rng: random.Random, token_ids: tuple[int, int], n: int) -> list[int]:
    low, high = token_ids
    return [rng.randrange(low, high) for _ in range(n)]


def grown_prompt(
    rng: random.Random,
    token_ids: tuple[int, int],
    prompt: Sequence[int],
    output: Sequence[int],
) -> list[int]:
    """A conversation's next prompt: ``prompt``, the first TURN_TOKENS
    tokens of its ``output``, and random tokens up to TURN_TOKENS more."""
    appended = list(output[:TURN_TOKENS])
    fill = random_tokens(rng, token_ids, TURN_TOKENS - len(appended))
    return [*prompt, *appended, *fill]


@dataclass
class Play:
    """What a case needs to play turns: where, what, and how to check.
    ``logprob_atol`` holds a hit to the request on its own path (None:
    check_logprobs_close alone); ``batched`` plays turns at once, each hit
    then held to its recompute alone on a server that computes each request
    as alone (:attr:`invariant`), else to its batched cold twin within the
    case's path noise (``noise``, once measured). ``stop``, if given, ends a
    conversation before its next turn once it holds for the turns played so
    far."""

    servers: Sequence[Server]
    binding: Binding
    deployment: Deployment
    mode: Mode
    units: Units
    logprob_atol: float | None
    batched: bool = False
    noise: PathNoise | None = None
    stop: Callable[[Sequence[Turn]], bool] | None = None
    # The salts whose requests resumed inside a block (Turn.mid_block).
    off_block_salts: set[str] = field(default_factory=set)

    @property
    def drafting(self) -> Drafting:
        """What the drafter changes on the instance that consults its prefix
        cache (the prefiller under P/D)."""
        return self.mode.drafting(self.deployment.instances[0])

    @property
    def invariant(self) -> bool:
        """Whether its turns are batched on servers that compute each request
        as alone (Binding.batch_invariant_env; cases.run_case serves them)."""
        return self.batched and self.binding.batch_invariant_env is not None

    @property
    def recompute_atol(self) -> float | None:
        """What a hit and its recompute may differ by: ``logprob_atol``
        where both took one path, else the case's path tolerance."""
        if self.noise is None:
            return self.logprob_atol
        return self.noise.held_to(self.logprob_atol)


def fresh_salt(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex}"


def send_turn(play: Play, turn: Turn, prompt: Sequence[int], salt: str) -> None:
    """Send ``prompt`` under ``salt`` (after the offload reset, if any),
    then its cold twin under a fresh salt, the way the hit went: under P/D
    through the same prefiller, transfer and decoder; batched, in the same
    wave of requests. Played alone on one server, or batched on one that
    computes each request as alone, the recompute is the hit's same-path
    control and no twin is sent."""
    turn.prompt, turn.salt = list(prompt), salt
    turn.batched, turn.invariant = play.batched, play.invariant
    start = time.monotonic()
    servers, model = play.servers, play.binding.model
    if play.deployment.offload:
        reset_prefix_caches(servers)
        before = read_counters(servers[0])[EXTERNAL_HITS]
    turn.output = send(servers, model, prompt, salt, turn.problems)
    if play.binding.exact_on_blocks:
        # A state computed after a resume inside a block carries that
        # resume's rounding into every later checkpoint of the salt.
        if turn.output.cached_tokens % play.units.block:
            play.off_block_salts.add(salt)
        turn.mid_block = salt in play.off_block_salts
    if play.deployment.offload and turn.output.cached_tokens > 0:
        after = poll_counter(servers[0], EXTERNAL_HITS, lambda v: v > (before or 0))
        if before is None or after is None or after <= before:
            turn.problems.append(
                f"{turn.name}: cached {turn.output.cached_tokens} after the "
                f"device prefix cache was reset, but {EXTERNAL_HITS} did not "
                f"grow ({before} -> {after}): the hit did not come from the "
                f"offload tier"
            )
    if len(servers) > 1 or (play.batched and not play.invariant):
        twin_problems = None if play.batched else turn.problems
        turn.twin = send(servers, model, prompt, fresh_salt("twin"), twin_problems)
    turn.seconds += time.monotonic() - start


def recompute_turn(play: Play, turn: Turn) -> None:
    """Recompute the turn's prompt on the decoder alone under a fresh salt
    (under P/D it computes the whole prompt itself, so a transfer that
    corrupts the state cannot corrupt both sides alike). Under P/D of one
    configuration where instances compute alike, send the transfer's exact
    counterparts (harness.transfer); else, or after a resume inside a block,
    the decode-against-prefill control. Then check the turn."""
    start = time.monotonic()
    decoder, model, prompt = play.servers[-1], play.binding.model, turn.prompt
    turn.recompute = complete(decoder, model, prompt, fresh_salt("recompute"))
    relays = (
        play.binding.exact_across_instances
        and play.deployment.same_instances
        and play.deployment.compares_logprobs
    )
    if relays:
        relay = relay_prompt(turn)
        turn.relay = send(play.servers, model, relay, fresh_salt("relay"))
        turn.prefiller_alone = complete(
            play.servers[0], model, prompt, fresh_salt("prefiller")
        )
    if (len(play.servers) > 1 and not relays) or turn.mid_block:
        # The recompute's second token came from a decode step, from a state
        # stored after its prefill and reloaded; here its first token is
        # part of the prompt, so the same logprob comes from the prefill
        # path, its state kept in the kernel: the noise a P/D decoder's last
        # token, or a hit resumed mid-block, adds.
        extended = [*prompt, turn.recompute.token_ids[0]]
        turn.control = complete(decoder, model, extended, fresh_salt("control"))
    turn.seconds += time.monotonic() - start
    check_turn(
        turn,
        play.units,
        play.logprob_atol,
        play.deployment.compares_logprobs,
        play.drafting.drops_unit,
    )
    check_transfer(turn, play.logprob_atol)


def play_turn(play: Play, turn: Turn, prompt: Sequence[int], salt: str) -> None:
    """One turn played alone: sent, recomputed and checked."""
    send_turn(play, turn, prompt, salt)
    recompute_turn(play, turn)


def measure_path_noise(play: Play, turns: Sequence[Turn]) -> None:
    """Send the further cold controls that ``turns`` need to measure the
    case's path noise on PATH_NOISE_MIN_PAIRS pairs (compare.control_shifts):
    each on the decoder alone, under a fresh salt, the turn's prompt and the
    first tokens of its recompute."""
    decoder, model = play.servers[-1], play.binding.model
    for turn, shift in control_shifts(turns):
        assert turn.recompute is not None
        start = time.monotonic()
        extended = [*turn.prompt, *turn.recompute.token_ids[:shift]]
        turn.more_controls.append(
            complete(decoder, model, extended, fresh_salt("control"))
        )
        turn.seconds += time.monotonic() - start


def finish_turns(play: Play, turns: Sequence[Turn]) -> None:
    """Once every turn of a case is played: measure its path noise on
    enough cold controls (:func:`measure_path_noise`), then hold its
    comparisons across paths to it (compare.check_paths)."""
    measure_path_noise(play, turns)
    play.noise = check_paths(
        turns, play.logprob_atol, play.deployment.compares_logprobs
    )


def planned_turn(play: Play, label: str, planned: PlannedTurn) -> Turn:
    """The :class:`Turn` of ``planned`` with its expected hit and bound for
    the case's geometry, drafter and deployment."""
    backoff = play.deployment.cache_backoff
    rule = play.drafting
    expected, bound = expectation(
        planned, play.units.hit, rule.drops_unit, backoff, rule.lookahead
    )
    return Turn(
        label,
        planned.index,
        planned.prompt_len,
        planned.prev_len,
        expected,
        bound=bound,
        resend=planned.resend,
        backoff=backoff,
    )


def run_conversations(
    play: Play, conversations: Sequence[Conversation], turns: list[Turn]
) -> None:
    """Play ``conversations`` (each under its own salt) turn by turn, as
    :func:`plan_turns` lays them out, appending to ``turns``. A later turn's
    prompt is the previous prompt, the previous output and random tokens.
    Batched (``play.batched``), every conversation's turn is in flight at
    once, each with its cold twin, as a busy server sees them; their
    recomputes run alone after the wave."""
    states = []
    for conv in conversations:
        rng = random.Random(conv.seed)
        prompt = random_tokens(rng, play.binding.token_ids, conv.first_len)
        salt = fresh_salt("conversation")
        plan = plan_turns(conv.first_len, conv.num_turns, conv.resend)
        states.append((conv, rng, salt, prompt, plan))
    if len({len(plan) for *_, plan in states}) > 1:
        raise ValueError("conversations played together must have as many turns")
    for index in range(len(states[0][4])):
        batch = []
        for conv, _, salt, prompt, plan in states:
            turn = planned_turn(play, conv.label, plan[index])
            if turn.prompt_len != len(prompt):
                raise AssertionError(f"{turn.name}: the plan and the prompt part")
            turns.append(turn)
            batch.append((turn, prompt, salt))
        if play.batched:
            with phase("requests"), ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(lambda args: send_turn(play, *args), batch))
            for turn, _, _ in batch:
                recompute_turn(play, turn)
        else:
            for args in batch:
                play_turn(play, *args)
        if play.stop is not None and play.stop(turns):
            break
        for i, ((conv, rng, salt, prompt, plan), (turn, _, _)) in enumerate(
            zip(states, batch)
        ):
            if index + 1 >= len(plan) or plan[index + 1].resend:
                continue  # the resend sends this prompt again
            assert turn.output is not None
            grown = grown_prompt(
                rng, play.binding.token_ids, prompt, turn.output.token_ids
            )
            states[i] = (conv, rng, salt, grown, plan)
    finish_turns(play, turns)

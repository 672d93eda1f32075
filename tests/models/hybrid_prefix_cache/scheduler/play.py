# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Conversations and resends played through replayed servers as the harness
plays them (:func:`play_conversations`, :func:`play_resend`), and the
harness's reading of an engine's labels (:func:`units_of`)."""

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.scheduler.engine import Engine
from tests.models.hybrid_prefix_cache.scheduler.servers import ReplayServer
from tests.models.hybrid_prefix_cache.scheduler.workers import Completion


@dataclass
class TurnResult:
    """One turn as vLLM computed it: the hit of the instance that consults
    its cache (the prefiller's under P/D) and the recompute's."""

    conversation: str
    planned: harness.rules.PlannedTurn
    hit: int
    # None where the harness sends no recompute (a resend's cold request).
    recompute_hit: int | None
    # Under P/D, the decoder's own prefix-cache hit for its decode leg (its
    # prefix_cache_hits delta, as harness.client.send reads it).
    decoder_hit: int | None = None


def send(
    servers: Sequence[ReplayServer], prompt: list[int], salt: str
) -> tuple[Completion, int, int | None]:
    """One turn's request through the deployment, as harness.client.send sends it:
    the returned hit is the prefiller's under P/D, and with it the
    decoder's own hit for its decode leg."""
    if len(servers) == 1:
        completion = servers[0].complete(prompt, salt)
        assert completion.cached_tokens is not None
        return completion, completion.cached_tokens, None
    prefiller, decoder = servers
    prefill = prefiller.complete(
        prompt,
        salt,
        max_tokens=1,
        kv_transfer_params=harness.client.PREFILL_KV_TRANSFER_PARAMS,
    )
    assert prefill.kv_transfer_params, "the prefiller returned no kv_transfer_params"
    sent = prefill.kv_transfer_params
    before = decoder.moved[harness.reconcile.PREFIX_HITS] or 0.0
    decode = decoder.complete(prompt, salt, kv_transfer_params=sent)
    decoder_hit = int((decoder.moved[harness.reconcile.PREFIX_HITS] or 0.0) - before)
    # The prefiller frees the transferred blocks once the decoder read them.
    prefiller.drain()
    assert prefill.cached_tokens is not None
    return decode, prefill.cached_tokens, decoder_hit


def hit_and_recompute(
    servers: Sequence[ReplayServer],
    deployment: harness.Deployment,
    prompt: list[int],
    salt: str,
    recompute_salt: str,
) -> tuple[Completion, int, int, int | None]:
    """A hit request as harness.conversation.send_turn sends it (the offload tier's
    device caches reset first, so the hit comes from host memory), then its
    recompute on the last server under ``recompute_salt``: the output, the
    hit, the recompute's hit and (under P/D) the decoder's own hit."""
    if deployment.offload:
        for server in servers:
            server.reset_prefix_cache()
    output, hit, decoder_hit = send(servers, prompt, salt)
    recompute = servers[-1].complete(prompt, recompute_salt)
    assert recompute.cached_tokens is not None
    return output, hit, recompute.cached_tokens, decoder_hit


def play_conversations(
    servers: Sequence[ReplayServer],
    deployment: harness.Deployment,
    conversations: Sequence[harness.conversation.Conversation],
    token_ids: tuple[int, int],
    concurrent: bool = False,
) -> list[TurnResult]:
    """Play ``conversations`` turn by turn as harness.conversation.run_conversations and
    harness.conversation.play_turn do: each prompt is the previous one, its output's
    first TURN_TOKENS tokens and random fill (the last turn resends); under
    offload the device prefix caches are reset before every turn; each turn
    is followed by its recompute under a fresh salt on the decoder.
    Concurrently, every conversation's turn is admitted at once and each
    recompute as soon as its turn finished."""
    results: list[TurnResult] = []
    states = []
    for conv in conversations:
        rng = random.Random(conv.seed)
        prompt = harness.conversation.random_tokens(rng, token_ids, conv.first_len)
        states.append([conv, rng, f"conversation-{conv.seed}", prompt])
    plans = [
        harness.rules.plan_turns(c.first_len, c.num_turns, c.resend)
        for c in conversations
    ]
    assert len({len(plan) for plan in plans}) == 1, "conversations of unequal turns"
    for index in range(len(plans[0])):
        outputs: list[list[int]] = []
        if concurrent:
            assert len(servers) == 1 and not deployment.offload, (
                "concurrent conversations run on one server without offload"
            )
            outputs = _play_batch(servers[0], states, plans, index, results)
        else:
            for state, plan in zip(states, plans):
                conv, _, salt, prompt = state
                planned = plan[index]
                assert planned.prompt_len == len(prompt), "the plan and the prompt"
                output, hit, recomputed, _ = hit_and_recompute(
                    servers, deployment, prompt, salt, f"recompute-{salt}-{index}"
                )
                results.append(TurnResult(conv.label, planned, hit, recomputed))
                outputs.append(output.token_ids)
        for state, plan, output in zip(states, plans, outputs):
            conv, rng, salt, prompt = state
            if index + 1 >= len(plan) or plan[index + 1].resend:
                continue
            state[3] = harness.conversation.grown_prompt(rng, token_ids, prompt, output)
    for server in servers:
        server.drain()
    return results


def _play_batch(
    server: ReplayServer,
    states: list,
    plans: list[list[harness.rules.PlannedTurn]],
    index: int,
    results: list[TurnResult],
) -> list[list[int]]:
    turns = []
    for state, plan in zip(states, plans):
        conv, _, salt, prompt = state
        planned = plan[index]
        assert planned.prompt_len == len(prompt), "the plan and the prompt"
        turns.append(
            (
                conv,
                planned,
                salt,
                prompt,
                server.submit(prompt, salt, harness.client.MAX_TOKENS),
            )
        )
    recomputes: dict[int, Completion] = {}
    while not all(
        turn[4].finished and i in recomputes and recomputes[i].finished
        for i, turn in enumerate(turns)
    ):
        assert server.step(), "concurrent turns stalled"
        for i, (_, _, salt, prompt, completion) in enumerate(turns):
            if completion.finished and i not in recomputes:
                server.settle(completion, None)
                recomputes[i] = server.submit(
                    prompt, f"recompute-{salt}-{index}", harness.client.MAX_TOKENS
                )
    outputs = []
    for i, (conv, planned, _, _, completion) in enumerate(turns):
        server.settle(recomputes[i], None)
        assert completion.cached_tokens is not None
        assert recomputes[i].cached_tokens is not None
        results.append(
            TurnResult(
                conv.label,
                planned,
                completion.cached_tokens,
                recomputes[i].cached_tokens,
            )
        )
        outputs.append(completion.token_ids)
    return outputs


def play_resend(
    servers: Sequence[ReplayServer],
    deployment: harness.Deployment,
    prompt_len: int,
    seed: str,
    token_ids: tuple[int, int],
) -> list[TurnResult]:
    """harness.run_resend: a cold request, then (after the offload reset)
    the same prompt again and its recompute under a fresh salt."""
    prompt = harness.conversation.random_tokens(
        random.Random(seed), token_ids, prompt_len
    )
    salt = f"resend-{seed}"
    results = []
    _, cold, decoder_hit = send(servers, prompt, salt)
    planned = harness.rules.PlannedTurn(0, prompt_len, 0)
    results.append(TurnResult("", planned, cold, None, decoder_hit))
    _, hit, recomputed, decoder_hit = hit_and_recompute(
        servers, deployment, prompt, salt, f"recompute-{seed}"
    )
    resend = harness.rules.PlannedTurn(1, prompt_len, prompt_len, resend=True)
    results.append(TurnResult("", resend, hit, recomputed, decoder_hit))
    for server in servers:
        server.drain()
    return results


def units_of(engine: Engine, mode: harness.Mode) -> harness.Units:
    """The harness's reading of ``engine``'s cache_config_info labels."""
    labels = engine.geometry.labels
    if mode.prefix_match_unit is not None:
        labels["prefix_match_unit"] = str(
            engine.vllm_config.cache_config.prefix_match_unit
        )
    return harness.Units.from_cache_config(labels, mode)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Conversations and resends played through replayed servers as the harness plays
them (:func:`play_conversations`, :func:`play_resend`)."""

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import conversation
from tests.models.hybrid_prefix_cache.harness.client import MAX_TOKENS
from tests.models.hybrid_prefix_cache.harness.rules import PlannedTurn, plan_turns
from tests.models.hybrid_prefix_cache.scheduler.servers import ReplayServer
from tests.models.hybrid_prefix_cache.scheduler.workers import Completion


@dataclass
class TurnResult:
    """One turn as vLLM computed it: the hit of the instance that consults
    its cache (the prefiller's under P/D) and the recompute's."""

    conversation: str
    planned: PlannedTurn
    hit: int
    # None where the harness sends no recompute (a resend's cold request).
    recompute_hit: int | None
    # Under P/D, the decoder's own hit for its decode leg (harness.client.send's).
    decoder_hit: int | None = None


def send(
    servers: Sequence[ReplayServer], prompt: list[int], salt: str
) -> tuple[Completion, int, int | None]:
    """One turn's request as harness.client.send sends it: the hit is the
    prefiller's under P/D, and with it the decoder's own for its decode leg."""
    if len(servers) == 1:
        completion = servers[0].complete(prompt, salt)
        assert completion.cached_tokens is not None
        return completion, completion.cached_tokens, None
    prefiller, decoder = servers
    params = harness.client.PREFILL_KV_TRANSFER_PARAMS
    prefill = prefiller.complete(prompt, salt, max_tokens=1, kv_transfer_params=params)
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
    device caches reset first: the hit comes from host memory), then its recompute
    on the last server; with the decoder's own hit under P/D."""
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
    conversations: Sequence[conversation.Conversation],
    token_ids: tuple[int, int],
    concurrent: bool = False,
) -> list[TurnResult]:
    """As harness.conversation.play_waves and play_turn play them (the offload
    tier's caches reset before every turn, each turn's recompute on the decoder);
    concurrently, every conversation's turn admitted at once and each recompute as
    soon as its turn finished."""
    rngs = [random.Random(c.seed) for c in conversations]
    prompts = [
        conversation.random_tokens(rng, token_ids, c.first_len)
        for rng, c in zip(rngs, conversations)
    ]
    plans = [plan_turns(c.first_len, c.num_turns, c.resend) for c in conversations]
    assert len({len(plan) for plan in plans}) == 1, "conversations of unequal turns"
    results: list[TurnResult] = []
    for index in range(len(plans[0])):
        if concurrent:
            assert len(servers) == 1 and not deployment.offload, (
                "concurrent conversations run on one server without offload"
            )
        turns = []
        for conv, plan, prompt in zip(conversations, plans, prompts):
            assert plan[index].prompt_len == len(prompt), "the plan and the prompt"
            turns.append((conv.label, plan[index], f"conversation-{conv.seed}", prompt))
        if concurrent:
            outputs = _play_batch(servers[0], turns, index, results)
        else:
            outputs = []
            for label, planned, salt, prompt in turns:
                output, hit, recomputed, _ = hit_and_recompute(
                    servers, deployment, prompt, salt, f"recompute-{salt}-{index}"
                )
                results.append(TurnResult(label, planned, hit, recomputed))
                outputs.append(output.token_ids)
        for i, (rng, plan, out) in enumerate(zip(rngs, plans, outputs)):
            if index + 1 < len(plan) and not plan[index + 1].resend:
                prompts[i] = conversation.grown_prompt(rng, token_ids, prompts[i], out)
    for server in servers:
        server.drain()
    return results


def _play_batch(
    server: ReplayServer, turns: list[tuple], index: int, results: list[TurnResult]
) -> list[list[int]]:
    sent = [server.submit(prompt, salt, MAX_TOKENS) for _, _, salt, prompt in turns]
    recomputes: dict[int, Completion] = {}
    while not all(
        completion.finished and i in recomputes and recomputes[i].finished
        for i, completion in enumerate(sent)
    ):
        assert server.step(), "concurrent turns stalled"
        for i, ((_, _, salt, prompt), completion) in enumerate(zip(turns, sent)):
            if completion.finished and i not in recomputes:
                server.settle(completion, None)
                recompute_salt = f"recompute-{salt}-{index}"
                recomputes[i] = server.submit(prompt, recompute_salt, MAX_TOKENS)
    for i, ((label, planned, _, _), completion) in enumerate(zip(turns, sent)):
        server.settle(recomputes[i], None)
        hit, recomputed = completion.cached_tokens, recomputes[i].cached_tokens
        assert hit is not None and recomputed is not None
        results.append(TurnResult(label, planned, hit, recomputed))
    return [completion.token_ids for completion in sent]


def play_resend(
    servers: Sequence[ReplayServer],
    deployment: harness.Deployment,
    prompt_len: int,
    seed: str,
    token_ids: tuple[int, int],
) -> list[TurnResult]:
    """harness.run_resend: a cold request, then (after the offload reset)
    the same prompt again and its recompute under a fresh salt."""
    prompt = conversation.random_tokens(random.Random(seed), token_ids, prompt_len)
    salt = f"resend-{seed}"
    _, cold, decoder_hit = send(servers, prompt, salt)
    results = [TurnResult("", PlannedTurn(0, prompt_len, 0), cold, None, decoder_hit)]
    _, hit, recomputed, decoder_hit = hit_and_recompute(
        servers, deployment, prompt, salt, f"recompute-{seed}"
    )
    resend = PlannedTurn(1, prompt_len, prompt_len, resend=True)
    results.append(TurnResult("", resend, hit, recomputed, decoder_hit))
    for server in servers:
        server.drain()
    return results

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Batched restores at the servers' own thread count (``Play.prefill_step``):
each batched hit's prefill step, its first sampled logprob, must equal exactly
the same prompt's sent alone under a salt whose every turn went alone. Pure."""

from collections.abc import Sequence

from tests.models.hybrid_prefix_cache.harness.compare import Found, Turn, compare
from tests.models.hybrid_prefix_cache.harness.problems import Problem

ALONE = "same prompt alone (prefill step)"

# Both resume from one checkpoint and compute the same tokens in one step: only the
# batch differs (a recompute chunks otherwise: findings/batch-noise-cpu.md). vLLM's CPU
# kernels compute prefill rows alike in any batch: attention splits the KV only for
# one-token query tiles (csrc/cpu/cpu_attn_impl.hpp, split_kv_q_token_num_threshold),
# the GEMM takes brgemm above 4 rows (csrc/cpu/sgl-kernels/gemm.h, can_use_brgemm).
# Later tokens' decode kernels differ batched: the concurrent cases judge those.


def check_prefill_steps(
    turns: Sequence[Turn], compare_logprobs: bool = True
) -> list[Found]:
    """Each batched hit's prefill step held exactly to its alone counterpart's
    (``Turn.alone``); a case where no hit could be judged so fails."""
    found = [Found() for _ in turns]
    batched = [
        i for i, t in enumerate(turns) if t.prefill_step and t.batched and t.restored
    ]
    if not compare_logprobs or not batched:
        return found
    judged = 0
    for i in batched:
        turn, alone = turns[i], turns[i].alone
        assert turn.output is not None
        if alone is None or alone.cached_tokens != turn.restored:
            hit = None if alone is None else alone.cached_tokens
            notice = (
                f"{turn.name}: alone, the same prompt hit {hit} tokens, batched "
                f"{turn.restored}: not held on its prefill step"
            )
            found[i] += Found(notices=(notice,))
            continue
        judged += 1
        # the prefill step computes the first token
        hit, names = turn.output.head(1), ("hit", ALONE)
        why, found[i] = compare(turn.name, hit, alone.head(1), names, 0.0, True)
        if why:
            text = (
                f"{turn.name}: the batched hit, {turn.restored} tokens restored "
                f"from the prefix cache, differs in its prefill step from the "
                f"same prompt alone on the same checkpoint, {why}: the state "
                f"restored in a shared batch, or the prefill from it, is wrong"
            )
            numbers = dict(restored=turn.restored, control=ALONE)
            found[i] += Found((Problem(text, "hit-apart", turn.name, **numbers),))
    if not judged:
        no_hit = (
            f"{turns[batched[-1]].name}: no batched hit hit what its prompt alone "
            f"did: the case judged no restore in a batch"
        )
        found[batched[-1]] += Found((no_hit,))
    return found

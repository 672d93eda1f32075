# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Batched restores at the servers' own thread count (``Play.prefill_step``):
each batched hit's prefill step, its first sampled logprob, must equal the
same prompt's sent alone under a salt whose every turn went alone
(``Turn.alone``), exactly (:func:`check_prefill_steps`).

Both resume from the same checkpoint and compute the same tokens in one step,
so only the batch differs; a recompute would cut its prompt into other chunks
(findings/batch-noise-cpu.md, where twins failed for that). Prefill rows are
computed alike in any batch by vLLM's CPU kernels: attention splits the KV
only for one-token query tiles (csrc/cpu/cpu_attn_impl.hpp,
split_kv_q_token_num_threshold), the GEMM takes brgemm above 4 rows
(csrc/cpu/sgl-kernels/gemm.h, can_use_brgemm). Later tokens are
decode steps, where a request alone and in a batch take different kernels; the
concurrent cases judge those. Pure."""

from collections.abc import Sequence

from tests.models.hybrid_prefix_cache.harness.compare import (
    Found,
    Sample,
    Turn,
    compare,
)
from tests.models.hybrid_prefix_cache.harness.problems import Problem

ALONE = "same prompt alone (prefill step)"


def prefill_step(sample: Sample) -> Sample:
    """The part of ``sample`` computed in its prefill step: its first token."""
    return sample.head(1)


def check_prefill_steps(
    turns: Sequence[Turn], compare_logprobs: bool = True
) -> list[Found]:
    """Each batched hit's prefill step held to its alone counterpart's, on the
    same checkpoint, exactly (what each of ``turns`` found, in order); a case
    where no hit could be judged so fails."""
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
        if alone is None or alone.cached_tokens != turn.output.cached_tokens:
            hit = None if alone is None else alone.cached_tokens
            notice = (
                f"{turn.name}: alone, the same prompt hit {hit} tokens, batched "
                f"{turn.output.cached_tokens}: not held on its prefill step"
            )
            found[i] += Found(notices=(notice,))
            continue
        judged += 1
        hit = prefill_step(turn.output)
        names = ("hit", ALONE)
        why, seen = compare(turn.name, hit, prefill_step(alone), names, 0.0, True)
        found[i] += seen
        if why:
            apart = Problem(
                f"{turn.name}: the batched hit, {turn.restored} tokens "
                f"restored from the prefix cache, differs in its prefill "
                f"step from the same prompt alone on the same checkpoint, "
                f"{why}: the state restored in a shared batch, or the "
                f"prefill from it, is wrong",
                "hit-apart",
                turn.name,
                restored=turn.restored,
                control=ALONE,
            )
            found[i] += Found((apart,))
    if not judged:
        last = batched[-1]
        found[last] += Found(
            (
                f"{turns[last].name}: no batched hit hit what its prompt alone "
                f"did: the case judged no restore in a batch",
            )
        )
    return found

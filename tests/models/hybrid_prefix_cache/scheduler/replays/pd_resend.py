# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler tier's replay of workloads/pd_resend.py."""

from tests.models.hybrid_prefix_cache.harness import conversation
from tests.models.hybrid_prefix_cache.harness.reconcile import decoder_resend_hit
from tests.models.hybrid_prefix_cache.scheduler import judge, play
from tests.models.hybrid_prefix_cache.scheduler.cell import Replay, ReplayCell
from tests.models.hybrid_prefix_cache.workloads.pd_resend import WORKLOAD


def replay(cell: ReplayCell) -> None:
    """Resends of a prompt ending on a block, of one whose prefilled part does, and
    of the reference prompt: each hits its own checkpoint on the prefiller, and
    the decoder's own cache follows its role's rule."""
    for kda, alignment in cell.kda_checkpoints.items():
        engines = cell.engines(kda=alignment)
        units, _ = cell.servers_of(engines)
        aligned = conversation.shape_length("exact", units)
        reference = conversation.reference_conversation(units, "").first_len
        for prompt_len in (aligned, aligned + cell.deployment.cache_backoff, reference):
            units, servers = cell.servers_of(engines)
            results = play.play_resend(
                servers, cell.deployment, prompt_len, cell.cell_id, cell.token_ids
            )
            rows, problems = judge.case_problems(
                servers, results, units, cell.mode, cell.deployment
            )
            expected = decoder_resend_hit(prompt_len, units, cell.mode, cell.deployment)
            if results[-1].decoder_hit != expected:
                problems.append(
                    f"resend of {prompt_len} tokens: the decoder's own cache hit "
                    f"{results[-1].decoder_hit}, its role's rule says {expected} "
                    f"(harness.reconcile.decoder_resend_hit)"
                )
            cell.fail(WORKLOAD, problems, f"{kda}\n" + "\n".join(rows))


REPLAY = Replay(WORKLOAD, replay, applies=lambda d, m: d.prefill is not None)

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An exact resend under P/D: it hits its own checkpoint on the prefiller,
is answered, and the decoder's own cache follows the rule of its role."""

from tests.models.hybrid_prefix_cache.harness.cases import run_resend
from tests.models.hybrid_prefix_cache.harness.compare import Turn
from tests.models.hybrid_prefix_cache.harness.conversation import Play, shape_length
from tests.models.hybrid_prefix_cache.harness.deployment import Units
from tests.models.hybrid_prefix_cache.harness.reconcile import decoder_resend_hit
from tests.models.hybrid_prefix_cache.harness.records import CaseRecord
from tests.models.hybrid_prefix_cache.harness.rules import PD_PREFILL_BACKOFF
from tests.models.hybrid_prefix_cache.harness.workload import Workload, WorkloadRun


def resend_length(units: Units) -> int:
    """The part the prefiller sees, less what the decoder recomputes, ends on a block
    (nixl/base_scheduler.py _truncate_request_for_prefill; vLLM #53514)."""
    return shape_length("exact", units) + PD_PREFILL_BACKOFF


def decoder_problems(resend: Turn, play: Play) -> list[str]:
    """The decoder's own hit for the resend is its role's rule."""
    assert resend.output is not None
    hit = resend.output.decoder_hit
    deployment = play.deployment
    expected = decoder_resend_hit(resend.prompt_len, play.units, play.mode, deployment)
    if hit == expected:
        return []
    if expected:
        why = (
            f"{expected}, what its decode of the same {resend.prompt_len}-token "
            f"prompt cached up to the resend's checkpoint"
        )
    elif deployment.offload:
        why = "0: its device cache was reset before the resend"
    else:
        why = "0: it keeps no prefix cache"
    return [f"resend: the decoder's own cache hit {hit} tokens, not {why}"]


def play(run: WorkloadRun) -> CaseRecord:
    __tracebackhide__ = True
    cell = (run.suite, run.case_id, run.binding, run.deployment, run.mode)
    return run_resend(
        *cell, resend_length, WORKLOAD.failure, decoder_problems, run.known
    )


WORKLOAD = Workload(
    "pd-resend",
    "an exact resend under P/D hits its own checkpoint on the prefiller and is "
    "answered, and the decoder's counters follow the rule for its role",
    "distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py (the truncation in "
    "on_new_request), v1/kv_cache_interface.py get_mamba_prefill_checkpoint_position, "
    "nixl/pull_scheduler.py NixlPullScheduler.get_num_new_matched_tokens (the decoder "
    "pulls what its own cache does not hold)",
    play=play,
    # A cold request, then the resend with its recompute.
    turns=2,
)

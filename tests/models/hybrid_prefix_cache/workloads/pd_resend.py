# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An exact resend under P/D: it hits its own checkpoint on the prefiller,
is answered, and the decoder's own cache follows the rule of its role."""

from tests.models.hybrid_prefix_cache import harness
from tests.models.hybrid_prefix_cache.harness import conversation, reconcile, rules
from tests.models.hybrid_prefix_cache.harness.compare import Turn


def resend_length(units: harness.Units) -> int:
    """The part the prefiller sees, less what the decoder recomputes, ends on a block
    (nixl/base_scheduler.py _truncate_request_for_prefill; vLLM #53514)."""
    return conversation.shape_length("exact", units) + rules.PD_PREFILL_BACKOFF


def decoder_problems(resend: Turn, p: conversation.Play) -> list[str]:
    """The decoder's own hit for the resend is its role's rule."""
    assert resend.output is not None
    hit, length = resend.output.decoder_hit, resend.prompt_len
    expected = reconcile.decoder_resend_hit(length, p.units, p.mode, p.deployment)
    if hit == expected:
        return []
    if expected:
        why = (
            f"{expected}, what its decode of the same {length}-token "
            f"prompt cached up to the resend's checkpoint"
        )
    elif p.deployment.offload:
        why = "0: its device cache was reset before the resend"
    else:
        why = "0: it keeps no prefix cache"
    return [f"resend: the decoder's own cache hit {hit} tokens, not {why}"]


def play(run: harness.WorkloadRun) -> harness.CaseRecord:
    __tracebackhide__ = True
    return harness.run_resend(run, resend_length, WORKLOAD.failure, decoder_problems)


WORKLOAD = harness.Workload(
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

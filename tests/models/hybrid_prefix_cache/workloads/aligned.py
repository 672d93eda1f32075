# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A conversation whose first prompt ends exactly on a block: every turn
hits its previous prompt's checkpoint and matches its recompute."""

from tests.models.hybrid_prefix_cache import harness


def play(run: harness.WorkloadRun) -> harness.CaseRecord:
    """The sweep's "exact" shape, with the turns its matrix gives it."""
    __tracebackhide__ = True
    return harness.run_case(run, shapes=("exact",))


WORKLOAD = harness.Workload(
    "aligned",
    "a prompt that ends on a block hits its previous prompt's "
    "checkpoint and matches its recompute",
    "v1/kv_cache_interface.py get_mamba_prefill_checkpoint_position",
    play=play,
)

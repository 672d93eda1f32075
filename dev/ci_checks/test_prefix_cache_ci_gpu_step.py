# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU tier's step: per PR on one GPU of an upstream pool, the whole
tier, set up as the KV connector step, triggered on what the tier reads."""

import ast

import pytest
import yaml
from prefix_cache_ci_area import (
    AREA,
    CHECK_SCRIPT,
    GPU_KEY,
    GPU_TIER_MODULE,
    INSTALL_SCRIPT,
    OUR_KEYS,
    ROOT,
    SHARDED_KEY,
    TRIGGERS,
    VLLM_SOURCE_ROOT,
    _pytest_commands,
    _pytest_runs,
    _step,
    covered,
    scripts,
    setup,
)
from prefix_cache_ci_collect import collect, step_imports
from prefix_cache_ci_reads import (
    _imported_modules,
    _module_path,
    _uncovered,
    _vllm_path,
    drafter_code,
    drafter_configs,
    vllm_reads,
)

# No distributed state or device in-process: skip vLLM's global cleanup.
pytestmark = pytest.mark.skip_global_cleanup


def upstream_one_gpu_pools() -> set[str]:
    """The devices of upstream's per-PR one-GPU NVIDIA steps (every area)."""
    pools = set()
    for area in sorted(AREA.parent.glob("*.yaml")):
        for step in yaml.safe_load(area.read_text()).get("steps") or []:
            if step.get("key") in OUR_KEYS or step.get("optional"):
                continue
            one = step.get("num_devices", 1) == 1
            if one and str(step.get("label", "")).startswith(":nvidia:"):
                pools.add(step.get("device"))
    pools.discard(None)
    return pools


def test_gpu_step_runs_per_pr_on_one_gpu_of_an_ordinary_pool():
    """Not nightly (optional) as the 4xB200 step is: one GPU of a pool that
    upstream's own per-PR one-GPU NVIDIA steps run on, one job."""
    step = _step(GPU_KEY)
    assert not step.get("optional"), f"{GPU_KEY} is optional (nightly only)"
    assert step.get("num_devices", 1) == 1, step.get("num_devices")
    pools = upstream_one_gpu_pools()
    assert step.get("device") in pools, (step.get("device"), sorted(pools))
    assert not step.get("parallelism") and not step.get("automatic_shard")


def test_gpu_step_runs_the_whole_gpu_tier():
    """Its pytest command selects every case of the tier's matrix and the
    default budget's tests, and nothing else."""
    from tests.models.hybrid_prefix_cache import gpu_binding

    errors: list[str] = []
    nodes = []
    for argv, here in _pytest_runs(_step(GPU_KEY)):
        nodes += collect(argv, cwd=here, errors=errors)
    assert not errors, errors
    assert all(node.split("::")[0].endswith(GPU_TIER_MODULE) for node in nodes)
    cases = {n.split("[", 1)[1][:-1] for n in nodes if "::test_prefix_cache[" in n}
    assert cases == set(gpu_binding.MATRIX.cases), cases ^ set(gpu_binding.MATRIX.cases)
    assert [n for n in nodes if "::test_default_budget[" in n], nodes


# The longest of each in the tier's run on vLLM 0.34.0 on an H100, five lanes
# side by side (findings/gpu-tier-0.34.md): a server start, the first one's
# (a cold Triton cache), a test's requests on a P/D pair and on one server.
# models_basic.yaml states the arithmetic.
GPU_START, GPU_COLD_START, GPU_PD_TEST, GPU_ONE_SERVER_TEST = 53, 70, 13, 8


def test_gpu_step_timeout_covers_the_tier():
    """The step's timeout is no less than its stated arithmetic on the
    tier's matrix as it is: one start per server of each cell (a P/D pair
    counted as 2) and of each default-budget test, then every test's
    requests."""
    from tests.models.hybrid_prefix_cache import gpu_binding

    (argv,) = _pytest_commands(_step(GPU_KEY))
    nodes = collect(argv)
    matrix = gpu_binding.MATRIX
    servers = {
        (case.deployment, case.mode): (
            2 if gpu_binding.DEPLOYMENTS[case.deployment].prefill else 1
        )
        for case in matrix.cases.values()
    }
    default = len([n for n in nodes if "::test_default_budget[" in n])
    pd_tests = sum(servers[(c.deployment, c.mode)] == 2 for c in matrix.cases.values())
    one_server_tests = len(matrix.cases) - pd_tests + default
    seconds = (sum(servers.values()) + default) * GPU_START + GPU_COLD_START
    seconds += pd_tests * GPU_PD_TEST + one_server_tests * GPU_ONE_SERVER_TEST
    timeout = _step(GPU_KEY)["timeout_in_minutes"]
    assert timeout * 60 >= seconds, f"{GPU_KEY}: {timeout} min < {seconds / 60:.0f}"


def test_gpu_step_runs_the_setup_of_the_kv_connector_step():
    """How a job on vLLM's CUDA image gets the KV connectors is upstream's to
    say: the GPU step runs the 4xB200 step's setup as merged (0.34.0:
    check-kv-connectors.sh, which verifies what the image has baked in;
    before, install-kv-connectors.sh), and installs nothing where the
    checkout verifies."""
    merged = _step(GPU_KEY)["commands"]
    assert setup(merged), merged
    assert setup(merged) == setup(_step(SHARDED_KEY)["commands"])
    if (ROOT / CHECK_SCRIPT).is_file():
        assert CHECK_SCRIPT in scripts(merged), merged
        assert INSTALL_SCRIPT not in " ".join(merged), merged


# What the derivation must find (one that found nothing would pass).
GPU_STEP_READS = (
    "vllm/distributed/kv_transfer/kv_connector/v1/nixl/",
    "vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py",
    "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
)


def test_gpu_step_triggers_on_what_the_tier_reads():
    """The GPU step starts on a change to whatever vLLM file the suite's
    files it imports read (vllm_reads): the connectors it configures, the
    routes it calls, the counters it reads, the files its rules and known
    failures name."""
    step = _step(GPU_KEY)
    reads = vllm_reads(step_imports(step))
    for path in GPU_STEP_READS:
        assert path in reads, (path, sorted(reads))
    missing = _uncovered(step, reads)
    assert not missing, f"{GPU_KEY} misses triggers: {missing}"


def served_model_files() -> dict[str, str]:
    """The vLLM files that serve the GPU tier's model, as triggers: the
    model files of its architecture and of its MTP drafter's (as vLLM's
    registry maps them; SpeculativeConfig names the drafter's), and the
    Mamba layers they import."""
    from transformers import AutoConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.models.registry import _VLLM_MODELS

    from tests.models.hybrid_prefix_cache import tiny_hybrid

    def config():
        values = dict(tiny_hybrid._config("mtp"))
        return AutoConfig.for_model(values.pop("model_type"), **values)

    target = config().architectures
    draft = SpeculativeConfig.hf_config_override(config()).architectures
    found: dict[str, str] = {}
    for architecture in [*target, *draft]:
        module = _VLLM_MODELS[architecture][0]
        path = _module_path(f"vllm.model_executor.models.{module}")
        assert path, (architecture, module)
        found[path] = f"vLLM serves {architecture} from it"
    for path in list(found):
        tree = ast.parse((VLLM_SOURCE_ROOT / path).read_text())
        for node in ast.walk(tree):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if module.startswith("vllm.model_executor.layers.mamba"):
                for name in _imported_modules(node):
                    if layer := _module_path(name):
                        found.setdefault(layer, f"{path} imports {name}")
    return found


def test_gpu_step_triggers_on_its_model_and_drafter():
    """The GPU step starts on a change to the files that serve its model
    (qwen3_next.py, qwen3_next_mtp.py and the Mamba layers they use), to
    the MTP drafter's code in every spec_decode folder vLLM keeps one (the
    model runner's vllm/v1/spec_decode/, and vllm/v1/worker/gpu/spec_decode/
    where the release has it), and to the drafter configs SpeculativeConfig
    answers the harness from."""
    from tests.models.hybrid_prefix_cache import gpu_binding

    listed = _step(GPU_KEY)[TRIGGERS]
    model = served_model_files()
    assert any(p.endswith("_mtp.py") for p in model), model
    missing = [f"{p} ({why})" for p, why in model.items() if not covered(p, listed)]
    assert not missing, f"{GPU_KEY} misses its model's files: {missing}"
    methods = {mode.spec["method"] for mode in gpu_binding.MODES.values() if mode.spec}
    assert methods == {"mtp"}, methods
    folders = [
        _vllm_path(folder.relative_to(VLLM_SOURCE_ROOT).as_posix())
        for folder in sorted((VLLM_SOURCE_ROOT / "vllm" / "v1").rglob("spec_decode"))
    ]
    assert folders, "vLLM has no spec_decode folder"
    drafters = [*drafter_code("mtp"), *folders, *drafter_configs()]
    missing = [path for path in drafters if not covered(path, listed)]
    assert not missing, f"{GPU_KEY} misses the MTP drafter: {missing}"

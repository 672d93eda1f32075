# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The deployment model: bindings, instances, modes, their ``vllm serve``
arguments, reported geometry and known failures. Pure."""

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate, pairwise
from math import lcm

from packaging.version import Version

from tests.models.hybrid_prefix_cache.harness import rules
from tests.models.hybrid_prefix_cache.harness.problems import Finding


@dataclass(frozen=True)
class Mode:
    prefix_match_unit: int | None = None  # None: by block
    spec: Mapping | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.spec is not None and "method" not in self.spec:
            raise ValueError(
                "a speculative config must name its method: whether the prefix "
                "cache drops a unit depends on it"
            )

    @property
    def drops_unit(self) -> bool:
        """:func:`rules.drafting`'s drop, without a KV connector."""
        return self.drafting().drops_unit

    def drafting(self, instance: "Instance | None" = None) -> rules.Drafting:
        """:func:`rules.drafting` for ``instance`` (None: no KV connector)."""
        instance = instance or Instance()
        return rules.drafting(self.spec, instance.kv_config, instance.prefix_caching)

    def args(self, prefix_caching: bool = True) -> list[str]:
        """``vllm serve`` arguments; no match unit without prefix caching."""
        args = []
        if self.prefix_match_unit is not None and prefix_caching:
            args += ["--prefix-match-unit", str(self.prefix_match_unit)]
        if self.spec is not None:
            args += ["--speculative-config", json.dumps(self.spec)]
        return args


def matrix_modes(partial_unit: int, drafter: str, spec: Mapping) -> dict[str, Mode]:
    """Every tier's four modes: block or partial, without and with ``drafter``."""
    return {
        "block": Mode(),
        "partial": Mode(prefix_match_unit=partial_unit),
        f"block-{drafter}": Mode(spec=spec),
        f"partial-{drafter}": Mode(prefix_match_unit=partial_unit, spec=spec),
    }


def kv_connector(name: str, extra: Mapping | None = None, **fields) -> dict:
    """A kv_both ``--kv-transfer-config``, ``extra`` its extra config."""
    config = {"kv_connector": name, "kv_role": "kv_both", **fields}
    if extra is not None:
        config["kv_connector_extra_config"] = dict(extra)
    return config


def cpu_offload(bytes_per_rank: int) -> dict:
    """SimpleCPUOffloadConnector storing eagerly, as the Kimi-K3 recipe does."""
    extra = {"cpu_bytes_to_use_per_rank": bytes_per_rank, "lazy_offload": False}
    return kv_connector("SimpleCPUOffloadConnector", extra)


def multi_connector(*connectors: Mapping) -> dict:
    return kv_connector("MultiConnector", {"connectors": list(connectors)})


@dataclass(frozen=True)
class Instance:
    tp: int = 1
    dp: int = 1
    dcp: int = 1
    expert_parallel: bool = False
    kv_config: Mapping | None = field(default=None, hash=False)
    prefix_caching: bool = True
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    serve_args: tuple[str, ...] = ()

    @property
    def num_devices(self) -> int:
        return self.tp * self.dp

    def args(self) -> list[str]:
        args = []
        sizes = {"tensor": self.tp, "data": self.dp, "decode-context": self.dcp}
        for kind, size in sizes.items():
            if size > 1:
                args += [f"--{kind}-parallel-size", str(size)]
        if self.expert_parallel:
            args.append("--enable-expert-parallel")
        if self.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_config)]
        caching = "--enable-prefix-caching" if self.prefix_caching else None
        args.append(caching or "--no-enable-prefix-caching")
        return [*args, *self.serve_args]


@dataclass(frozen=True)
class Deployment:
    """A decoder, optionally fed by a prefiller; ``offload``: hits from the CPU tier."""

    decode: Instance = Instance()
    prefill: Instance | None = None
    offload: bool = False

    @property
    def instances(self) -> tuple[Instance, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)

    @property
    def num_devices(self) -> int:
        return sum(instance.num_devices for instance in self.instances)

    @property
    def cache_backoff(self) -> int:
        """Trailing tokens the cache-consulting instance never sees."""
        return 0 if self.prefill is None else rules.PD_PREFILL_BACKOFF

    @property
    def same_instances(self) -> bool:
        """Whether P/D's two instances are one config, env aside (harness.transfer)."""
        if self.prefill is None:
            return False
        return replace(self.prefill, env={}) == replace(self.decode, env={})

    @property
    def compares_logprobs(self) -> bool:
        """Not under P/D with two TP sizes: the weights are sharded apart."""
        return self.prefill is None or self.prefill.tp == self.decode.tp

    def _each_instance(self, change: Callable[[Instance], Instance]) -> "Deployment":
        prefill = None if self.prefill is None else change(self.prefill)
        return replace(self, decode=change(self.decode), prefill=prefill)


def with_serve_args(deployment: Deployment, args: Sequence[str]) -> Deployment:
    return deployment._each_instance(
        lambda i: replace(i, serve_args=(*i.serve_args, *args))
    )


def with_serve_env(deployment: Deployment, env: Mapping[str, str]) -> Deployment:
    return deployment._each_instance(lambda i: replace(i, env={**i.env, **env}))


def device_ranges(deployment: Deployment) -> list[range]:
    """Disjoint, contiguous device ids for each instance, in order."""
    ends = [0, *accumulate(i.num_devices for i in deployment.instances)]
    return [range(start, end) for start, end in pairwise(ends)]


@dataclass(frozen=True)
class Binding:
    """What a tier binds the harness to. ``logprob_atol``: a hit against a cold request
    on its path (0.0 bit-exact; None: check_logprobs_close only); across paths, measured
    noise (paths.check_paths). ``exact_on_blocks``: only hits on a multiple of
    ``exact_grid`` (None: a block) share the recompute's path.
    ``exact_across_instances``: a config computes alike in two processes (not Kimi-K3).
    ``batch_invariant_env``: as if alone (None: batched twins)."""

    model: str
    base_args: tuple[str, ...]
    token_ids: tuple[int, int]
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    startup_timeout: float = 600.0
    logprob_atol: float | None = 0.0
    # gives a P/D instance its own devices; None: shared (CPU backend)
    visible_devices_env: str | None = "CUDA_VISIBLE_DEVICES"
    concurrent_start: bool = True
    exact_on_blocks: bool = False
    exact_grid: int | None = None
    exact_across_instances: bool = False
    batch_invariant_env: Mapping[str, str] | None = field(default=None, hash=False)

    @property
    def chunk_invariant(self) -> bool:
        """Whether chunk ends leave a prefill's arithmetic alone, any budget."""
        return self.logprob_atol is not None and not self.exact_on_blocks


def server_args(binding: Binding, instance: Instance, mode: Mode) -> list[str]:
    return [*binding.base_args, *instance.args(), *mode.args(instance.prefix_caching)]


@dataclass(frozen=True)
class Units:
    """The checkpoint geometry a server reports."""

    block: int  # lcm of the attention and Mamba block sizes
    hit: int  # the finest boundary a hit can land on

    @classmethod
    def from_cache_config(cls, labels: Mapping[str, str], mode: Mode) -> "Units":
        block = lcm(int(labels["block_size"]), int(labels["mamba_block_size"]))
        if mode.prefix_match_unit is None:
            return cls(block=block, hit=block)
        reported = labels.get("prefix_match_unit")
        if reported != str(mode.prefix_match_unit):
            raise AssertionError(
                f"server reports prefix_match_unit={reported!r}, "
                f"expected {mode.prefix_match_unit}"
            )
        return cls(block=block, hit=mode.prefix_match_unit)


@dataclass(frozen=True)
class Known:
    """A cell that cannot pass: ``evidence``, vLLM's text, or ``found``, in a record."""

    kind: str  # "xfail" (a vLLM bug; strict) or "unsupported" (refused: skip)
    reason: str
    evidence: str = ""
    found: Finding | None = None  # its kind, turn and numbers (harness.problems)
    geometry: tuple[int, int] | None = None  # the (block, hit unit) it needs
    confirmed_by: str | None = None  # the one case confirming a shared failure
    at_config: bool = False  # refused while building the config: confirmed in-process
    releases: str | None = None  # PEP 440, None for all

    def __post_init__(self) -> None:
        if self.kind not in ("xfail", "unsupported"):
            raise ValueError(f"unknown kind of known failure: {self.kind!r}")
        if bool(self.evidence) == (self.found is not None):
            raise ValueError("a known failure shows either vLLM's text or a finding")
        if self.at_config and self.kind != "unsupported":
            raise ValueError("only a refusal can be confirmed at config time")
        if self.at_config and self.found is not None:
            raise ValueError("a refusal at config time leaves no record")

    @property
    def replayed(self) -> bool:
        """Whether the scheduler tier's replay shows it, not a served case."""
        return self.found is not None and self.found.kind == "scheduler-hit"

    @property
    def expects(self) -> str:
        return repr(self.evidence) if self.found is None else str(self.found)

    def shown(self, text: str, problems: Sequence[str] = ()) -> bool:
        """Whether a failure that says ``text`` and found ``problems`` shows it."""
        if self.found is None:
            return self.evidence in text
        return any(self.found.shown_by(problem) for problem in problems)

    @property
    def arrives(self) -> str:
        """Where the evidence shows: "config", "record" or "crash"."""
        if self.at_config:
            return "config"
        return "record" if self.found is not None else "crash"

    def holds(self, version: Version | None = None) -> bool:
        """Whether it holds for ``version`` (default: the vLLM under test)."""
        return rules.holds_for(self.releases, version)


def select_known(entries: Sequence[Known], units: "Units | None") -> Known | None:
    """The entry that applies at ``units`` (None: no server answered)."""
    at = None if units is None else (units.block, units.hit)
    found = [k for k in entries if k.holds() and k.geometry in (None, at)]
    if len(found) > 1:
        raise ValueError(f"several known failures apply at {units}: {found}")
    return found[0] if found else None

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The deployment model: what a tier serves (:class:`Binding`), what a case
deploys (:class:`Deployment` of :class:`Instance`) and how prefixes are
matched (:class:`Mode`), the ``vllm serve`` arguments of each, the checkpoint
geometry a server reports (:class:`Units`), and the known-failure entries
(:class:`Known`). Pure: nothing here talks to a server."""

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from math import lcm

from packaging.version import Version

from tests.models.hybrid_prefix_cache.harness import rules
from tests.models.hybrid_prefix_cache.harness.rules import PD_PREFILL_BACKOFF


@dataclass(frozen=True)
class Mode:
    """How prefixes are matched: by block, or by a finer prefix match unit,
    with or without speculative decoding."""

    prefix_match_unit: int | None = None
    spec: Mapping | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.spec is not None and "method" not in self.spec:
            raise ValueError(
                "a speculative config must name its method: whether the prefix "
                "cache drops a unit depends on it"
            )

    @property
    def drops_unit(self) -> bool:
        """Whether the vLLM under test drops the trailing hit unit for this
        drafter on an instance without a KV connector
        (:func:`rules.drafting`)."""
        return self.drafting().drops_unit

    def drafting(self, instance: "Instance | None" = None) -> rules.Drafting:
        """What this mode's drafter changes in ``instance``'s prefix cache
        (None: one without a KV connector): :func:`rules.drafting`."""
        if instance is None:
            return rules.drafting(self.spec)
        return rules.drafting(
            self.spec,
            kv_config=instance.kv_config,
            prefix_caching=instance.prefix_caching,
        )

    def args(self, prefix_caching: bool = True) -> list[str]:
        """The mode's ``vllm serve`` arguments; an instance without prefix
        caching gets no prefix match unit, which it would not use."""
        args = []
        if self.prefix_match_unit is not None and prefix_caching:
            args += ["--prefix-match-unit", str(self.prefix_match_unit)]
        if self.spec is not None:
            args += ["--speculative-config", json.dumps(self.spec)]
        return args


def matrix_modes(partial_unit: int, drafter: str, spec: Mapping) -> dict[str, Mode]:
    """The four modes of every tier's matrix: by block or by
    ``partial_unit``, each without and with the speculative config ``spec``
    of ``drafter``; ids ``block``, ``partial``, ``block-<drafter>`` and
    ``partial-<drafter>``."""
    return {
        "block": Mode(),
        "partial": Mode(prefix_match_unit=partial_unit),
        f"block-{drafter}": Mode(spec=spec),
        f"partial-{drafter}": Mode(prefix_match_unit=partial_unit, spec=spec),
    }


def kv_connector(name: str, extra: Mapping | None = None, **fields) -> dict:
    """An instance's ``--kv-transfer-config``: connector ``name`` in role
    kv_both, with top-level ``fields`` and ``kv_connector_extra_config``
    ``extra``. Both tiers build every connector with it and the helpers
    below; they differ only in the parameters."""
    config = {"kv_connector": name, "kv_role": "kv_both", **fields}
    if extra is not None:
        config["kv_connector_extra_config"] = dict(extra)
    return config


def cpu_offload(bytes_per_rank: int) -> dict:
    """SimpleCPUOffloadConnector with ``bytes_per_rank`` of host memory per
    rank, storing eagerly (as the Kimi-K3 recipe configures it)."""
    extra = {"cpu_bytes_to_use_per_rank": bytes_per_rank, "lazy_offload": False}
    return kv_connector("SimpleCPUOffloadConnector", extra)


def multi_connector(*connectors: Mapping) -> dict:
    """MultiConnector over ``connectors``, in that order."""
    return kv_connector("MultiConnector", {"connectors": list(connectors)})


@dataclass(frozen=True)
class Instance:
    """One ``vllm serve`` process, the devices it owns, and its own
    environment and extra arguments (e.g. CPU thread binding)."""

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
        if self.tp > 1:
            args += ["--tensor-parallel-size", str(self.tp)]
        if self.dp > 1:
            args += ["--data-parallel-size", str(self.dp)]
        if self.dcp > 1:
            args += ["--decode-context-parallel-size", str(self.dcp)]
        if self.expert_parallel:
            args.append("--enable-expert-parallel")
        if self.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_config)]
        caching = "--enable-prefix-caching" if self.prefix_caching else None
        args.append(caching or "--no-enable-prefix-caching")
        return [*args, *self.serve_args]


@dataclass(frozen=True)
class Deployment:
    """The instances of one case: a decoder, optionally fed by a prefiller.

    ``offload`` means the hit must come from the CPU offload tier: the
    instances' GPU prefix caches are reset before every turn.
    """

    decode: Instance = Instance()
    prefill: Instance | None = None
    offload: bool = False

    @property
    def instances(self) -> tuple[Instance, ...]:
        if self.prefill is None:
            return (self.decode,)
        return (self.prefill, self.decode)

    @property
    def num_devices(self) -> int:
        return sum(instance.num_devices for instance in self.instances)

    @property
    def cache_backoff(self) -> int:
        """Trailing prompt tokens that the instance consulting its prefix
        cache never sees: the P/D prefiller's (:data:`PD_PREFILL_BACKOFF`)."""
        return 0 if self.prefill is None else PD_PREFILL_BACKOFF

    @property
    def same_instances(self) -> bool:
        """Whether a P/D prefiller and decoder are one configuration, their
        environments aside (CPU thread binding), so that one request served
        by either is computed alike (harness.transfer)."""
        if self.prefill is None:
            return False
        return replace(self.prefill, env={}) == replace(self.decode, env={})

    @property
    def compares_logprobs(self) -> bool:
        """Whether a hit's logprobs can be held to the recompute's.

        Under P/D with different TP sizes, prefiller and decoder hold
        differently sharded (and, with dummy weights, different) weights.
        """
        return self.prefill is None or self.prefill.tp == self.decode.tp


def _each_instance(
    deployment: Deployment, change: Callable[[Instance], Instance]
) -> Deployment:
    prefill = None if deployment.prefill is None else change(deployment.prefill)
    return replace(deployment, decode=change(deployment.decode), prefill=prefill)


def with_serve_args(deployment: Deployment, args: Sequence[str]) -> Deployment:
    """``deployment`` with ``args`` added to the ``vllm serve`` arguments of
    each of its instances (a workload that needs servers of its own)."""
    return _each_instance(
        deployment, lambda i: replace(i, serve_args=(*i.serve_args, *args))
    )


def with_serve_env(deployment: Deployment, env: Mapping[str, str]) -> Deployment:
    """``deployment`` with ``env`` added to the environment of each of its
    instances (a case that needs servers of its own)."""
    return _each_instance(deployment, lambda i: replace(i, env={**i.env, **env}))


def device_ranges(deployment: Deployment) -> list[range]:
    """Disjoint, contiguous device ids for each instance, in order."""
    ranges, start = [], 0
    for instance in deployment.instances:
        ranges.append(range(start, start + instance.num_devices))
        start += instance.num_devices
    return ranges


@dataclass(frozen=True)
class Binding:
    """What a tier binds the harness to.

    ``token_ids`` is the half-open range random prompt ids are drawn from.
    ``logprob_atol`` bounds the difference between the sampled tokens'
    logprobs of a cache hit and of the cold request that took the same
    numerical path (the recompute where both ran alone on one server, the
    cold twin under P/D): 0.0 where one path is bit-exact, None where no
    tolerance holds (GPUs: check_logprobs_close alone). Comparisons across
    two paths are held to the noise each case measures on its cold controls
    instead (compare.check_paths). ``concurrent_start`` starts a
    deployment's instances at once instead of one after another.
    ``exact_on_blocks``: a hit is on its recompute's path only where it
    resumes on a block boundary (a GPU under a budget of one block); one
    that resumes inside a block stored and reloaded its state where its
    recompute kept it, and is held to the case's measured noise.
    ``exact_across_instances``: two instances of one configuration compute
    one request bit for bit alike, so that the P/D transfer is judged
    exactly (harness.transfer); seen on CPUs, where kernels pick no
    configuration per process (GPU kernels may autotune per process).
    ``batch_invariant_env``: an environment under which a server computes
    each request as it would alone, whatever shares its steps; a batched
    case is served with it and holds each hit exactly to its recompute
    alone. None: it holds them to batched cold twins within measured noise.
    """

    model: str
    base_args: tuple[str, ...]
    token_ids: tuple[int, int]
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    startup_timeout: float = 600.0
    logprob_atol: float | None = 0.0
    # The variable that gives a P/D instance its own devices, or None where
    # instances share the machine (the CPU backend).
    visible_devices_env: str | None = "CUDA_VISIBLE_DEVICES"
    concurrent_start: bool = True
    exact_on_blocks: bool = False
    exact_across_instances: bool = False
    batch_invariant_env: Mapping[str, str] | None = field(default=None, hash=False)

    @property
    def chunk_invariant(self) -> bool:
        """Whether a hit is on its recompute's path wherever it resumes: then
        where a prefill's chunks end does not change its arithmetic, and two
        prefill budgets compute one prompt alike."""
        return self.logprob_atol is not None and not self.exact_on_blocks


def server_args(binding: Binding, instance: Instance, mode: Mode) -> list[str]:
    """The ``vllm serve`` arguments (after the model) of one instance."""
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
    """A cell that cannot pass, and the text its failure must contain.

    ``kind`` is "xfail" for a vLLM bug (the cell runs, must fail with
    ``evidence``, and fails loudly if it passes) or "unsupported" for a
    feature the platform does not implement (the server must refuse with
    ``evidence``; the cell then skips with ``reason``). ``geometry`` is the
    (block, hit unit) its servers reported where the failure was seen, for a
    failure that depends on it; None where it does not.

    How a failure is confirmed, cheapest first: ``confirmed_by`` names the
    one case that confirms a failure several cells share (this cell then
    skips without a run); ``at_config`` says vLLM refuses while it builds its
    config, so the refusal is confirmed by building the config in-process
    from the servers' own arguments, and the servers only start if it builds.

    Where the evidence arrives (:attr:`arrives`): in vLLM's refusal of the
    config (``at_config``), in the oracle's own wording of a problem on the
    case's record (``in_record``), or else in a crash: an exception and the
    logs of the case's servers (harness.failure_text).

    ``releases`` names the vLLM releases the failure holds for (a PEP 440
    specifier such as "<0.34"; None: every release); under another, the
    case is expected to pass.
    """

    kind: str
    reason: str
    evidence: str
    geometry: tuple[int, int] | None = None
    confirmed_by: str | None = None
    at_config: bool = False
    in_record: bool = False
    releases: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("xfail", "unsupported"):
            raise ValueError(f"unknown kind of known failure: {self.kind!r}")
        if self.at_config and self.kind != "unsupported":
            raise ValueError("only a refusal can be confirmed at config time")
        if self.at_config and self.in_record:
            raise ValueError("a refusal at config time leaves no record")

    @property
    def arrives(self) -> str:
        """Where the evidence shows: "config", "record" or "crash"."""
        if self.at_config:
            return "config"
        return "record" if self.in_record else "crash"

    def holds(self, version: Version | None = None) -> bool:
        """Whether the failure holds for ``version`` (default: the vLLM
        under test)."""
        return rules.holds_for(self.releases, version)

    def applies(self, units: "Units | None") -> bool:
        if not self.holds():
            return False
        if self.geometry is None:
            return True
        return units is not None and (units.block, units.hit) == self.geometry


def select_known(entries: Sequence[Known], units: "Units | None") -> Known | None:
    """The entry of ``entries`` that applies where the case's servers
    reported ``units`` (None: no server answered), if any."""
    found = [known for known in entries if known.applies(units)]
    if len(found) > 1:
        raise ValueError(f"several known failures apply at {units}: {found}")
    return found[0] if found else None

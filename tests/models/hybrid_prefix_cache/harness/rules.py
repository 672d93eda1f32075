# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What vLLM promises a hybrid model's prefix cache, each rule naming its vLLM
source; across releases, the vLLM under test's code or release decides."""

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from types import SimpleNamespace

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


def release_under_test() -> Version:
    """The imported vLLM's release; a tree without one counts as newest."""
    import vllm

    try:
        return Version(vllm.__version__)
    except InvalidVersion:
        return Version("9999")


def holds_for(releases: str | None, version: Version | None = None) -> bool:
    """Whether ``releases`` (PEP 440; None: all) holds for ``version``."""
    if releases is None:
        return True
    version = version or release_under_test()
    return SpecifierSet(releases).contains(version, prereleases=True)


# First prompt: FIRST_PROMPT_BLOCKS blocks and a tail; each turn adds TURN_TOKENS.
NUM_TURNS = 3
FIRST_PROMPT_BLOCKS = 3
FIRST_PROMPT_TAIL = 37
TURN_TOKENS = 777


@dataclass(frozen=True)
class PlannedTurn:
    """One request as sent: its length, the previous prompt's (same salt)."""

    index: int
    prompt_len: int
    prev_len: int
    resend: bool = False


def plan_turns(
    first_len: int, num_turns: int = NUM_TURNS, resend: bool = True
) -> list[PlannedTurn]:
    """``num_turns`` turns, each TURN_TOKENS longer, then (``resend``) a resend."""
    lengths = [0] + [first_len + i * TURN_TOKENS for i in range(num_turns)]
    turns = [PlannedTurn(i, n, prev) for i, (prev, n) in enumerate(pairwise(lengths))]
    if resend:
        turns.append(PlannedTurn(num_turns, lengths[-1], lengths[-1], resend=True))
    return turns


# NIXL truncates a Mamba prefill by one token, which the decoder recomputes
# (nixl/base_scheduler.py _prefill_backoff, _truncate_request_for_prefill).
PD_PREFILL_BACKOFF = 1


@functools.cache
def pd_lookup_backoff() -> int:
    """Tokens a P/D prefiller's lookup misses: the backoff where NIXL truncates
    on add (0.32: nixl/base_scheduler.py _truncate_request_for_prefill), 0 where
    after the lookup (0.26: nixl/pull_scheduler.py get_num_new_matched_tokens)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler
    except ImportError:
        return PD_PREFILL_BACKOFF
    classes = [c for c in vars(base_scheduler).values() if isinstance(c, type)]
    truncates_on_add = any("_truncate_request_for_prefill" in vars(c) for c in classes)
    return PD_PREFILL_BACKOFF if truncates_on_add else 0


@functools.cache
def decoder_reports_prefill_hit() -> bool:
    """Whether a P/D decoder reports the prefiller's hit (0.32: output_processor.py
    remote_prefill_cached_tokens); 0.26 reports all it held."""
    import vllm.v1.engine.output_processor as output_processor

    return "remote_prefill_cached_tokens" in inspect.getsource(output_processor)


def decoder_reported_cached(prompt_len: int, prefill_hit: int) -> int:
    held = prompt_len - PD_PREFILL_BACKOFF
    return prefill_hit if decoder_reports_prefill_hit() else held


def seen_lengths(prev_len: int, prompt_len: int, backoff: int) -> tuple[int, int]:
    """Both lengths as seen ``backoff`` tokens short."""
    return max(prev_len - backoff, 0), prompt_len - backoff


def exact_budget(block: int) -> int:
    """A budget chunking a hit and its recompute alike: align mode ends chunks
    on blocks (v1/core/sched/scheduler.py _mamba_block_aligned_split)."""
    return block


def partial_unit(block: int) -> int:
    """The largest power of two below ``block`` dividing it: a finer unit vLLM
    accepts (v1/core/kv_cache_utils.py resolve_kv_cache_block_sizes)."""
    unit = block & -block
    if unit == block:
        unit //= 2
    if unit < 1:
        raise ValueError(f"no prefix match unit below a block of {block}")
    return unit


@dataclass(frozen=True)
class Drafting:
    """Lookups drop their last hit unit, or hashes cover ``lookahead`` more."""

    drops_unit: bool = False
    lookahead: int = 0


def _declared(cls: type, fields: Mapping):
    """``cls`` with ``fields``, skipping ``__post_init__`` (loads a drafter)."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(fields) - set(names)):
        raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}")
    instance = object.__new__(cls)
    for name, field in names.items():
        if name in fields:
            value = fields[name]
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            continue  # a required field the deployment does not declare
        object.__setattr__(instance, name, value)
    return instance


def _connector_hashes_lookahead(kv_config: Mapping) -> bool:
    """0.34: KVConnectorBase_V1.supports_lookahead_block_hashes."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = KVTransferConfig(**kv_config)
    connector = KVConnectorFactory.get_connector_class(config)
    return connector.supports_lookahead_block_hashes(config)


def drafting(
    spec: Mapping | None, kv_config: Mapping | None = None, prefix_caching: bool = True
) -> Drafting:
    """What drafter ``spec`` changes behind ``kv_config``. Drop: config/speculative.py
    use_eagle_block_drop (0.26: use_eagle). Lookahead: config/vllm.py
    num_hash_lookahead_tokens, read from its pieces so a resolver drift shows."""
    if spec is None:
        return Drafting()
    from vllm.config import VllmConfig
    from vllm.config.speculative import SpeculativeConfig

    speculative = _declared(SpeculativeConfig, spec)
    drop_rule = getattr(speculative, "use_eagle_block_drop", speculative.use_eagle)
    if not drop_rule():
        return Drafting()
    if hasattr(VllmConfig, "_resolve_num_hash_lookahead_tokens"):
        per_connector = True  # 0.34
    elif isinstance(getattr(VllmConfig, "num_hash_lookahead_tokens", None), property):
        per_connector = False  # 0.33
    else:
        return Drafting(drops_unit=True)  # 0.32: no lookahead hashes
    if getattr(speculative, "disable_lookahead_block_hashes", False):
        return Drafting(drops_unit=True)
    if kv_config is not None:
        if not (per_connector and _connector_hashes_lookahead(kv_config)):
            return Drafting(drops_unit=True)
    elif not prefix_caching:
        return Drafting(drops_unit=True)
    # Prefill lookahead: 0.34 spec_decode/speculator_config.py, 0.33 VllmConfig.
    if hasattr(type(speculative), "speculator_config"):
        lookahead = speculative.speculator_config.num_prefill_lookahead_tokens
    else:
        stand_in = SimpleNamespace(
            speculative_config=speculative,
            num_speculative_tokens=speculative.num_speculative_tokens,
        )
        lookahead = VllmConfig.num_prefill_lookahead_tokens.fget(stand_in)
    return Drafting(drops_unit=not lookahead, lookahead=lookahead)


def prompt_end_checkpoint(
    prompt_len: int, unit: int, drops_unit: bool, lookahead: int = 0
) -> int:
    """Where a prefill saves its Mamba state, the deepest later hit. From
    v1/kv_cache_interface.py get_mamba_prefill_checkpoint_position; a dropping
    drafter lowers it a unit (v1/core/kv_cache_coordinator.py lookup)."""
    limit = prompt_len if drops_unit else prompt_len - max(1, lookahead)
    checkpoint = limit // unit * unit
    if drops_unit:
        checkpoint -= unit
    return max(checkpoint, 0)


def expected_cached(
    prev_len: int, unit: int, drops_unit: bool, lookahead: int = 0
) -> int:
    """The hit a turn must reach: the previous prompt's checkpoint."""
    if prev_len <= 0:
        return 0
    return prompt_end_checkpoint(prev_len, unit, drops_unit, lookahead)


# An exact resend hits its own prompt-end checkpoint.
expected_resend = prompt_end_checkpoint


def decode_checkpoint(
    prompt_len: int, decoded: int, block: int, interval: int | None
) -> int:
    """The deepest state a decode leaves past its prompt under retention
    ``interval`` (0: none). From v1/core/kv_cache_manager.py allocate_slots and
    single_type_kv_cache_manager.py MambaManager.reachable_block_mask."""
    if interval == 0:
        return 0
    step = block if interval is None or interval <= block else interval
    boundary = (prompt_len + decoded) // step * step
    return boundary if boundary > prompt_len else 0


def decoded_expectation(
    prev_len: int,
    unit: int,
    drafter: Drafting,
    decoded: int,
    block: int,
    interval: int | None,
) -> tuple[int, int]:
    """(hit to reach, what the salt stored) when ``decoded`` tokens are shared."""
    prompt = expected_cached(prev_len, unit, drafter.drops_unit, drafter.lookahead)
    decode = decode_checkpoint(prev_len, decoded, block, interval)
    return max(prompt, decode), max(prev_len, decode)


def hit_bound(prev_len: int, prompt_len: int, unit: int) -> int:
    """The largest real hit: within what was stored and the prompt less one."""
    return min(prev_len, prompt_len - 1) // unit * unit


def impossible_hit(cached: int, prev_len: int, prompt_len: int, unit: int) -> str:
    """Why ``cached`` cannot be a real hit (:func:`hit_bound`), or ""."""
    if cached % unit:
        return f"cached {cached} is not a multiple of the hit unit {unit}"
    if cached > prev_len:
        return f"cached {cached} exceeds the previous prompt's {prev_len} tokens"
    if cached >= prompt_len:
        return f"cached {cached} leaves nothing of the {prompt_len}-token prompt"
    return ""


def expectation(
    turn: PlannedTurn, unit: int, drops_unit: bool, backoff: int = 0, lookahead: int = 0
) -> tuple[int, int]:
    """(expected hit, largest possible hit), seen ``backoff`` tokens short."""
    prev_len, prompt_len = seen_lengths(turn.prev_len, turn.prompt_len, backoff)
    expected = expected_cached(prev_len, unit, drops_unit, lookahead)
    return expected, hit_bound(prev_len, prompt_len, unit)

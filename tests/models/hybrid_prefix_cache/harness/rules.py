# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What vLLM promises a hybrid model's prefix cache: where a prompt leaves
its checkpoint, the hit a later turn must reach and the most it can reach,
what an exact resend hits, what a drafter changes, and what a P/D
prefiller sees. Every rule names the vLLM file and function it is read
from. Where a rule changed between releases, the vLLM under test decides:
by asking its own code where the rule is a config method, else by the
release it reports (:func:`holds_for`). Following a release means reading
this module against its code. Pure: no server, no clock."""

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# --- the release under test --------------------------------------------------


def release_under_test() -> Version:
    """The vLLM release the rules are asked of: what the imported vllm
    reports; a tree without a release number (a developer's main) counts as
    newer than every release."""
    import vllm

    try:
        return Version(vllm.__version__)
    except InvalidVersion:
        return Version("9999")


def holds_for(releases: str | None, version: Version | None = None) -> bool:
    """Whether a fact stated for ``releases`` (a PEP 440 specifier such as
    "<0.34"; None: every release) holds for ``version`` (default: the
    release under test); a main tree's dev release counts as its release."""
    if releases is None:
        return True
    version = version or release_under_test()
    return SpecifierSet(releases).contains(version, prereleases=True)


# --- the conversation the rules are applied to ----------------------------------

# The first prompt spans FIRST_PROMPT_BLOCKS blocks plus an unaligned tail;
# every later turn appends TURN_TOKENS tokens (the previous output, then
# random token ids); the last turn resends the last prompt.
NUM_TURNS = 3
FIRST_PROMPT_BLOCKS = 3
FIRST_PROMPT_TAIL = 37
TURN_TOKENS = 777


@dataclass(frozen=True)
class PlannedTurn:
    """One request of a conversation, as sent: its prompt length, the
    length of the previous prompt of the same salt, and whether it resends
    that previous prompt exactly."""

    index: int
    prompt_len: int
    prev_len: int
    resend: bool = False


def plan_turns(
    first_len: int, num_turns: int = NUM_TURNS, resend: bool = True
) -> list[PlannedTurn]:
    """The requests of a conversation whose first prompt has ``first_len``
    tokens: ``num_turns`` turns, each TURN_TOKENS longer than the one
    before, then (``resend``) an exact resend of the last prompt."""
    turns, prev_len = [], 0
    for index in range(num_turns):
        prompt_len = first_len + index * TURN_TOKENS
        turns.append(PlannedTurn(index, prompt_len, prev_len))
        prev_len = prompt_len
    if resend:
        turns.append(PlannedTurn(num_turns, prev_len, prev_len, resend=True))
    return turns


# --- P/D -------------------------------------------------------------------------

# The trailing prompt tokens a P/D prefiller never sees. vLLM's NIXL
# scheduler truncates a do_remote_decode request when it is added
# (distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py,
# _prefill_backoff and _truncate_request_for_prefill): by one token for a
# model with Mamba layers, whose last token the decoder recomputes; by more
# only for multi-module MTP, which no tier here uses. The prefiller's lookup,
# its checkpoints and its query counter see the shorter prompt, and the
# decoder loads exactly that many tokens (_get_remote_prefill_token_count).
PD_PREFILL_BACKOFF = 1


@functools.cache
def pd_lookup_backoff() -> int:
    """The trailing prompt tokens that a P/D prefiller's prefix-cache lookup
    and its query counter do not see: PD_PREFILL_BACKOFF where its NIXL
    scheduler truncates the request when it is added (0.32:
    nixl/base_scheduler.py on_new_request, _truncate_request_for_prefill),
    none where it truncates it only after the local lookup (0.26:
    nixl/pull_scheduler.py get_num_new_matched_tokens,
    _truncate_mamba_request_for_prefill). Either way the prefiller computes,
    and leaves its checkpoint in, the prompt less PD_PREFILL_BACKOFF."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler
    except ImportError:
        return PD_PREFILL_BACKOFF
    classes = [c for c in vars(base_scheduler).values() if isinstance(c, type)]
    truncates_on_add = any("_truncate_request_for_prefill" in vars(c) for c in classes)
    return PD_PREFILL_BACKOFF if truncates_on_add else 0


@functools.cache
def decoder_reports_prefill_hit() -> bool:
    """Whether a P/D decoder's usage reports the prefiller's hit as its
    cached tokens (0.32: the transfer carries it,
    v1/engine/output_processor.py remote_prefill_cached_tokens); where not
    (0.26), it reports what it held before its leg: its own hit and what
    NIXL loaded, all but the token it computes itself."""
    import inspect

    import vllm.v1.engine.output_processor as output_processor

    return "remote_prefill_cached_tokens" in inspect.getsource(output_processor)


def decoder_reported_cached(prompt_len: int, prefill_hit: int) -> int:
    """The cached tokens a P/D decoder reports for its leg of a
    ``prompt_len``-token prompt whose prefiller hit ``prefill_hit``
    (:func:`decoder_reports_prefill_hit`)."""
    if decoder_reports_prefill_hit():
        return prefill_hit
    return prompt_len - PD_PREFILL_BACKOFF


def seen_lengths(prev_len: int, prompt_len: int, backoff: int) -> tuple[int, int]:
    """The previous and the current prompt's lengths as an instance that
    sees every prompt ``backoff`` tokens short has them."""
    return max(prev_len - backoff, 0), prompt_len - backoff


# --- geometry-derived settings ------------------------------------------------------


def exact_budget(block: int) -> int:
    """A prefill budget (--max-num-batched-tokens) that cuts a hit on a block
    boundary and its recompute into the same chunks from that boundary on:
    one block. In Mamba "align" mode every chunk ends on a block boundary
    (v1/core/sched/scheduler.py Scheduler._mamba_block_aligned_split), so
    with one block a step every chunk after a boundary is that block,
    whether the request restored the prefix before it or computed it."""
    return block


def partial_unit(block: int) -> int:
    """A prefix match unit finer than ``block`` that vLLM accepts with it:
    the largest power of two below the block that divides it (every KV
    cache group's block must be a multiple of the unit:
    v1/core/kv_cache_utils.py resolve_kv_cache_block_sizes)."""
    unit = block & -block
    if unit == block:
        unit //= 2
    if unit < 1:
        raise ValueError(f"no prefix match unit below a block of {block}")
    return unit


# --- drafters ----------------------------------------------------------------------


@dataclass(frozen=True)
class Drafting:
    """What a drafter changes in an instance's prefix cache: whether every
    lookup drops its trailing hit unit (and the prompt-end checkpoint sits
    one unit lower), and how many tokens past a block its hash covers
    (``lookahead``; then nothing is dropped)."""

    drops_unit: bool = False
    lookahead: int = 0


def _declared(cls: type, fields: Mapping):
    """An instance of vLLM config dataclass ``cls`` holding its defaults and
    ``fields``, as declared: no validation, no ``__post_init__`` (which
    would load a draft model)."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - set(names))
    if unknown:
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


def _lookahead_count(speculative) -> int:
    """How far past a block the drafter reads in prefill
    (``VllmConfig.num_prefill_lookahead_tokens``): 0.34 asks the method's
    speculator config (v1/worker/gpu/spec_decode/speculator_config.py),
    0.33 the VllmConfig property itself (config/vllm.py)."""
    from vllm.config import VllmConfig

    if hasattr(type(speculative), "speculator_config"):
        return speculative.speculator_config.num_prefill_lookahead_tokens
    stand_in = SimpleNamespace(
        speculative_config=speculative,
        num_speculative_tokens=speculative.num_speculative_tokens,
    )
    return VllmConfig.num_prefill_lookahead_tokens.fget(stand_in)


def _connector_hashes_lookahead(kv_config: Mapping) -> bool:
    """0.34: whether the instance's KV connector declares that it keeps
    block hashes with lookahead (KVConnectorBase_V1.
    supports_lookahead_block_hashes; a MultiConnector, when all its
    children do), as config/vllm.py VllmConfig.
    _resolve_num_hash_lookahead_tokens asks it."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    config = KVTransferConfig(**kv_config)
    return KVConnectorFactory.get_connector_class(
        config
    ).supports_lookahead_block_hashes(config)


def drafting(
    spec: Mapping | None,
    *,
    kv_config: Mapping | None = None,
    prefix_caching: bool = True,
) -> Drafting:
    """What the drafter of speculative config ``spec`` (None: none) changes
    for an instance with KV connector ``kv_config`` in the vLLM under test.

    The drop: ``SpeculativeConfig.use_eagle_block_drop()``
    (config/speculative.py), which Scheduler.__init__
    (v1/core/sched/scheduler.py) and the Mamba checkpoint code read, or
    ``use_eagle()`` where a release has no such method (0.26). 0.32 drops a
    unit for every EAGLE-style drafter, 0.33 no longer for DSpark and DFlash
    (``needs_eagle_block_drop``).

    The lookahead hashes, where a drafter would drop a unit: 0.32 has none;
    0.33 hashes ``num_prefill_lookahead_tokens`` past each block with prefix
    caching and no KV connector (the VllmConfig.num_hash_lookahead_tokens
    property); 0.34 also behind a connector that declares it
    (:func:`_connector_hashes_lookahead`). Read here from those pieces, not
    from 0.34's resolver, so that a resolver that stops honouring a
    connector's declaration shows against this. Where there is a lookahead,
    the scheduler turns the drop off.
    """
    if spec is None:
        return Drafting()
    from vllm.config import VllmConfig
    from vllm.config.speculative import SpeculativeConfig

    speculative = _declared(SpeculativeConfig, spec)
    # Releases before use_eagle_block_drop (0.26) drop for every EAGLE-style
    # drafter: Scheduler.__init__ reads use_eagle() itself.
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
    if kv_config is not None and not (
        per_connector and _connector_hashes_lookahead(kv_config)
    ):
        return Drafting(drops_unit=True)
    if not prefix_caching and not (per_connector and kv_config is not None):
        return Drafting(drops_unit=True)
    lookahead = _lookahead_count(speculative)
    return Drafting(drops_unit=not lookahead, lookahead=lookahead)


def drops_unit(
    spec: Mapping | None, *, kv_connector: Mapping | None = None, prefix_caching=True
) -> bool:
    """:func:`drafting`'s drop alone."""
    rule = drafting(spec, kv_config=kv_connector, prefix_caching=prefix_caching)
    return rule.drops_unit


# --- checkpoints and hits ----------------------------------------------------------


def prompt_end_checkpoint(
    prompt_len: int, unit: int, drops_unit: bool, lookahead: int = 0
) -> int:
    """Where vLLM saves the Mamba state at the end of a ``prompt_len``-token
    prefill, which is also the deepest hit a later request can resume at.

    From v1/kv_cache_interface.py, get_mamba_prefill_checkpoint_position
    (``unit`` is the hit unit, vLLM's cache_hit_alignment_tokens): the last
    unit boundary that leaves the last token to recompute for its logits,
    and from 0.33 ``lookahead`` tokens for the boundary's hash; with an
    EAGLE-style drafter that drops a unit, the last unit boundary within the
    prompt, one unit lower (the lookup in v1/core/kv_cache_coordinator.py
    reads that unit as the drafter's proof and drops it).
    """
    limit = prompt_len if drops_unit else prompt_len - max(1, lookahead)
    checkpoint = limit // unit * unit
    if drops_unit:
        checkpoint -= unit
    return max(checkpoint, 0)


def expected_cached(
    prev_len: int, unit: int, drops_unit: bool, lookahead: int = 0
) -> int:
    """The hit a turn must reach: the prompt-end checkpoint of the previous
    prompt of ``prev_len`` tokens (0 on the first turn)."""
    if prev_len <= 0:
        return 0
    return prompt_end_checkpoint(prev_len, unit, drops_unit, lookahead)


def expected_resend(
    prompt_len: int, unit: int, drops_unit: bool, lookahead: int = 0
) -> int:
    """The hit of an exact resend of a ``prompt_len``-token prompt: its own
    prompt-end checkpoint. With DSpark dropping a unit and unit 128, 7449
    tokens hit 7296."""
    return prompt_end_checkpoint(prompt_len, unit, drops_unit, lookahead)


def decode_checkpoint(
    prompt_len: int, decoded: int, block: int, interval: int | None
) -> int:
    """The deepest state that the decode of a ``prompt_len``-token request
    leaves in the prefix cache, after ``decoded`` generated tokens were
    computed (a request of max_tokens N computes N - 1 of them), under
    ``--prefix-cache-retention-interval`` ``interval``; 0 where it leaves
    none past its prompt.

    A synchronous scheduler caches a decoding request's full blocks as its
    steps are allocated (v1/core/kv_cache_manager.py
    KVCacheManager.allocate_slots, ``num_tokens_to_cache``; from 0.34 also
    Scheduler.update_from_output after each step). Whether a Mamba group
    keeps the state at such a block boundary is its retention
    (v1/core/single_type_kv_cache_manager.py MambaManager.
    reachable_block_mask, config/cache.py prefix_cache_retention_interval):
    with 0, vLLM's default, only the prompt's replay boundaries
    (v1/core/kv_cache_coordinator.py replay_boundaries), so none; with
    None or an interval of one scheduler ``block``, every block; with a
    larger interval, its multiples."""
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
    """(the hit a turn must reach, what its salt stored before) where the
    previous request of ``prev_len`` prompt tokens also decoded ``decoded``
    tokens that this turn's prompt shares, under retention ``interval``
    (:func:`decode_checkpoint`): its prompt-end checkpoint, or the deepest
    state its decode left where that is deeper."""
    prompt = expected_cached(prev_len, unit, drafter.drops_unit, drafter.lookahead)
    decode = decode_checkpoint(prev_len, decoded, block, interval)
    return max(prompt, decode), max(prev_len, decode)


def hit_bound(prev_len: int, prompt_len: int, unit: int) -> int:
    """The largest hit that can be real: the last unit boundary within both
    what this salt stored before (``prev_len``: the previous prompt, and any
    of its decoded tokens whose state was kept) and the current prompt minus
    its last token."""
    return min(prev_len, prompt_len - 1) // unit * unit


def impossible_hit(cached: int, prev_len: int, prompt_len: int, unit: int) -> str:
    """Why ``cached`` cannot be a real hit, or "" if it can.

    A hit lands on a ``unit`` boundary, cannot reach past what this salt's
    earlier requests stored (``prev_len``, as :func:`hit_bound` has it), and
    always leaves at least the last prompt token to compute.
    """
    if cached % unit:
        return f"cached {cached} is not a multiple of the hit unit {unit}"
    if cached > prev_len:
        return f"cached {cached} exceeds the previous prompt's {prev_len} tokens"
    if cached >= prompt_len:
        return f"cached {cached} leaves nothing of the {prompt_len}-token prompt"
    return ""


def expectation(
    turn: PlannedTurn,
    unit: int,
    drops_unit: bool,
    backoff: int = 0,
    lookahead: int = 0,
) -> tuple[int, int]:
    """(expected hit, largest possible hit) of ``turn``, on an instance that
    sees every prompt ``backoff`` tokens short."""
    prev_len, prompt_len = seen_lengths(turn.prev_len, turn.prompt_len, backoff)
    return (
        expected_cached(prev_len, unit, drops_unit, lookahead),
        hit_bound(prev_len, prompt_len, unit),
    )

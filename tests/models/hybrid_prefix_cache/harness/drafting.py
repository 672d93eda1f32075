# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whether a drafter makes the prefix cache drop its trailing hit unit, as
the installed vLLM decides it, not as one release once did.

vLLM 0.32.0 drops a unit for every EAGLE-style drafter (DSpark and DFlash
included); 0.33.0 drops none for DSpark and DFlash, and for EAGLE, EAGLE3
and MTP hashes lookahead tokens instead, unless a KV connector is on. The
harness therefore asks the installed vLLM's own methods, the ones its
scheduler and its Mamba checkpoint code call, on the speculative config a
deployment declares (``--speculative-config``):

- ``SpeculativeConfig.use_eagle_block_drop()`` (vllm/config/speculative.py),
  read by ``Scheduler.__init__`` (v1/core/sched/scheduler.py) and by
  ``MambaPrefillCheckpoint`` (model_executor/layers/mamba/checkpoint.py);
- where the release has it, ``VllmConfig.num_hash_lookahead_tokens``
  (vllm/config/vllm.py): when it is not 0, the scheduler turns the drop off
  and every block hash covers that many tokens past the block.

The config is built as declared, from the dataclass defaults and the
deployment's keys, without ``__post_init__``, which would load the draft
model: the methods above read only the declared fields. The scheduler tier
checks the answer against what vLLM's scheduler then does, so a scheduler
that stops honouring its config still fails there.
"""

import dataclasses
from collections.abc import Mapping
from types import SimpleNamespace


def _declared(cls: type, fields: Mapping):
    """An instance of vLLM config dataclass ``cls`` holding its defaults and
    ``fields``, as declared: no validation, no ``__post_init__``."""
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


def _lookahead(speculative, prefix_caching: bool, kv_connector: bool) -> int:
    """``VllmConfig.num_hash_lookahead_tokens`` on a config with
    ``speculative``, or 0 where the release has no lookahead hashes."""
    from vllm.config import VllmConfig

    rule = getattr(VllmConfig, "num_hash_lookahead_tokens", None)
    if not isinstance(rule, property):
        return 0  # vLLM 0.32: no lookahead hashes

    class _Unmodelled:
        # The count itself comes from the draft model's config
        # (VllmConfig.num_prefill_lookahead_tokens), which is not loaded here.
        @property
        def num_prefill_lookahead_tokens(self) -> int:
            raise NotImplementedError(
                f"vLLM hashes lookahead tokens for the {speculative.method!r} "
                "drafter (vllm/config/vllm.py, VllmConfig.num_hash_lookahead_"
                "tokens): the harness's expected hits do not model them yet"
            )

    config = _Unmodelled()
    config.__dict__.update(
        speculative_config=speculative,
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
        kv_transfer_config=object() if kv_connector else None,
    )
    return rule.fget(config)


def drops_unit(
    spec: Mapping | None, *, kv_connector: bool = False, prefix_caching: bool = True
) -> bool:
    """Whether the installed vLLM drops the trailing hit unit of every
    prefix-cache lookup, and saves the prompt-end Mamba checkpoint one unit
    lower, for an instance with speculative config ``spec`` (None: no
    drafter), with or without a KV connector.

    Raises NotImplementedError where vLLM would hash lookahead tokens
    instead, which the expected hits do not model.
    """
    if spec is None:
        return False
    from vllm.config.speculative import SpeculativeConfig

    speculative = _declared(SpeculativeConfig, spec)
    drop = speculative.use_eagle_block_drop()
    # Scheduler.__init__ (0.33): lookahead hashes prove the boundary token,
    # so the drop is turned off; checkpoint.py follows the same config.
    return drop and not _lookahead(speculative, prefix_caching, kv_connector)

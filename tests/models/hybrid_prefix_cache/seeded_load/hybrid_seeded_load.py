# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The load format ``hybrid_seeded``: seeded weights like the tiny model's, with no
checkpoint on disk, where dummy weights hide the recurrent state
(findings/tiny-hybrid-state.md). Values depend on seed and name only, so ranks agree."""

import zlib

import torch
from torch import nn

LOAD_FORMAT = "hybrid_seeded"
SEED = 1234
STD = 0.02
DECAY_RATE_RANGE = (0.001, 0.1)
LM_HEAD_GAIN = 10.0


def _neutral_norm(module: nn.Module, weight: nn.Parameter) -> float:
    """1, or 0 for a (1 + weight) norm such as Qwen3-Next's: tried at zero."""
    forward = getattr(module, "forward_native", module.forward)
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.zero_()
            x = torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device)
            out = forward(x)
            out = out[0] if isinstance(out, tuple) else out
        return 0.0 if bool(out.abs().sum() > 0) else 1.0
    except Exception:
        return 1.0
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def seeded_values(
    name: str, param: torch.Tensor, owner: nn.Module, seed: int = SEED
) -> torch.Tensor | None:
    """``param``'s seeded float32 values, drawn on its device (a large model
    would not fit twice in host memory); None where not floating point."""
    if not param.is_floating_point():
        return None
    salt = zlib.crc32(name.encode())
    generator = torch.Generator(device=param.device).manual_seed(seed ^ salt)
    leaf = name.rsplit(".", 1)[-1]
    empty = torch.empty(tuple(param.shape), dtype=torch.float32, device=param.device)
    if leaf == "A_log":
        return empty.uniform_(*DECAY_RATE_RANGE, generator=generator).log()
    if param.dim() <= 1:
        if "norm" in type(owner).__name__.lower() and leaf == "weight":
            return empty.fill_(_neutral_norm(owner, param))
        return empty.zero_()  # biases, dt_bias: the initializers' zeros
    values = empty.normal_(0.0, STD, generator=generator)
    if name.split(".")[0] == "lm_head":
        values *= LM_HEAD_GAIN
    return values


def seeded_init(model: nn.Module, seed: int = SEED) -> int:
    """Set each parameter to :func:`seeded_values`; return how many."""
    owners = {
        f"{prefix}.{leaf}" if prefix else leaf: module
        for prefix, module in model.named_modules()
        for leaf, _ in module.named_parameters(recurse=False)
    }
    count = 0
    for name, param in model.named_parameters():
        values = seeded_values(name, param, owners[name], seed)
        if values is not None:
            with torch.no_grad():
                param.copy_(values.to(dtype=param.dtype))
            count += 1
    return count


def register() -> None:
    """The general plugin (vllm/plugins/__init__.py load_general_plugins, by this
    folder's dist-info): register the load format (maybe called twice)."""
    import vllm.model_executor.model_loader as model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class SeededModelLoader(DummyModelLoader):
        def load_weights(self, model: nn.Module, model_config) -> None:
            super().load_weights(model, model_config)
            seeded_init(model)

    if LOAD_FORMAT not in getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {}):
        model_loader.register_model_loader(LOAD_FORMAT)(SeededModelLoader)

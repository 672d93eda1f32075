# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The load format ``hybrid_seeded``: any config served with weights like the
suite's tiny model's, seeded, under which a wrong recurrent state shows,
and no checkpoint on disk (a B200 run of Kimi-K3 has only its config).

vLLM's ``--load-format dummy`` draws every weight from U(-1e-3, 1e-3), which
makes the recurrent state numerically invisible: a 10% error in every
restored state moved nothing (test_sensitivity.py; on an H200 too). Here
every weight is drawn as an initializer draws it (N(0, STD)), norms are
neutral, and the state is made to matter as tiny_hybrid.py makes it: each
linear-attention head's decay rate from DECAY_RATE_RANGE, a memory of 10 to
1000 tokens, and an lm_head of LM_HEAD_GAIN times the scale, a next-token
distribution as peaked as a trained model's. Each parameter's values depend
on the seed and its name alone, so every rank and every run draws them alike.

A server takes it with its folder first on PYTHONPATH: the folder's
``hybrid_seeded_load-0.dist-info`` declares :func:`register` a vLLM general
plugin (vllm/plugins/__init__.py load_general_plugins, called by the engine
core and by each worker), which registers the loader by name
(vllm/model_executor/model_loader/__init__.py register_model_loader).
"""

import zlib

import torch
from torch import nn

LOAD_FORMAT = "hybrid_seeded"
SEED = 1234
STD = 0.02
DECAY_RATE_RANGE = (0.001, 0.1)
LM_HEAD_GAIN = 10.0


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(name.encode()))


def _neutral_norm(module: nn.Module, weight: nn.Parameter) -> float:
    """The weight that leaves ``module``, a norm, neutral: 1 where it scales
    by its weight, 0 where it scales by one plus it (Gemma-style, as
    Qwen3-Next's), found by running it with a zero weight."""
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
    """What ``param`` (of ``owner``, named ``name`` in the model) is set to,
    in float32 on its device (drawn there: a large model's weights would not
    fit twice in host memory); None for a parameter that is not floating
    point (quantized scales and indices keep what the dummy loader drew)."""
    if not param.is_floating_point():
        return None
    device = param.device
    generator = _generator(name, seed, device)
    shape = tuple(param.shape)
    leaf = name.rsplit(".", 1)[-1]
    empty = torch.empty(shape, dtype=torch.float32, device=device)
    if leaf == "A_log":
        low, high = DECAY_RATE_RANGE
        return empty.uniform_(low, high, generator=generator).log()
    if param.dim() <= 1:
        if "norm" in type(owner).__name__.lower() and leaf == "weight":
            return empty.fill_(_neutral_norm(owner, param))
        return empty.zero_()  # biases, dt_bias: the initializers' zeros
    values = empty.normal_(0.0, STD, generator=generator)
    if name.split(".")[0] == "lm_head":
        values *= LM_HEAD_GAIN
    return values


def seeded_init(model: nn.Module, seed: int = SEED) -> int:
    """Set every floating-point parameter of ``model`` to its
    :func:`seeded_values`; returns how many were set."""
    owners = {
        f"{prefix}.{leaf}" if prefix else leaf: module
        for prefix, module in model.named_modules()
        for leaf, _ in module.named_parameters(recurse=False)
    }
    count = 0
    for name, param in model.named_parameters():
        values = seeded_values(name, param, owners[name], seed)
        if values is None:
            continue
        with torch.no_grad():
            param.copy_(values.to(dtype=param.dtype))
        count += 1
    return count


def register() -> None:
    """Register the load format with the vLLM of this process (a vLLM
    general plugin; called once per process, maybe more)."""
    import vllm.model_executor.model_loader as model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class SeededModelLoader(DummyModelLoader):
        """The dummy loader's model, then :func:`seeded_init` over it."""

        def load_weights(self, model: nn.Module, model_config) -> None:
            super().load_weights(model, model_config)
            seeded_init(model)

    if LOAD_FORMAT not in getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {}):
        model_loader.register_model_loader(LOAD_FORMAT)(SeededModelLoader)

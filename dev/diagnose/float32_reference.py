# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which side of a hit/recompute logprob gap is wrong? (not a test)

    dev/suite.sh reference RECORD.json [MODEL_DIR]

Runs every turn of a case record whose hit and recompute both answered through
the model in float32 (sensitivity.reference_logprobs; the CPU tier's model unless
MODEL_DIR holds one) and prints each side's distance per sampled token. Rounding
puts both sides equally far from it; a wrongly restored state, the hit alone.
How to read it: findings/unit-minus1.md.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from sensitivity import load_model, reference_logprobs

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

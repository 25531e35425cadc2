"""A separate engine process for the KV tier tests (restart, sharing, PYTHONHASHSEED): not a test module.

    python tests/unit/kv_tier_child.py SPEC [--prompt-seed S] [--prompt-len N] [--block-size B] [--weights-seed W]

serves one long seeded prompt (greedy, 8 tokens) on a fresh engine whose tier is SPEC (a directory or a redis://
URL) and prints one JSON line: the output token ids, the tier's counters, prefill tokens computed vs loaded, and the
tier keys of the prompt's blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=800)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--weights-seed", type=int, default=None, help="random weights of the bundled shapes")
    args = ap.parse_args()

    from minienv.engine import InferenceEngine
    from minienv.kv_tier import block_keys
    from minienv.model import LlamaModel, load_model, random_weights
    from minienv.sampling import SamplingParams
    from minienv.tokenizer import load_tokenizer

    model = load_model()
    if args.weights_seed is not None:
        model = LlamaModel(model.config, random_weights(model.config, seed=args.weights_seed))
    prompt = [int(t) for t in np.random.default_rng(args.prompt_seed).integers(0, 2000, args.prompt_len)]
    engine = InferenceEngine(model, load_tokenizer(), block_size=args.block_size, kv_tier=args.spec)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    stats = engine.kv_tier.stats
    print(json.dumps({
        "token_ids": list(out.token_ids),
        "stats": dataclasses.asdict(stats),
        "prompt_tokens": len(prompt),
        "prefill_loaded": stats.hit_tokens,
        "prefill_computed": len(prompt) - stats.hit_tokens - engine.kv_cache_manager.prefix_stats.hits,
        "keys": [k.hex() for k in block_keys(prompt, args.block_size, engine.kv_tier.fingerprint)],
        "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
    }))


if __name__ == "__main__":
    main()

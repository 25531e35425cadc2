"""``python -m minienv "To be, or not to be"`` — stream a continuation from the bundled model.

Bad arguments exit with status 2 and a usage message on stderr (argparse's convention); a request the model
cannot serve (missing files, prompt too long) exits with status 1 and a one-line ``minienv: error:`` message.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minienv",
        description="Continue a prompt with minienv's numpy Llama, streaming tokens to stdout.",
    )
    p.add_argument("prompt", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=100, help="most tokens to generate (default: 100)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1 = off (default: 0)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass in (0, 1] (default: 0.95)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="model directory with config.json + model.safetensors (default: bundled assets/target)")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="FILE",
                   help="tokenizer.json (default: bundled assets/tokenizer.json)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (slow)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    from minienv.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))  # exits 2

    from minienv.generate import TextStream, generate
    from minienv.model import load_model
    from minienv.tokenizer import load_tokenizer

    try:
        model = load_model(args.model)
        tokenizer = load_tokenizer(args.tokenizer)
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}")
        tokens = generate(model, tokenizer, args.prompt, params, use_cache=not args.no_cache)
        stream = TextStream(tokenizer.decode)
        for token in tokens:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
    except (OSError, ValueError) as exc:
        print(f"minienv: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

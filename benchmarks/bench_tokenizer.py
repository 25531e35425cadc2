"""Tokenizer throughput: minienv's pure-Python BPE vs Hugging Face `tokenizers` (Rust) on the corpus.

    python benchmarks/bench_tokenizer.py [--corpus /tmp/minienv-corpus] [--repeats 3]

Both encode the same text with the same `assets/tokenizer.json` and must produce the same ids (checked). Three
numbers for minienv: the *cold* pass (empty pre-token cache: every distinct word runs BPE once), the *warm* pass
(cache filled: the steady state of a serving process), and the cost of training the tokenizer. For `tokenizers`:
one long string (single-threaded) and `encode_batch` over paragraphs (uses every core). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.tokenizer import BPETokenizer, load_tokenizer  # noqa: E402


def corpus_text(folder: Path | None) -> str:
    default = [Path.home() / ".cache/minienv/corpus-prepared", Path("/tmp/minienv-corpus")]
    candidates = [folder] if folder else default
    for c in candidates:
        if c and (c / "train.txt").is_file():
            return (c / "train.txt").read_text(encoding="utf-8")
    sys.exit("corpus not found: run  python training/prepare_corpus.py  first (or pass --corpus DIR)")


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    text = corpus_text(args.corpus)
    path = REPO / "assets" / "tokenizer.json"

    def cold():
        tok = load_tokenizer(path)  # fresh cache
        return tok.encode(text)

    t_cold, ids = best_of(cold, args.repeats)
    tok = load_tokenizer(path)
    tok.encode(text)
    t_warm, ids_warm = best_of(lambda: tok.encode(text), args.repeats)
    assert ids == ids_warm
    n = len(ids)
    out = {"bench": "tokenizer", "corpus_chars": len(text), "tokens": n, "tokens_per_char": round(n / len(text), 4),
           "cpu_count": os.cpu_count(),
           "minienv_cold_tok_per_s": round(n / t_cold), "minienv_warm_tok_per_s": round(n / t_warm)}
    print(f"corpus: {len(text):,} chars -> {n:,} tokens ({n / len(text):.3f} tokens/char)")
    print(f"minienv  cold cache : {n / t_cold:12,.0f} tok/s  ({t_cold:.2f}s)")
    print(f"minienv  warm cache : {n / t_warm:12,.0f} tok/s  ({t_warm:.2f}s)")
    t_train, _ = best_of(lambda: BPETokenizer.train(text, 2048), 1)
    out["minienv_train_seconds_vocab2048"] = round(t_train, 2)
    print(f"minienv  train (vocab 2048): {t_train:.1f}s")
    try:
        import tokenizers
    except ImportError:
        print("tokenizers not installed: minienv numbers only")
    else:
        hf = tokenizers.Tokenizer.from_file(str(path))
        t_one, enc = best_of(lambda: hf.encode(text, add_special_tokens=False).ids, args.repeats)
        paragraphs = text.split("\n\n")
        t_batch, batch = best_of(lambda: hf.encode_batch(paragraphs, add_special_tokens=False), args.repeats)
        same = enc == ids
        print(f"tokenizers one string: {n / t_one:12,.0f} tok/s  ({t_one:.2f}s)   same ids: {same}")
        print(f"tokenizers encode_batch: {n / t_batch:10,.0f} tok/s  ({t_batch:.2f}s, {len(paragraphs):,} paragraphs)")
        print(f"ratio minienv warm / tokenizers one string: {t_one / t_warm:.2f}x; "
              f"/ encode_batch: {t_batch / t_warm:.2f}x")
        out.update({"tokenizers_version": tokenizers.__version__, "same_ids": same,
                    "tokenizers_tok_per_s": round(n / t_one), "tokenizers_batch_tok_per_s": round(n / t_batch),
                    "ratio_minienv_warm_over_tokenizers": round(t_one / t_warm, 3),
                    "ratio_minienv_warm_over_tokenizers_batch": round(t_batch / t_warm, 3)})
        if not same:
            print(json.dumps(out))
            return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

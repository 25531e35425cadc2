"""Tokenizer throughput: minienv's pure-Python BPE vs Hugging Face `tokenizers` (Rust) on the corpus.

    python benchmarks/bench_tokenizer.py [--corpus /tmp/minienv-corpus] [--rounds 3]
    python benchmarks/bench_tokenizer.py --quick     # this repository's docs as the text: a smoke run

Both encode the same text with the same `assets/tokenizer.json` and must produce the same ids (checked). Three
numbers for minienv: the *cold* pass (empty pre-token cache: every distinct word runs BPE once), the *warm* pass
(cache filled: the steady state of a serving process), and the cost of training the tokenizer. For `tokenizers`:
one long string (single-threaded) and `encode_batch` over paragraphs (uses every core). The encoders run in
interleaved rounds in a balanced order (``benchmarks/_common.py``); min and median reported, rates from the
minima; training is timed once (it is not compared with anything). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

from _common import add_common_args, emit_json, interleaved, print_settings, rounds_of  # noqa: E402

from minienv.tokenizer import BPETokenizer, load_tokenizer  # noqa: E402


def corpus_text(folder: Path | None, quick: bool) -> tuple[str, str]:
    """(text, where it came from): the prepared training corpus, or with ``quick`` this repository's docs."""
    if quick and folder is None:
        files = [REPO / "README.md", REPO / "docs" / "ARCHITECTURE.md", REPO / "CONTRIBUTING.md"]
        return "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file()), "README + docs (--quick)"
    default = [Path.home() / ".cache/minienv/corpus-prepared", Path("/tmp/minienv-corpus")]
    candidates = [folder] if folder else default
    for c in candidates:
        if c and (c / "train.txt").is_file():
            return (c / "train.txt").read_text(encoding="utf-8"), str(c / "train.txt")
    sys.exit("corpus not found: run  python training/prepare_corpus.py  first (or pass --corpus DIR, or --quick)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path)
    add_common_args(ap, rounds=3)
    args = ap.parse_args(argv)
    rounds = rounds_of(args)
    settings = print_settings()
    text, source = corpus_text(args.corpus, args.quick)
    path = REPO / "assets" / "tokenizer.json"
    warm_tok = load_tokenizer(path)
    warm_tok.encode(text)  # fill the pre-token cache: the steady state of a serving process
    variants = {"cold": lambda: load_tokenizer(path).encode(text),  # a fresh cache every call
                "warm": lambda: warm_tok.encode(text)}
    try:
        import tokenizers
    except ImportError:
        tokenizers = None
        print("tokenizers not installed: minienv numbers only")
    else:
        hf = tokenizers.Tokenizer.from_file(str(path))
        paragraphs = text.split("\n\n")
        variants["hf_one"] = lambda: hf.encode(text, add_special_tokens=False).ids
        variants["hf_batch"] = lambda: hf.encode_batch(paragraphs, add_special_tokens=False)
    t = interleaved(variants, rounds=rounds, seed=args.seed)
    ids = t["cold"].result
    assert ids == t["warm"].result, "cold and warm encodings differ"
    n = len(ids)
    t_cold, t_warm = t["cold"].min, t["warm"].min
    out = {"benchmark": "bench_tokenizer", "corpus": source, "quick": args.quick, "rounds": rounds,
           "corpus_chars": len(text), "tokens": n, "tokens_per_char": round(n / len(text), 4),
           "seconds": {k: v.as_dict() for k, v in t.items()},
           "minienv_cold_tok_per_s": round(n / t_cold), "minienv_warm_tok_per_s": round(n / t_warm)}
    print(f"corpus: {source}, {len(text):,} chars -> {n:,} tokens ({n / len(text):.3f} tokens/char); {rounds} rounds")
    print(f"minienv  cold cache : {n / t_cold:12,.0f} tok/s  ({t_cold:.3f}s min, {t['cold'].median:.3f}s median)")
    print(f"minienv  warm cache : {n / t_warm:12,.0f} tok/s  ({t_warm:.3f}s min, {t['warm'].median:.3f}s median)")
    vocab = 300 if args.quick else 2048
    t0 = time.perf_counter()
    BPETokenizer.train(text, vocab)
    t_train = time.perf_counter() - t0
    out[f"minienv_train_seconds_vocab{vocab}"] = round(t_train, 2)
    print(f"minienv  train (vocab {vocab}, once): {t_train:.1f}s")
    same = True
    if tokenizers is not None:
        t_one, t_batch = t["hf_one"].min, t["hf_batch"].min
        same = t["hf_one"].result == ids
        print(f"tokenizers one string: {n / t_one:12,.0f} tok/s  ({t_one:.3f}s)   same ids: {same}")
        print(f"tokenizers encode_batch: {n / t_batch:10,.0f} tok/s  ({t_batch:.3f}s, {len(paragraphs):,} paragraphs)")
        print(f"ratio minienv warm / tokenizers one string: {t_one / t_warm:.2f}x; "
              f"/ encode_batch: {t_batch / t_warm:.2f}x")
        out.update({"tokenizers_version": tokenizers.__version__, "same_ids": same,
                    "tokenizers_tok_per_s": round(n / t_one), "tokenizers_batch_tok_per_s": round(n / t_batch),
                    "ratio_minienv_warm_over_tokenizers": round(t_one / t_warm, 3),
                    "ratio_minienv_warm_over_tokenizers_batch": round(t_batch / t_warm, 3)})
    emit_json(out, settings)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

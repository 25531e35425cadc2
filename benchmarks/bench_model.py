"""Decode speed of minienv's numpy Llama: with vs without the KV cache, and vs ``transformers`` generate.

    .venv/bin/python benchmarks/bench_model.py [--tokens 256] [--model DIR] [--rounds 3]
    .venv/bin/python benchmarks/bench_model.py --quick      # 16 tokens, no transformers: a smoke run

Greedy decoding of ``--tokens`` new tokens (end-of-text ignored, so every run generates exactly that many) from
the same prompt, on the bundled target model (``assets/target``). If the bundled model is not there yet, a random
checkpoint of the same shape is written to a temporary folder and used instead — the speed is the same, the text
is noise; the output says which. The decoders run in interleaved rounds (``benchmarks/_common.py``; a
balanced order), min and median reported; ratios use the minima. ``transformers`` runs in its fastest
configuration here, per torch thread count: a pre-race of ``sdpa`` / ``eager`` attention x dynamic / static KV
cache picks it (``benchmarks/_hf.py``). Prints a table of ratios and ends with exactly one JSON line
(``cache_speedup``: the KV cache vs recompute figure).

numpy's OpenBLAS runs with one thread by default here (``--blas-threads`` changes it): for matrices this small,
a second BLAS thread costs more in hand-off than it saves, and one thread is the fair match for torch threads=1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

from _common import add_common_args, emit_json, interleaved, print_settings, rounds_of, settle  # noqa: E402
from _hf import generate_variants, strongest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.generate import generate_ids  # noqa: E402
from minienv.model import LlamaConfig, load_model, random_weights, save_checkpoint  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402

# Same shape as training/train.py's "target" (used only when assets/target is missing).
STAND_IN = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                       rms_norm_eps=1e-5, tie_word_embeddings=True)
PROMPT = "To be, or not to be"


def resolve_model(arg: str | None) -> tuple[Path, str]:
    if arg:
        return Path(arg), f"model from {arg}"
    bundled = REPO / "assets" / "target"
    if (bundled / "model.safetensors").is_file():
        return bundled, "bundled assets/target"
    tmp = Path(tempfile.mkdtemp(prefix="minienv-bench-"))
    save_checkpoint(tmp, STAND_IN, random_weights(STAND_IN, seed=0, scale=0.05))
    return tmp, "RANDOM stand-in with assets/target's shape (bundled model not found; speeds comparable, text is noise)"


def prompt_ids(vocab_size: int) -> tuple[list[int], str]:
    tok_path = REPO / "assets" / "tokenizer.json"
    if tok_path.is_file():
        from minienv.tokenizer import load_tokenizer

        ids = load_tokenizer(tok_path).encode(PROMPT)
        if max(ids) < vocab_size:
            return ids, f"{PROMPT!r} via assets/tokenizer.json"
    return [int(b) for b in PROMPT.encode()], f"{PROMPT!r} as raw byte ids (no tokenizer)"


def minienv_decoder(model, ids: list[int], n: int, use_cache: bool):
    """A no-argument callable that decodes ``n`` greedy tokens and returns them."""
    params = SamplingParams(max_tokens=n, temperature=0)
    return lambda: list(generate_ids(model, ids, params, use_cache=use_cache, eos_token_id=None))


def transformers_decoder(model_dir: Path, ids: list[int], n: int, threads: int, rounds: int, seed: int):
    """The same through ``transformers`` generate (torch with ``threads`` threads) in its fastest configuration here
    (a pre-race, :mod:`_hf`): ``(callable, its name, the pre-race summary)``, or None if not installed."""
    try:
        import torch
    except ImportError:
        return None
    x = torch.tensor([ids])
    # An explicit all-ones mask: without one, generate() infers it from pad_token_id and would mask every prompt
    # token that happens to be id 0 (there is no padding here: one unpadded prompt).
    variants = generate_variants(model_dir, x, torch.ones_like(x), n, threads)
    if variants is None:
        return None
    print(f"torch threads={threads}:")
    chosen, summary = strongest(variants, rounds, seed, indent="  ")
    run = variants[chosen]
    return (lambda: run()[1][0]), chosen, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per run (default 256; 16 with --quick)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers even if installed")
    add_common_args(ap, rounds=3)
    args = ap.parse_args()
    rounds = rounds_of(args)
    settings = print_settings()

    model_dir, source = resolve_model(args.model)
    model = load_model(model_dir)
    ids, prompt_note = prompt_ids(model.config.vocab_size)
    n = args.tokens or (16 if args.quick else 256)
    print(f"model: {source}\n  {model}\nprompt: {prompt_note} ({len(ids)} tokens); greedy, {n} new tokens, "
          f"{rounds} interleaved rounds\n")

    names = {"cache": "minienv, KV cache", "nocache": "minienv, no cache (recompute all)"}
    variants = {"cache": minienv_decoder(model, ids, n, True), "nocache": minienv_decoder(model, ids, n, False)}
    hf_configs = {}
    if not (args.quick or args.no_transformers):
        for threads in (1, 2):
            found = transformers_decoder(model_dir, ids, n, threads, rounds, args.seed)
            if found is None:
                break
            variants[f"hf{threads}"], chosen, hf_configs[str(threads)] = found
            names[f"hf{threads}"] = f"transformers {chosen}, torch threads={threads}"
        print()
    t = interleaved(variants, rounds=rounds, seed=args.seed, before_each=settle)
    out_cache = t["cache"].result
    assert t["nocache"].result == out_cache, "cached and uncached greedy decoding disagree"
    hf = [k for k in t if k.startswith("hf")]
    agree = {k: next((i for i, (a, b) in enumerate(zip(out_cache, t[k].result)) if a != b), n) for k in hf}

    print(f"{'decoder':<44}{'min s':>9}{'median s':>10}{'tokens/s':>10}")
    for k, name in names.items():
        print(f"{name:<44}{t[k].min:>9.3f}{t[k].median:>10.3f}{n / t[k].min:>10.1f}")
    cache_speedup = t["nocache"].min / t["cache"].min
    print(f"\nKV cache speed-up (no-cache time / cache time, minima) at {n} tokens: {cache_speedup:.2f}x "
          f"(medians: {t['nocache'].median / t['cache'].median:.2f}x)")
    for k in hf:
        print(f"minienv (cached) / {names[k]} tokens/s: {t[k].min / t['cache'].min:.2f}x  "
              f"(greedy tokens identical for the first {agree[k]} of {n})")
    if not hf:
        print("transformers: skipped (" + ("--quick / --no-transformers" if args.quick or args.no_transformers
                                           else "torch/transformers not installed") + ")")

    emit_json({
        "benchmark": "bench_model",
        "model": "bundled" if source.startswith("bundled") else ("random_stand_in" if "RANDOM" in source else "custom"),
        "params": model.num_parameters,
        "new_tokens": n,
        "prompt_tokens": len(ids),
        "rounds": rounds,
        "quick": args.quick,
        "seconds": {k: t[k].as_dict() for k in t},
        "minienv_cache_tok_s": round(n / t["cache"].min, 1),
        "minienv_nocache_tok_s": round(n / t["nocache"].min, 1),
        "cache_speedup": round(cache_speedup, 2),
        "cache_speedup_median": round(t["nocache"].median / t["cache"].median, 2),
        "transformers_tok_s": {k[2:]: round(n / t[k].min, 1) for k in hf},
        "minienv_over_transformers": {k[2:]: round(t[k].min / t["cache"].min, 2) for k in hf},
        "greedy_prefix_agreement": {k[2:]: v for k, v in agree.items()},
        "transformers_configs": hf_configs,
    }, settings)


if __name__ == "__main__":
    main()

"""Decode speed of minienv's numpy Llama: with vs without the KV cache, and vs ``transformers`` generate.

    .venv/bin/python benchmarks/bench_model.py [--tokens 256] [--model DIR]

Greedy decoding of ``--tokens`` new tokens (end-of-text ignored, so every run generates exactly that many) from
the same prompt, on the bundled target model (``assets/target``). If the bundled model is not there yet, a random
checkpoint of the same shape is written to a temporary folder and used instead — the speed is the same, the text
is noise; the output says which. Prints a table of ratios and ends with exactly one JSON line.

numpy's OpenBLAS runs with one thread by default here (``--blas-threads`` changes it): for matrices this small,
a second BLAS thread costs more in hand-off than it saves, and one thread is the fair match for torch threads=1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

import numpy as np  # noqa: E402

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


def time_minienv(model, ids: list[int], n: int, use_cache: bool) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0)
    start = time.perf_counter()
    out = list(generate_ids(model, ids, params, use_cache=use_cache, eos_token_id=None))
    return time.perf_counter() - start, out


def time_transformers(model_dir: Path, ids: list[int], n: int, threads: int) -> tuple[float, list[int]] | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    torch.set_num_threads(threads)  # note: torch's own OpenMP pool, independent of OPENBLAS_NUM_THREADS
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    # An explicit all-ones mask: without one, generate() infers it from pad_token_id and would mask every prompt
    # token that happens to be id 0 (there is no padding here: one unpadded prompt).
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        hf.generate(x, **dict(kw, max_new_tokens=8, min_new_tokens=8))  # warm-up
        start = time.perf_counter()
        out = hf.generate(x, **kw)[0].tolist()[len(ids):]
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--model", default=None)
    ap.add_argument("--blas-threads", default="1", help="numpy OpenBLAS threads (default 1)")
    args = ap.parse_args()

    model_dir, source = resolve_model(args.model)
    model = load_model(model_dir)
    ids, prompt_note = prompt_ids(model.config.vocab_size)
    n = args.tokens
    print(f"model: {source}\n  {model}\nprompt: {prompt_note} ({len(ids)} tokens); greedy, {n} new tokens")
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, numpy {np.__version__} (BLAS threads {BLAS_THREADS})\n")

    time_minienv(model, ids, 8, True)  # warm-up
    t_cache, out_cache = time_minienv(model, ids, n, True)
    t_nocache, out_nocache = time_minienv(model, ids, n, False)
    assert out_cache == out_nocache, "cached and uncached greedy decoding disagree"

    rows = [("minienv, KV cache", t_cache), ("minienv, no cache (recompute all)", t_nocache)]
    hf_results: dict[int, float] = {}
    agree: dict[int, int] = {}
    for threads in (1, 2):
        res = time_transformers(model_dir, ids, n, threads)
        if res is None:
            break
        hf_results[threads] = res[0]
        agree[threads] = next((i for i, (a, b) in enumerate(zip(out_cache, res[1])) if a != b), n)
        rows.append((f"transformers generate, torch threads={threads}", res[0]))

    print(f"{'decoder':<44}{'seconds':>9}{'tokens/s':>10}")
    for name, t in rows:
        print(f"{name:<44}{t:>9.3f}{n / t:>10.1f}")
    cache_speedup = t_nocache / t_cache
    print(f"\nKV cache speed-up (no-cache time / cache time) at {n} tokens: {cache_speedup:.2f}x")
    for threads, t in hf_results.items():
        print(f"minienv (cached) / transformers (threads={threads}) tokens/s: {t / t_cache:.2f}x  "
              f"(greedy tokens identical for the first {agree[threads]} of {n})")
    if not hf_results:
        print("transformers/torch not installed: comparison skipped")

    result = {
        "benchmark": "bench_model",
        "model": "bundled" if source.startswith("bundled") else ("random_stand_in" if "RANDOM" in source else "custom"),
        "params": model.num_parameters,
        "new_tokens": n,
        "prompt_tokens": len(ids),
        "numpy_blas_threads": int(BLAS_THREADS),
        "minienv_cache_tok_s": round(n / t_cache, 1),
        "minienv_nocache_tok_s": round(n / t_nocache, 1),
        "cache_speedup": round(cache_speedup, 2),
        "transformers_tok_s": {str(k): round(n / v, 1) for k, v in hf_results.items()},
        "minienv_over_transformers": {str(k): round(v / t_cache, 2) for k, v in hf_results.items()},
        "greedy_prefix_agreement": {str(k): v for k, v in agree.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

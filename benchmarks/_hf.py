"""``transformers`` generate at its strongest on this machine: the baseline ``bench_model.py`` and ``bench_engine.py``
race minienv against.

A ratio against a baseline left at its defaults flatters if another setting of the same library is faster. So each
of those benchmarks builds every configuration of ``generate`` that could plausibly be faster for a 2 M-parameter
model on a CPU — attention through PyTorch's fused ``sdpa`` kernel (transformers' default) or the ``eager`` matmuls,
with the default growing (``dynamic``) KV cache or a preallocated ``static`` one — races them in a few interleaved
rounds (:func:`_common.race`), checks that all of them generate the same tokens, and keeps the fastest by median as
the baseline of its main race. The output prints the whole pre-race, so the choice can be checked.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

from _common import race

#: (attention implementation, KV cache implementation); the first is transformers' default.
CONFIGS = (("sdpa", "dynamic"), ("sdpa", "static"), ("eager", "dynamic"), ("eager", "static"))


def generate_variants(model_dir: Path, input_ids: Any, attention_mask: Any, n_new: int, threads: int
                      ) -> dict[str, Callable[[], tuple[float, list[list[int]]]]] | None:
    """One callable per :data:`CONFIGS` entry, ``run() -> (seconds, new token ids per row)``: greedy, exactly
    ``n_new`` tokens per row (no end-of-text stop), torch with ``threads`` threads. Each is warmed up once here.
    None if torch or transformers is not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    models = {impl: transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                  attn_implementation=impl).eval()
              for impl in dict(CONFIGS)}
    width = input_ids.shape[1]
    kw = dict(attention_mask=attention_mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
              pad_token_id=0, eos_token_id=None)

    def make(impl: str, cache: str) -> Callable[[], tuple[float, list[list[int]]]]:
        hf, extra = models[impl], ({} if cache == "dynamic" else {"cache_implementation": cache})

        def run() -> tuple[float, list[list[int]]]:
            torch.set_num_threads(threads)  # torch's own OpenMP pool, independent of OPENBLAS_NUM_THREADS
            with torch.no_grad():
                start = time.perf_counter()
                out = hf.generate(input_ids, **kw, **extra)
                seconds = time.perf_counter() - start
            return seconds, out[:, width:].tolist()

        torch.set_num_threads(threads)
        with torch.no_grad():  # warm-up: first-call costs (kernel selection, allocator) stay out of the race
            hf.generate(input_ids, **dict(kw, max_new_tokens=4, min_new_tokens=4), **extra)
        return run

    return {f"{impl}+{cache}": make(impl, cache) for impl, cache in CONFIGS}


def strongest(variants: dict[str, Callable[[], tuple[float, Any]]], rounds: int, seed: int, indent: str = "   "
              ) -> tuple[str, dict]:
    """Race ``variants`` (:func:`generate_variants`) for ``rounds`` interleaved rounds; print each one's min and
    median; return the fastest by median and a summary for the JSON line. Raises if their outputs differ: the
    variants are the same model, so a difference would be a broken baseline, not a faster one."""
    times, outs = race(variants, rounds, seed)
    first = next(iter(outs.values()))
    differ = [name for name, out in outs.items() if out != first]
    if differ:
        raise RuntimeError(f"transformers configurations disagree on the greedy tokens: {differ} vs "
                           f"{next(iter(outs))}")
    best = min(times, key=lambda name: statistics.median(times[name]))
    print(f"{indent}transformers configurations (attention+KV cache), {rounds} interleaved rounds, identical outputs:")
    for name, ts in times.items():
        print(f"{indent}  {name:<16}{min(ts):8.3f} s min {statistics.median(ts):8.3f} s median"
              f"{'   <- the baseline' if name == best else ''}")
    summary = {"chosen": best, "rounds": rounds,
               "seconds": {name: {"min": min(ts), "median": statistics.median(ts)} for name, ts in times.items()}}
    return best, summary

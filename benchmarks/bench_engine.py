"""The engine, side by side: continuous vs static batching, prefix caching on vs off, minienv vs ``transformers``.

    .venv/bin/python benchmarks/bench_engine.py [--model DIR] [--requests 48] [--blas-threads 1]

1. **Continuous vs static batching**, same mixed-length workload (``minienv.lab.workload``: log-normal prompt and
   output lengths, seeded), same budgets: generated tokens/s and engine steps. Static batching admits a batch of
   ``max_num_seqs`` and waits for its longest member; continuous refills a slot the step it frees. Two static
   baselines: **static** (faithful, ``static_padding=True``: a finished member keeps its row and computes one
   discarded token per step until the batch ends, like ``transformers.generate`` on a padded batch — what the
   Orca and vLLM papers compared against) and **static, charitable** (``static_padding=False``: finished members
   stop computing, so only the idle-slot loss remains). The must-show ratio is against the faithful one.
2. **Prefix caching on vs off**, a 5-shot workload: 16 requests = one shared 5-example prefix + their own question.
   Prompt tokens computed, time to first token, tokens/s.
3. **minienv's batched engine vs transformers ``generate``** on the same weights, 16 prompts x 64 new tokens,
   greedy, both batched (transformers with left padding). Skipped with a note if torch / transformers are missing.

Every run generates exactly the requested lengths (the end-of-text token is ignored, as benchmarks do). On the
bundled model when ``assets/target`` exists; otherwise a random stand-in of the same shape (speeds comparable,
text is noise; the output says which). Each comparison is one run of each side on the same workload. Ends with
exactly one JSON line.

numpy's OpenBLAS runs with one thread (``--blas-threads``): for matrices this small a second thread costs more in
hand-off than it saves (and under load it spins), and one thread is the fair match for ``torch.set_num_threads(1)``.
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

from minienv.engine import InferenceEngine, RequestOutput  # noqa: E402
from minienv.model import LlamaConfig, load_model, random_weights, save_checkpoint  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.lab.workload import LengthDistribution, WorkloadConfig, generate_workload, workload_stats  # noqa: E402

# training/train.py's "target" shape (used only when assets/target is missing).
STAND_IN = LlamaConfig(vocab_size=2048, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=48, max_position_embeddings=1024,
                       rms_norm_eps=1e-5, tie_word_embeddings=True)
#: Mixed lengths: short prompts, long-tailed outputs (a few requests generate ~4x the mean).
MIXED = WorkloadConfig("mixed", LengthDistribution(32.0, 0.6), LengthDistribution(48.0, 1.0))
FIVE_SHOT = [("What is the capital of France?", "Paris."), ("Who wrote Hamlet?", "William Shakespeare."),
             ("What is two plus two?", "Four."), ("What colour is the sky?", "Blue."),
             ("How many legs has a spider?", "Eight.")]
QUESTIONS = ["Who wrote Macbeth?", "What is the capital of Italy?", "What is three plus four?",
             "What colour is grass?", "How many legs has a cat?", "Who was Romeo's love?",
             "What is the capital of Spain?", "What colour is snow?", "How many days in a week?",
             "Who wrote King Lear?", "What is ten minus one?", "What colour is the sea?",
             "How many wheels has a bicycle?", "Who was Hamlet's father?", "What is the capital of Greece?",
             "What is five times two?"]


class ByteStandInTokenizer:
    """For the random stand-in only: UTF-8 bytes as ids, any id decodes to some character, no end-of-text."""

    eos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return "".join(chr(32 + i % 95) for i in ids)


def resolve(arg: str | None):
    """(model dir, model, tokenizer, note)."""
    if arg:
        from minienv.tokenizer import load_tokenizer

        return Path(arg), load_model(arg), load_tokenizer(), f"model from {arg}"
    bundled = REPO / "assets" / "target"
    if (bundled / "model.safetensors").is_file() and (REPO / "assets" / "tokenizer.json").is_file():
        from minienv.tokenizer import load_tokenizer

        return bundled, load_model(bundled), load_tokenizer(), "bundled assets/target"
    tmp = Path(tempfile.mkdtemp(prefix="minienv-bench-"))
    save_checkpoint(tmp, STAND_IN, random_weights(STAND_IN, seed=0, scale=0.05))
    return (tmp, load_model(tmp), ByteStandInTokenizer(STAND_IN.vocab_size),
            "RANDOM stand-in with assets/target's shape (bundled model not found; speeds comparable, text is noise)")


def make_engine(model, tok, **kw) -> InferenceEngine:
    e = InferenceEngine(model, tok, history_size=0, **kw)
    e.eos_token_id = None  # benchmarks generate exactly max_tokens per request
    return e


def timed(engine: InferenceEngine, prompts, params) -> tuple[float, list[RequestOutput]]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, outs


def mean(xs) -> float:
    return float(np.mean(list(xs)))


# ------------------------------------------------------------------------------------------------ 1
def bench_batching(model, tok, n_requests: int, max_num_seqs: int) -> dict:
    specs = generate_workload(n_requests, MIXED, max_len=min(384, model.config.max_position_embeddings), seed=0)
    rng = np.random.default_rng(0)
    vocab = min(getattr(tok, "vocab_size", 256), model.config.vocab_size)
    prompts = [list(map(int, rng.integers(0, vocab - 1, s.prompt_len))) for s in specs]
    params = [SamplingParams(max_tokens=s.output_len, temperature=0) for s in specs]
    ws = workload_stats(specs)
    budget = sum(s.total_len + 16 for s in specs)  # ample: this comparison is about batching, not memory
    kw = dict(kv_budget_tokens=budget, block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    make_engine(model, tok, **kw).generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    res = {}
    outs = {}
    modes = {"static": dict(scheduling="static"),
             "static-charit.": dict(scheduling="static", static_padding=False),
             "continuous": dict(scheduling="continuous")}
    for mode, mkw in modes.items():
        e = make_engine(model, tok, **mkw, **kw)
        t, outs[mode] = timed(e, prompts, params)
        st = e.stats
        n = st.num_generated_tokens
        res[mode] = dict(seconds=t, steps=st.num_steps, tokens=n, tok_s=n / t, computed=st.num_computed_tokens,
                         padding=st.num_padding_tokens, step_ms=1e3 * t / st.num_steps,
                         tokens_per_step=st.num_computed_tokens / st.num_steps,
                         ttft_steps=mean(o.metrics.ttft_steps for o in outs[mode]),
                         e2e_steps=mean(o.metrics.e2e_steps for o in outs[mode]))
    same = all([o.token_ids for o in outs[m]] == [o.token_ids for o in outs["continuous"]] for m in modes)
    s, ch, c = res["static"], res["static-charit."], res["continuous"]
    ratio, ratio_ch = c["tok_s"] / s["tok_s"], c["tok_s"] / ch["tok_s"]
    print(f"1. continuous vs static batching — {n_requests} requests, prompt len mean {ws['prompt_mean']:.0f} "
          f"(max {ws['prompt_max']:.0f}), output len mean {ws['output_mean']:.0f} (max {ws['output_max']:.0f}); "
          f"max_num_seqs={max_num_seqs}")
    print(f"   {'':<15}{'seconds':>8}{'steps':>7}{'tokens/s':>10}{'computed':>10}{'padding':>9}{'mean TTFT':>11}"
          f"{'mean e2e':>10}{'ms/step':>9}{'tok/step':>10}  (latencies in steps)")
    for mode in modes:
        r = res[mode]
        print(f"   {mode:<15}{r['seconds']:>8.2f}{r['steps']:>7}{r['tok_s']:>10.1f}{r['computed']:>10}{r['padding']:>9}"
              f"{r['ttft_steps']:>11.1f}{r['e2e_steps']:>10.1f}{r['step_ms']:>9.2f}{r['tokens_per_step']:>10.1f}")
    print(f"   continuous / static (faithful): {ratio:.2f}x tokens/s, {s['steps'] / c['steps']:.2f}x fewer steps "
          f"-> tokens/s >= 2x: {'yes' if ratio >= 2 else 'NO'}")
    print(f"   continuous / static (charitable): {ratio_ch:.2f}x tokens/s, {ch['steps'] / c['steps']:.2f}x fewer "
          f"steps; outputs identical in all three: {same}")
    print(f"   (\"computed\" = tokens through the model; \"padding\" = of them, finished members' discarded tokens.\n"
          f"    A CPU step's cost grows with the tokens in it: the charitable baseline's steps are nearly empty "
          f"({ch['step_ms']:.2f} ms/step\n    vs {c['step_ms']:.2f} continuous), so it loses far less in tokens/s than "
          f"in steps. Faithful static keeps every row of\n    the batch busy ({s['step_ms']:.2f} ms/step), so its "
          f"extra steps cost nearly in full. Not modelled, in static's favour:\n    prompts padded to the batch's "
          f"longest one.)")
    if ratio < 2:
        print(f"   Below 2x in this run: the faithful static's steps carry {s['tokens_per_step']:.1f} tokens against "
              f"continuous's\n    {c['tokens_per_step']:.1f} (continuous steps also hold the prefills of newly "
              f"admitted requests), and a CPU step costs per\n    token, so tokens/s gains less than the "
              f"{s['steps'] / c['steps']:.2f}x in steps; timing noise on a shared machine moves this ratio by\n"
              f"    several percent. The workload is not tuned to reach 2x.")
    print()
    return {"static_tok_s": round(s["tok_s"], 1), "continuous_tok_s": round(c["tok_s"], 1),
            "static_charitable_tok_s": round(ch["tok_s"], 1),
            "static_steps": s["steps"], "continuous_steps": c["steps"],
            "throughput_ratio": round(ratio, 2), "steps_ratio": round(s["steps"] / c["steps"], 2),
            "throughput_ratio_vs_charitable": round(ratio_ch, 2),
            "static_padding_tokens": s["padding"],
            "computed_tokens": {"static": s["computed"], "static_charitable": ch["computed"],
                                "continuous": c["computed"]},
            "ms_per_step": {"static": round(s["step_ms"], 2), "static_charitable": round(ch["step_ms"], 2),
                            "continuous": round(c["step_ms"], 2)},
            "outputs_identical": same}


# ------------------------------------------------------------------------------------------------ 2
def bench_prefix(model, tok, block_size: int = 16) -> dict:
    prefix = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in FIVE_SHOT)
    prompts = [prefix + f"Q: {q}\nA:" for q in QUESTIONS]
    params = SamplingParams(max_tokens=16, temperature=0)
    n_prefix = len(tok.encode(prefix))
    res = {}
    outs = {}
    for caching in (False, True):
        e = make_engine(model, tok, kv_budget_tokens=8192, block_size=block_size, enable_prefix_caching=caching,
                        max_num_seqs=16, max_num_batched_tokens=512)
        t, outs[caching] = timed(e, prompts, params)
        st = e.stats
        res[caching] = dict(seconds=t, tok_s=st.num_generated_tokens / t,
                            prefill=st.num_computed_tokens - st.num_generated_tokens + len(prompts),
                            hit_rate=st.prefix_cache_hit_rate, steps=st.num_steps,
                            ttft=mean(o.metrics.ttft for o in outs[caching]),
                            ttft_steps=mean(o.metrics.ttft_steps for o in outs[caching]))
    same = [o.token_ids for o in outs[False]] == [o.token_ids for o in outs[True]]
    off, on = res[False], res[True]
    print(f"2. prefix caching — 16 requests, a 5-shot prefix of {n_prefix} tokens + a question each, 16 new tokens")
    print(f"   {'':<12}{'seconds':>9}{'tokens/s':>10}{'prompt tok computed':>21}{'hit rate':>10}{'mean TTFT ms':>14}"
          f"{'TTFT steps':>12}")
    for name, r in (("cache off", off), ("cache on", on)):
        print(f"   {name:<12}{r['seconds']:>9.2f}{r['tok_s']:>10.1f}{r['prefill']:>21}{r['hit_rate']:>10.1%}"
              f"{1e3 * r['ttft']:>14.1f}{r['ttft_steps']:>12.1f}")
    print(f"   on / off: {on['tok_s'] / off['tok_s']:.2f}x tokens/s, {off['prefill'] / on['prefill']:.2f}x fewer prompt "
          f"tokens computed, {off['ttft'] / on['ttft']:.2f}x lower TTFT; outputs identical: {same}\n")
    return {"prefix_tokens": n_prefix, "off_tok_s": round(off["tok_s"], 1), "on_tok_s": round(on["tok_s"], 1),
            "throughput_ratio": round(on["tok_s"] / off["tok_s"], 2),
            "prompt_tokens_computed": {"off": off["prefill"], "on": on["prefill"]},
            "hit_rate": round(on["hit_rate"], 3), "ttft_ratio": round(off["ttft"] / on["ttft"], 2),
            "outputs_identical": same}


# ------------------------------------------------------------------------------------------------ 3
def bench_transformers(model_dir: Path, model, tok, n_new: int = 64) -> dict | None:
    try:
        import torch
        import transformers
    except ImportError:
        print("3. minienv vs transformers: SKIPPED (torch / transformers not installed)")
        return None
    prompts = [f"{q} " for q in QUESTIONS]
    ids = [tok.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=n_new, temperature=0)
    e = make_engine(model, tok, kv_budget_tokens=16 * (max(map(len, ids)) + n_new + 16), block_size=16,
                    max_num_seqs=16, max_num_batched_tokens=1024)
    make_engine(model, tok, kv_budget_tokens=1024).generate(ids[:2], SamplingParams(max_tokens=4, temperature=0))
    t_mini, outs = timed(e, ids, params)

    torch.set_num_threads(int(BLAS_THREADS))
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(map(len, ids))
    x = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):  # left padding: every prompt ends at the same column
        x[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    kw = dict(attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        hf.generate(x[:2], **dict(kw, attention_mask=mask[:2], max_new_tokens=4, min_new_tokens=4))  # warm-up
        start = time.perf_counter()
        hf_out = hf.generate(x, **kw)[:, width:].tolist()
        t_hf = time.perf_counter() - start
    agree = sum(list(o.token_ids) == h for o, h in zip(outs, hf_out))
    n = len(ids) * n_new
    print(f"3. minienv engine vs transformers generate — 16 prompts x {n_new} new tokens, greedy, both batched, "
          f"threads={BLAS_THREADS}")
    print(f"   minienv InferenceEngine   {t_mini:7.2f} s  {n / t_mini:8.1f} tokens/s")
    print(f"   transformers generate     {t_hf:7.2f} s  {n / t_hf:8.1f} tokens/s")
    print(f"   minienv / transformers: {t_hf / t_mini:.2f}x tokens/s; identical greedy outputs: {agree}/16\n")
    return {"minienv_tok_s": round(n / t_mini, 1), "transformers_tok_s": round(n / t_hf, 1),
            "ratio": round(t_hf / t_mini, 2), "identical_outputs": agree, "torch_threads": int(BLAS_THREADS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: bundled assets/target)")
    ap.add_argument("--requests", type=int, default=48, help="requests in the batching workload (default 48)")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="batch size cap in part 1 (default 8)")
    ap.add_argument("--blas-threads", default="1", help="numpy OpenBLAS (and torch) threads (default 1)")
    args = ap.parse_args()

    model_dir, model, tok, source = resolve(args.model)
    print(f"model: {source}\n  {model}")
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, numpy {np.__version__} "
          f"(BLAS threads {BLAS_THREADS})\n")
    batching = bench_batching(model, tok, args.requests, args.max_num_seqs)
    prefix = bench_prefix(model, tok)
    hf = bench_transformers(model_dir, model, tok)
    result = {
        "benchmark": "bench_engine",
        "model": "bundled" if source.startswith("bundled") else ("random_stand_in" if "RANDOM" in source else "custom"),
        "params": model.num_parameters,
        "numpy_blas_threads": int(BLAS_THREADS),
        "continuous_vs_static": batching,
        "prefix_caching": prefix,
        "vs_transformers": hf if hf is not None else "skipped: torch/transformers not installed",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

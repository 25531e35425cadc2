"""The engine, side by side: continuous vs static batching, prefix caching on vs off, minienv vs ``transformers``.

    .venv/bin/python benchmarks/bench_engine.py [--model DIR] [--requests 48] [--rounds 3] [--blas-threads 1]
    .venv/bin/python benchmarks/bench_engine.py --quick     # small workloads, no transformers: a smoke run

1. **Continuous vs static batching** on four seeded workloads (``WORKLOADS``: ShareGPT-like long tails,
   Alpaca-like short outputs, uniform lengths, mixed), same budgets: generated tokens/s (the CPU figure) and model
   calls = engine steps (the GPU proxy: on a GPU a decode step costs about the same at any batch size). Static batching admits a batch of
   ``max_num_seqs`` and waits for its longest member; continuous refills a slot the step it frees. Two static
   baselines: **static** (faithful, ``static_padding=True``: a finished member keeps its row and computes one
   discarded token per step until the batch ends, like ``transformers.generate`` on a padded batch — what the
   Orca and vLLM papers compared against) and **static, charitable** (``static_padding=False``: finished members
   stop computing, so only the idle-slot loss remains). The must-show ratio is against the faithful one.
2. **Prefix caching on vs off**, a 5-shot workload: 16 requests = one shared 5-example prefix + their own question.
   Prompt tokens computed, time to first token, tokens/s.
3. **minienv's batched engine vs transformers ``generate``** on the same weights, 16 prompts x 64 new tokens,
   greedy, both batched (transformers with left padding, in its fastest configuration here: a 5-round pre-race
   of ``sdpa`` / ``eager`` attention x dynamic / static KV cache picks it, ``benchmarks/_hf.py``), and next to
   them **the ceiling**: the same model's forward pass over the same batch in a bare loop
   (``benchmarks/_ceiling.py``: dense caches, argmax, no engine), an upper bound for any engine on this numpy
   model. At least 9 rounds (``PART3_MIN_ROUNDS``: each is a fraction of a second). Skipped with a note if torch /
   transformers are missing.
4. **A continuous-batching run vs its own ceiling**: 48 requests (``_ceiling.continuous_run``, the run
   ``profile_engine.py --run continuous`` samples) through the engine, and the same run's steps replayed without
   one (``_ceiling.replay``: each step's tokens at their positions through the model, dense slot caches, an
   argmax, every index laid out before the clock starts). The replay's tokens are checked against the engine's.

Every run generates exactly the requested lengths (the end-of-text token is ignored, as benchmarks do). On the
bundled model when ``assets/target`` exists; otherwise a random stand-in of the same shape (speeds comparable,
text is noise; the output says which). Each comparison runs every side once per round on a fresh engine, in
interleaved rounds in a balanced order (``benchmarks/_common.py``); min and median are reported and the
ratios use the minima; parts 3 and 4 also give the paired ratio (within each round, median over rounds). Ends
with exactly one JSON line.

numpy's OpenBLAS runs with one thread (``--blas-threads``): for matrices this small a second thread costs more in
hand-off than it saves (and under load it spins), and one thread is the fair match for ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

import numpy as np  # noqa: E402
from _common import (add_common_args, emit_json, paired, print_settings, race, rounds_of, settle,  # noqa: E402
                     schedule, target_stand_in)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _hf import generate_variants, strongest  # noqa: E402
from _ceiling import (CONTINUOUS, bare_greedy, continuous_run, replay, slot_steps,  # noqa: E402  (imports minienv)
                      traced_continuous_run)

from minienv.engine import InferenceEngine, RequestOutput  # noqa: E402
from minienv.model import load_model, random_weights, save_checkpoint  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.lab.workload import LengthDistribution, WorkloadConfig, generate_workload, workload_stats  # noqa: E402

STAND_IN = target_stand_in()  # used only when assets/target is missing
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
#: The batching workloads. Output-length spread is what static batching pays for (a batch waits for its longest
#: member), so the workloads span it: ShareGPT-like long tails and Alpaca-like short outputs (the vLLM paper's
#: two traces, with the paper's length *shapes* — log-normal sigmas — and ShareGPT's means divided by 4 so a CPU
#: run takes seconds), uniform lengths (the control: no spread, nothing for continuous batching to win) and the
#: mixed workload of earlier versions of this benchmark.
WORKLOADS = {
    "sharegpt": WorkloadConfig("ShareGPT-like (means / 4)", LengthDistribution(161.31 / 4, 1.0),
                               LengthDistribution(337.99 / 4, 0.9)),
    "alpaca": WorkloadConfig("Alpaca-like", LengthDistribution(19.31, 0.6), LengthDistribution(58.45, 0.7)),
    "uniform": WorkloadConfig("uniform", LengthDistribution(32.0, 0.0), LengthDistribution(48.0, 0.0)),
    "mixed": MIXED,
}
#: the three ways of batching: faithful static (finished members keep computing padding), charitable static
#: (finished members stop computing; only idle slots are lost), continuous
MODES = {"static": dict(scheduling="static"),
         "static_charitable": dict(scheduling="static", static_padding=False),
         "continuous": dict(scheduling="continuous")}


def run_batching(model, tok, workload: str, n_requests: int, max_num_seqs: int, rounds: int, seed: int,
                 max_len: int = 384) -> dict:
    """One workload, the three modes in interleaved rounds (fresh engine per run; only ``generate`` is timed)."""
    specs = generate_workload(n_requests, WORKLOADS[workload], max_len=min(max_len, model.config.max_position_embeddings),
                              seed=0)
    rng = np.random.default_rng(0)
    vocab = min(getattr(tok, "vocab_size", 256), model.config.vocab_size)
    prompts = [list(map(int, rng.integers(0, vocab - 1, s.prompt_len))) for s in specs]
    params = [SamplingParams(max_tokens=s.output_len, temperature=0) for s in specs]
    ws = workload_stats(specs)
    budget = sum(s.total_len + 16 for s in specs)  # ample: this comparison is about batching, not memory
    kw = dict(kv_budget_tokens=budget, block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    res: dict[str, dict] = {}
    outs: dict[str, list] = {}
    for order in schedule(list(MODES), rounds, seed):
        for mode in order:
            settle()
            e = make_engine(model, tok, **MODES[mode], **kw)
            t, o = timed(e, prompts, params)
            times[mode].append(t)
            outs[mode] = [x.token_ids for x in o]
            st = e.stats
            res[mode] = dict(steps=st.num_steps, tokens=st.num_generated_tokens, computed=st.num_computed_tokens,
                             padding=st.num_padding_tokens, ttft_steps=mean(x.metrics.ttft_steps for x in o),
                             e2e_steps=mean(x.metrics.e2e_steps for x in o))
    same = all(outs[m] == outs["continuous"] for m in MODES)
    for mode, r in res.items():
        t_min, t_med = min(times[mode]), statistics.median(times[mode])
        r.update(seconds_min=t_min, seconds_median=t_med, tok_s=r["tokens"] / t_min, tok_s_median=r["tokens"] / t_med,
                 step_ms=1e3 * t_min / r["steps"], tokens_per_step=r["computed"] / r["steps"])
    c = res["continuous"]
    out = {"name": WORKLOADS[workload].name, "requests": n_requests, "max_num_seqs": max_num_seqs,
           "prompt_mean": round(ws["prompt_mean"], 1), "output_mean": round(ws["output_mean"], 1),
           "output_max": int(ws["output_max"]), "outputs_identical": same, "rounds": rounds,
           "modes": {m: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for m, r in res.items()}}
    for base in ("static", "static_charitable"):
        b = res[base]
        sfx = "" if base == "static" else "_vs_charitable"
        out["throughput_ratio" + sfx] = round(c["tok_s"] / b["tok_s"], 3)  # tokens/s, from the fastest rounds
        out["throughput_ratio_median" + sfx] = round(c["tok_s_median"] / b["tok_s_median"], 3)
        out["model_calls_ratio" + sfx] = round(b["steps"] / c["steps"], 3)  # the GPU proxy: fewer forward passes
    return out


def bench_batching(model, tok, workloads: list[str], n_requests: int, max_num_seqs: int, rounds: int,
                   seed: int, max_len: int) -> dict:
    print(f"1. continuous vs static batching — {n_requests} requests per workload, max_num_seqs={max_num_seqs}, "
          f"{rounds} interleaved rounds (min / median)")
    print("   tokens/s is the CPU figure; model calls (engine steps: one batched forward pass each) are the GPU "
          "proxy,\n   where a decode step costs about the same whatever its batch size.")
    results = {}
    for w in workloads:
        r = results[w] = run_batching(model, tok, w, n_requests, max_num_seqs, rounds, seed, max_len)
        print(f"\n   {r['name']}: prompt mean {r['prompt_mean']:.0f}, output mean {r['output_mean']:.0f} "
              f"(max {r['output_max']}); outputs identical in all three: {r['outputs_identical']}")
        print(f"   {'':<18}{'s (min)':>8}{'s (med)':>8}{'tokens/s':>10}{'model calls':>12}{'computed':>10}"
              f"{'padding':>9}{'TTFT':>7}{'e2e':>7}{'ms/call':>9}  (latencies in steps)")
        for mode, m in r["modes"].items():
            print(f"   {mode:<18}{m['seconds_min']:>8.2f}{m['seconds_median']:>8.2f}{m['tok_s']:>10.1f}{m['steps']:>12}"
                  f"{m['computed']:>10}{m['padding']:>9}{m['ttft_steps']:>7.1f}{m['e2e_steps']:>7.1f}"
                  f"{m['step_ms']:>9.2f}")
        print(f"   continuous / static (faithful):   {r['throughput_ratio']:.2f}x tokens/s (median "
              f"{r['throughput_ratio_median']:.2f}x), {r['model_calls_ratio']:.2f}x fewer model calls")
        print(f"   continuous / static (charitable): {r['throughput_ratio_vs_charitable']:.2f}x tokens/s (median "
              f"{r['throughput_ratio_median_vs_charitable']:.2f}x), {r['model_calls_ratio_vs_charitable']:.2f}x fewer "
              f"model calls")
    print("   (\"computed\" = tokens through the model; \"padding\" = of them, finished members' discarded tokens.\n"
          "    On a CPU a step's cost grows with the tokens in it, so the charitable baseline's nearly empty steps\n"
          "    are cheap and tokens/s understates what fewer model calls are worth on a GPU. Not modelled, in\n"
          "    static's favour: prompts padded to the batch's longest one.)\n")
    return results


# ------------------------------------------------------------------------------------------------ 2
def bench_prefix(model, tok, rounds: int, seed: int, n_questions: int = 16, block_size: int = 16) -> dict:
    prefix = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in FIVE_SHOT)
    prompts = [prefix + f"Q: {q}\nA:" for q in QUESTIONS[:n_questions]]
    params = SamplingParams(max_tokens=16, temperature=0)
    n_prefix = len(tok.encode(prefix))
    times: dict[bool, list[float]] = {False: [], True: []}
    ttfts: dict[bool, list[float]] = {False: [], True: []}
    res = {}
    outs = {}
    for order in schedule([False, True], rounds, seed):
        for caching in order:
            settle()
            e = make_engine(model, tok, kv_budget_tokens=8192, block_size=block_size, enable_prefix_caching=caching,
                            max_num_seqs=16, max_num_batched_tokens=512)
            t, outs[caching] = timed(e, prompts, params)
            times[caching].append(t)
            ttfts[caching].append(mean(o.metrics.ttft for o in outs[caching]))
            st = e.stats
            res[caching] = dict(tokens=st.num_generated_tokens,
                                prefill=st.num_computed_tokens - st.num_generated_tokens + len(prompts),
                                hit_rate=st.prefix_cache_hit_rate, steps=st.num_steps,
                                ttft_steps=mean(o.metrics.ttft_steps for o in outs[caching]))
    for caching, r in res.items():
        r.update(seconds=min(times[caching]), seconds_median=statistics.median(times[caching]),
                 ttft=min(ttfts[caching]))
        r["tok_s"] = r["tokens"] / r["seconds"]
    same = [o.token_ids for o in outs[False]] == [o.token_ids for o in outs[True]]
    off, on = res[False], res[True]
    print(f"2. prefix caching — {len(prompts)} requests, a 5-shot prefix of {n_prefix} tokens + a question each, "
          f"16 new tokens, {rounds} interleaved rounds")
    print(f"   {'':<12}{'s (min)':>9}{'s (med)':>9}{'tokens/s':>10}{'prompt tok computed':>21}{'hit rate':>10}"
          f"{'mean TTFT ms':>14}{'TTFT steps':>12}")
    for name, r in (("cache off", off), ("cache on", on)):
        print(f"   {name:<12}{r['seconds']:>9.2f}{r['seconds_median']:>9.2f}{r['tok_s']:>10.1f}{r['prefill']:>21}"
              f"{r['hit_rate']:>10.1%}{1e3 * r['ttft']:>14.1f}{r['ttft_steps']:>12.1f}")
    print(f"   on / off: {on['tok_s'] / off['tok_s']:.2f}x tokens/s, {off['prefill'] / on['prefill']:.2f}x fewer prompt "
          f"tokens computed, {off['ttft'] / on['ttft']:.2f}x lower TTFT (best round's mean); outputs identical: "
          f"{same}\n")
    return {"prefix_tokens": n_prefix, "requests": len(prompts), "off_tok_s": round(off["tok_s"], 1),
            "on_tok_s": round(on["tok_s"], 1), "throughput_ratio": round(on["tok_s"] / off["tok_s"], 2),
            "throughput_ratio_median": round(off["seconds_median"] / on["seconds_median"], 2),
            "prompt_tokens_computed": {"off": off["prefill"], "on": on["prefill"]},
            "prompt_tokens_ratio": round(off["prefill"] / on["prefill"], 2),
            "hit_rate": round(on["hit_rate"], 3), "ttft_ratio": round(off["ttft"] / on["ttft"], 2),
            "outputs_identical": same}


# ------------------------------------------------------------------------------------------------ 3
#: Part 3's rounds last a fraction of a second each (16 x 64 tokens), short enough for a busy host's hiccups to
#: move a min-of-3 by 10-20 %: it runs at least this many rounds, whatever ``--rounds`` says (about 7 s in all).
PART3_MIN_ROUNDS = 9
#: rounds of the pre-race that picks transformers' fastest configuration (benchmarks/_hf.py)
HF_PRE_RACE_ROUNDS = 5

def bench_transformers(model_dir: Path, model, tok, rounds: int, seed: int, n_new: int = 64) -> dict | None:
    """minienv's batched engine vs ``transformers`` batched ``generate`` (left padding) vs the bare loop (the
    ceiling, :func:`_ceiling.bare_greedy`), interleaved rounds."""
    try:
        import torch
        import transformers  # noqa: F401  (benchmarks/_hf.py loads the models)
    except ImportError:
        print("3. minienv vs transformers: SKIPPED (torch / transformers not installed)")
        return None
    prompts = [f"{q} " for q in QUESTIONS]
    ids = [tok.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=n_new, temperature=0)
    budget = 16 * (max(map(len, ids)) + n_new + 16)

    def run_minienv():
        e = make_engine(model, tok, kv_budget_tokens=budget, block_size=16, max_num_seqs=16,
                        max_num_batched_tokens=1024)
        t, outs = timed(e, ids, params)
        return t, [list(o.token_ids) for o in outs]

    def run_ceiling():
        start = time.perf_counter()
        out = bare_greedy(model, ids, n_new)
        return time.perf_counter() - start, out

    width = max(map(len, ids))
    x = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):  # left padding: every prompt ends at the same column
        x[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    print(f"3. minienv engine vs transformers generate — {len(ids)} prompts x {n_new} new tokens, greedy, both "
          f"batched, threads={BLAS_THREADS}, {rounds} interleaved rounds")
    # the baseline: the fastest configuration of generate here (benchmarks/_hf.py), picked in a pre-race
    variants = generate_variants(model_dir, x, mask, n_new, int(BLAS_THREADS))
    chosen, hf_configs = strongest(variants, HF_PRE_RACE_ROUNDS, seed)
    run_hf = variants[chosen]

    make_engine(model, tok, kv_budget_tokens=1024).generate(ids[:2], SamplingParams(max_tokens=4, temperature=0))
    bare_greedy(model, ids[:2], 4)
    times, outs = race({"minienv": run_minienv, "transformers": run_hf, "ceiling": run_ceiling}, rounds, seed)
    agree = sum(o == h for o, h in zip(outs["minienv"], outs["transformers"], strict=True))
    agree_ceiling = sum(o == c for o, c in zip(outs["minienv"], outs["ceiling"], strict=True))
    n = len(ids) * n_new
    t_mini, t_hf = min(times["minienv"]), min(times["transformers"])
    med_mini, med_hf = statistics.median(times["minienv"]), statistics.median(times["transformers"])
    t_top, med_top = min(times["ceiling"]), statistics.median(times["ceiling"])
    print(f"   minienv InferenceEngine   {t_mini:7.2f} s min  {med_mini:7.2f} s median  {n / t_mini:8.1f} tokens/s")
    print(f"   {'transformers, ' + chosen:<26}{t_hf:7.2f} s min  {med_hf:7.2f} s median  {n / t_hf:8.1f} tokens/s")
    print(f"   bare loop (the ceiling)   {t_top:7.2f} s min  {med_top:7.2f} s median  {n / t_top:8.1f} tokens/s")
    paired_hf, paired_top = paired(times["transformers"], times["minienv"]), paired(times["ceiling"], times["minienv"])
    print(f"   minienv / transformers: {t_hf / t_mini:.2f}x tokens/s (median {med_hf / med_mini:.2f}x, paired "
          f"{paired_hf:.2f}x); identical greedy outputs: {agree}/{len(ids)}")
    print(f"   ceiling / transformers: {t_hf / t_top:.2f}x (median {med_hf / med_top:.2f}x) — no engine on this numpy "
          f"model can beat it;\n   minienv reaches {t_top / t_mini:.0%} of the ceiling (median {med_top / med_mini:.0%}, "
          f"paired {paired_top:.0%}); identical greedy outputs: {agree_ceiling}/{len(ids)}\n")
    return {"minienv_tok_s": round(n / t_mini, 1), "transformers_tok_s": round(n / t_hf, 1),
            "ratio": round(t_hf / t_mini, 2), "ratio_median": round(med_hf / med_mini, 2),
            "ratio_paired": round(paired_hf, 2), "minienv_over_ceiling_paired": round(paired_top, 3),
            "identical_outputs": agree, "ceiling_tok_s": round(n / t_top, 1),
            "ceiling_over_transformers": round(t_hf / t_top, 2),
            "minienv_over_ceiling": round(t_top / t_mini, 3), "minienv_over_ceiling_median": round(med_top / med_mini, 3),
            "ceiling_identical_outputs": agree_ceiling, "torch_threads": int(BLAS_THREADS), "rounds": rounds,
            "transformers_configs": hf_configs}


# ------------------------------------------------------------------------------------------------ 4
def bench_continuous_ceiling(model, tok, rounds: int, seed: int) -> dict:
    """A continuous-batching run through the engine vs the same run replayed without an engine
    (:func:`_ceiling.replay`: each step's tokens at their positions through the model, dense slot caches, an
    argmax, every index laid out before the clock starts), interleaved rounds."""
    steps = traced_continuous_run(model, tok)
    slots = CONTINUOUS["max_num_seqs"]
    laid = slot_steps(steps, slots)
    max_len = max(ctx + len(toks) for step in steps for _, ctx, toks in step.chunks)
    n = sum(len(step.sampled) for step in steps)

    def run_engine():
        engine = continuous_run(model, tok)
        start = time.perf_counter()
        engine.run()
        return time.perf_counter() - start, None

    def run_replay():
        start = time.perf_counter()
        out = replay(model, laid, slots, max_len)
        return time.perf_counter() - start, out

    times, outs = race({"engine": run_engine, "replay": run_replay}, rounds, seed)
    same = sum(o == list(step.sampled) for o, step in zip(outs["replay"], steps, strict=True))
    t_e, t_r = min(times["engine"]), min(times["replay"])
    m_e, m_r = statistics.median(times["engine"]), statistics.median(times["replay"])
    print(f"4. a continuous run vs its replay without an engine — 48 requests, {len(steps)} steps, {n} tokens, "
          f"{rounds} interleaved rounds")
    print(f"   minienv InferenceEngine   {t_e:7.2f} s min  {m_e:7.2f} s median  {n / t_e:8.1f} tokens/s")
    print(f"   replay (the ceiling)      {t_r:7.2f} s min  {m_r:7.2f} s median  {n / t_r:8.1f} tokens/s")
    p_r = paired(times["replay"], times["engine"])
    print(f"   minienv reaches {t_r / t_e:.0%} of the ceiling (median {m_r / m_e:.0%}, paired {p_r:.0%}); the replay's "
          f"tokens equal the engine's at {same}/{len(steps)} steps\n")
    return {"steps": len(steps), "tokens": n, "minienv_tok_s": round(n / t_e, 1), "replay_tok_s": round(n / t_r, 1),
            "minienv_over_ceiling": round(t_r / t_e, 3), "minienv_over_ceiling_median": round(m_r / m_e, 3),
            "minienv_over_ceiling_paired": round(p_r, 3),
            "identical_steps": same, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: bundled assets/target)")
    ap.add_argument("--requests", type=int, default=None, help="requests per batching workload (default 48; 8 quick)")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="batch size cap in part 1 (default 8)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--no-transformers", action="store_true", help="skip part 3 even if transformers is installed")
    add_common_args(ap, rounds=3)
    args = ap.parse_args()
    rounds = rounds_of(args)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    n_requests = args.requests or (8 if args.quick else 48)
    settings = print_settings()

    model_dir, model, tok, source = resolve(args.model)
    print(f"model: {source}\n  {model}\n")
    batching = bench_batching(model, tok, workloads, n_requests, args.max_num_seqs, rounds, args.seed,
                              max_len=64 if args.quick else 384)
    prefix = bench_prefix(model, tok, rounds=rounds, seed=args.seed, n_questions=8 if args.quick else 16)
    hf = None if args.quick or args.no_transformers else bench_transformers(
        model_dir, model, tok, max(rounds, PART3_MIN_ROUNDS), args.seed)
    if args.quick or args.no_transformers:
        print("3. minienv vs transformers: skipped (--quick / --no-transformers)")
    continuous = bench_continuous_ceiling(model, tok, rounds, args.seed)
    main_w = "mixed" if "mixed" in batching else workloads[0]
    result = {
        "benchmark": "bench_engine",
        "model": "bundled" if source.startswith("bundled") else ("random_stand_in" if "RANDOM" in source else "custom"),
        "params": model.num_parameters,
        "quick": args.quick,
        "rounds": rounds,
        "numpy_blas_threads": int(BLAS_THREADS),
        # the headline workload's figures at the top level (README), every workload under "workloads"
        "continuous_vs_static": {"headline_workload": main_w,
                                 **{k: batching[main_w][k] for k in (
                                     "throughput_ratio", "throughput_ratio_median", "model_calls_ratio",
                                     "throughput_ratio_vs_charitable", "throughput_ratio_median_vs_charitable",
                                     "model_calls_ratio_vs_charitable", "outputs_identical")},
                                 "workloads": batching},
        "prefix_caching": prefix,
        "vs_transformers": hf if hf is not None else "skipped",
        "continuous_vs_ceiling": continuous,
    }
    emit_json(result, settings)


if __name__ == "__main__":
    main()

"""SmolLM2-135M-Instruct (a real, memory-bound model) through minienv's engine, measured against transformers on the
same GGUF weights, against the machine's floor, with n-gram speculation, and over gRPC / HTTP.

    python benchmarks/bench_real_model.py [--quick] [--rounds N] [--parts floor,stream,batch,spec,serving]

Every ratio is PAIRED: the variants run once per interleaved round (:func:`_common.interleaved`) and each ratio is
the median of per-round ratios. Greedy tokens are checked equal between the variants of a race.

* ``stream``: one chat request, minienv's engine vs ``transformers`` ``generate`` (sdpa, dynamic cache; torch on one
  thread, numpy's BLAS on one thread), tokens/s including the prefill. Target >= 2x.
* ``batch``: 16 ragged chat requests together (continuous batching vs transformers' left-padded batch), once per
  cap on the answers' length (``--batch-caps``, default 48, 256 and 512 tokens; greedy answers end at EOS or at the
  cap). Both sides run the same kind of float32 GEMMs, so the engine gains only the rows ``transformers`` computes
  for padding and for answers that have already ended: the wider the answers' lengths spread, the more it gains.
  Target >= 1.5x.
* ``floor``: one stream's fastest decode step (and its median step) vs the machine's floor = read bandwidth (the fastest of three passes
  of a 1 GiB ``np.sum``, measured in the same round) / fp32 weight bytes read per token (every layer's matrices and
  the LM head; one embedding row). Target >= 0.85.
* ``spec``: n-gram (prompt lookup) speculation vs plain decoding on free chat (a poem) and on a grounded task
  (copying a passage that is in the prompt). No draft model is possible here: SmolLM2-135M is the smallest model of
  its tokenizer's family on this machine — a draft must share the tokenizer and be several times cheaper.
* ``serving``: the same request in-process, over gRPC (``Client.generate``) and over HTTP (the OpenAI client)
  against ``python -m minienv serve --model`` (prefix caching off on both sides, so the repeated prompt is
  computed every time).

The model comes from the cache (``python -m minienv download smollm2-135m-instruct``; MINIENV_MODELS_DIR).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402

BLAS_THREADS = pin_blas_threads()

import argparse  # noqa: E402
import gc  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from _common import add_common_args, emit_json, interleaved, print_settings, rounds_of  # noqa: E402

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.model.hub import cached_path  # noqa: E402
from minienv.model.pretrained import load_pretrained  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NAME = "smollm2-135m-instruct"
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]
QUESTIONS = ["What is the capital of France?", "Explain photosynthesis to a child.", "List three uses of copper.",
             "Why do cats purr?", "Write a haiku about rain.", "What is 17 times 23?",
             "Give me a tip for learning to cook.", "Describe the water cycle in detail, step by step.",
             "Who wrote Hamlet, and what is it about?", "How does a bicycle stay upright?",
             "Suggest a name for a bakery.", "What is machine learning? Answer in two paragraphs.",
             "Translate 'good morning' into French, Spanish and German.", "Why is the sea salty?",
             "Tell me a joke about computers.", "What should I pack for a week of hiking in the mountains?"]
PASSAGE = ("The lighthouse stood on a rock at the end of the harbour wall. Every evening at dusk the keeper climbed "
           "the one hundred and twelve steps, trimmed the wick, polished the great lens and lit the lamp, and every "
           "morning he wrote the hours of the light, the weather and the ships he had seen into a leather-bound log.")
GROUNDED = [{"role": "user", "content": f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}"}]
POEM = [{"role": "user", "content": "Write a poem about autumn leaves."}]


def ratio(num: list[float], den: list[float]) -> float:
    """Median of per-round ratios num/den (paired)."""
    return statistics.median(a / b for a, b in zip(num, den))


def race(variants: dict, rounds: int, seed: int) -> dict[str, list[float]]:
    """Each variant returns the seconds of its own measured region (engine construction and tokenization stay
    outside); interleaved rounds, the warm-up call dropped. name -> seconds per round."""
    times: dict[str, list[float]] = {k: [] for k in variants}

    def wrap(name, fn):
        return lambda: times[name].append(fn())

    interleaved({k: wrap(k, fn) for k, fn in variants.items()}, rounds=rounds, seed=seed)
    return {k: v[1:] for k, v in times.items()}


def hf_load(path: Path):
    import torch
    import transformers

    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return tok, model


def hf_generate(tok, model, prompts: list[list[int]], n_new: int, eos: int) -> tuple[float, list[list[int]]]:
    """Greedy, left-padded batch; returns (seconds, new ids per row up to and including EOS)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)
        dt = time.perf_counter() - t0
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[:row.index(eos) + 1] if eos in row else row)
    return dt, rows


def engine_run(pre, prompts: list[list[int]], n_new: int, **engine_kw) -> tuple[float, list[list[int]], object]:
    engine = InferenceEngine(pre.model, pre.tokenizer, kv_budget_tokens=engine_kw.pop("kv_budget_tokens", 4096),
                             max_num_seqs=16, **engine_kw)
    t0 = time.perf_counter()
    outs = engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=n_new, temperature=0.0))
    dt = time.perf_counter() - t0
    eos = pre.tokenizer.eos_token_id
    return dt, [list(o.token_ids) + ([eos] if o.finish_reason == "eos" else []) for o in outs], engine


def read_bandwidth(n_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s of the fastest of ``reps`` np.sum passes over ``n_bytes`` of float32 (reads only)."""
    a = np.ones(n_bytes // 4, dtype=np.float32)
    a.sum()
    best = min(_timed(a.sum) for _ in range(reps))
    del a
    return n_bytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes_per_token(model) -> int:
    """fp32 bytes a decode step reads: every layer's matrices and norms, the final norm, the LM head."""
    total = sum(a.nbytes for layer in model.layers for a in vars(layer).values())
    return total + model.norm.nbytes + model.lm_head.nbytes + model.embed_tokens[0].nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, rounds=3)
    ap.add_argument("--parts", default="floor,stream,batch,spec,serving")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per answer in stream, floor, spec, serving")
    ap.add_argument("--batch-caps", default="48,256,512", help="comma-separated caps on the batch's answers")
    args = ap.parse_args()
    rounds = rounds_of(args)
    parts = set(args.parts.split(","))
    n_new = 16 if args.quick else args.new_tokens
    path = cached_path(NAME, verify=False)
    if path is None:
        raise SystemExit(f"{NAME} is not cached: run `python -m minienv download {NAME}`")
    settings = print_settings()
    pre = load_pretrained(path)
    enc = lambda conv: pre.tokenizer.encode(pre.chat_template.render(conv))  # noqa: E731
    eos = pre.tokenizer.eos_token_id
    result: dict = {"benchmark": "bench_real_model", "model": NAME, "rounds": rounds, "new_tokens": n_new}
    hf = hf_load(path) if parts & {"stream", "batch"} else None

    if "floor" in parts:
        # Paired: each round measures the read bandwidth right before the decode run, so a neighbour's load hits
        # both sides of that round's ratio alike.
        wb = weight_bytes_per_token(pre.model)
        prompt = enc(STORY)
        engine_run(pre, [prompt], 8)  # warm-up
        bws, decode, typical = [], [], []
        for _ in range(rounds):
            gc.collect()
            bws.append(read_bandwidth(reps=3))
            _, _, engine = engine_run(pre, [prompt], n_new, history_size=4096)
            steps = [r.duration_s for r in engine.history if r.scheduler_output.num_scheduled_tokens == 1]
            # Both sides as the harness reads timings — what the code costs when it gets the CPU: the fastest of
            # three bandwidth passes, the fastest decode step of the run (the median step is reported too).
            decode.append(1.0 / min(steps))
            typical.append(1.0 / statistics.median(steps))
        fractions = [d / (bw / wb) for d, bw in zip(decode, bws)]
        typical_fractions = [d / (bw / wb) for d, bw in zip(typical, bws)]
        result["floor"] = {"read_bandwidth_GBps": [round(b / 1e9, 2) for b in bws], "weight_MB_per_token": wb / 1e6,
                           "decode_tokens_per_s": [round(d, 2) for d in decode],
                           "fraction_of_floor_paired_median": statistics.median(fractions),
                           "fraction_of_floor_best_round": max(fractions),
                           "median_step_fraction_of_floor_paired_median": statistics.median(typical_fractions)}
        print(f"floor: {wb / 1e6:.0f} MB of fp32 weights per token; read bandwidth per round "
              f"{[round(b / 1e9, 1) for b in bws]} GB/s; one-stream decode {[round(d, 1) for d in decode]} tokens/s "
              f"= {statistics.median(fractions):.2f} of the floor (fastest step; paired median over rounds, best round "
              f"{max(fractions):.2f}); the median step is {statistics.median(typical_fractions):.2f} of it",
              flush=True)

    caps = [n_new] if args.quick else [int(c) for c in args.batch_caps.split(",")]
    questions = QUESTIONS[:4] if args.quick else QUESTIONS  # --quick: a smoke run (the test suite's), not a figure
    races = [("stream", [STORY], n_new, None)]
    races += [("batch", [[{"role": "user", "content": q}] for q in questions], cap, str(cap)) for cap in caps]
    for part, convs, n_race, key in races:
        if part not in parts:
            continue
        prompts = [enc(c) for c in convs]
        got: dict[str, list] = {}

        # the KV transformers' padded cache holds too: every row at the longest prompt plus the cap (no preemption)
        budget = max(4096, len(prompts) * (max(map(len, prompts)) + n_race))

        def mine():
            dt, rows, _ = engine_run(pre, prompts, n_race, kv_budget_tokens=budget)
            got["minienv"] = rows
            return dt

        def theirs():
            dt, rows = hf_generate(*hf, prompts, n_race, eos)
            got["transformers"] = rows
            return dt

        t = race({"minienv": mine, "transformers": theirs}, rounds, args.seed)
        tokens = sum(map(len, got["minienv"]))
        hf_tokens = sum(map(len, got["transformers"]))
        same = sum(a == b for a, b in zip(got["minienv"], got["transformers"]))
        # tokens/s paired per round (the two may differ in length where a row diverges on a near-tie)
        r = statistics.median((tokens / a) / (hf_tokens / b) for a, b in zip(t["minienv"], t["transformers"]))
        row = {"requests": len(prompts), "tokens": tokens, "transformers_tokens": hf_tokens,
               "equal_rows": same, "minienv_tokens_per_s": tokens / min(t["minienv"]),
               "transformers_tokens_per_s": hf_tokens / min(t["transformers"]), "speedup_paired_median": r}
        if key is None:
            result[part] = row
        else:  # the batch, per cap: the rows transformers computes (16 x its longest answer, + the prompts' padding)
            row["longest_answer"] = max(map(len, got["minienv"]))
            result.setdefault(part, {})[key] = row
        label = part if key is None else f"{part} (answers capped at {key})"
        print(f"{label}: {len(prompts)} request(s), {tokens} tokens, {same}/{len(prompts)} rows equal; minienv "
              f"{tokens / min(t['minienv']):.1f} tokens/s, transformers {hf_tokens / min(t['transformers']):.1f} "
              f"tokens/s (best rounds); paired speedup {r:.2f}x", flush=True)
    if hf is not None:
        del hf
        gc.collect()

    if "spec" in parts:
        result["spec"] = {}
        for task, conv in (("free_chat", POEM), ("grounded_copy", GROUNDED)):
            prompt = [enc(conv)]
            n = max(n_new, 96) if task == "grounded_copy" and not args.quick else n_new
            got = {}

            def run(name, cfg):
                def go():
                    dt, rows, engine = engine_run(pre, prompt, n, speculative_config=cfg)
                    got[name] = (rows, engine)
                    return dt
                return go

            variants = {"plain": run("plain", None),
                        "ngram": run("ngram", {"method": "ngram", "num_speculative_tokens": 4,
                                               "prompt_lookup_max": 3})}
            t = race(variants, rounds, args.seed)
            rows = got["plain"][0]
            assert got["ngram"][0] == rows, f"{task}: speculation changed the greedy tokens"
            acc = got["ngram"][1].speculator.stats.acceptance_rate
            r = ratio(t["plain"], t["ngram"])
            result["spec"][task] = {"tokens": len(rows[0]), "speedup_paired_median": r, "acceptance_rate": acc}
            print(f"spec {task}: {len(rows[0])} tokens, n-gram speculation {r:.2f}x plain (paired), acceptance "
                  f"{acc:.2f}", flush=True)

    if "serving" in parts:
        result["serving"] = serving(pre, path, enc(STORY), n_new, rounds, args.seed)
    emit_json(result, settings)
    return 0


def serving(pre, path: Path, prompt: list[int], n_new: int, rounds: int, seed: int) -> dict:
    """One request in-process, over gRPC and over HTTP (OpenAI client) against `serve --model`."""
    import os

    from openai import OpenAI

    from minienv.serving import Client

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "minienv", "serve", "--model", str(path), "--port", "0",
                             "--http-port", "0", "--kv-budget-tokens", "4096", "--no-prefix-caching"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    grpc_addr = http_url = None
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"MinienvEngine on (\S+)", line)
            grpc_addr = m.group(1) if m else grpc_addr
            m = re.search(r"HTTP API at (\S+)", line)
            http_url = m.group(1) if m else http_url
            if grpc_addr and http_url:
                break
        if not (grpc_addr and http_url):
            raise RuntimeError("serve did not come up:\n" + "".join(lines))
        text = pre.tokenizer.decode(prompt)
        got = {}
        with Client(grpc_addr) as client:
            oa = OpenAI(base_url=http_url, api_key="none")

            def inproc():  # prefix caching off on both sides: the server would otherwise reuse the repeated prompt
                dt, rows, _ = engine_run(pre, [prompt], n_new, enable_prefix_caching=False)
                got["in-process"] = rows[0]
                return dt

            def over_grpc():
                t0 = time.perf_counter()
                c = client.generate(prompt, n_new, temperature=0.0)
                dt = time.perf_counter() - t0
                got["grpc"] = list(c.token_ids) + ([pre.tokenizer.eos_token_id] if c.finish_reason == "eos" else [])
                return dt

            def over_http():
                t0 = time.perf_counter()
                r = oa.completions.create(model=path.stem, prompt=text, max_tokens=n_new, temperature=0.0)
                dt = time.perf_counter() - t0
                got["http_text"] = r.choices[0].text
                return dt

            t = race({"in-process": inproc, "grpc": over_grpc, "http": over_http}, rounds, seed)
        assert got["grpc"] == got["in-process"], "gRPC returned other tokens than the engine in-process"
        n = len(got["in-process"])
        out = {"tokens": n}
        for k in ("grpc", "http"):
            out[f"{k}_vs_inprocess_tokens_per_s"] = ratio(t["in-process"], t[k])
        out["inprocess_tokens_per_s"] = n / min(t["in-process"])
        print(f"serving: {n} tokens; tokens/s over gRPC = {out['grpc_vs_inprocess_tokens_per_s']:.2f}x in-process, "
              f"over HTTP = {out['http_vs_inprocess_tokens_per_s']:.2f}x (paired)", flush=True)
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())

"""Metrics on vs off: does observing the engine slow it? Engine tokens/s with and without ``metrics_of(engine)``.

    .venv/bin/python benchmarks/bench_metrics.py [--requests 48] [--rounds 5] [--blas-threads 1]

Three variants of the same engine on the same seeded mixed-length workload (``minienv.lab.workload``), in
interleaved rounds in the harness's balanced order, each run on a fresh engine:

* **off** — ``history_size=0``, no listeners: the lean engine the other benchmarks time;
* **off, history** — the default ``history_size=256`` and no metrics: the engine already builds a ``StepRecord``
  per step for its history ring, which is what a step listener costs (so this is the seam's price, not metrics');
* **on** — the same engine with ``metrics_of(engine)`` attached (its step and finish listeners; a step listener makes
  the engine build a ``StepRecord`` with its stats every step, which ``history_size=0`` otherwise skips);
* **on + scraped** — also serving ``/metrics`` while a thread GETs it every 250 ms, as a Prometheus with a short
  scrape interval would (the scrape competes for the GIL).

Reports min and median seconds per side, tokens/s, and the ratio on / off of engine tokens/s three ways: from the
medians, from the minima, and paired (off / variant within each round, median over rounds: adjacent runs share
the machine's load, so this is the estimate that survives a busy machine) — and the same paired ratio of CPU
seconds (``time.process_time``: this process only, the scraper thread included), which other processes on a
shared machine disturb far less than wall time. The target is >= 0.97. Also checks that every variant generated
the same tokens. Generation runs to exactly
``max_tokens`` (EOS ignored). The machine may be shared: the spread between min and median says how noisy the run
was. Ends with exactly one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

import numpy as np  # noqa: E402
from _common import add_common_args, emit_json, paired, print_settings, rounds_of, schedule, settle  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.lab.workload import LengthDistribution, WorkloadConfig, generate_workload  # noqa: E402
from minienv.metrics import metrics_of, serve_metrics  # noqa: E402
from minienv.model import load_model  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.tokenizer import load_tokenizer  # noqa: E402

MIXED = WorkloadConfig("mixed", LengthDistribution(32.0, 0.6), LengthDistribution(48.0, 1.0))
VARIANTS = ("off", "off, history", "on", "on + scraped")


def run(variant: str, model, tok, prompts, params, engine_kw) -> tuple[float, float, int, list, int]:
    """(wall seconds in generate, CPU seconds of this process meanwhile (the scraper thread's included),
    generated tokens, outputs' token ids, scrapes served)."""
    e = InferenceEngine(model, tok, history_size=256 if variant == "off, history" else 0, **engine_kw)
    e.eos_token_id = None
    scrapes = 0
    stop = threading.Event()
    scraper = None
    if variant.startswith("on"):
        metrics_of(e)  # attach
    if variant == "on + scraped":
        server = serve_metrics(e, 0)

        def scrape() -> None:
            nonlocal scrapes
            while not stop.wait(0.25):
                with urllib.request.urlopen(server.url, timeout=5) as r:
                    r.read()
                scrapes += 1

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = e.generate(prompts, params)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if scraper is not None:
        stop.set()
        scraper.join()
        server.close()
    if variant.startswith("on"):  # the metrics saw the whole run
        assert metrics_of(e).value("vllm:generation_tokens_total") == e.stats.num_generated_tokens
        assert metrics_of(e).value("vllm:request_success_total", finished_reason="length") == len(prompts)
    return seconds, cpu, e.stats.num_generated_tokens, [o.token_ids for o in outs], scrapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=None, help="default 48 (8 with --quick)")
    add_common_args(ap, rounds=5)
    args = ap.parse_args()
    rounds = rounds_of(args)
    args.requests = args.requests or (8 if args.quick else 48)

    model, tok = load_model(), load_tokenizer()
    specs = generate_workload(args.requests, MIXED, max_len=min(256, model.config.max_position_embeddings), seed=0)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, tok.vocab_size - 1, s.prompt_len))) for s in specs]
    params = [SamplingParams(max_tokens=s.output_len, temperature=0) for s in specs]
    budget = sum(s.total_len for s in specs) // 2  # tight enough that some requests wait and get preempted
    engine_kw = dict(kv_budget_tokens=budget, block_size=16, max_num_seqs=16, max_num_batched_tokens=256)
    settings = print_settings()
    print(f"workload: {len(specs)} requests, {sum(s.prompt_len for s in specs)} prompt + "
          f"{sum(s.output_len for s in specs)} output tokens; engine {engine_kw}")

    run("off", model, tok, prompts[:4], [SamplingParams(max_tokens=4, temperature=0)] * 4, engine_kw)  # warm-up
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu_times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[str, int] = {}
    outputs: dict[str, list] = {}
    scrapes = 0
    for r, order in enumerate(schedule(list(VARIANTS), rounds, args.seed)):  # order: seeded, balanced
        for v in order:
            settle()
            sec, cpu, ntok, outs, n_scrapes = run(v, model, tok, prompts, params, engine_kw)
            times[v].append(sec)
            cpu_times[v].append(cpu)
            tokens[v], outputs[v] = ntok, outs
            scrapes += n_scrapes
        print(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.3f} s" for v in VARIANTS))
    assert all(outputs[v] == outputs["off"] for v in VARIANTS), "metrics changed the generated tokens"
    assert len(set(tokens.values())) == 1

    result: dict = {"benchmark": "metrics", "requests": len(specs), "generated_tokens": tokens["off"],
                    "rounds": rounds, "quick": args.quick, "blas_threads": BLAS_THREADS, "scrapes": scrapes}
    print(f"\n{'variant':<14} {'min s':>7} {'median s':>9} {'tok/s (median)':>15} {'ratio vs off':>13} "
          f"{'paired ratio':>13} {'CPU paired':>11}")
    med_off = statistics.median(times["off"])
    for v in VARIANTS:
        lo, med = min(times[v]), statistics.median(times[v])
        ratio = med_off / med  # tokens/s ratio = inverse time ratio (same tokens)
        ratio_min = min(times["off"]) / lo
        # paired: off / variant within each round (adjacent runs share the machine's load), median over rounds
        ratio_paired, cpu_paired = paired(times["off"], times[v]), paired(cpu_times["off"], cpu_times[v])
        print(f"{v:<14} {lo:7.3f} {med:9.3f} {tokens[v] / med:15.1f} {ratio:13.3f} {ratio_paired:13.3f} "
              f"{cpu_paired:11.3f}")
        key = v.replace(" + ", "_").replace(", ", "_").replace(" ", "_")
        result[key] = {"min_s": round(lo, 4), "median_s": round(med, 4), "tokens_per_s": round(tokens[v] / med, 1),
                       "ratio_vs_off_median": round(ratio, 4), "ratio_vs_off_min": round(ratio_min, 4),
                       "ratio_vs_off_paired_median": round(ratio_paired, 4),
                       "cpu_ratio_vs_off_paired_median": round(cpu_paired, 4),
                       "cpu_min_s": round(min(cpu_times[v]), 4)}
    emit_json(result, settings)


if __name__ == "__main__":
    main()

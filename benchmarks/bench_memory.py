"""Memory over a long run: does the engine's resident set stay flat while it serves thousands of requests?

    .venv/bin/python benchmarks/bench_memory.py [--requests 5000] [--warmup 500] [--blas-threads 1]
    .venv/bin/python benchmarks/bench_memory.py --quick     # 240 requests (warm-up 48): a smoke run

One engine serves ``--requests`` short requests (a few words of prompt, ``max_tokens`` 1-8, greedy), in rounds of
24 that rotate through the three ways in: ``add_request`` + a ``step()`` loop, ``generate``, and ``stream``
(consumed to the end). The resident set size (``/proc/self/statm``, after ``gc.collect()``) is read after the
warm-up and after every 1,000 requests, with ``len(engine.requests)`` and ``len(engine.history)``.

A finished request's state should be released once its final output has been delivered (a few are kept for
``engine.output(id)`` look-ups: ``finished_retention``), and ``engine.history`` should be a bounded ring
(``history_size``). Target: growth after the warm-up <= 5 MB. Engines that predate those two constructor arguments
are run with their defaults (the script passes only the arguments the constructor accepts, via
``inspect.signature``), which gives the "before" number. The model and the KV pool are allocated before the
warm-up, so they are not growth. Nothing is timed against anything here (the figure is memory), so there are no
interleaved rounds. Ends with exactly one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

import numpy as np  # noqa: E402
from _common import emit_json, print_settings  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.model import load_model  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.tokenizer import load_tokenizer  # noqa: E402

WORDS = ["ROMEO:", "JULIET:", "HAMLET:", "My lord,", "O", "Now is the", "To be", "Good night,", "The king", "Fair"]
ROUND = 24
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def engine_kwargs(history_size: int, retention: int) -> tuple[dict, dict]:
    """(kwargs passed, kwargs the engine does not accept and so were left out)."""
    accepted = inspect.signature(InferenceEngine.__init__).parameters
    wanted = {"history_size": history_size, "finished_retention": retention}
    return ({k: v for k, v in wanted.items() if k in accepted}, {k: v for k, v in wanted.items() if k not in accepted})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=None, help="default 5000 (240 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="default 500 (48 with --quick)")
    ap.add_argument("--every", type=int, default=None, help="report RSS every N requests (default 1000; 96 quick)")
    ap.add_argument("--quick", action="store_true", help="a short run: checks the script, not the figure")
    ap.add_argument("--history-size", type=int, default=64, help="passed if the engine accepts it (default 64)")
    ap.add_argument("--finished-retention", type=int, default=16, help="passed if accepted (default 16)")
    ap.add_argument("--blas-threads", default="1", help="numpy OpenBLAS threads (default 1)")
    args = ap.parse_args()
    args.requests = args.requests or (240 if args.quick else 5000)
    args.warmup = args.warmup or (48 if args.quick else 500)
    args.every = args.every or (96 if args.quick else 1000)
    settings = print_settings()

    model, tok = load_model(), load_tokenizer()
    passed, missing = engine_kwargs(args.history_size, args.finished_retention)
    engine = InferenceEngine(model, tok, kv_budget_tokens=2048, block_size=16, max_num_seqs=16,
                             max_num_batched_tokens=256, **passed)
    rng = np.random.default_rng(0)
    print(f"bench_memory: {args.requests} requests (warm-up {args.warmup}), rounds of {ROUND} rotating "
          f"add_request+step / generate / stream; BLAS threads {BLAS_THREADS}")
    print(f"engine args passed: {passed or 'none'}; not accepted by this engine (defaults used): {missing or 'none'}")
    print(f"{'requests':>9}{'RSS MB':>9}{'maxRSS MB':>10}{'engine.requests':>17}{'history':>9}{'steps':>8}{'s':>7}")

    served = 0
    mode = 0
    checkpoints = sorted({args.warmup, *range(args.every, args.requests + 1, args.every)})
    rows = []
    start = time.perf_counter()
    rss0 = rss_mb()
    for target in checkpoints:
        while served < target:
            n = min(ROUND, target - served)
            prompts = [f"{WORDS[int(rng.integers(len(WORDS)))]} {served + i}" for i in range(n)]
            params = [SamplingParams(max_tokens=int(rng.integers(1, 9)), temperature=0) for _ in range(n)]
            finals = 0
            if mode == 0:
                ids = {engine.add_request(p, sp) for p, sp in zip(prompts, params)}
                while engine.has_unfinished_requests():
                    finals += sum(o.finished for o in engine.step() if o.request_id in ids)
            elif mode == 1:
                finals = sum(o.finished for o in engine.generate(prompts, params))
            else:
                finals = sum(o.finished for o in engine.stream(prompts, params))
            assert finals == n, f"round of {n} requests ({['step', 'generate', 'stream'][mode]}) gave {finals} finals"
            served += n
            mode = (mode + 1) % 3
        rss = rss_mb()
        row = dict(requests=served, rss_mb=round(rss, 2),
                   max_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 2),
                   engine_requests=len(engine.requests), history=len(engine.history),
                   steps=engine.stats.num_steps, seconds=round(time.perf_counter() - start, 1))
        rows.append(row)
        print(f"{row['requests']:>9}{row['rss_mb']:>9.1f}{row['max_rss_mb']:>10.1f}{row['engine_requests']:>17}"
              f"{row['history']:>9}{row['steps']:>8}{row['seconds']:>7.1f}")

    warm = next(r for r in rows if r["requests"] == args.warmup)
    last = rows[-1]
    growth = last["rss_mb"] - warm["rss_mb"]
    per_1k = growth / max(1, (last["requests"] - warm["requests"])) * 1000
    print(f"RSS before serving {rss0:.1f} MB; growth after the warm-up ({warm['requests']} -> {last['requests']} "
          f"requests): {growth:+.2f} MB ({per_1k:+.2f} MB per 1k requests); target <= 5 MB: "
          f"{'met' if growth <= 5 else 'NOT met'}")
    emit_json({
        "benchmark": "bench_memory", "quick": args.quick, "requests": last["requests"], "warmup": args.warmup,
        "numpy_blas_threads": int(BLAS_THREADS), "engine_args": passed, "engine_args_not_accepted": sorted(missing),
        "rss_before_mb": round(rss0, 2),
        "rss_mb": {str(r["requests"]): r["rss_mb"] for r in rows},
        "growth_after_warmup_mb": round(growth, 2), "growth_per_1k_requests_mb": round(per_1k, 3),
        "engine_requests": {str(r["requests"]): r["engine_requests"] for r in rows},
        "history_len": {str(r["requests"]): r["history"] for r in rows},
        "steps": last["steps"], "seconds": last["seconds"], "target_mb": 5, "within_target": growth <= 5,
    }, settings)


if __name__ == "__main__":
    main()

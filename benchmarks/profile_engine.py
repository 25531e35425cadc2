"""Where an engine run's time goes: BLAS, attention, the model's elementwise numpy, the engine's Python.

    # 1. sample a run with native frames (py-spy: `pip install py-spy`; not a minienv dependency)
    py-spy record --native -r 200 -f raw -o /tmp/run.raw -- \\
        .venv/bin/python benchmarks/profile_engine.py --run continuous  # or continuous_ceiling, single, batched, ceiling
    # 2. split the samples taken inside the engine's run by what they were doing
    .venv/bin/python benchmarks/profile_engine.py --split /tmp/run.raw

Keep the rate near 200 Hz: py-spy pauses the process for each native stack it reads, and at 1000 Hz on one host
the 5-second bare loop ran for 160 s under it and its BLAS share read 26 % instead of 61 %.

``--run continuous``: 48 seeded requests (prompts of 16-64 tokens, 16-128 greedy output tokens), 16 running at
once, the bundled model — a continuous-batching run (``_ceiling.continuous_run``), 5 times; ``--kernel numpy`` or
``--kernel numba`` runs its paged attention with that kernel instead of auto's choice (it prints each run's CPU
time, so a kernel that raises the BLAS share by being slower shows as slower). ``--run
continuous_ceiling``: the same run's steps replayed without an engine, 5 times — each step's tokens at their
positions through the model with dense slot caches and an argmax, every index laid out before the clock starts
(``_ceiling.replay``; a child process records the run's trace first, unsampled) — the largest BLAS share an
engine could show on that run. ``--run single``: one request, 32 prompt tokens, 256 tokens.
``--run batched``: ``bench_engine.py`` part 3's batch (16 prompts x 64 greedy tokens) through the engine, 20 times;
``--run ceiling``: the same batch through the bare loop of ``_ceiling.py`` (the model's forward pass with dense
caches and no engine), 20 times — the largest BLAS share any engine running this numpy model could show.

``--race-kernels N``: no sampling — the continuous run with each paged-attention kernel (auto's choice, numpy,
numba when installed), N interleaved rounds of the harness (``benchmarks/_common.py``), this thread's CPU time: the speed side
of what ``--kernel`` shows of the BLAS share.

``--split`` classifies each sample by its stack (a sample is one moment of the run): **BLAS** if an OpenBLAS frame
is on it (matrix products: Q/K/V, output, MLP and LM-head projections, and the attention kernel's own products),
else **attention** (paged attention's gathers, softmax, masks), **model** (RMSNorm, RoPE, SiLU, residual adds,
embedding rows), or **engine** (scheduler, step inputs, sampling, commit, outputs; the bare loops' argmax). Only
samples inside ``InferenceEngine.run`` / ``generate`` / ``bare_greedy`` / ``replay`` count (not imports or model
loading). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

BLAS_MARKERS = ("openblas", "sgemm", "gemv", "cblas", "dgemm", "gemm_")
#: the frames under which a sample counts: the engine's run, the bare loop, the continuous run's replay
ROOTS = ("InferenceEngine.run (", "InferenceEngine.generate (", "bare_greedy (", "replay (")
#: the continuous run (and its replay) is repeated, fresh each time, so a 200 Hz profile holds ~2,000 samples
REPEATS = 5


def classify(stack: str) -> str:
    lower = stack.lower()
    blas = any(m in lower for m in BLAS_MARKERS)
    if "PagedAttentionMetadata" in stack or "build_step_inputs" in stack:
        return "engine: step inputs"
    if "paged_attention" in stack or "causal_attention" in stack or "DenseBatchDecode.attend" in stack \
            or "DenseSlots.attend" in stack:
        return "attention: BLAS" if blas else "attention: other (gather, softmax, masks)"
    if blas:
        return "BLAS: projections, MLP, LM head"
    if "forward_step (" in stack:
        for key, name in (("rms_norm", "RMSNorm"), ("apply_rope", "RoPE"), ("rotate_in_place", "RoPE"),
                          ("RopeTable", "RoPE"),
                          ("silu", "SiLU"), ("_check", "input checks")):
            if key in stack:
                return f"model: {name}"
        return "model: other numpy (residuals, embedding, slicing)"
    for key, name in (("_commit (minienv/engine", "engine: sample, commit, outputs"),
                      ("schedule (minienv", "engine: scheduler")):
        if key in stack:
            return name
    return "engine: other"


def split(path: Path) -> dict:
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        if any(root in stack for root in ROOTS):
            counts[classify(stack)] += int(n)
    total = sum(counts.values())
    if not total:
        raise SystemExit(f"{path}: no samples inside InferenceEngine.run/generate, bare_greedy or replay (record "
                         f"with py-spy --native)")
    shares = {k: round(100 * v / total, 1) for k, v in counts.most_common()}
    blas = sum(v for k, v in counts.items() if k.startswith("BLAS") or k == "attention: BLAS")
    return {"samples": total, "percent": shares, "blas_percent": round(100 * blas / total, 1)}


def run(kind: str, trace: Path | None = None, kernel: str = "auto") -> None:
    import os
    import pickle

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from minienv.engine import InferenceEngine
    from minienv.model import load_model
    from minienv.sampling import SamplingParams
    from minienv.tokenizer import load_tokenizer

    model, tok = load_model(), load_tokenizer()
    rng = np.random.default_rng(0)
    if kind in ("batched", "ceiling"):
        from _ceiling import bare_greedy
        from bench_engine import QUESTIONS

        ids = [tok.encode(f"{q} ") for q in QUESTIONS]  # bench_engine part 3's batch
        budget = 16 * (max(map(len, ids)) + 64 + 16)
        for _ in range(20):
            if kind == "ceiling":
                bare_greedy(model, ids, 64)
            else:
                engine = InferenceEngine(model, tok, kv_budget_tokens=budget, block_size=16, max_num_seqs=16,
                                         max_num_batched_tokens=1024, history_size=0)
                engine.eos_token_id = None
                engine.generate(ids, SamplingParams(max_tokens=64, temperature=0))
        return
    if kind == "single":
        engine = InferenceEngine(model, tok, kv_budget_tokens=4096)
        engine.eos_token_id = None
        engine.generate([rng.integers(1, tok.vocab_size, 32).tolist()], SamplingParams(max_tokens=256, temperature=0))
        return
    from _ceiling import CONTINUOUS, replay, slot_steps, traced_continuous_run

    if kind == "trace":  # the continuous run's trace, for continuous_ceiling (in a child process: not sampled)
        assert trace is not None
        trace.write_bytes(pickle.dumps(traced_continuous_run(model, tok)))
        return
    if kind == "continuous_ceiling":
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.pkl"
            subprocess.run([sys.executable, __file__, "--run", "trace", "--trace", str(path)], check=True)
            steps = slot_steps(pickle.loads(path.read_bytes()), CONTINUOUS["max_num_seqs"])
        for _ in range(REPEATS):
            replay(model, steps, CONTINUOUS["max_num_seqs"], 256)
        return
    seconds = []
    for _ in range(REPEATS):
        engine = continuous_engine(model, tok, kernel)
        start = time.process_time()
        engine.run()
        seconds.append(time.process_time() - start)
    print(f"continuous run, kernel {kernel}: {REPEATS} runs, CPU time min {min(seconds):.3f} s, "
          f"median {statistics.median(seconds):.3f} s")


def continuous_engine(model, tok, kernel: str):
    """``_ceiling.continuous_run``'s engine, not yet run, its paged attention on ``kernel``."""
    from _ceiling import continuous_run

    return continuous_run(model, tok, attention_kernel=kernel)


def race_kernels(rounds: int, seed: int = 0) -> None:
    """The continuous run once per kernel per round (a fresh engine each time; only ``engine.run()`` is timed, in
    this thread's CPU time), in the harness's balanced order; the tokens must agree across kernels."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import emit_json, paired, pin_blas_threads, print_settings, race

    pin_blas_threads()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from minienv.model import load_model
    from minienv.tokenizer import load_tokenizer

    settings = print_settings()
    model, tok = load_model(), load_tokenizer()

    def side(kernel: str):
        def run_once():
            engine = continuous_engine(model, tok, kernel)
            ids = list(engine.requests)
            start = time.thread_time()
            engine.run()
            seconds = time.thread_time() - start
            return seconds, [list(engine.output(rid).token_ids) for rid in ids]
        return run_once

    from minienv.kv.paged_attention import NUMBA_MISSING

    kernels = ("auto", "numpy") if NUMBA_MISSING else ("auto", "numpy", "numba")
    times, outs = race({k: side(k) for k in kernels}, rounds, seed)
    differ = [k for k in kernels if outs[k] != outs["auto"]]
    if differ:
        raise SystemExit(f"the kernels generated different tokens: {', '.join(differ)} against auto's choice")
    print(f"the continuous run ({len(outs['auto'])} requests), {rounds} interleaved rounds, CPU time of engine.run()")
    result = {"rounds": rounds, "kernels": {}}
    for k in kernels:
        ratio = paired(times[k], times["auto"])
        print(f"  {k:8s} min {min(times[k]):.3f} s  median {statistics.median(times[k]):.3f} s  "
              f"/ auto {ratio:.3f} paired")
        result["kernels"][k] = {"min_s": round(min(times[k]), 4), "median_s": round(statistics.median(times[k]), 4),
                                "paired_over_auto": round(ratio, 4)}
    result["identical_tokens"] = True
    emit_json({"benchmark": "profile_engine_kernels", **result}, settings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--run", choices=["continuous", "continuous_ceiling", "single", "batched", "ceiling", "trace"],
                       help="the run to sample (under py-spy); trace: write the continuous run's trace to --trace")
    group.add_argument("--split", type=Path, help="a py-spy --native raw file of such a run")
    group.add_argument("--race-kernels", type=int, metavar="ROUNDS",
                       help="time the continuous run with each attention kernel, interleaved (no py-spy)")
    ap.add_argument("--kernel", choices=["auto", "numpy", "numba"], default="auto",
                    help="--run continuous: the paged-attention kernel (default: auto's choice per step)")
    ap.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.kernel != "auto" and args.run != "continuous":
        ap.error("--kernel applies to --run continuous only")
    if args.race_kernels is not None:
        if args.race_kernels < 3:
            ap.error("--race-kernels needs at least 3 rounds")
        race_kernels(args.race_kernels)
        return
    if args.run:
        run(args.run, args.trace, args.kernel)
        return
    result = split(args.split)
    for name, pct in result["percent"].items():
        print(f"{name:52s} {pct:5.1f} %")
    print(f"{'BLAS in total':52s} {result['blas_percent']:5.1f} %   ({result['samples']} samples)")
    print(json.dumps({"benchmark": "profile_engine", **result}))


if __name__ == "__main__":
    main()

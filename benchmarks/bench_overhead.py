"""Engine overhead: one request through ``InferenceEngine`` vs the same request through ``minienv.generate``.

    .venv/bin/python benchmarks/bench_overhead.py [--prompt-tokens 32] [--max-tokens 128] [--rounds 5] [--quick]
                                                  [--blas-threads 1]

``minienv.generate`` (``generate_ids``, with its contiguous KV cache) is the loop without an engine: prefill, then
one ``forward_step`` per token. The engine runs the same model on the same request through everything a served
request goes through — scheduler, KV cache manager, paged attention, sampler, detokenizer, output routing, step
history — so ``generate tokens/s / engine tokens/s`` is the engine's overhead on one request (1.0 = none).

Greedy, exactly ``--max-tokens`` tokens (end-of-text ignored on both sides), and the script checks that both
produce the same token ids. Each round builds a fresh engine before its clock starts (so a prefix-cache hit from
the round before never helps), on the bundled model when ``assets/target`` exists, else a random stand-in of the
same shape. Rounds are interleaved in the harness's balanced order; best and median on this thread's CPU time and
on wall time, and the *paired* ratio (engine / generate within each round, median over rounds: a round's two runs
are adjacent, so a host whose speed drifts from second to second moves both). Ends with exactly one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

import numpy as np  # noqa: E402

from _common import (add_common_args, emit_json, paired, print_settings, rounds_of, schedule, settle,  # noqa: E402
                     target_stand_in)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.generate import generate_ids  # noqa: E402
from minienv.model import LlamaModel, load_model, random_weights  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402

STAND_IN = target_stand_in()  # used only when assets/target is missing


def load() -> tuple[LlamaModel, object, str]:
    """The bundled model and tokenizer, or a seeded random stand-in of the same shape (and no tokenizer)."""
    if (REPO / "assets" / "target").is_dir():
        from minienv.tokenizer import load_tokenizer

        return load_model(), load_tokenizer(), "bundled target model"
    return LlamaModel(STAND_IN, random_weights(STAND_IN, seed=0)), None, "random stand-in (no assets/target)"


def run_generate(model: LlamaModel, prompt: list[int], params: SamplingParams) -> list[int]:
    return list(generate_ids(model, prompt, params, eos_token_id=None))


def make_engine(model: LlamaModel, tokenizer: object) -> InferenceEngine:
    engine = InferenceEngine(model, tokenizer, kv_budget_tokens=4096)
    engine.eos_token_id = None  # exactly max_tokens, like generate_ids(eos_token_id=None)
    return engine


def run_engine(engine: InferenceEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    (out,) = engine.generate([prompt], params)
    return list(out.token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.max_tokens = min(args.max_tokens, 32)
    rounds = rounds_of(args)
    settings = print_settings()
    model, tokenizer, which = load()
    rng = np.random.default_rng(0)
    vocab = getattr(tokenizer, "vocab_size", None) or model.config.vocab_size
    prompt = rng.integers(1, vocab, args.prompt_tokens).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(f"model: {which} ({model!r})")
    print(f"one request: {args.prompt_tokens} prompt tokens, {args.max_tokens} greedy tokens; {rounds} interleaved "
          "rounds, a fresh engine per round (built before the clock starts)")

    cpu: dict[str, list[float]] = {"generate": [], "engine": []}
    wall: dict[str, list[float]] = {"generate": [], "engine": []}
    outputs: dict[str, list[int]] = {}
    for order in schedule(list(cpu), rounds, args.seed):
        for name in order:
            settle()
            engine = make_engine(model, tokenizer) if name == "engine" else None
            w0, c0 = time.perf_counter(), time.thread_time()
            ids = run_generate(model, prompt, params) if engine is None else run_engine(engine, prompt, params)
            c1, w1 = time.thread_time(), time.perf_counter()
            cpu[name].append(c1 - c0)
            wall[name].append(w1 - w0)
            outputs[name] = ids
    if outputs["engine"] != outputs["generate"]:
        raise SystemExit("the engine's tokens differ from minienv.generate's: the comparison is void")

    n = args.max_tokens
    result: dict = {"benchmark": "bench_overhead", "model": which, "prompt_tokens": args.prompt_tokens,
                    "max_tokens": n, "rounds": rounds, "same_tokens": True}
    print(f"\n{'':10} {'tokens/s, CPU time':>26} {'tokens/s, wall':>26}")
    for name in cpu:
        tps = {clock: {"best": n / min(ts[name]), "median": n / statistics.median(ts[name])}
               for clock, ts in (("cpu", cpu), ("wall", wall))}
        result[f"{name}_tokens_per_s"] = tps
        print(f"{name:10} {tps['cpu']['best']:>12,.1f} ({tps['cpu']['median']:>9,.1f}) "
              f"{tps['wall']['best']:>12,.1f} ({tps['wall']['median']:>9,.1f})")
    for clock, ts in (("cpu", cpu), ("wall", wall)):
        g, e = result["generate_tokens_per_s"][clock], result["engine_tokens_per_s"][clock]
        # paired: engine time / generate time within each round, median over rounds — the two runs of a round are
        # adjacent and share the host's state, so this is the estimate that survives a host whose speed drifts
        result[f"generate_over_engine_{clock}"] = {"best": g["best"] / e["best"], "median": g["median"] / e["median"],
                                                   "paired": paired(ts["engine"], ts["generate"])}
    r, w = result["generate_over_engine_cpu"], result["generate_over_engine_wall"]
    print(f"\ngenerate / engine tokens/s: {r['paired']:.3f} paired ({r['best']:.3f} best, {r['median']:.3f} median) on "
          f"CPU time; {w['paired']:.3f} paired ({w['best']:.3f} best) on wall time (1.0 = no engine overhead)")
    emit_json(result, settings)


if __name__ == "__main__":
    main()

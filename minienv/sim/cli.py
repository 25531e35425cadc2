"""``python -m minienv simulate``: serve a synthetic trace with minienv's engine on a simulated GPU.

Shaped like vLLM's ``benchmarks/benchmark_serving.py``: the same flag names where they exist, a readable table,
then — last line — one JSON object with its result keys (``request_throughput``, ``output_throughput``,
``mean_ttft_ms``, ``median_itl_ms``, ``median_tpot_ms``, ``median_e2el_ms``, ...) plus preemptions, KV usage and the
prefix-cache hit rate. Bad arguments exit 2 with a message naming the flag; a model that does not fit the GPU
exits 1 naming both sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid rate {text!r}: requests/s > 0, or inf") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 requests/s (or inf: all at once), got {text}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from minienv.sim.hardware import GPUS
    from minienv.sim.models import MODELS
    from minienv.sim.reservation import LAYOUTS
    from minienv.sim.roofline import DEFAULT_MBU, DEFAULT_MFU, DEFAULT_OVERHEAD_S
    from minienv.sim.workloads import DATASETS

    p = argparse.ArgumentParser(
        prog="python -m minienv simulate",
        description="Run minienv's scheduler and paged KV manager on a simulated GPU (a roofline clock) over a "
                    "seeded synthetic trace; print vLLM benchmark_serving's figures.")
    p.add_argument("--model", default="Llama-3-8B",
                   help=f"one of {', '.join(MODELS)}, minienv-target, minienv-draft (default: Llama-3-8B)")
    p.add_argument("--gpu", default="H100-SXM", help=f"one of {', '.join(GPUS)} (default: H100-SXM)")
    p.add_argument("--tensor-parallel-size", type=_positive, default=1, help="GPUs the model is split over")
    p.add_argument("--dataset-name", choices=DATASETS, default="sharegpt",
                   help="sharegpt-like or alpaca-like lengths (synthetic, seeded), or fixed random lengths")
    p.add_argument("--random-input-len", type=_positive, default=1024)
    p.add_argument("--random-output-len", type=_positive, default=128)
    p.add_argument("--num-prompts", type=_positive, default=1000)
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="Poisson arrivals, requests/s; inf (default) sends every request at once")
    p.add_argument("--max-concurrency", type=_positive, default=None,
                   help="at most this many requests in flight (a closed loop of N streams)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduler", choices=("continuous", "static"), default="continuous")
    p.add_argument("--kv-layout", choices=LAYOUTS, default="paged",
                   help="paged, or an Orca-style reservation per request (the vLLM paper's baselines)")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="every prompt starts with one of --num-prefixes shared prefixes of N tokens")
    p.add_argument("--num-prefixes", type=_positive, default=1)
    p.add_argument("--block-size", type=_positive, default=16)
    p.add_argument("--max-num-seqs", type=_positive, default=256)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=8192)
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9)
    p.add_argument("--mfu", type=_fraction, default=DEFAULT_MFU, help="fraction of peak FLOP/s a step reaches")
    p.add_argument("--mbu", type=_fraction, default=DEFAULT_MBU, help="fraction of peak bandwidth a step reaches")
    p.add_argument("--overhead-ms", type=float, default=DEFAULT_OVERHEAD_S * 1e3, help="fixed time per step")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="a progress bar on stderr (auto: for 2000 prompts or more)")
    return p


ROWS = (("Successful requests", "completed", "{:d}"), ("Benchmark duration (s)", "duration", "{:.2f}"),
        ("Total input tokens", "total_input_tokens", "{:d}"), ("Total generated tokens", "total_output_tokens", "{:d}"),
        ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
        ("Output token throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("Mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"), ("Median TTFT (ms)", "median_ttft_ms", "{:.1f}"),
        ("P99 TTFT (ms)", "p99_ttft_ms", "{:.1f}"), ("Median TPOT (ms)", "median_tpot_ms", "{:.2f}"),
        ("Median ITL (ms)", "median_itl_ms", "{:.2f}"), ("P99 ITL (ms)", "p99_itl_ms", "{:.2f}"),
        ("Median E2E latency (ms)", "median_e2el_ms", "{:.1f}"),
        ("Normalized latency (s/token)", "normalized_latency_s_per_token", "{:.4f}"),
        ("Preemptions", "num_preemptions", "{:d}"), ("KV cache blocks", "kv_cache_blocks", "{:d}"),
        ("KV usage mean / peak", None, "kv"), ("Prefix cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),
        ("Engine steps", "num_steps", "{:d}"), ("Simulation wall / CPU time (s)", None, "wall"),
        ("Simulated requests per wall second", "sim_requests_per_s", "{:.0f}"))


def format_table(m: dict) -> str:
    head = f" {m['model']} on {m['tensor_parallel_size']} x {m['gpu']} · {m['scheduler']} · {m['kv_layout']} "
    lines = [f"{head:=^60}"]
    for label, key, fmt in ROWS:
        if fmt == "kv":
            value = f"{m['kv_usage_mean']:.1%} / {m['kv_usage_peak']:.1%}"
        elif fmt == "wall":
            value = f"{m['sim_wall_s']:.2f} / {m['sim_cpu_s']:.2f}"
        else:
            value = fmt.format(m[key])
        lines.append(f"{label + ':':<42}{value:>18}")
    lines.append("=" * 60)
    return "\n".join(lines)


def simulate_main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from minienv.sim.roofline import ModelDoesNotFitError, RooflineClock
    from minienv.sim.run import SimConfig, simulate
    from minienv.sim.workloads import make_trace

    if args.shared_prefix_len < 0:
        parser.error(f"--shared-prefix-len must be >= 0, got {args.shared_prefix_len}")
    if not args.overhead_ms >= 0:
        parser.error(f"--overhead-ms must be >= 0, got {args.overhead_ms}")
    cfg = SimConfig(args.model, args.gpu, args.tensor_parallel_size, args.scheduler, args.kv_layout,
                    args.enable_prefix_caching, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                    args.gpu_memory_utilization, args.mfu, args.mbu, args.overhead_ms / 1e3)
    try:
        clock = RooflineClock(cfg.model, cfg.gpu, tensor_parallel_size=cfg.tensor_parallel_size)
    except ModelDoesNotFitError as exc:
        print(f"minienv simulate: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # unknown model / GPU, TP that does not divide the heads: argument errors
        parser.error(str(exc))
    try:
        trace = make_trace(args.dataset_name, args.num_prompts, args.request_rate, seed=args.seed,
                           max_model_len=clock.model.max_model_len, input_len=args.random_input_len,
                           output_len=args.random_output_len, shared_prefix_len=args.shared_prefix_len,
                           num_prefixes=args.num_prefixes)
    except ValueError as exc:
        parser.error(str(exc))
    progress = args.progress == "on" or (args.progress == "auto" and args.num_prompts >= 2000)
    try:
        result = simulate(trace, cfg, max_concurrency=args.max_concurrency, progress=progress)
    except ModelDoesNotFitError as exc:
        print(f"minienv simulate: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"minienv simulate: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(result.metrics))
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in result.metrics.items()}))
    return 0

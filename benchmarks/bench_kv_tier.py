"""Persistent KV tier: time to first token for a long shared prefix — recompute vs embedded store vs Redis.

    .venv/bin/python benchmarks/bench_kv_tier.py              # ~30 s
    .venv/bin/python benchmarks/bench_kv_tier.py --rounds 5
    .venv/bin/python benchmarks/bench_kv_tier.py --quick      # 3 rounds, 240-token prefix

Each round serves one request on a **fresh engine** (an empty local prefix cache, as after a restart): a long
prefix shared by every round (``--prefix-len`` tokens, default 960 of the model's 1024 positions) followed by a
16-token suffix of its own, one greedy token out (so the time is the time to first token: prefill + one sample).
Three ways, interleaved in every round (a seeded, balanced order: ``benchmarks/_common.py``'s
``schedule``, so drift on a shared machine hits all alike):

* **recompute** — no tier: the whole prompt runs through the model;
* **embedded** — the SQLite store (filled once before the rounds): the prefix's blocks are loaded and verified;
* **redis** — the same through a ``redis-server`` started here on 127.0.0.1 (skipped when it is not installed).

Engine construction (pool allocation, the model fingerprint) is outside the timed region; each engine's first
request is timed. Outputs must be identical in all three (checked). Reported: min and median TTFT per way, the
ratios recompute / tier, the prefill tokens loaded, and bytes per token: raw K/V (the model's), a stored record
(header + token ids + payload + checksum), and the SQLite file on disk. The last line is one JSON object.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import pin_blas_threads  # noqa: E402

BLAS_THREADS = pin_blas_threads()

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from _common import add_common_args, emit_json, print_settings, rounds_of, schedule, settle  # noqa: E402

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.kv_tier import RedisStore, SQLiteStore  # noqa: E402
from minienv.kv_tier.local_redis import LocalRedis, redis_server_binary  # noqa: E402
from minienv.model import load_model  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.tokenizer import load_tokenizer  # noqa: E402

BLOCK_SIZE = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix-len", type=int, default=None, help="shared prefix tokens (default 960; 240 quick)")
    add_common_args(ap, rounds=7)
    args = ap.parse_args()
    rounds = rounds_of(args)
    args.prefix_len = args.prefix_len or (240 if args.quick else 960)
    settings = print_settings()

    model, tok = load_model(), load_tokenizer()
    rng = np.random.default_rng(0)
    prefix = [int(t) for t in rng.integers(0, 2000, args.prefix_len)]
    suffixes = [[int(t) for t in rng.integers(0, 2000, 16)] for _ in range(rounds + 1)]
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    with tempfile.TemporaryDirectory() as tmp:
        stores = {"embedded": SQLiteStore(Path(tmp) / "sqlite")}
        server = None
        if redis_server_binary() is not None:
            server = LocalRedis(Path(tmp) / "redis").start()
            stores["redis"] = RedisStore(server.url)
        try:
            # fill every tier once with the prefix (the warm-up request, not timed)
            for store in stores.values():
                InferenceEngine(model, tok, block_size=BLOCK_SIZE, kv_tier=store).generate([prefix + suffixes[-1]], sp)
            ways = ["recompute", *stores]
            times: dict[str, list[float]] = {w: [] for w in ways}
            loaded: dict[str, int] = {w: 0 for w in ways}
            outputs: dict[str, set] = {w: set() for w in ways}
            for r, order in enumerate(schedule(ways, rounds, args.seed)):
                prompt = prefix + suffixes[r]
                for w in order:
                    settle()
                    engine = InferenceEngine(model, tok, block_size=BLOCK_SIZE,
                                             kv_tier=None if w == "recompute" else stores[w])
                    t0 = time.perf_counter()
                    out = engine.generate([prompt], sp)[0]
                    times[w].append(time.perf_counter() - t0)
                    outputs[w].add((r, tuple(out.token_ids)))
                    if engine.kv_tier is not None:
                        loaded[w] = engine.kv_tier.stats.hit_tokens
                        assert engine.kv_tier.stats.errors == 0
            for w in ways[1:]:
                assert outputs[w] == outputs["recompute"], f"{w}: outputs differ from recompute"
            records, nbytes = stores["embedded"].usage()
            disk = sum(p.stat().st_size for p in (Path(tmp) / "sqlite").iterdir())
        finally:
            if server is not None:
                server.stop()

    prompt_len = args.prefix_len + 16
    result = {
        "benchmark": "bench_kv_tier", "rounds": rounds, "quick": args.quick, "prompt_tokens": prompt_len, "block_size": BLOCK_SIZE,
        "blas_threads": BLAS_THREADS, "redis": "redis" in times,
        "ttft_s": {w: {"min": min(t), "median": statistics.median(t)} for w, t in times.items()},
        "prefill_tokens_loaded": loaded,
        "bytes_per_token": {
            "raw_kv": model.config.kv_bytes_per_token(4),
            "record": nbytes / (records * BLOCK_SIZE),
            "sqlite_files_incl_wal": disk / (records * BLOCK_SIZE),
        },
    }
    result["ratio_recompute_over"] = {
        w: {"min": result["ttft_s"]["recompute"]["min"] / result["ttft_s"][w]["min"],
            "median": result["ttft_s"]["recompute"]["median"] / result["ttft_s"][w]["median"]}
        for w in times if w != "recompute"}
    print(f"prompt {prompt_len} tokens ({args.prefix_len} shared), block {BLOCK_SIZE}, {rounds} rounds, "
          f"BLAS threads {BLAS_THREADS}")
    for w, t in result["ttft_s"].items():
        ratio = result["ratio_recompute_over"].get(w)
        extra = f"  recompute/{w}: {ratio['median']:.2f}x median, {ratio['min']:.2f}x min" if ratio else ""
        print(f"  {w:10s} TTFT min {t['min'] * 1e3:7.2f} ms  median {t['median'] * 1e3:7.2f} ms  "
              f"prefill loaded {loaded[w]:4d} tokens{extra}")
    if "redis" not in times:
        print("  redis: skipped (no redis-server on this machine; Debian: apt-get install redis-server)")
    b = result["bytes_per_token"]
    print(f"  bytes per token: raw K/V {b['raw_kv']}, stored record {b['record']:.1f}, "
          f"SQLite db + WAL files {b['sqlite_files_incl_wal']:.1f}")
    emit_json(result, settings)


if __name__ == "__main__":
    main()

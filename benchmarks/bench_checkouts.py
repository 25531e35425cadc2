"""Two checkouts of minienv side by side: the continuous-batching run of ``bench_engine.py`` part 4, paired.

    .venv/bin/python benchmarks/bench_checkouts.py --base /path/to/older/checkout --rounds 9
    .venv/bin/python benchmarks/bench_checkouts.py --quick      # this checkout against itself: checks the script

How a change is judged (``docs/ARCHITECTURE.md``, the performance rule): on a run a user sees, both versions in
interleaved rounds on the same machine, the ratio taken within each round. Each side is a long-lived worker
process with its own ``sys.path`` (``--base``'s tree, or this one with each attention kernel it has), so imports,
model loading and numba's compilation happen once, before the clock. Every round runs every side once, in a
balanced order (``_common.schedule``: each side in each position and right after each other side equally often),
on a fresh engine: 48 seeded requests (prompts of 16-64 tokens, 16-128 greedy tokens each, end-of-text ignored),
``engine.run()`` timed on the worker's CPU clock. The tokens of every side must be identical, or the script
stops. Reported: per side, min and median seconds, and the paired speedup over the base (base time / side time
within each round, median over rounds). Ends with one JSON line.

``--kernel-on-base`` adds a side that separates the kernel's gain from the engine's: the base's engine with its
attention replaced by this tree's block walk (the base's backend still writes the new K/V into its pool, which must
have this tree's layout: ``KVPool.storage [layers, 2, H, blocks, block_size, D]``, as ``72e9c1e``'s has; with
another layout the walk reads the wrong K/V and the tokens check stops the script). It is what the block walk
alone buys the base's engine, special-case paths and all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()  # before numpy loads; the workers pin their own, and inherit this environment

from _common import add_common_args, emit_json, print_settings, rounds_of, schedule  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

#: the worker: ``tree`` on sys.path, then one line in = one timed run out (json: seconds, tokens)
WORKER = r"""
import json, sys, time
tree, kernel, requests, this_tree = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.path[:0] = [tree, tree + "/benchmarks"]
from _common import pin_blas_threads
pin_blas_threads()
import numpy as np
from _ceiling import CONTINUOUS
from minienv.engine import InferenceEngine
from minienv.model import load_model
from minienv.sampling import SamplingParams
from minienv.tokenizer import load_tokenizer
import minienv
assert minienv.__file__.startswith(tree), (minienv.__file__, tree)
model, tok = load_model(), load_tokenizer()
kw = {} if kernel in ("default", "walk-on-base") else {"attention_kernel": kernel}
if kernel == "walk-on-base":  # the base's engine, this tree's block walk as its attention (--kernel-on-base)
    import importlib, importlib.util
    spec = importlib.util.spec_from_file_location("minienv.kv.block_walk", this_tree + "/minienv/kv/block_walk.py")
    walk_module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its numba cache is found
    spec.loader.exec_module(walk_module)
    backend_class = importlib.import_module("minienv.kv.paged_attention").PagedAttentionBackend

    def attend(self, layer_idx, q, k, v):
        meta = self.metadata
        self.kv_pool.write(layer_idx, meta.slot_mapping, k, v)
        walk = meta.__dict__.get("walk_on_base")
        if walk is None:  # once per step: (sequence, block) pairs in physical-block order, as this tree's walk_order
            blocks = -(-meta.seq_lens // meta.block_size)
            seq, blk = np.nonzero(np.arange(meta.block_tables.shape[1]) < blocks[:, None])
            order = np.argsort(meta.block_tables[seq, blk], kind="stable")
            walk = meta.__dict__["walk_on_base"] = (seq[order], blk[order])
        storage = self.kv_pool.storage[layer_idx]  # [2, H, blocks, block_size, D]
        q = np.ascontiguousarray(q, dtype=np.float32)
        return walk_module.block_walk(q, storage[0], storage[1], meta.block_tables, meta.context_lens,
                                      meta.query_start_loc, walk[0], walk[1], np.float32(1 / np.sqrt(q.shape[2])),
                                      np.empty_like(q))

    backend_class.attend = attend

def run():
    engine = InferenceEngine(model, tok, **CONTINUOUS, **kw)
    engine.eos_token_id = None
    rng = np.random.default_rng(0)
    ids = []
    for _ in range(requests):
        prompt = rng.integers(1, tok.vocab_size, int(rng.integers(16, 64))).tolist()
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(16, 128)), temperature=0)))
    start = time.thread_time()
    engine.run()
    seconds = time.thread_time() - start
    return seconds, [list(engine.output(i).token_ids) for i in ids]

run()  # warm: caches, and numba's compile or cache load
print("ready", flush=True)
for line in sys.stdin:
    seconds, tokens = run()
    print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
"""


def start(tree: Path, kernel: str, requests: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tree), kernel, str(requests), str(REPO)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(tree))
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"the worker for {tree} ({kernel}) did not start: {line!r}")
    return proc


def kernels_here() -> list[str]:
    sys.path.insert(0, str(REPO))
    import importlib

    pa = importlib.import_module("minienv.kv.paged_attention")
    return ["numpy"] + ([] if pa.NUMBA_MISSING else ["numba"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=REPO, help="the other checkout (default: this one)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--kernel-on-base", action="store_true",
                    help="add a side: the base's engine with this tree's block walk as its attention (needs numba)")
    add_common_args(ap, rounds=9, quick_rounds=3)
    args = ap.parse_args()
    rounds = rounds_of(args)
    requests = 6 if args.quick else args.requests
    settings = print_settings()
    base = args.base.resolve()
    sides = {"base": (base, "default")}
    if args.kernel_on_base:
        if "numba" not in kernels_here():
            raise SystemExit("--kernel-on-base needs numba here (pip install 'minienv[lab]')")
        sides["base + this walk"] = (base, "walk-on-base")
    sides.update({f"this ({k})": (REPO, k) for k in kernels_here()})
    print(f"base {base}; this {REPO}; {requests} requests, {rounds} interleaved rounds, CPU time of engine.run()")
    workers = {name: start(tree, kernel, requests) for name, (tree, kernel) in sides.items()}
    names = list(workers)
    times: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list] = {}
    try:
        # a balanced design: every side in every position, and right after every other side, equally often
        for order in schedule(names, rounds, seed=args.seed):
            for name in order:
                proc = workers[name]
                proc.stdin.write("run\n")
                proc.stdin.flush()
                out = json.loads(proc.stdout.readline())
                times[name].append(out["seconds"])
                tokens.setdefault(name, out["tokens"])
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    differ = [n for n in names if tokens[n] != tokens["base"]]
    if differ:
        raise SystemExit(f"tokens differ from the base's: {', '.join(differ)}")
    result = {"base": str(base), "requests": requests, "rounds": rounds, "identical_tokens": True, "sides": {}}
    for n in names:
        paired = statistics.median(b / t for b, t in zip(times["base"], times[n], strict=True))
        print(f"  {n:16s} min {min(times[n]):.3f} s  median {statistics.median(times[n]):.3f} s  "
              f"speedup over base {paired:.3f} (paired, median of rounds)")
        result["sides"][n] = {"min_s": round(min(times[n]), 4), "median_s": round(statistics.median(times[n]), 4),
                              "paired_speedup_over_base": round(paired, 4)}
    emit_json({"benchmark": "bench_checkouts", **result}, settings)


if __name__ == "__main__":
    main()

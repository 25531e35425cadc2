"""Block manager, side by side: minienv's ``KVCacheManager`` vs nano-vllm's ``BlockManager`` algorithm, same trace.

    .venv/bin/python benchmarks/bench_block_manager.py [--blocks 1000 10000 100000] [--rounds 5] [--quick]
                                                        [--requests 600] [--hit-requests 240] [--blas-threads 1]
                                                        [--gc on|off] [--young-pool]

Only bookkeeping is timed (no model, no K/V arrays). Both managers replay the same trace of events, the work an
engine asks of its block manager, step by step:

* **decode** one token of each running request (maybe a new block; the token's slot; a block that fills is hashed),
* **admit** new requests (allocate their prompts' blocks, prefix hits included; their prefill runs in the step),
* **free** the requests that produced their last token.

``ops/s`` = trace events per second. 24 requests run at once, block size 16, prompts of 72 tokens, 32 decode
tokens each. Two traces:

* **no hits**: every prompt is new, so the prefix cache only costs (hash, look up, miss);
* **hits on cached-free blocks**: 48 distinct prompts, reused in turn, so each admission finds its 4 full prompt
  blocks cached by a request that has finished — free, still indexed, somewhere in the free queue.

The nano-vllm side is a faithful reimplementation (written here, from nano-vllm's ``engine/block_manager.py`` and
``engine/sequence.py``; nothing imported): a ``deque`` of free block ids, a ``hash -> block id`` dict that is never
cleaned (a stale entry is caught by comparing the block's stored token ids), ``deque.remove`` to take a block out
of the free list — O(1) for the head, O(position) for a cached-free block found by a hit, which is why its cost
grows with the pool. It hashes a block when its last token is appended (``may_append``), before the step computes
it. Block hashes: xxhash's 64-bit chain, as nano-vllm computes them (``xxhash`` is one of its dependencies, and
the test extra installs it); without ``xxhash`` the script stops and says so, because its stand-in — a sha256 chain
truncated to 64 bits, ``--nano-hash sha256`` — is slower than nano-vllm's real hash and so makes a weaker baseline.
minienv's side calls what its scheduler calls: ``append_slots`` per decode, ``lookup`` + ``allocate`` per
admission, ``commit`` per scheduled request after the step's model call (only then are blocks hashed
and indexed), ``free``. Both sides produce the slot of every token
computed, and for a prefill its input ids and positions too (nano-vllm's as its ``ModelRunner.prepare_prefill``
computes them); the script checks that the two produce the same slots.

The cyclic garbage collector runs as in a real process (``--gc off`` disables it during the runs, as ``timeit``
does), and the table shows how many collections of each generation a trace triggered on each side (the most any
round needed). A collection is triggered by *surviving* container objects (tuples, lists, objects: allocations
minus deallocations), and a full one walks every live object, the pool's included; so a manager that keeps one
small object per indexed block pays for collections whose cost grows with the pool. minienv's prefix index stores
only ints and bytes (never tracked), so its traces, like nano-vllm's, trigger next to none. Each manager is built,
then ``gc.collect()`` moves its pool to the oldest generation (where a running server's pool is) before the clocks
start; ``--young-pool`` collects before building instead, so the trace also pays the collections a brand-new pool
costs (its objects' first promotions), whichever side triggers them.

Rounds are interleaved in the harness's balanced order (``_common.schedule``), each on a fresh manager built outside
the timed region; best and median over rounds, on two clocks: this thread's CPU time (the work itself, whatever
the neighbours on a shared machine do: the ratios quoted) and wall time, and the *paired* ratio (the two sides
within each round, median over rounds: what survives a host whose speed drifts). Ends with exactly one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path

from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

import numpy as np  # noqa: E402

from _common import add_common_args, emit_json, paired, print_settings, rounds_of, schedule  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.kv.interface import KVRequest  # noqa: E402
from minienv.kv.kv_cache_manager import KVCacheManager  # noqa: E402

try:  # nano-vllm hashes with xxhash (--nano-hash sha256: a slower stand-in, only when asked for)
    import xxhash  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None
NANO_HASH = "xxh64" if xxhash is not None else "sha256"  # main() sets it from --nano-hash (and insists on xxh64)

BLOCK_SIZE = 16
LIVE = 24
PROMPT_LEN = 72  # 4 full blocks + 8 tokens
DECODE_LEN = 32
DISTINCT_PROMPTS = 48  # > LIVE: a prompt's previous user has always finished (its blocks are cached-free)


# ---------------------------------------------------------------------------------------------- nano-vllm's algorithm
class NanoBlock:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class NanoSequence:
    """The part of nano-vllm's ``Sequence`` the block manager reads: tokens, block table, cached-token count."""

    def __init__(self, token_ids: list[int], block_size: int):
        self.token_ids = list(token_ids)
        self.num_tokens = len(self.token_ids)
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_cached_tokens = 0

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_tokens += 1


def nano_hash(token_ids: list[int], prefix: int = -1) -> int:
    """nano-vllm's ``compute_hash``: the parent's hash (if any) then the block's tokens, 64 bits."""
    if NANO_HASH == "xxh64":
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids).tobytes())
        return h.intdigest()
    h = hashlib.sha256()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.array(token_ids).tobytes())
    return int.from_bytes(h.digest()[:8], "little")


class NanoBlockManager:
    """nano-vllm's block manager, reimplemented: deque free list, never-cleaned hash dict, ``deque.remove``."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [NanoBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _allocate_block(self, block_id: int) -> NanoBlock:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)  # O(position in the deque)
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: NanoSequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: NanoSequence) -> None:
        assert not seq.block_table
        h = -1
        cache_miss = False
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            h = nano_hash(token_ids, h) if len(token_ids) == self.block_size else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                cache_miss = True
            if cache_miss:
                block_id = self.free_block_ids[0]
                block = self._allocate_block(block_id)
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.update(h, token_ids)
                self.hash_to_block_id[h] = block_id
            seq.block_table.append(block_id)

    def deallocate(self, seq: NanoSequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: NanoSequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: NanoSequence) -> None:
        block_table = seq.block_table
        last_block = self.blocks[block_table[-1]]
        if len(seq) % self.block_size == 1:
            assert last_block.hash != -1
            block_id = self.free_block_ids[0]
            self._allocate_block(block_id)
            block_table.append(block_id)
        elif len(seq) % self.block_size == 0:
            assert last_block.hash == -1
            token_ids = seq.block(seq.num_blocks - 1)
            prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
            h = nano_hash(token_ids, prefix)
            last_block.update(h, token_ids)
            self.hash_to_block_id[h] = last_block.block_id
        else:
            assert last_block.hash == -1


# ---------------------------------------------------------------------------------------------- the trace
def make_trace(num_requests: int, *, hits: bool) -> list[tuple]:
    """One engine step after another: a ``("decode", rid, token)`` for every running request, ``("admit", rid,
    prompt)`` for requests joining (up to ``LIVE`` at once), ``("step",)`` where the step's model call ends (its
    K/V now exist), then ``("free", rid)`` for requests that produced their last token. Token ids are distinct
    per request (no accidental sharing); with ``hits`` request ``i`` reuses prompt ``i % DISTINCT_PROMPTS``."""
    def prompt(i: int) -> list[int]:
        p = i % DISTINCT_PROMPTS if hits else i
        return [1 + p * 1000 + j for j in range(PROMPT_LEN)]

    events: list[tuple] = []
    running: dict[int, int] = {}  # rid -> tokens decoded
    next_rid = 0
    while running or next_rid < num_requests:
        finished = []
        for rid in running:
            events.append(("decode", rid, 10_000_000 + rid * 1000 + running[rid]))
            running[rid] += 1
            if running[rid] == DECODE_LEN:
                finished.append(rid)
        while len(running) - len(finished) < LIVE and next_rid < num_requests:
            events.append(("admit", next_rid, prompt(next_rid)))
            running[next_rid] = 0
            next_rid += 1
        events.append(("step",))
        for rid in finished:
            events.append(("free", rid))
            del running[rid]
    return events


def run_minienv(mgr: KVCacheManager, trace: list[tuple]) -> tuple[float, list[int]]:
    """What minienv's scheduler calls: ``append_slots`` per decode, ``lookup`` + ``allocate`` per admission,
    ``commit`` per request when the step's K/V exist, ``free``."""
    slots: list = []  # slot-mapping arrays, flattened after the clocks stop
    step: list[KVRequest] = []
    reqs: dict = {}  # each request's tokens and progress, as the scheduler's Request holds them
    w0, c0 = time.perf_counter(), time.thread_time()
    for ev in trace:
        kind = ev[0]
        if kind == "decode":
            req = reqs[ev[1]]
            req.all_token_ids.append(ev[2])
            alloc = mgr.append_slots(req, 1)
            assert alloc is not None
            slots.append(alloc.slot_mapping)
            step.append(req)
        elif kind == "step":
            for req in step:
                req.num_computed_tokens = len(req.all_token_ids)
                mgr.commit(req)
            step = []
        elif kind == "admit":
            req = reqs[ev[1]] = KVRequest(ev[1], list(ev[2]))
            hit = mgr.lookup(ev[2])
            alloc = mgr.allocate(req, len(ev[2]) - hit.num_cached_tokens)
            assert alloc is not None
            slots.append(alloc.slot_mapping)  # the array the engine uses; listed for the comparison untimed
            step.append(req)
        else:
            mgr.free(ev[1])
            del reqs[ev[1]]
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    flat = [x for s in slots for x in (s.tolist() if isinstance(s, np.ndarray) else (s,))]
    return wall, cpu, flat


def run_nano(mgr: NanoBlockManager, trace: list[tuple]) -> tuple[float, list[int]]:
    """What nano-vllm's scheduler and model runner call: ``can_append`` + ``may_append`` per decode (after the
    sampled token joined the sequence), ``can_allocate`` + ``allocate`` per admission, ``deallocate``."""
    slots: list[int] = []
    seqs: dict[int, NanoSequence] = {}
    B = mgr.block_size
    w0, c0 = time.perf_counter(), time.thread_time()
    for ev in trace:
        kind = ev[0]
        if kind == "decode":
            seq = seqs[ev[1]]
            seq.append_token(ev[2])
            assert mgr.can_append(seq)
            mgr.may_append(seq)
            slots.append(seq.block_table[-1] * B + seq.last_block_num_tokens - 1)
        elif kind == "admit":
            seq = seqs[ev[1]] = NanoSequence(ev[2], B)
            assert mgr.can_allocate(seq)
            mgr.allocate(seq)
            # the prefill's input ids, positions and slots, as nano-vllm's ModelRunner.prepare_prefill computes
            # them (minienv's allocation returns the same three: token_ids, positions, slot_mapping)
            input_ids = seq.token_ids[seq.num_cached_tokens:]
            positions = list(range(seq.num_cached_tokens, len(seq)))
            assert len(input_ids) == len(positions)
            num_cached_blocks = seq.num_cached_tokens // B
            for i in range(num_cached_blocks, seq.num_blocks):
                start = seq.block_table[i] * B
                end = start + (B if i != seq.num_blocks - 1 else seq.last_block_num_tokens)
                slots.extend(list(range(start, end)))
        elif kind == "free":
            mgr.deallocate(seqs.pop(ev[1]))
    return time.perf_counter() - w0, time.thread_time() - c0, slots


def measure(num_blocks: int, trace: list[tuple], rounds: int, seed: int, young_pool: bool = False) -> dict:
    """Interleaved rounds in the harness's balanced order; a fresh manager per run, built before the clocks start.
    Both clocks: wall, and this thread's CPU time (the work itself, whatever the neighbours on a shared machine
    do); ratios are minienv / nano-vllm in ops/s, so > 1 means minienv is faster."""
    runners = {
        "minienv": (lambda: KVCacheManager(num_blocks, BLOCK_SIZE), run_minienv),
        "nano": (lambda: NanoBlockManager(num_blocks, BLOCK_SIZE), run_nano),
    }
    wall: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    collections: dict[str, list[list[int]]] = {k: [] for k in runners}  # per run: [gen0, gen1, gen2]
    slots: dict[str, list[int]] = {}
    for order in schedule(list(runners), rounds, seed):
        for name in order:
            build, run = runners[name]
            if young_pool:  # the pool's objects still in the young generations: the first collections walk them
                gc.collect()
                manager = build()
            else:
                manager = build()
                # Each run starts from the same collector state, the pool already in the oldest generation (where
                # a running server's is): collections that promote a new pool's objects are the construction's.
                gc.collect()
            counts = [0, 0, 0]

            def count(phase: str, info: dict, counts: list[int] = counts) -> None:
                if phase == "start":
                    counts[info["generation"]] += 1

            gc.callbacks.append(count)  # counts the trace's collections only
            try:
                w, c, slots[name] = run(manager, trace)
            finally:
                gc.callbacks.remove(count)
            del manager
            wall[name].append(w)
            cpu[name].append(c)
            collections[name].append(counts)
    ops = sum(ev[0] != "step" for ev in trace)
    out: dict = {"num_blocks": num_blocks, "ops": ops, "same_slots": slots["minienv"] == slots["nano"]}
    for name, per_run in collections.items():  # the most any run needed, per generation
        out[f"{name}_gc_collections"] = [max(run[g] for run in per_run) for g in range(3)]
    for clock, times in (("cpu", cpu), ("wall", wall)):
        for name, ts in times.items():
            out[f"{name}_ops_per_s_{clock}"] = {"best": ops / min(ts), "median": ops / statistics.median(ts)}
        for stat in ("best", "median"):
            out.setdefault(f"minienv_over_nano_{clock}", {})[stat] = (
                out[f"minienv_ops_per_s_{clock}"][stat] / out[f"nano_ops_per_s_{clock}"][stat])
        # ops/s ratio = nano's time / minienv's, within each round
        out[f"minienv_over_nano_{clock}"]["paired"] = paired(times["nano"], times["minienv"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--requests", type=int, default=600, help="requests in the no-hit trace")
    ap.add_argument("--hit-requests", type=int, default=240, help="requests in the hit trace")
    ap.add_argument("--gc", choices=["on", "off"], default="on",
                    help="Python's cyclic garbage collector during the timed runs (off: as timeit does)")
    ap.add_argument("--young-pool", action="store_true",
                    help="collect before building each manager, not after: the trace starts with a brand-new pool "
                         "whose objects the collector has not yet moved to its oldest generation")
    ap.add_argument("--nano-hash", choices=["xxh64", "sha256"], default="xxh64",
                    help="nano-vllm's block hash: xxh64 as nano-vllm computes it (needs the xxhash package), or "
                         "sha256 truncated to 64 bits, a slower stand-in that weakens the baseline")
    add_common_args(ap)
    args = ap.parse_args()
    global NANO_HASH
    NANO_HASH = args.nano_hash
    if NANO_HASH == "xxh64" and xxhash is None:
        sys.exit("bench_block_manager: nano-vllm hashes blocks with xxhash, which is not installed here. Install it "
                 "(pip install xxhash==4.1.0; the test extra has it) or pass --nano-hash sha256 for a slower stand-in "
                 "that weakens the baseline.")
    if args.quick:
        args.blocks, args.requests, args.hit_requests = [1000, 10_000], 120, 60
    rounds = rounds_of(args)
    settings = print_settings()
    if args.gc == "off":
        gc.disable()
    print(f"garbage collector during the runs: {args.gc}; each pool "
          f"{'brand-new (young)' if args.young_pool else 'moved to the oldest generation before the clocks start'}")
    print("nano-vllm hash: " + ("xxhash xxh64, as nano-vllm" if NANO_HASH == "xxh64" else "sha256 truncated to 64 "
                                "bits (a stand-in slower than nano-vllm's xxh64: --nano-hash sha256)"))
    print(f"trace: {LIVE} live requests, block size {BLOCK_SIZE}, prompt {PROMPT_LEN} + {DECODE_LEN} decode tokens; "
          f"{rounds} interleaved rounds; ops/s best (median), on this thread's CPU time [wall best]; "
          "minienv / nano: best (median) [paired: within each round, median over rounds]")
    results: dict[str, list[dict]] = {}
    for label, hits, n_req in (("no_hits", False, args.requests), ("hits", True, args.hit_requests)):
        trace = make_trace(n_req, hits=hits)
        results[label] = []
        print(f"\n{label}: {sum(ev[0] != 'step' for ev in trace)} events ({n_req} requests)")
        print(f"{'blocks':>8} {'minienv ops/s':>30} {'nano-vllm ops/s':>30} {'minienv / nano':>22} same slots"
              "  gc collections per trace, gen0/1/2 (minienv | nano)")
        for nb in args.blocks:
            row = measure(nb, trace, rounds, args.seed, args.young_pool)
            results[label].append(row)
            m, n = row["minienv_ops_per_s_cpu"], row["nano_ops_per_s_cpu"]
            r = row["minienv_over_nano_cpu"]
            print(f"{nb:>8} {m['best']:>10,.0f} ({m['median']:>8,.0f}) [{row['minienv_ops_per_s_wall']['best']:>8,.0f}]"
                  f" {n['best']:>10,.0f} ({n['median']:>8,.0f}) [{row['nano_ops_per_s_wall']['best']:>8,.0f}]"
                  f" {r['best']:>7.2f} ({r['median']:.2f}) [{r['paired']:.2f}] {str(row['same_slots']):>10}"
                  f"  {'/'.join(map(str, row['minienv_gc_collections']))} | "
                  f"{'/'.join(map(str, row['nano_gc_collections']))}")
    emit_json({"benchmark": "bench_block_manager", "block_size": BLOCK_SIZE, "live_requests": LIVE,
               "prompt_len": PROMPT_LEN, "decode_len": DECODE_LEN, "rounds": rounds,
               "nano_hash": NANO_HASH if NANO_HASH == "xxh64" else "sha256-64", "gc": args.gc,
               "young_pool": args.young_pool, **results}, settings)


if __name__ == "__main__":
    main()

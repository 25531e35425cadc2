"""Block manager, side by side: minienv's ``KVCacheManager`` vs nano-vllm's ``BlockManager`` algorithm, same trace.

    .venv/bin/python benchmarks/bench_block_manager.py [--blocks 1000 10000 100000] [--rounds 3]
                                                        [--requests 600] [--hit-requests 240] [--blas-threads 1]

Only bookkeeping is timed (no model, no K/V arrays). Both managers replay the same trace of events, the work an
engine asks of its block manager:

* **admit** a request (allocate its prompt's blocks, prefix hits included; the prefill is then computed),
* **decode** one token of a running request (maybe a new block; the token's slot; a block that fills is hashed),
* **free** a finished request.

``ops/s`` = trace events per second. 24 requests run at once, block size 16, prompts of 72 tokens, 32 decode
tokens each. Two traces:

* **no hits**: every prompt is new, so the prefix cache only costs (hash, look up, miss);
* **hits on cached-free blocks**: 48 distinct prompts, reused in turn, so each admission finds its 4 full prompt
  blocks cached by a request that has finished — free, still indexed, somewhere in the free queue.

The nano-vllm side is a faithful reimplementation (written here, from nano-vllm's ``engine/block_manager.py`` and
``engine/sequence.py``; nothing imported): a ``deque`` of free block ids, a ``hash -> block id`` dict that is never
cleaned (a stale entry is caught by comparing the block's stored token ids), ``deque.remove`` to take a block out
of the free list — O(1) for the head, O(position) for a cached-free block found by a hit, which is why its cost
grows with the pool. Block hashes: xxhash's 64-bit chain as nano-vllm does when ``xxhash`` is installed, otherwise
a sha256 chain truncated to 64 bits (the output says which). minienv's side calls what its scheduler calls:
``find_prefix`` + ``allocate_slots`` (the admission with the scheduler's lookup) + ``commit`` for an admission,
``append_slot`` (the decode fast path) + ``commit`` for a decode, ``free``. Both sides produce the slot of every
token computed (nano-vllm's prefill slots as its ``ModelRunner.prepare_prefill`` computes them); the script checks
that the two produce the same slots.

Rounds are interleaved (minienv, nano; nano, minienv; ...), each on a fresh manager built outside the timed region;
min and median over rounds. Ends with exactly one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections import deque
from pathlib import Path

from _common import pin_blas_threads  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

BLAS_THREADS = pin_blas_threads()

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minienv.kv.kv_cache_manager import KVCacheManager  # noqa: E402

try:  # nano-vllm hashes with xxhash; without it, a 64-bit sha256 chain stands in
    import xxhash  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

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
    if xxhash is not None:
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
    """Events ``("admit", rid, prompt)``, ``("decode", rid, token)``, ``("free", rid)``: ``LIVE`` requests at once,
    each decoding one token per step in admission order; a finished request is freed and the next one admitted.
    Token ids are distinct per request (no accidental sharing); with ``hits`` request ``i`` reuses prompt
    ``i % DISTINCT_PROMPTS``."""
    def prompt(i: int) -> list[int]:
        p = i % DISTINCT_PROMPTS if hits else i
        return [1 + p * 1000 + j for j in range(PROMPT_LEN)]

    events: list[tuple] = []
    live: dict[int, int] = {}  # rid -> tokens decoded
    next_rid = 0
    while live or next_rid < num_requests:
        while len(live) < LIVE and next_rid < num_requests:
            events.append(("admit", next_rid, prompt(next_rid)))
            live[next_rid] = 0
            next_rid += 1
        for rid in list(live):
            events.append(("decode", rid, 10_000_000 + rid * 1000 + live[rid]))
            live[rid] += 1
            if live[rid] == DECODE_LEN:
                events.append(("free", rid))
                del live[rid]
    return events


def run_minienv(mgr: KVCacheManager, trace: list[tuple]) -> tuple[float, list[int]]:
    slots: list[int] = []
    t0 = time.perf_counter()
    for ev in trace:
        kind, rid = ev[0], ev[1]
        if kind == "decode":
            slot = mgr.append_slot(rid, ev[2])
            assert slot is not None
            mgr.commit(rid)
            slots.append(slot)
        elif kind == "admit":  # what the scheduler calls: look up, then allocate with that hit
            hit = mgr.find_prefix(ev[2])
            alloc = mgr.allocate_slots(rid, ev[2], hit, len(ev[2]) - hit.num_cached_tokens)
            assert alloc is not None
            slots.extend(alloc.slot_mapping.tolist())
            mgr.commit(rid)
        else:
            mgr.free(rid)
    return time.perf_counter() - t0, slots


def run_nano(mgr: NanoBlockManager, trace: list[tuple]) -> tuple[float, list[int]]:
    slots: list[int] = []
    seqs: dict[int, NanoSequence] = {}
    B = mgr.block_size
    t0 = time.perf_counter()
    for ev in trace:
        kind, rid = ev[0], ev[1]
        if kind == "decode":
            seq = seqs[rid]
            seq.append_token(ev[2])
            assert mgr.can_append(seq)
            mgr.may_append(seq)
            slots.append(seq.block_table[-1] * B + seq.last_block_num_tokens - 1)
        elif kind == "admit":
            seq = seqs[rid] = NanoSequence(ev[2], B)
            assert mgr.can_allocate(seq)
            mgr.allocate(seq)
            # the prefill's slots, as nano-vllm's ModelRunner.prepare_prefill computes them
            num_cached_blocks = seq.num_cached_tokens // B
            for i in range(num_cached_blocks, seq.num_blocks):
                start = seq.block_table[i] * B
                end = start + (B if i != seq.num_blocks - 1 else seq.last_block_num_tokens)
                slots.extend(list(range(start, end)))
        else:
            mgr.deallocate(seqs.pop(rid))
    return time.perf_counter() - t0, slots


def measure(num_blocks: int, trace: list[tuple], rounds: int) -> dict:
    """Interleaved rounds, order rotated each round; a fresh manager per run, built before the clock starts."""
    runners = {
        "minienv": lambda: run_minienv(KVCacheManager(num_blocks, BLOCK_SIZE), trace),
        "nano": lambda: run_nano(NanoBlockManager(num_blocks, BLOCK_SIZE), trace),
    }
    times: dict[str, list[float]] = {k: [] for k in runners}
    slots: dict[str, list[int]] = {}
    names = list(runners)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            seconds, slots[name] = runners[name]()
            times[name].append(seconds)
    ops = len(trace)
    out = {"num_blocks": num_blocks, "ops": ops, "same_slots": slots["minienv"] == slots["nano"]}
    for name, ts in times.items():
        out[f"{name}_ops_per_s_best"] = ops / min(ts)
        out[f"{name}_ops_per_s_median"] = ops / statistics.median(ts)
    out["minienv_over_nano_best"] = out["minienv_ops_per_s_best"] / out["nano_ops_per_s_best"]
    out["minienv_over_nano_median"] = out["minienv_ops_per_s_median"] / out["nano_ops_per_s_median"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1000, 10_000, 100_000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=600, help="requests in the no-hit trace")
    ap.add_argument("--hit-requests", type=int, default=240, help="requests in the hit trace")
    ap.add_argument("--blas-threads", default=BLAS_THREADS)
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (interleaved, rotated)")
    print(f"python {platform.python_version()}, numpy {np.__version__}, BLAS threads {BLAS_THREADS} "
          f"(OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}), cpus {os.cpu_count()}; "
          f"nano-vllm hash: {'xxhash xxh64' if xxhash is not None else 'sha256 truncated to 64 bits (no xxhash)'}")
    print(f"trace: {LIVE} live requests, block size {BLOCK_SIZE}, prompt {PROMPT_LEN} + {DECODE_LEN} decode tokens; "
          f"{args.rounds} interleaved rounds, ops/s best (median)")
    results: dict[str, list[dict]] = {}
    for label, hits, n_req in (("no_hits", False, args.requests), ("hits", True, args.hit_requests)):
        trace = make_trace(n_req, hits=hits)
        results[label] = []
        print(f"\n{label}: {len(trace)} events ({n_req} requests)")
        print(f"{'blocks':>8} {'minienv ops/s':>22} {'nano-vllm ops/s':>22} {'minienv / nano':>16} same slots")
        for nb in args.blocks:
            row = measure(nb, trace, args.rounds)
            results[label].append(row)
            print(f"{nb:>8} {row['minienv_ops_per_s_best']:>11,.0f} ({row['minienv_ops_per_s_median']:>8,.0f}) "
                  f"{row['nano_ops_per_s_best']:>11,.0f} ({row['nano_ops_per_s_median']:>8,.0f}) "
                  f"{row['minienv_over_nano_best']:>7.2f} ({row['minienv_over_nano_median']:.2f}) "
                  f"{row['same_slots']}")
    print(json.dumps({"benchmark": "block_manager", "blas_threads": BLAS_THREADS, "block_size": BLOCK_SIZE,
                      "live_requests": LIVE, "rounds": args.rounds,
                      "nano_hash": "xxh64" if xxhash is not None else "sha256-64", **results}))


if __name__ == "__main__":
    main()

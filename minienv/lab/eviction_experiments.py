"""Prefix-cache eviction experiments for notebook 06: hit rate vs KV budget, and a cache stream to watch.

Pure token-level simulations (no model): the bookkeeping is the real :class:`~minienv.kv.kv_cache_manager.
KVCacheManager` (or, for comparison, a faithful model of another engine's block manager). The numbers are tested
in ``tests/unit/test_sharing_experiments.py``.

* :class:`NanoVLLMBlockManager` — nano-vllm's ``BlockManager`` policy reproduced: a ``deque`` of free block ids,
  allocation from the left, frees appended on the right, a ``hash -> block id`` dict checked against the block's
  own token ids.
* :func:`popular_prefix_workload`, :func:`simulate_cache`, :func:`hit_rate_sweep` — prefix-cache hit rate (in
  tokens) as a function of the KV budget for several policies on one seeded request stream.
* :class:`CacheStream` — a request stream served step by step through a real manager (the live widget's data).
* :func:`usable_prefix_after_evictions` — why a chain is freed last block first (LMCache #184: its evictor evicted a request's first chunk first).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from minienv.kv.block_table import cdiv
from minienv.kv.errors import OutOfBlocksError
from minienv.kv.hashing import ROOT_HASH, hash_block_tokens
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import KVCacheManager

__all__ = [
    "NanoVLLMBlockManager", "POLICIES", "CacheRequest", "popular_prefix_workload", "CacheRunStats", "admits",
    "simulate_cache",
    "CacheStream", "hit_rate_sweep", "format_hit_rate_table", "usable_prefix_after_evictions",
]


# ====================================================================== nano-vllm's block manager, as a policy
class NanoVLLMBlockManager:
    """nano-vllm's ``BlockManager`` (``nanovllm/engine/block_manager.py``) reproduced as a cache policy.

    What it does, read from its source:

    * ``free_block_ids`` is a ``collections.deque``; a new block is ``free_block_ids[0]`` — the **left** end —
      removed with ``deque.remove`` (O(position); O(1) at the head);
    * ``deallocate`` walks the block table **in reverse** and ``append``s each block whose refcount reaches 0 to the
      **right** end — so the deque is ordered by *when blocks were freed* ("FIFO of frees"); a freed block keeps its
      hash and token ids;
    * ``hash_to_block_id`` maps a chain hash (xxhash64 of the parent hash and the block's tokens) to a block id.
      Entries are never removed when a block is reused; a lookup is a hit only if the block's *own* token ids still
      equal the request's, so a reused block simply stops matching;
    * a hit on a block with refcount 0 takes it out of the *middle* of the deque (``deque.remove``: O(n)); the
      first miss makes every later block of the prompt a miss; a prompt whose every block is cached is hit in full
      (nano-vllm #144: zero tokens left to compute).

    Here the hash is our sha256 chain (the policy does not depend on the hash function), and tokens are counted
    like :class:`KVCacheManager` counts them (queries = prompt tokens, hits = cached prompt tokens).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.token_ids: list[tuple[int, ...]] = [()] * num_blocks
        self.hash_to_block_id: dict[bytes, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.tables: dict[object, list[int]] = {}
        self.seqs: dict[object, list[int]] = {}
        self.queries = self.hits = self.evicted_blocks = self.full_prompt_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _take(self, bid: int) -> None:
        self.free_block_ids.remove(bid)  # nano-vllm's _allocate_block: deque.remove, O(position)
        self.ref_count[bid] = 1

    def _hit_blocks(self, prompt: Sequence[int]) -> list[int]:
        B, h, out = self.block_size, ROOT_HASH, []
        for j in range(len(prompt) // B):
            toks = tuple(prompt[j * B:(j + 1) * B])
            h = hash_block_tokens(h, toks)
            bid = self.hash_to_block_id.get(h)
            if bid is None or self.token_ids[bid] != toks:
                break
            out.append(bid)
        return out

    def lookup_blocks(self, prompt: Sequence[int]) -> int:
        return len(self._hit_blocks(prompt))

    def hit_free_blocks(self, prompt: Sequence[int]) -> int:
        return sum(1 for b in self._hit_blocks(prompt) if self.ref_count[b] == 0)

    def allocate(self, rid, prompt: Sequence[int]) -> int:
        """Admit a request; return its cached prompt tokens."""
        B = self.block_size
        prompt = [int(t) for t in prompt]
        hits = self._hit_blocks(prompt)
        n_blocks = cdiv(len(prompt), B)
        if n_blocks - sum(1 for b in hits if self.ref_count[b] > 0) > len(self.free_block_ids):
            raise OutOfBlocksError(n_blocks, len(self.free_block_ids), self.num_blocks)
        table: list[int] = []
        h = ROOT_HASH
        for j in range(n_blocks):
            toks = tuple(prompt[j * B:(j + 1) * B])
            full = len(toks) == B
            if full:
                h = hash_block_tokens(h, toks)
            if j < len(hits):
                bid = hits[j]
                if self.ref_count[bid] > 0:
                    self.ref_count[bid] += 1
                else:
                    self._take(bid)
            else:
                bid = self.free_block_ids[0]
                if self.hash[bid] is not None:
                    self.evicted_blocks += 1  # its old contents are gone (the stale dict entry stays)
                self._take(bid)
                self.hash[bid], self.token_ids[bid] = None, ()
                if full:
                    self.hash[bid], self.token_ids[bid] = h, toks
                    self.hash_to_block_id[h] = bid
            table.append(bid)
        self.tables[rid] = table
        self.seqs[rid] = prompt
        self.queries += len(prompt)
        self.hits += len(hits) * B
        if hits and len(hits) * B == len(prompt):
            self.full_prompt_hits += 1
        return len(hits) * B

    def append(self, rid, token: int) -> None:
        """``may_append`` after a decode token: a new block at a boundary; hash the block it fills."""
        B = self.block_size
        seq, table = self.seqs[rid], self.tables[rid]
        seq.append(int(token))
        n = len(seq)
        if n % B == 1:
            if not self.free_block_ids:
                raise OutOfBlocksError(1, 0, self.num_blocks)
            bid = self.free_block_ids[0]
            if self.hash[bid] is not None:
                self.evicted_blocks += 1
            self._take(bid)
            self.hash[bid], self.token_ids[bid] = None, ()
            table.append(bid)
        elif n % B == 0:
            parent = self.hash[table[-2]] if len(table) > 1 else ROOT_HASH
            if parent is None:
                return
            toks = tuple(seq[-B:])
            h = hash_block_tokens(parent, toks)
            self.hash[table[-1]], self.token_ids[table[-1]] = h, toks
            self.hash_to_block_id[h] = table[-1]

    def free(self, rid) -> None:
        for bid in reversed(self.tables.pop(rid)):
            self.ref_count[bid] -= 1
            if self.ref_count[bid] == 0:
                self.free_block_ids.append(bid)
        del self.seqs[rid]


class _OursPolicy:
    """:class:`KVCacheManager` behind the small interface :func:`simulate_cache` drives."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool):
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.block_size = block_size
        self.reqs: dict[object, KVRequest] = {}  # each request's tokens and progress (the manager reads them)

    @property
    def num_free_blocks(self) -> int:
        return self.mgr.num_free_blocks

    def lookup_blocks(self, prompt) -> int:
        return len(self.mgr.lookup(prompt).block_ids)

    def hit_free_blocks(self, prompt) -> int:
        return sum(1 for b in self.mgr.lookup(prompt).block_ids if self.mgr.ref_cnt(b) == 0)

    def allocate(self, rid, prompt) -> int:
        req = self.reqs[rid] = KVRequest(rid, list(prompt))
        n = self.mgr.allocate(req).num_cached_tokens
        req.num_computed_tokens = req.num_tokens  # the step computes the prompt
        self.mgr.commit(req)
        return n

    def append(self, rid, token: int) -> None:
        req = self.reqs[rid]
        req.all_token_ids.append(token)
        self.mgr.append_slots(req, 1)
        req.num_computed_tokens = req.num_tokens
        self.mgr.commit(req)

    def free(self, rid) -> None:
        self.mgr.free(rid)
        del self.reqs[rid]

    @property
    def queries(self) -> int:
        return self.mgr.prefix_stats.queries

    @property
    def hits(self) -> int:
        return self.mgr.prefix_stats.hits

    @property
    def evicted_blocks(self) -> int:
        return self.mgr.prefix_stats.evicted_blocks


#: policy name -> factory(num_blocks, block_size)
POLICIES: dict[str, Callable[[int, int], object]] = {
    "minienv LRU": lambda n, b: _OursPolicy(n, b, True),
    "nano-vllm FIFO-of-frees": NanoVLLMBlockManager,
    "no caching": lambda n, b: _OursPolicy(n, b, False),
}


# ====================================================================== workload + hit-rate simulation
@dataclass(frozen=True)
class CacheRequest:
    """One request of a cache simulation: its prompt token ids, how many tokens it generates, and its prefix."""

    prompt: tuple[int, ...]
    output_len: int
    prefix_id: int  # 0 = the popular system prompt, k >= 1 = tail system prompt k


def popular_prefix_workload(
    num_requests: int = 240,
    *,
    popular_share: float = 0.5,
    num_tail_prefixes: int = 60,
    prefix_len: int = 96,
    question_mean: float = 24.0,
    output_mean: float = 16.0,
    vocab: int = 1000,
    seed: int = 0,
) -> list[CacheRequest]:
    """A request stream with one popular system prompt and a long tail of others.

    Each request is a system prompt of ``prefix_len`` tokens followed by its own question (log-normal length, mean
    ``question_mean``), and generates a log-normal number of tokens (mean ``output_mean``). With probability
    ``popular_share`` the system prompt is the popular one; otherwise it is tail prompt ``k`` with Zipf-like
    probability ∝ 1/k over ``num_tail_prefixes`` prompts (a few tail prompts recur, most are rare). Token ids are
    random (seeded), so two prompts share exactly the tokens they are meant to share.
    """
    rng = np.random.default_rng(seed)
    prefixes = [tuple(int(t) for t in rng.integers(0, vocab, prefix_len)) for _ in range(num_tail_prefixes + 1)]
    weights = 1.0 / np.arange(1, num_tail_prefixes + 1)
    weights /= weights.sum()
    out = []
    for _ in range(num_requests):
        k = 0 if rng.random() < popular_share else 1 + int(rng.choice(num_tail_prefixes, p=weights))
        q = max(1, int(round(rng.lognormal(np.log(question_mean) - 0.125, 0.5))))
        o = max(1, int(round(rng.lognormal(np.log(output_mean) - 0.125, 0.5))))
        question = tuple(int(t) for t in rng.integers(0, vocab, q))
        out.append(CacheRequest(prefixes[k] + question, o, k))
    return out


@dataclass(frozen=True)
class CacheRunStats:
    """Prefix-cache counters of one simulated run (tokens, like vLLM's ``prefix_cache_queries/hits``)."""

    policy: str
    kv_budget_tokens: int
    queries: int
    hits: int
    evicted_blocks: int
    prefill_tokens_computed: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def simulate_cache(requests: Sequence[CacheRequest], kv_budget_tokens: int, policy: str = "minienv LRU", *,
                   block_size: int = 16, max_running: int = 4) -> CacheRunStats:
    """Serve ``requests`` (bookkeeping only, no model) under one policy and budget; count prefix-cache hits.

    FCFS: every step each running request appends one (request-unique) token; a request is admitted when fewer
    than ``max_running`` run and its whole life fits in the free blocks next to what running requests still need;
    it is freed when it has generated ``output_len`` tokens.
    """
    num_blocks = kv_budget_tokens // block_size
    longest = max(cdiv(len(r.prompt) + r.output_len, block_size) for r in requests)
    if num_blocks < longest:
        raise ValueError(f"a budget of {kv_budget_tokens} tokens cannot hold the longest request ({longest} blocks)")
    pol = POLICIES[policy](num_blocks, block_size)
    waiting = deque(range(len(requests)))
    running: dict[int, int] = {}  # rid -> tokens generated
    computed = 0
    # notebook 06 runs this loop in its first cell (its `serve`), asserted equal to this function
    while waiting or running:
        for rid, n in list(running.items()):
            if n == requests[rid].output_len:
                pol.free(rid)
                del running[rid]
            else:
                pol.append(rid, 1_000_000 + rid * 1000 + n)  # unique decode tokens: never shared by accident
                running[rid] = n + 1
        while waiting and len(running) < max_running and admits(pol, requests, waiting[0], running, block_size):
            rid = waiting.popleft()
            computed += len(requests[rid].prompt) - pol.allocate(rid, requests[rid].prompt)
            running[rid] = 0
        if not running and waiting:  # pragma: no cover - the budget check above rules it out
            raise RuntimeError("no request could be admitted")
    return CacheRunStats(policy, num_blocks * block_size, pol.queries, pol.hits, pol.evicted_blocks, computed)


def admits(pol, requests: Sequence[CacheRequest], rid: int, running: dict[int, int], block_size: int = 16) -> bool:
    """Whether request ``rid`` may start now: its whole life (prompt and output, less the blocks its prefix hit
    brings, plus the cached-free hit blocks that leave the free queue) fits in the free blocks next to what the
    ``running`` requests (``rid -> tokens generated``) still need — so no admitted request ever runs out."""
    reserved = sum(cdiv(len(requests[r].prompt) + requests[r].output_len, block_size)
                   - cdiv(len(requests[r].prompt) + n, block_size) for r, n in running.items())
    req = requests[rid]
    life = (cdiv(len(req.prompt) + req.output_len, block_size) - pol.lookup_blocks(req.prompt)
            + pol.hit_free_blocks(req.prompt))
    return life + reserved <= pol.num_free_blocks


class CacheStream:
    """A request stream served step by step through a real :class:`KVCacheManager` (bookkeeping only, no model).

    Each :meth:`step` is one engine step: requests that have generated ``output_len`` tokens finish (freed, last
    block first), every running request decodes one token, then waiting requests are admitted FCFS while fewer than
    ``max_running`` run and the request's whole life fits next to what the running ones still need. Returns a
    caption, or ``None`` when everything has finished. Request ``i`` is ``"r{i}"`` in the manager; ``hits`` and
    ``running`` are keyed by ``i``. ``evicted_in_use`` collects any evicted block that a running
    request held at that moment — it must stay empty (the naive design's evictor fills it).
    """

    def __init__(self, requests: Sequence[CacheRequest], mgr: KVCacheManager, *, max_running: int = 2):
        self.requests = list(requests)
        self.mgr = mgr
        self.max_running = max_running
        self.waiting = deque(range(len(self.requests)))
        self.running: dict[int, int] = {}
        self.hits: dict[int, int] = {}
        self.kv_requests: dict[int, KVRequest] = {}  # the running requests' tokens and progress, by index
        self.evicted_in_use: list[int] = []
        self.evictions: list[tuple[int, int]] = []  # (step, block id)
        self.steps = 0
        self._evicted_now: list[int] = []
        mgr.add_listener(self._on_event)
        B = mgr.block_size
        longest = max(cdiv(len(r.prompt) + r.output_len, B) for r in self.requests)
        if longest > mgr.num_blocks:
            raise ValueError(f"the pool ({mgr.num_blocks} blocks) cannot hold the longest request ({longest} blocks)")

    @staticmethod
    def request_name(index: int) -> str:
        """The manager's request id for request ``index`` ("r0", "r1", ...)."""
        return f"r{index}"

    def _on_event(self, event) -> None:
        if event.kind == "evict":
            self._evicted_now.append(event.block_id)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> str | None:
        if self.done:
            return None
        mgr, B, notes = self.mgr, self.mgr.block_size, []
        name = self.request_name
        for rid in [r for r, n in self.running.items() if n == self.requests[r].output_len]:
            mgr.free(name(rid))
            del self.running[rid], self.kv_requests[rid]
            notes.append(f"{name(rid)} finishes")
        held = {b for rid in self.running for b in mgr.block_ids(name(rid))}
        self._evicted_now = []
        for rid in self.running:
            kv_req = self.kv_requests[rid]
            kv_req.all_token_ids.append(1_000_000 + rid * 1000 + self.running[rid])
            mgr.append_slots(kv_req, 1)
            kv_req.num_computed_tokens = kv_req.num_tokens
            mgr.commit(kv_req)
            self.running[rid] += 1
        if self.running:
            notes.append("running decode 1 token")
        reserved = sum(cdiv(len(self.requests[r].prompt) + self.requests[r].output_len, B)
                       - len(mgr.block_ids(name(r))) for r in self.running)
        admitted: list[int] = []
        while self.waiting and len(self.running) < self.max_running:
            req = self.requests[self.waiting[0]]
            hit = mgr.lookup(req.prompt)
            hit_free = sum(1 for b in hit.block_ids if mgr.ref_cnt(b) == 0)
            life = cdiv(len(req.prompt) + req.output_len, B) - len(hit.block_ids)
            if life + hit_free + reserved > mgr.num_free_blocks:
                break
            rid = self.waiting.popleft()
            self.kv_requests[rid] = KVRequest(name(rid), list(req.prompt))
            alloc = mgr.allocate(self.kv_requests[rid])
            admitted.append(rid)
            self.hits[rid] = alloc.num_cached_tokens
            self.running[rid] = 0
            reserved += cdiv(len(req.prompt) + req.output_len, B) - len(mgr.block_ids(name(rid)))
            notes.append(f"{name(rid)} arrives ({alloc.num_cached_tokens}/{len(req.prompt)} cached)")
        for rid in admitted:  # after the step that computes them, their full blocks become findable
            kv_req = self.kv_requests[rid]
            kv_req.num_computed_tokens = kv_req.num_tokens
            mgr.commit(kv_req)
        self.evicted_in_use += [b for b in self._evicted_now if b in held]
        self.evictions += [(self.steps, b) for b in self._evicted_now]
        if self._evicted_now:
            notes.append(f"evicted {self._evicted_now}")
        self.steps += 1
        return f"step {self.steps}: " + "; ".join(notes)

    def close(self) -> None:
        """Stop listening to the manager."""
        self.mgr.remove_listener(self._on_event)


def hit_rate_sweep(requests: Sequence[CacheRequest], budgets: Sequence[int], policies: Sequence[str] = tuple(POLICIES),
                   *, block_size: int = 16, max_running: int = 4) -> dict[str, list[CacheRunStats]]:
    """:func:`simulate_cache` for every policy at every budget (tokens): ``{policy: [stats per budget]}``."""
    return {p: [simulate_cache(requests, b, p, block_size=block_size, max_running=max_running) for b in budgets]
            for p in policies}


def format_hit_rate_table(sweep: dict[str, list[CacheRunStats]]) -> str:
    """A fixed-width table: one row per budget, one hit-rate column per policy."""
    policies = list(sweep)
    rows = [f"{'KV budget (tokens)':>18} " + " ".join(f"{p:>24}" for p in policies)]
    for i, first in enumerate(sweep[policies[0]]):
        rows.append(f"{first.kv_budget_tokens:>18} " + " ".join(f"{sweep[p][i].hit_rate:>24.1%}" for p in policies))
    return "\n".join(rows)


# ====================================================================== eviction order inside a chain (LMCache #184)
def usable_prefix_after_evictions(num_blocks: int, num_evicted: int, *, tail_first: bool) -> tuple[list[int], int, int]:
    """A cached chain of ``num_blocks`` blocks (logical 0..n-1) freed together; evict ``num_evicted`` from the head.

    ``tail_first`` frees the chain last block first (the queue reads n-1, ..., 0), as minienv and vLLM do;
    otherwise first block first. Returns ``(evicted logical blocks, usable cached blocks, stranded blocks)``: a
    block is usable only if every block before it survived; a surviving block after a hole is stranded — it
    still takes memory but no lookup can ever reach it (LMCache #184: updating the evictor first chunk to last made the first chunk the first victim).
    """
    order = list(range(num_blocks))[::-1] if tail_first else list(range(num_blocks))
    evicted = sorted(order[:num_evicted])
    alive = [b not in evicted for b in range(num_blocks)]
    usable = next((i for i, a in enumerate(alive) if not a), num_blocks)
    stranded = sum(alive[usable:])
    return evicted, usable, stranded



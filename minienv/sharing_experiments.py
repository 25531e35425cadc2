"""Experiments on sharing and eviction for notebooks 05 and 06: small serving loops, policies, paper accounting.

Everything here drives the real :class:`~minienv.kv.kv_cache_manager.KVCacheManager` (or, for comparison, a
faithful model of another engine's block manager) and returns plain numbers, so the notebooks stay short and the
numbers are tested (``tests/unit/test_sharing_experiments.py``). Nothing here is needed to *serve*; it measures.

* :func:`load_demo_model` — the bundled model + tokenizer, or a small random model with a byte "tokenizer" when the
  assets are absent (same code path, nonsense text).
* :func:`serve_greedy` — a minimal batched greedy serving loop over the paged backend and the manager, with the
  prefix cache on or off (the differential proof "cache on == cache off == dense" runs on it).
* :class:`NanoVLLMBlockManager` — nano-vllm's ``BlockManager`` policy reproduced: a ``deque`` of free block ids,
  allocation from the left, frees appended on the right, a ``hash -> block id`` dict checked against the block's
  own token ids.
* :func:`popular_prefix_workload`, :func:`simulate_cache`, :func:`hit_rate_sweep` — prefix-cache hit rate (in
  tokens) as a function of the KV budget for several policies on one seeded request stream.
* :func:`parallel_sampling_saving`, :func:`beam_search_saving`, :func:`shared_prefix_saving` — the vLLM paper's
  sharing results (Kwon et al., SOSP 2023, §6.3 Fig. 15 and §6.4 Fig. 16) recomputed in our units.
"""

from __future__ import annotations

import re
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from minienv.generate import dense_greedy
from minienv.kv import KVPool, OutOfBlocksError, PagedAttentionBackend, PagedAttentionMetadata
from minienv.kv.block_table import cdiv
from minienv.kv.hashing import ROOT_HASH, hash_block_tokens
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.workload import ALPACA, generate_workload

__all__ = [
    "DemoModel", "load_demo_model", "ServeResult", "serve_greedy", "dense_greedy",
    "NanoVLLMBlockManager", "CacheRequest", "CacheStream", "CacheRunStats", "popular_prefix_workload", "simulate_cache",
    "hit_rate_sweep", "format_hit_rate_table", "POLICIES",
    "SavingResult", "parallel_sampling_saving", "beam_search_saving", "SharedPrefixResult", "shared_prefix_saving",
    "PAPER_SHARING", "usable_prefix_after_evictions", "paper_sharing_results", "format_paper_table",
    "EvictorDamage", "seed_evictor_damage",
]


# ====================================================================== the model the demos run on
@dataclass
class DemoModel:
    """A model plus ``encode`` / ``decode``; ``bundled`` says whether it is the trained model from ``assets/``."""

    model: object
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    name: str
    bundled: bool


def load_demo_model() -> DemoModel:
    """The bundled target model and tokenizer; if they are not in this checkout, a small seeded random Llama.

    The fallback "tokenizer" maps each word or punctuation mark to ``crc32(word) % vocab`` (about as many tokens as
    the BPE tokenizer gives): prompts built from the same text still share the same token prefix, so every sharing
    demo behaves the same; only the generated text is nonsense.
    """
    try:
        from minienv.model import load_model
        from minienv.tokenizer import load_tokenizer

        model, tok = load_model(), load_tokenizer()
        return DemoModel(model, tok.encode, tok.decode, "the bundled target model", True)
    except (FileNotFoundError, OSError):
        from minienv.model import LlamaConfig, LlamaModel, random_weights

        cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
        model = LlamaModel(cfg, random_weights(cfg, seed=0, scale=0.3))

        def encode(text: str) -> list[int]:
            return [zlib.crc32(w.encode("utf-8")) % 97 for w in re.findall(r"\w+|[^\w\s]", text)]

        def decode(ids: Sequence[int]) -> str:
            return "[" + " ".join(str(int(i)) for i in ids) + "]"

        return DemoModel(model, encode, decode, "a small random model (assets/ not found)", False)


# ====================================================================== a minimal serving loop
@dataclass
class ServeResult:
    """Outputs of :func:`serve_greedy` and what the prefix cache did."""

    outputs: list[list[int]]
    prefill_tokens_computed: int
    prompt_tokens: int
    cached_tokens_per_request: list[int]
    evicted_blocks: int
    steps: int
    manager: KVCacheManager = field(repr=False)


def serve_greedy(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    caching: bool = True,
    max_running: int = 4,
    before_admit: Callable[[KVCacheManager, KVPool, int], None] | None = None,
    check_invariants: bool = False,
    arrival_steps: Sequence[int] | None = None,
) -> ServeResult:
    """Serve ``prompts`` first come first served, greedy, one batched model call per step, over the paged backend.

    Each step decodes one token for every running request, then admits waiting requests (whole prompt as one
    prefill, minus the prefix-cache hit) while at most ``max_running`` run and the request's whole life
    (prompt + ``max_new_tokens``) fits in the free blocks — so no running request ever runs out of blocks (the
    scheduler of notebook 07 preempts instead). ``before_admit(manager, kv_pool, i)`` is a hook called before
    request ``i`` is admitted (the MinivLLM #98 check poisons cached K/V there). ``check_invariants`` (tests)
    re-checks the manager's invariants and the step's slot mapping after every step. ``arrival_steps[i]`` (default
    all 0) is the step at which request ``i`` arrives: e.g. ``range(n)`` for one arrival per step, a steady rate
    under which each prompt can hit the blocks of every request computed before it.
    """
    prompts = [[int(t) for t in p] for p in prompts]
    if num_blocks is None:
        num_blocks = sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)
    kv = KVPool.for_model(model.config, num_blocks * block_size, block_size)
    mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, kv_pool=kv)
    backend = PagedAttentionBackend(kv)
    waiting = deque(range(len(prompts)))
    running: list[int] = []
    outputs: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    arrivals = [0] * len(prompts) if arrival_steps is None else [int(a) for a in arrival_steps]
    if len(arrivals) != len(prompts) or any(a < 0 for a in arrivals):
        raise ValueError(f"arrival_steps needs one step >= 0 per prompt ({len(prompts)}), got {list(arrivals)}")
    computed = steps = clock = 0
    while waiting or running:
        batch = [(rid, mgr.append_slots(rid, [outputs[rid][-1]])) for rid in running]
        reserved = sum(cdiv(len(prompts[r]) + max_new_tokens, block_size) - len(mgr.block_ids(r)) for r in running)
        while waiting and arrivals[waiting[0]] <= clock and len(batch) < max_running:
            rid = waiting[0]
            if before_admit is not None:
                before_admit(mgr, kv, rid)
            hit = mgr.lookup(prompts[rid])
            hit_free = sum(1 for b in hit.block_ids if mgr.ref_cnt(b) == 0)
            life = cdiv(len(prompts[rid]) + max_new_tokens, block_size) - len(hit.block_ids)
            if life + hit_free + reserved > mgr.num_free_blocks:
                break
            alloc = mgr.allocate(rid, prompts[rid])
            waiting.popleft()
            reserved += life - (len(mgr.block_ids(rid)) - len(hit.block_ids))
            cached[rid] = alloc.num_cached_tokens
            computed += alloc.num_new_tokens
            batch.append((rid, alloc))
        clock += 1
        if not batch:
            if waiting and arrivals[waiting[0]] >= clock:  # idle until the next arrival
                continue
            raise ValueError(f"a budget of {num_blocks} blocks of {block_size} cannot hold one request's life")
        meta = PagedAttentionMetadata.from_block_tables([mgr.block_table(r) for r, _ in batch],
                                                        [a.num_new_tokens for _, a in batch])
        if check_invariants:  # the manager's slot mapping is the one attention will read through
            np.testing.assert_array_equal(meta.slot_mapping, np.concatenate([a.slot_mapping for _, a in batch]))
        backend.set_metadata(meta)
        tokens = [t for _, a in batch for t in a.token_ids]
        logits = model.forward_step(tokens, meta.positions, backend, logits_indices=meta.query_start_loc[1:] - 1)
        steps += 1
        for (rid, _), row in zip(batch, logits):
            mgr.commit(rid)
            outputs[rid].append(int(np.argmax(row)))
            if rid not in running:
                running.append(rid)
        for rid in [r for r in running if len(outputs[r]) == max_new_tokens]:
            mgr.free(rid)
            running.remove(rid)
        if check_invariants:
            mgr.check_invariants()
    return ServeResult(outputs, computed, sum(len(p) for p in prompts), cached, mgr.stats().evicted_blocks, steps,
                       mgr)


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

    @property
    def num_free_blocks(self) -> int:
        return self.mgr.num_free_blocks

    def lookup_blocks(self, prompt) -> int:
        return len(self.mgr.lookup(prompt).block_ids)

    def hit_free_blocks(self, prompt) -> int:
        return sum(1 for b in self.mgr.lookup(prompt).block_ids if self.mgr.ref_cnt(b) == 0)

    def allocate(self, rid, prompt) -> int:
        n = self.mgr.allocate(rid, prompt).num_cached_tokens
        self.mgr.commit(rid)
        return n

    def append(self, rid, token: int) -> None:
        self.mgr.append_slots(rid, [token])
        self.mgr.commit(rid)

    def free(self, rid) -> None:
        self.mgr.free(rid)

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
    while waiting or running:
        for rid in list(running):
            n = running[rid]
            if n == requests[rid].output_len:
                pol.free(rid)
                del running[rid]
            else:
                pol.append(rid, 1_000_000 + rid * 1000 + n)  # unique decode tokens: never shared by accident
                running[rid] = n + 1
        reserved = sum(cdiv(len(requests[r].prompt) + requests[r].output_len, block_size)
                       - cdiv(len(requests[r].prompt) + running[r], block_size) for r in running)
        while waiting and len(running) < max_running:
            req = requests[waiting[0]]
            hit = pol.lookup_blocks(req.prompt)
            life = cdiv(len(req.prompt) + req.output_len, block_size) - hit + pol.hit_free_blocks(req.prompt)
            if life + reserved > pol.num_free_blocks:
                break
            rid = waiting.popleft()
            cached = pol.allocate(rid, req.prompt)
            computed += len(req.prompt) - cached
            reserved += cdiv(len(req.prompt) + req.output_len, block_size) - cdiv(len(req.prompt), block_size)
            running[rid] = 0
        if not running and waiting:  # pragma: no cover - the budget check above rules it out
            raise RuntimeError("no request could be admitted")
    return CacheRunStats(policy, num_blocks * block_size, pol.queries, pol.hits, pol.evicted_blocks, computed)


class CacheStream:
    """A request stream served step by step through a real :class:`KVCacheManager` (bookkeeping only, no model).

    Each :meth:`step` is one engine step: requests that have generated ``output_len`` tokens finish (freed, last
    block first), every running request decodes one token, then waiting requests are admitted FCFS while fewer than
    ``max_running`` run and the request's whole life fits next to what the running ones still need. Returns a
    caption, or ``None`` when everything has finished. Request ``i`` is ``"r{i}"`` in the manager; ``hits`` and
    ``running`` are keyed by ``i``. ``evicted_in_use`` collects any evicted block that a running
    request held at that moment — it must stay empty (the seed's evictor fills it).
    """

    def __init__(self, requests: Sequence[CacheRequest], mgr: KVCacheManager, *, max_running: int = 2):
        self.requests = list(requests)
        self.mgr = mgr
        self.max_running = max_running
        self.waiting = deque(range(len(self.requests)))
        self.running: dict[int, int] = {}
        self.hits: dict[int, int] = {}
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
            del self.running[rid]
            notes.append(f"{name(rid)} finishes")
        held = {b for rid in self.running for b in mgr.block_ids(name(rid))}
        self._evicted_now = []
        for rid in self.running:
            mgr.append_slots(name(rid), [1_000_000 + rid * 1000 + self.running[rid]])
            mgr.commit(name(rid))
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
            alloc = mgr.allocate(name(rid), req.prompt)
            admitted.append(rid)
            self.hits[rid] = alloc.num_cached_tokens
            self.running[rid] = 0
            reserved += cdiv(len(req.prompt) + req.output_len, B) - len(mgr.block_ids(name(rid)))
            notes.append(f"{name(rid)} arrives ({alloc.num_cached_tokens}/{len(req.prompt)} cached)")
        for rid in admitted:  # after the step that computes them, their full blocks become findable
            mgr.commit(name(rid))
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


# ====================================================================== LMCache #443: eviction order inside a chain
def usable_prefix_after_evictions(num_blocks: int, num_evicted: int, *, tail_first: bool) -> tuple[list[int], int, int]:
    """A cached chain of ``num_blocks`` blocks (logical 0..n-1) freed together; evict ``num_evicted`` from the head.

    ``tail_first`` frees the chain last block first (the queue reads n-1, ..., 0), as minienv and vLLM do;
    otherwise first block first. Returns ``(evicted logical blocks, usable cached blocks, stranded blocks)``: a
    block is usable only if every block before it survived; a surviving block after a hole is stranded — it
    still takes memory but no lookup can ever reach it (LMCache #443).
    """
    order = list(range(num_blocks))[::-1] if tail_first else list(range(num_blocks))
    evicted = sorted(order[:num_evicted])
    alive = [b not in evicted for b in range(num_blocks)]
    usable = next((i for i, a in enumerate(alive) if not a), num_blocks)
    stranded = sum(alive[usable:])
    return evicted, usable, stranded


# ====================================================================== the paper's sharing results, in our units
#: Kwon et al., SOSP 2023: Fig. 15 (OPT-13B, Alpaca trace) and Fig. 16 (LLaMA-13B, WMT16 en-de).
PAPER_SHARING = {
    "parallel sampling memory saving (Alpaca, n = 2..6)": "6.1 % – 9.8 %",
    "beam search memory saving (Alpaca, width = 2..6)": "37.6 % – 55.2 %",
    "1-shot shared prefix (80 tokens): throughput vs Orca (Oracle)": "1.67×",
    "5-shot shared prefix (341 tokens): throughput vs Orca (Oracle)": "3.58×",
}


@dataclass(frozen=True)
class SavingResult:
    """Block-steps summed over every decode step of every request: without sharing (logical) vs physical."""

    label: str
    logical_block_steps: int
    physical_block_steps: int
    cow_copies: int

    @property
    def saved_fraction(self) -> float:
        """The paper's Fig. 15 metric: blocks saved by sharing / blocks without sharing (time-averaged)."""
        return 1 - self.physical_block_steps / self.logical_block_steps


def _alpaca(num_requests: int, seed: int):
    return generate_workload(num_requests, ALPACA, seed=seed)


def parallel_sampling_saving(n: int, *, num_requests: int = 200, block_size: int = 16, seed: int = 0) -> SavingResult:
    """Parallel sampling of ``n`` sequences per Alpaca-like prompt, through :meth:`KVCacheManager.fork`.

    Each request prefills its prompt, forks into ``n`` samples (the parent is sample 0), and each sample decodes its
    own length (drawn from the Alpaca output distribution; distinct tokens, so only the prompt is shared). The
    first write of each sample into the shared, partly filled last prompt block copies it (copy-on-write). After
    every decode step we add up the blocks the tables name (no sharing) and the blocks that physically exist.
    """
    reqs = _alpaca(num_requests, seed)
    rng = np.random.default_rng(seed + 1)
    logical = physical = copies = 0
    for r in reqs:
        out_lens = np.maximum(1, np.round(ALPACA.output.sample(rng, n))).astype(int).tolist()
        prompt = [int(t) for t in rng.integers(0, 30_000, r.prompt_len)]
        need = n * cdiv(r.prompt_len + max(out_lens), block_size) + 1
        mgr = KVCacheManager(need, block_size, enable_prefix_caching=False)
        mgr.allocate("s0", prompt)
        mgr.commit("s0")
        ids = [f"s{i}" for i in range(n)]
        if n > 1:
            mgr.fork("s0", ids[1:])
        alive = dict(zip(ids, out_lens))
        step = 0
        while alive:
            for i, sid in enumerate(list(alive)):
                mgr.append_slots(sid, [30_000 + 1000 * i + step])
                mgr.commit(sid)
            s = mgr.sharing()
            logical += s.logical_blocks
            physical += s.physical_blocks
            step += 1
            for sid in [s for s, m in alive.items() if m == step]:
                mgr.free(sid)
                del alive[sid]
        copies += mgr.cow_copies
    return SavingResult(f"parallel sampling n={n}", logical, physical, copies)


def beam_search_saving(width: int, *, num_requests: int = 100, block_size: int = 16, vocab: int = 64,
                       logit_std: float = 3.0, seed: int = 0) -> SavingResult:
    """Beam search of ``width`` beams per Alpaca-like prompt, through fork / free / copy-on-write.

    The "model" is a seeded random scorer: each beam's next-token log-probabilities are a log-softmax of
    ``N(0, logit_std²)`` logits over ``vocab`` tokens. Every step keeps the ``width`` best (beam, token) pairs: a
    beam chosen ``c`` times continues and forks ``c - 1`` children, a beam chosen 0 times is freed — exactly how
    vLLM's block manager implemented beam search. Each request runs its Alpaca output length.
    """
    reqs = _alpaca(num_requests, seed)
    rng = np.random.default_rng(seed + 2)
    logical = physical = copies = 0
    for r in reqs:
        prompt = [int(t) for t in rng.integers(0, 30_000, r.prompt_len)]
        mgr = KVCacheManager(width * cdiv(r.prompt_len + r.output_len, block_size) + 2 * width, block_size,
                             enable_prefix_caching=False)
        mgr.allocate(0, prompt)
        mgr.commit(0)
        beams = {0: 0.0}  # beam id -> cumulative log-prob
        next_id = 1
        for _ in range(r.output_len):
            ids = list(beams)
            logits = rng.normal(0.0, logit_std, (len(ids), vocab))
            logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
                - logits.max(1, keepdims=True)
            scores = np.array([beams[b] for b in ids])[:, None] + logp
            flat = np.argsort(-scores, axis=None, kind="stable")[:width]
            chosen: dict[int, list[tuple[int, float]]] = {}
            for f in flat:
                bi, tok = divmod(int(f), vocab)
                chosen.setdefault(ids[bi], []).append((tok, float(scores[bi, tok])))
            for b in ids:  # drop beams nobody continues (their blocks may stay alive through their children)
                if b not in chosen:
                    mgr.free(b)
                    del beams[b]
            plan = []
            for b, picks in chosen.items():
                kids = list(range(next_id, next_id + len(picks) - 1))
                next_id += len(kids)
                if kids:
                    mgr.fork(b, kids)
                plan += list(zip([b] + kids, picks))
            beams = {}
            for bid, (tok, score) in plan:
                mgr.append_slots(bid, [tok])
                mgr.commit(bid)
                beams[bid] = score
            s = mgr.sharing()
            logical += s.logical_blocks
            physical += s.physical_blocks
        copies += mgr.cow_copies
    return SavingResult(f"beam search width={width}", logical, physical, copies)


@dataclass(frozen=True)
class SharedPrefixResult:
    """A k-shot translation-like workload served with the prefix cache off and on."""

    label: str
    prefix_len: int
    num_requests: int
    prefill_off: int
    prefill_on: int
    decode_tokens: int
    blocks_off: int  # KV blocks held with every request resident at once, no sharing
    blocks_on: int   # the same with the prefix blocks shared

    @property
    def prefill_ratio(self) -> float:
        """Prompt tokens run through the model, off / on."""
        return self.prefill_off / self.prefill_on

    @property
    def work_ratio(self) -> float:
        """All tokens run through the model (prefill + decode), off / on."""
        return (self.prefill_off + self.decode_tokens) / (self.prefill_on + self.decode_tokens)

    @property
    def memory_ratio(self) -> float:
        """KV blocks per resident batch, off / on: how many more requests fit in the same memory."""
        return self.blocks_off / self.blocks_on


def shared_prefix_saving(prefix_len: int, *, num_requests: int = 64, block_size: int = 16, sentence_mean: float = 30.0,
                         seed: int = 0, label: str | None = None) -> SharedPrefixResult:
    """Every request = the same ``prefix_len``-token few-shot prefix + its own sentence; as many tokens out.

    WMT16 sentences are modelled as log-normal lengths with mean ``sentence_mean`` tokens (our assumption; the paper
    gives only the prefix lengths, 80 and 341 tokens). Prefill tokens are counted by the real manager (cache off:
    every prompt token; on: the prompt minus the full cached blocks). Memory: all requests resident at the end of
    their prefill, blocks counted once each.
    """
    rng = np.random.default_rng(seed)
    prefix = [int(t) for t in rng.integers(0, 30_000, prefix_len)]
    lens = np.maximum(1, np.round(rng.lognormal(np.log(sentence_mean) - 0.125, 0.5, num_requests))).astype(int)
    prompts = [prefix + [int(t) for t in rng.integers(0, 30_000, n)] for n in lens]
    decode = int(lens.sum())  # a translation is about as long as its source
    result = {}
    for caching in (False, True):
        mgr = KVCacheManager(sum(cdiv(len(p), block_size) for p in prompts), block_size,
                             enable_prefix_caching=caching)
        computed = 0
        for i, p in enumerate(prompts):
            computed += mgr.allocate(i, p).num_new_tokens
            mgr.commit(i)
        result[caching] = (computed, mgr.stats().num_in_use)
    return SharedPrefixResult(label or f"{prefix_len}-token prefix", prefix_len, num_requests, result[False][0],
                              result[True][0], decode, result[False][1], result[True][1])


def paper_sharing_results(*, parallel_requests: int = 100, beam_requests: int = 40):
    """Everything notebook 05's table shows: parallel sampling (n = 2, 4, 6), beam search (width = 2, 4, 6), and the
    1-shot (80-token) and 5-shot (341-token) shared prefixes."""
    par = [parallel_sampling_saving(n, num_requests=parallel_requests) for n in (2, 4, 6)]
    beam = [beam_search_saving(w, num_requests=beam_requests) for w in (2, 4, 6)]
    shots = [shared_prefix_saving(80, label="1-shot"), shared_prefix_saving(341, label="5-shot")]
    return par, beam, shots


def format_paper_table(par: Sequence[SavingResult], beam: Sequence[SavingResult],
                       shots: Sequence[SharedPrefixResult]) -> str:
    """Ours beside the paper's numbers (Kwon et al., SOSP 2023, Fig. 15 and Fig. 16)."""
    lines = [f"{'':<44}{'ours':>28}   paper",
             f"{'parallel sampling memory saved (n = 2, 4, 6)':<44}"
             f"{' / '.join(f'{r.saved_fraction:.1%}' for r in par):>28}   6.1 % – 9.8 %",
             f"{'beam search memory saved (width = 2, 4, 6)':<44}"
             f"{' / '.join(f'{r.saved_fraction:.1%}' for r in beam):>28}   37.6 % – 55.2 %"]
    for r, paper in zip(shots, ("1.67×", "3.58×")):
        lines += [f"{r.label + f' prefix ({r.prefix_len} tokens)':<44}{'':>28}   {paper} throughput vs Orca (Oracle)",
                  f"{'   prefill tokens computed, off / on':<44}{r.prefill_ratio:>27.2f}×",
                  f"{'   all tokens computed (prefill + decode)':<44}{r.work_ratio:>27.2f}×",
                  f"{f'   KV blocks of a {r.num_requests}-request batch, off / on':<44}{r.memory_ratio:>27.2f}×"]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m minienv.sharing_experiments: notebook 05's paper table
    print(format_paper_table(*paper_sharing_results()))


# ====================================================================== the seed's evictor, measured in logits
@dataclass(frozen=True)
class EvictorDamage:
    """Request A decodes; request B arrives after ``b_arrives_after`` of A's tokens under a budget that cannot hold
    both. Per decode step of A, ``*_logit_error`` is max |logits served - dense logits of the same token sequence|:
    ~1e-6 means A attended to its own K/V; anything large means it read someone else's.

    ``seed_*``: the seed's ``PagedAttentionManager`` + ``TokenBudgetLRUEvictor`` (``minienv.seed_design``), which
    evicts A's blocks while A runs (``seed_evicted_in_use``) and hands them to B (``seed_overwritten``: blocks that
    A's and B's tables name at once). ``ours_*``: :class:`KVCacheManager` with the same budget, which refuses B
    (``ours_b_refused``) until A is done. ``reference_ids``: A's greedy tokens alone with ample memory.
    """

    kv_budget_tokens: int
    b_arrives_after: int
    seed_evicted_in_use: tuple[int, ...]
    seed_overwritten: tuple[int, ...]
    seed_logit_error: tuple[float, ...]
    seed_ids: tuple[int, ...]
    ours_logit_error: tuple[float, ...]
    ours_ids: tuple[int, ...]
    ours_b_refused: bool
    reference_ids: tuple[int, ...]


def _paged_logits(model, backend, block_ids, num_tokens, new_tokens, block_size):
    from minienv.kv.block_table import BlockTable

    table = BlockTable(block_size, list(block_ids), num_tokens)
    meta = PagedAttentionMetadata.from_block_tables([table], [len(new_tokens)])
    backend.set_metadata(meta)
    return model.forward_step(list(new_tokens), meta.positions, backend, logits_indices=[len(new_tokens) - 1])[0]


def seed_evictor_damage(model, prompt_a: Sequence[int], prompt_b: Sequence[int], *, block_size: int = 4,
                        max_new_tokens: int = 8, b_arrives_after: int = 3,
                        kv_budget_tokens: int | None = None) -> EvictorDamage:
    """Run the arrival of B during A's decode under the seed's design and under ours; measure A's logits.

    The default budget holds either request alone (prompt + ``max_new_tokens``), not both. The dense logits of the
    sequence each design actually produced come from one ``model.forward`` over it (teacher forcing), so a wrong
    logit is caught even when the greedy token happens not to flip.
    """
    from minienv.seed_design import PagedAttentionManager, TokenBudgetLRUEvictor

    pa, pb = [int(t) for t in prompt_a], [int(t) for t in prompt_b]
    if kv_budget_tokens is None:
        kv_budget_tokens = cdiv(max(len(pa), len(pb)) + max_new_tokens, block_size) * block_size
    num_blocks = kv_budget_tokens // block_size

    def errors(prompt, out, rows):
        dense = model.forward(prompt + out[:-1])[len(prompt) - 1:]
        return tuple(float(np.abs(r - d).max()) for r, d in zip(rows, dense))

    # ---- the seed
    kv = KVPool.for_model(model.config, num_blocks * block_size, block_size)
    backend = PagedAttentionBackend(kv)
    mgr = PagedAttentionManager(num_blocks, block_size)
    evictor = TokenBudgetLRUEvictor(kv_budget_tokens, block_size)
    evicted_in_use: list[int] = []

    def seed_feed(rid, tokens):
        evicted = evictor.evict_if_needed(mgr, len(tokens))
        evicted_in_use.extend(b for b in evicted for other, t in mgr.block_tables.items() if other != rid and b in t)
        evictor.touch(mgr.append_tokens(rid, len(tokens)))
        evictor.touch(mgr.block_tables[rid])
        return _paged_logits(model, backend, mgr.block_tables[rid], mgr.seq_lens[rid], tokens, block_size)

    rows, out = [seed_feed("A", pa)], []
    overwritten: set[int] = set()
    while True:
        out.append(int(np.argmax(rows[-1])))
        if len(out) == max_new_tokens:
            break
        if len(out) == b_arrives_after:
            seed_feed("B", pb)
            overwritten |= set(mgr.block_tables["A"]) & set(mgr.block_tables["B"])
        rows.append(seed_feed("A", [out[-1]]))
    seed_ids, seed_err = tuple(out), errors(pa, out, rows)

    # ---- ours: same budget, same arrival
    kv = KVPool.for_model(model.config, num_blocks * block_size, block_size)
    backend = PagedAttentionBackend(kv)
    ours = KVCacheManager(num_blocks, block_size, kv_pool=kv)
    alloc = ours.allocate("A", pa)
    rows = [_paged_logits(model, backend, ours.block_ids("A"), ours.num_tokens("A"), alloc.token_ids, block_size)]
    ours.commit("A")
    out, refused = [], False
    while True:
        out.append(int(np.argmax(rows[-1])))
        if len(out) == max_new_tokens:
            break
        if len(out) == b_arrives_after:
            try:
                ours.allocate("B", pb)
                ours.free("B")
            except OutOfBlocksError:
                refused = True
        ours.append_slots("A", [out[-1]])
        rows.append(_paged_logits(model, backend, ours.block_ids("A"), ours.num_tokens("A"), [out[-1]], block_size))
        ours.commit("A")
    ours_ids, ours_err = tuple(out), errors(pa, out, rows)
    reference = serve_greedy(model, [pa], max_new_tokens, block_size=block_size).outputs[0]
    return EvictorDamage(kv_budget_tokens, b_arrives_after, tuple(sorted(set(evicted_in_use))), tuple(sorted(overwritten)),
                         seed_err, seed_ids, ours_err, ours_ids, refused, tuple(reference))

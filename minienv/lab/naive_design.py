"""THE NAIVE DESIGN — BROKEN ON PURPOSE. A teaching exhibit; never use it to serve anything.

The naive design, as it circulates in tutorials, draws the right boxes (PagedAttention manager with block table
and free list; KV cache manager with a prefix-aware refcounter and a token-budget LRU evictor) and then fills them
with code that is wrong in instructive ways: one block per whole prompt, an O(n) free list, eviction that ignores
refcounts, a refcount set instead of incremented (and a serving loop that emits one token per prompt token, which
notebook 08's engine replaces). The four KV-cache flaws are reproduced here faithfully, so the notebooks can show
each one fail on real requests and then show :mod:`minienv.kv.kv_cache_manager` pass the same demonstration:

1. ``PagedAttentionManager.free_list.pop(0)`` — a Python list used as a queue: every allocation shifts the
   whole list, O(num_free_blocks). (:func:`demo_pop0_timing`)
2. ``TokenBudgetLRUEvictor`` evicts the least recently used block *whatever its refcount*: a running request's
   block goes back to the free list, is handed to the next request, and its K/V are overwritten — the running
   request keeps decoding over someone else's K/V and its text changes. (:func:`demo_evict_in_use`,
   :func:`demo_evictor_damage`)
3. ``PrefixAwareRefcounter`` keys one prefix block by a hash of the *whole prompt*: two prompts with the same
   system prompt but different questions hash differently and share nothing. (:func:`demo_whole_prompt_hashing`)
4. ``PrefixAwareRefcounter.acquire`` *sets* the refcount of a reused block to 1 instead of incrementing it: the
   first owner to finish frees a block the second still uses. (:func:`demo_refcount_set`)

Each ``demo_*`` function returns a small frozen dataclass of plain numbers and lists (what the notebook prints or
plots); ``tests/unit/test_naive_design.py`` asserts each failure happens here and not in the real manager.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from minienv.generate import dense_greedy
from minienv.kv.block_pool import BlockPool
from minienv.kv.block_table import BlockTable, cdiv
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.kv.kv_pool import KVPool
from minienv.kv.paged_attention import PagedAttentionBackend, PagedAttentionMetadata

__all__ = [
    "BROKEN", "EvictInUseDemo", "EvictorDamage", "PagedAttentionManager", "Pop0TimingDemo", "PrefixAwareRefcounter",
    "RefcountSetDemo", "TokenBudgetLRUEvictor", "WholePromptHashingDemo", "demo_evict_in_use", "demo_evictor_damage",
    "demo_pop0_timing", "demo_refcount_set", "demo_whole_prompt_hashing", "paged_step", "random_demo_model",
]

BROKEN = True  #: this module is the broken teaching version (checked by the tests, shown by the notebooks)


# ====================================================================== the naive design's three classes, as written
class PagedAttentionManager:
    """NAIVE (BROKEN): block tables and a free *list*. ``free_list.pop(0)`` makes every allocation O(n)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free_list: list[int] = list(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.seq_lens: dict[str, int] = {}

    def allocate_block(self) -> int:
        if not self.free_list:
            raise RuntimeError("out of blocks")
        return self.free_list.pop(0)  # BUG (1): shifts every remaining element — O(n) per allocation

    def append_tokens(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow a request by ``num_tokens``; allocate blocks at block boundaries. Returns the new block ids."""
        table = self.block_tables.setdefault(request_id, [])
        length = self.seq_lens.get(request_id, 0) + num_tokens
        new = [self.allocate_block() for _ in range(cdiv(length, self.block_size) - len(table))]
        table.extend(new)
        self.seq_lens[request_id] = length
        return new

    def free(self, request_id: str) -> None:
        self.free_list.extend(self.block_tables.pop(request_id))
        del self.seq_lens[request_id]

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free_list)


class PrefixAwareRefcounter:
    """NAIVE (BROKEN): one prefix block per *whole-prompt* hash; reuse *sets* the refcount to 1."""

    def __init__(self) -> None:
        self.prefix_blocks: dict[int, int] = {}  # hash(whole prompt) -> block id
        self.refcount: dict[int, int] = {}

    @staticmethod
    def prompt_hash(prompt_tokens: Sequence[int]) -> int:
        return hash(tuple(prompt_tokens))  # BUG (3): the whole prompt is the key — a shared prefix never matches

    def lookup(self, prompt_tokens: Sequence[int]) -> int | None:
        return self.prefix_blocks.get(self.prompt_hash(prompt_tokens))

    def register(self, prompt_tokens: Sequence[int], block_id: int) -> None:
        self.prefix_blocks[self.prompt_hash(prompt_tokens)] = block_id
        self.refcount[block_id] = 1

    def acquire(self, block_id: int) -> None:
        self.refcount[block_id] = 1  # BUG (4): set, not incremented — the first release frees a shared block

    def release(self, block_id: int) -> bool:
        """Drop a reference; True when the block should go back to the free list."""
        self.refcount[block_id] -= 1
        if self.refcount[block_id] <= 0:
            del self.refcount[block_id]
            self.prefix_blocks = {h: b for h, b in self.prefix_blocks.items() if b != block_id}
            return True
        return False


class TokenBudgetLRUEvictor:
    """NAIVE (BROKEN): keeps used tokens under a budget by evicting the least recently used block — any block."""

    def __init__(self, token_budget: int, block_size: int):
        self.token_budget = token_budget
        self.block_size = block_size
        self.lru: OrderedDict[int, None] = OrderedDict()

    def touch(self, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            self.lru[bid] = None
            self.lru.move_to_end(bid)

    def evict_if_needed(self, manager: PagedAttentionManager, tokens_needed: int) -> list[int]:
        """Free LRU blocks until ``tokens_needed`` more tokens fit in the budget; return the evicted ids."""
        evicted = []
        while (manager.used_blocks * self.block_size + tokens_needed > self.token_budget) and self.lru:
            victim, _ = self.lru.popitem(last=False)
            # BUG (2): no refcount check, no "is a running request using it?" — the block table still names it.
            manager.free_list.append(victim)
            evicted.append(victim)
        return evicted


# ====================================================================== demo helpers
def _demo_model():
    """The bundled model if it is there, else :func:`random_demo_model` (same code path, nonsense text)."""
    from minienv.paths import assets_dir

    try:
        path = assets_dir() / "target"
    except FileNotFoundError:
        return random_demo_model()
    if (path / "model.safetensors").exists():
        from minienv.model import load_model

        return load_model(path)
    return random_demo_model()


def random_demo_model():
    """A small seeded random Llama (vocab 97): deterministic, fast, and sensitive to its K/V."""
    from minienv.model import LlamaConfig, LlamaModel, random_weights


    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    return LlamaModel(cfg, random_weights(cfg, seed=0, scale=0.3))


def paged_step(model, backend: PagedAttentionBackend, block_ids: Sequence[int], new_tokens: Sequence[int],
                num_tokens_after: int) -> np.ndarray:
    """One model step of one sequence through the paged backend; returns the last token's logits."""
    table = BlockTable(backend.kv_pool.block_size, list(block_ids), num_tokens_after)
    meta = PagedAttentionMetadata.from_block_tables([table], [len(new_tokens)])
    backend.set_metadata(meta)
    return model.forward_step(list(new_tokens), meta.positions, backend, logits_indices=[len(new_tokens) - 1])[0]


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ====================================================================== (2) eviction of an in-use block
@dataclass(frozen=True)
class EvictInUseDemo:
    """Request A decodes while request B arrives under a tight token budget.

    ``naive_evicted_in_use`` are blocks of a running request that the naive evictor freed and handed to another;
    ``naive_kv_overwritten`` says A's K/V in such a block were overwritten by B's prefill (the data-level proof);
    ``naive_a_ids`` is A's greedy output under the naive design (corrupted), ``ours_a_ids`` under the real manager, both
    beside ``reference_a_ids`` (no cache at all). ``ours_b_refused`` says the real manager refused B while A ran
    (``allocate`` returns None: the scheduler would queue or preempt), and ``ours_b_ids`` == ``reference_b_ids`` once A is done.
    """

    block_size: int
    kv_budget_tokens: int
    naive_evicted_in_use: tuple[int, ...]
    naive_kv_overwritten: bool
    reference_a_ids: tuple[int, ...]
    naive_a_ids: tuple[int, ...]
    ours_a_ids: tuple[int, ...]
    naive_first_divergence: int | None
    ours_b_refused: bool
    reference_b_ids: tuple[int, ...]
    ours_b_ids: tuple[int, ...]

    @property
    def naive_corrupted(self) -> bool:
        return self.naive_a_ids != self.reference_a_ids

    @property
    def ours_correct(self) -> bool:
        return self.ours_a_ids == self.reference_a_ids and self.ours_b_ids == self.reference_b_ids


def demo_evict_in_use(
    model=None,
    prompt_a: Sequence[int] | None = None,
    prompt_b: Sequence[int] | None = None,
    *,
    block_size: int = 4,
    kv_budget_tokens: int | None = None,
    max_new_tokens: int = 12,
    b_arrives_after: int = 6,
) -> EvictInUseDemo:
    """Run A, let B arrive after ``b_arrives_after`` of A's tokens, finish A — under the naive design and under ours.

    The default budget fits either request alone (prompt + ``max_new_tokens``), not both, so when B arrives
    something has to give.
    The naive evictor gives A's least recently used block (in use!) to B; ours refuses B until A is done.
    """
    model = _demo_model() if model is None else model
    rng = np.random.default_rng(7)
    vocab = model.config.vocab_size
    prompt_a = list(rng.integers(0, vocab, 10)) if prompt_a is None else list(prompt_a)
    prompt_b = list(rng.integers(0, vocab, 14)) if prompt_b is None else list(prompt_b)
    prompt_a = [int(t) for t in prompt_a]
    prompt_b = [int(t) for t in prompt_b]
    if kv_budget_tokens is None:
        kv_budget_tokens = cdiv(max(len(prompt_a), len(prompt_b)) + max_new_tokens, block_size) * block_size
    num_blocks = kv_budget_tokens // block_size
    reference_a = dense_greedy(model, prompt_a, max_new_tokens)
    reference_b = dense_greedy(model, prompt_b, max_new_tokens)

    # ---------------- the naive design: manager + LRU evictor, budget enforced by evicting whatever is oldest
    kv = KVPool.for_model(model.config, num_blocks * block_size, block_size)
    backend = PagedAttentionBackend(kv)
    mgr = PagedAttentionManager(num_blocks, block_size)
    evictor = TokenBudgetLRUEvictor(kv_budget_tokens, block_size)
    evicted_in_use: list[int] = []

    def naive_feed(rid: str, tokens: list[int]) -> int:
        evicted = evictor.evict_if_needed(mgr, len(tokens))
        for other, table in mgr.block_tables.items():
            evicted_in_use.extend(b for b in evicted if b in table and other != rid)
        evictor.touch(mgr.append_tokens(rid, len(tokens)))
        evictor.touch(mgr.block_tables[rid])
        logits = paged_step(model, backend, mgr.block_tables[rid], tokens, mgr.seq_lens[rid])
        return int(np.argmax(logits))

    naive_a = [naive_feed("A", prompt_a)]
    b_started = False
    kv_overwritten = False
    while len(naive_a) < max_new_tokens:
        if len(naive_a) == b_arrives_after and not b_started:
            a_blocks = list(mgr.block_tables["A"])
            before = kv.kv_cache[:, :, a_blocks].copy()
            naive_feed("B", prompt_b)  # B's prefill writes its K/V into the block taken from A
            kv_overwritten = bool((kv.kv_cache[:, :, a_blocks] != before).any())
            b_started = True
        naive_a.append(naive_feed("A", [naive_a[-1]]))

    # ---------------- ours: the same arrival; B does not fit while A runs, so it waits
    kv = KVPool.for_model(model.config, num_blocks * block_size, block_size)
    backend = PagedAttentionBackend(kv)
    ours = KVCacheManager(num_blocks, block_size)  # no forks here: no copy-on-write copies to apply

    reqs = {rid: KVRequest(rid) for rid in ("A", "B")}  # each request's tokens and progress

    def ours_feed(rid: str, tokens: list[int], first: bool) -> int:
        req = reqs[rid]
        req.all_token_ids.extend(tokens)
        ours.allocate(req) if first else ours.append_slots(req, len(tokens))
        logits = paged_step(model, backend, ours.block_ids(rid), tokens, ours.num_tokens(rid))
        req.num_computed_tokens = req.num_tokens
        ours.commit(req)
        return int(np.argmax(logits))

    ours_a = [ours_feed("A", prompt_a, True)]
    b_refused = False
    while len(ours_a) < max_new_tokens:
        if len(ours_a) == b_arrives_after:
            if ours.allocate(KVRequest("B", list(prompt_b)), len(prompt_b)) is None:
                b_refused = True
            else:
                ours.free("B")  # (does not happen with the default budget)
        ours_a.append(ours_feed("A", [ours_a[-1]], False))
    ours.free("A")
    ours_b = [ours_feed("B", prompt_b, True)]
    while len(ours_b) < max_new_tokens:
        ours_b.append(ours_feed("B", [ours_b[-1]], False))
    ours.free("B")

    return EvictInUseDemo(block_size, kv_budget_tokens, tuple(sorted(set(evicted_in_use))), kv_overwritten,
                          tuple(reference_a),
                          tuple(naive_a), tuple(ours_a), _first_divergence(naive_a, reference_a), b_refused,
                          tuple(reference_b), tuple(ours_b))


# ====================================================================== (3) whole-prompt hashing
@dataclass(frozen=True)
class WholePromptHashingDemo:
    """Prompts sharing a system prompt: blocks shared by the naive whole-prompt key vs our per-block chain."""

    num_prompts: int
    system_prompt_tokens: int
    block_size: int
    naive_shared_blocks: int
    ours_shared_blocks: int
    blocks_without_sharing: int
    ours_blocks_in_use: int
    ours_hit_tokens: int


def demo_whole_prompt_hashing(
    prompts: Sequence[Sequence[int]] | None = None, *, system_prompt_tokens: int | None = None, block_size: int = 4
) -> WholePromptHashingDemo:
    """Admit each prompt in turn (all stay running) and count blocks reused from earlier prompts.

    Default: 8 prompts of a 32-token system prompt followed by a distinct 6-token question.
    """
    if prompts is None:
        rng = np.random.default_rng(3)
        system = [int(t) for t in rng.integers(0, 90, 32)]
        prompts = [system + [int(t) for t in rng.integers(0, 90, 6)] for _ in range(8)]
        system_prompt_tokens = 32
    prompts = [[int(t) for t in p] for p in prompts]
    if system_prompt_tokens is None:
        system_prompt_tokens = len(_common_prefix(prompts))
    blocks_needed = sum(cdiv(len(p), block_size) for p in prompts)

    # the naive design: look the whole prompt up; on a hit, reuse that one block
    refcounter = PrefixAwareRefcounter()
    naive_mgr = PagedAttentionManager(blocks_needed, block_size)
    naive_shared = 0
    for i, p in enumerate(prompts):
        hit = refcounter.lookup(p)
        new = naive_mgr.append_tokens(f"r{i}", len(p))
        if hit is not None:
            refcounter.acquire(hit)
            naive_shared += 1
        else:
            refcounter.register(p, new[0])

    # ours: per-block chain hashes; every full block of the common prefix is shared
    ours = KVCacheManager(blocks_needed, block_size)
    hits = 0
    for i, p in enumerate(prompts):
        req = KVRequest(f"r{i}", list(p))
        hits += ours.allocate(req).num_cached_tokens
        req.num_computed_tokens = req.num_tokens
        ours.commit(req)
    sharing = ours.sharing()
    return WholePromptHashingDemo(len(prompts), system_prompt_tokens, block_size, naive_shared,
                                  sharing.saved_blocks, blocks_needed, sharing.physical_blocks, hits)


def _common_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    first = list(prompts[0])
    n = len(first)
    for p in prompts[1:]:
        n = min(n, len(p))
        for i in range(n):
            if p[i] != first[i]:
                n = i
                break
    return first[:n]


# ====================================================================== (1) pop(0) timing
@dataclass(frozen=True)
class Pop0TimingDemo:
    """Nanoseconds per allocate+free cycle at growing pool sizes: the naive list vs the O(1) block pool."""

    sizes: tuple[int, ...]
    naive_ns_per_op: tuple[float, ...]
    ours_ns_per_op: tuple[float, ...]

    @property
    def naive_growth(self) -> float:
        """naive time at the largest size / at the smallest (≈ size ratio for O(n))."""
        return self.naive_ns_per_op[-1] / self.naive_ns_per_op[0]

    @property
    def ours_growth(self) -> float:
        return self.ours_ns_per_op[-1] / self.ours_ns_per_op[0]


def demo_pop0_timing(sizes: Sequence[int] = (1_000, 10_000, 100_000), ops: int = 2_000, repeats: int = 3
                     ) -> Pop0TimingDemo:
    """Time ``ops`` allocate+free cycles on a mostly free pool of each size (best of ``repeats``)."""
    naive_ns, ours_ns = [], []
    for n in sizes:
        best_naive = best_ours = float("inf")
        for _ in range(repeats):
            mgr = PagedAttentionManager(n, 16)
            free_list = mgr.free_list
            t0 = time.perf_counter()
            for _ in range(ops):
                bid = mgr.allocate_block()
                free_list.append(bid)
            best_naive = min(best_naive, time.perf_counter() - t0)
            pool = BlockPool(n)
            allocate, free = pool.allocate, pool.free
            t0 = time.perf_counter()
            for _ in range(ops):
                free(allocate(1))
            best_ours = min(best_ours, time.perf_counter() - t0)
        naive_ns.append(best_naive / ops * 1e9)
        ours_ns.append(best_ours / ops * 1e9)
    return Pop0TimingDemo(tuple(sizes), tuple(naive_ns), tuple(ours_ns))


# ====================================================================== (4) refcount set, not incremented
@dataclass(frozen=True)
class RefcountSetDemo:
    """Two requests with the same prompt share its prefix block; then the first one finishes.

    ``naive_refcount_after_share`` is 1 (set) where 2 is right; so the first release frees the block
    (``naive_freed_while_in_use``) and the next request is handed it (``naive_block_reused_by``) while request 2
    still reads it. Ours: ``ours_refcount_after_share`` is 2 and the block stays in use after the first free.
    """

    block_id: int
    naive_refcount_after_share: int
    naive_freed_while_in_use: bool
    naive_block_reused_by: str | None
    ours_refcount_after_share: int
    ours_refcount_after_first_free: int
    ours_block_reused: bool


def demo_refcount_set(prompt: Sequence[int] | None = None, *, block_size: int = 4) -> RefcountSetDemo:
    """r1 and r2 send the same prompt (r2 reuses r1's prefix block); r1 finishes; r3 arrives and takes a block."""
    prompt = [int(t) for t in (prompt if prompt is not None else range(1, 2 * block_size + 2))]
    n = cdiv(len(prompt), block_size)

    # the naive design: a pool exactly big enough for r1 and r2, so r3 gets whatever r1 gave back
    refcounter = PrefixAwareRefcounter()
    mgr = PagedAttentionManager(2 * n - 1, block_size)
    mgr.append_tokens("r1", len(prompt))
    block = mgr.block_tables["r1"][0]
    refcounter.register(prompt, block)
    hit = refcounter.lookup(prompt)  # r2: same prompt -> shares the prefix block
    refcounter.acquire(hit)
    mgr.block_tables["r2"] = [hit] + [mgr.allocate_block() for _ in range(n - 1)]
    mgr.seq_lens["r2"] = len(prompt)
    naive_ref = refcounter.refcount[hit]
    # r1 finishes: its prefix block goes back if the refcounter says so, its other blocks always do
    table = mgr.block_tables.pop("r1")
    del mgr.seq_lens["r1"]
    freed = refcounter.release(table[0])
    mgr.free_list.extend(([table[0]] if freed else []) + table[1:])
    new = mgr.append_tokens("r3", block_size)  # r3's prefill will overwrite whatever block it gets
    reused_by = "r3" if block in new and block in mgr.block_tables["r2"] else None

    # ours
    ours = KVCacheManager(2 * n - 1, block_size)
    for rid in ("r1", "r2"):
        req = KVRequest(rid, list(prompt))
        ours.allocate(req)
        req.num_computed_tokens = req.num_tokens
        ours.commit(req)
    shared = ours.block_ids("r1")[0]
    ref_after_share = ours.ref_cnt(shared)
    ours.free("r1")
    ref_after_free = ours.ref_cnt(shared)
    ours.allocate(KVRequest("r3", list(range(500, 500 + block_size))))
    return RefcountSetDemo(block, naive_ref, freed, reused_by, ref_after_share, ref_after_free,
                           shared in ours.block_ids("r3"))


# ====================================================================== (2) the naive evictor, measured in logits
@dataclass(frozen=True)
class EvictorDamage:
    """Request A decodes; request B arrives after ``b_arrives_after`` of A's tokens under a budget that cannot hold
    both. Per decode step of A, ``*_logit_error`` is max |logits served - dense logits of the same token sequence|:
    ~1e-6 means A attended to its own K/V; anything large means it read someone else's.

    ``naive_*``: the naive design's ``PagedAttentionManager`` + ``TokenBudgetLRUEvictor``, which
    evicts A's blocks while A runs (``naive_evicted_in_use``) and hands them to B (``naive_overwritten``: blocks that
    A's and B's tables name at once). ``ours_*``: :class:`KVCacheManager` with the same budget, which refuses B
    (``ours_b_refused``) until A is done. ``reference_ids``: A's greedy tokens alone with ample memory.
    """

    kv_budget_tokens: int
    b_arrives_after: int
    naive_evicted_in_use: tuple[int, ...]
    naive_overwritten: tuple[int, ...]
    naive_logit_error: tuple[float, ...]
    naive_ids: tuple[int, ...]
    ours_logit_error: tuple[float, ...]
    ours_ids: tuple[int, ...]
    ours_b_refused: bool
    reference_ids: tuple[int, ...]


def demo_evictor_damage(model, prompt_a: Sequence[int], prompt_b: Sequence[int], *, block_size: int = 4,
                        max_new_tokens: int = 8, b_arrives_after: int = 3,
                        kv_budget_tokens: int | None = None) -> EvictorDamage:
    """Run the arrival of B during A's decode under the naive design and under ours; measure A's logits.

    The default budget holds either request alone (prompt + ``max_new_tokens``), not both. The dense logits of the
    sequence each design actually produced come from one ``model.forward`` over it (teacher forcing), so a wrong
    logit is caught even when the greedy token happens not to flip.
    """
    pa, pb = [int(t) for t in prompt_a], [int(t) for t in prompt_b]
    if kv_budget_tokens is None:
        kv_budget_tokens = cdiv(max(len(pa), len(pb)) + max_new_tokens, block_size) * block_size
    num_blocks = kv_budget_tokens // block_size

    def errors(prompt, out, rows):
        dense = model.forward(prompt + out[:-1])[len(prompt) - 1:]
        return tuple(float(np.abs(r - d).max()) for r, d in zip(rows, dense))

    # ---- the naive design
    kv = KVPool.for_model(model.config, num_blocks * block_size, block_size)
    backend = PagedAttentionBackend(kv)
    mgr = PagedAttentionManager(num_blocks, block_size)
    evictor = TokenBudgetLRUEvictor(kv_budget_tokens, block_size)
    evicted_in_use: list[int] = []

    def naive_feed(rid, tokens):
        evicted = evictor.evict_if_needed(mgr, len(tokens))
        evicted_in_use.extend(b for b in evicted for other, t in mgr.block_tables.items() if other != rid and b in t)
        evictor.touch(mgr.append_tokens(rid, len(tokens)))
        evictor.touch(mgr.block_tables[rid])
        return paged_step(model, backend, mgr.block_tables[rid], tokens, mgr.seq_lens[rid])

    rows, out = [naive_feed("A", pa)], []
    overwritten: set[int] = set()
    while True:
        out.append(int(np.argmax(rows[-1])))
        if len(out) == max_new_tokens:
            break
        if len(out) == b_arrives_after:
            naive_feed("B", pb)
            overwritten |= set(mgr.block_tables["A"]) & set(mgr.block_tables["B"])
        rows.append(naive_feed("A", [out[-1]]))
    naive_ids, naive_err = tuple(out), errors(pa, out, rows)

    # ---- ours: same budget, same arrival
    kv = KVPool.for_model(model.config, num_blocks * block_size, block_size)
    backend = PagedAttentionBackend(kv)
    ours = KVCacheManager(num_blocks, block_size)  # no forks here: no copy-on-write copies to apply
    req_a = KVRequest("A", list(pa))
    ours.allocate(req_a)
    rows = [paged_step(model, backend, ours.block_ids("A"), pa, ours.num_tokens("A"))]
    req_a.num_computed_tokens = req_a.num_tokens
    ours.commit(req_a)
    out, refused = [], False
    while True:
        out.append(int(np.argmax(rows[-1])))
        if len(out) == max_new_tokens:
            break
        if len(out) == b_arrives_after:
            if ours.allocate(KVRequest("B", list(pb))) is None:
                refused = True
            else:
                ours.free("B")
        req_a.all_token_ids.append(out[-1])
        ours.append_slots(req_a, 1)
        rows.append(paged_step(model, backend, ours.block_ids("A"), [out[-1]], ours.num_tokens("A")))
        req_a.num_computed_tokens = req_a.num_tokens
        ours.commit(req_a)
    ours_ids, ours_err = tuple(out), errors(pa, out, rows)
    reference = dense_greedy(model, pa, max_new_tokens)
    return EvictorDamage(kv_budget_tokens, b_arrives_after, tuple(sorted(set(evicted_in_use))),
                         tuple(sorted(overwritten)),
                         naive_err, naive_ids, ours_err, ours_ids, refused, tuple(reference))

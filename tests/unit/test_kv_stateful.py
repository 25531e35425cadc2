"""Stateful property test of the KV cache manager: random allocate / append / decode (the engine's fast path) /
commit / fork / free / lookup / evict / truncate sequences, with every invariant checked after every step against
an independent shadow model. The machine is the manager's caller: it owns each request (a ``KVRequest``: its
tokens and how many are computed) and the manager only reads them.

The shadow keeps what the KV pool *would* hold: every reserved slot is "written" with (token, position) as the
model step would write K/V, copy-on-write copies are applied, and after every step each live request must read its
own tokens back through its block table. So a block evicted while in use, a wrong prefix hit, a missed or wrong
copy-on-write, or a double-counted refcount all show up as a failure here, whatever the manager's own checks say.

``MINIENV_STATEFUL_EXAMPLES`` sets the number of sequences (default 1000; CI keeps the default),
``MINIENV_STATEFUL_STEPS`` the steps per sequence (default 20), and ``MINIENV_STATEFUL_RANDOM=1`` draws fresh
sequences instead of the reproducible derandomized ones (e.g. a long bug hunt: 4000 x 40 passes).
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minienv.kv.hashing import ROOT_HASH
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import BlockState, KVCacheManager, UnknownRequestError

EXAMPLES = int(os.environ.get("MINIENV_STATEFUL_EXAMPLES", "1000"))
STEPS = int(os.environ.get("MINIENV_STATEFUL_STEPS", "20"))

# A tiny alphabet makes shared prefixes (and so hits and shared blocks) frequent. A token list is drawn as two
# integers (length, base-3 digits) rather than a list of draws: hypothesis's per-draw cost dominates this test.
def _tokens(pair: tuple[int, int]) -> list[int]:
    length, digits = pair
    return [(digits // 3**i) % 3 for i in range(length)]


tokens_st = st.tuples(st.integers(1, 10), st.integers(0, 3**10 - 1)).map(_tokens)
pick_st = st.integers(0, 2**16)  # index into the live requests, modulo their number


def encode(token: int, position: int) -> int:
    return token * 4096 + position


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 10), block_size=st.sampled_from([1, 2, 3, 4]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.B = block_size
        self.shadow = np.full(num_blocks * block_size, -1, dtype=np.int64)  # what each KV slot holds
        self.next_id = 0
        self.freed: list[str] = []
        self.reqs: dict[str, KVRequest] = {}  # the caller's requests: tokens and progress, owned here only
        self.evicted_in_use: list[int] = []
        self.mgr.add_listener(self.on_event)

    def on_event(self, event):
        if event.kind == "evict":
            # At eviction the block was just taken from the free queue: no table may hold it.
            holders = sum(event.block_id in r.block_ids for r in self.mgr._requests.values())
            if holders:
                self.evicted_in_use.append(event.block_id)

    # ------------------------------------------------------------------ helpers
    def live(self) -> list[str]:
        return self.mgr.request_ids()

    def pick(self, i: int) -> str:
        live = self.live()
        return live[i % len(live)]

    def write(self, alloc) -> None:
        """What the model step does: apply CoW copies, then write each new token's (token, position), the tokens
        read from the request (the allocation carries positions and blocks only)."""
        for src, dst in alloc.blocks_to_copy:
            self.shadow[dst * self.B:(dst + 1) * self.B] = self.shadow[src * self.B:(src + 1) * self.B]
        # A write must only ever go into a block this request holds alone (never a shared one).
        for slot in alloc.slot_mapping:
            assert self.mgr.ref_cnt(int(slot) // self.B) == 1, "write into a shared block"
        tokens = self.reqs[alloc.request_id].all_token_ids[alloc.start:alloc.start + alloc.num_new_tokens]
        self.shadow[alloc.slot_mapping] = [encode(t, int(p)) for t, p in zip(tokens, alloc.positions, strict=True)]

    def attempt(self, fn):
        """Run an operation; when it finds no room (None) the manager must be exactly as before."""
        before = self.mgr.snapshot()
        out = fn()
        if out is None:
            assert self.mgr.snapshot() == before, "a failed allocation changed state"
        return out

    # ------------------------------------------------------------------ rules
    @rule(prompt=tokens_st, chunk=st.integers(1, 10))
    def allocate(self, prompt, chunk):
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.mgr.lookup(prompt)
        n = min(chunk, len(prompt) - hit.num_cached_tokens)
        req = KVRequest(rid, list(prompt))
        alloc = self.attempt(lambda: self.mgr.allocate(req, n))
        if alloc is not None:
            assert alloc.num_cached_tokens == hit.num_cached_tokens < len(prompt)
            assert alloc.num_new_tokens >= 1
            req.num_computed_tokens = alloc.num_cached_tokens
            self.reqs[rid] = req
            self.write(alloc)

    @precondition(lambda self: self.live())
    @rule(pick=pick_st, tokens=st.one_of(tokens_st, st.lists(st.integers(0, 9), min_size=1, max_size=2)))
    def append(self, pick, tokens):
        """Reserve the next len(tokens) slots: the request's own tokens not yet reserved (the rest of a chunked
        prompt) come first; past them, ``tokens`` are appended to the request (decode tokens)."""
        rid = self.pick(pick)
        req = self.reqs[rid]
        new = tokens[len(req.all_token_ids) - self.mgr.num_tokens(rid):]
        req.all_token_ids.extend(new)
        alloc = self.attempt(lambda: self.mgr.append_slots(req, len(tokens)))
        if alloc is None:
            del req.all_token_ids[len(req.all_token_ids) - len(new):]
        else:
            self.write(alloc)

    @precondition(lambda self: self.live())
    @rule(pick=pick_st, tokens=st.lists(st.integers(0, 9), min_size=1, max_size=3), other=st.one_of(st.none(), tokens_st),
          kv_written=st.booleans())
    def failed_step(self, pick, tokens, other, kv_written):
        """A step that appends to a request (copy-on-write included), may admit another (whose allocation may evict
        the copied original), then fails: before writing anything, or after its copies and some K/V were written.
        The scheduler's rollback: the admission undone, then the append. Every request must read back its own
        tokens (the invariant below), whichever block it holds afterwards."""
        rid = self.pick(pick)
        req = self.reqs[rid]
        if self.mgr.num_tokens(rid) != len(req.all_token_ids):
            return  # a chunked prompt mid-way: its next slots are its own tokens, covered by append
        n = len(req.all_token_ids)
        req.all_token_ids.extend(tokens)
        alloc = self.attempt(lambda: self.mgr.append_slots(req, len(tokens)))
        if alloc is None:
            del req.all_token_ids[n:]
            return
        admitted = None
        if other is not None:
            oreq = KVRequest(f"r{self.next_id}", list(other))
            self.next_id += 1
            self.reqs[oreq.request_id] = oreq
            admitted = self.attempt(lambda: self.mgr.allocate(oreq, len(other) - self.mgr.lookup(other).num_cached_tokens))
        if kv_written:  # the step applied its copies and the model wrote K/V before it failed
            self.write(alloc)
            if admitted is not None:
                self.write(admitted)
        if admitted is not None:
            self.mgr.undo_allocate(admitted.request_id)
        self.mgr.undo_append_slots(rid, n, kv_written=kv_written)
        del req.all_token_ids[n:]

    @precondition(lambda self: self.live())
    @rule(pick=pick_st, k=st.integers(1, 6))
    def truncate(self, pick, k):
        """Roll back the last k tokens (speculative decoding's rejected tokens)."""
        rid = self.pick(pick)
        n = self.mgr.num_tokens(rid)
        if n > 1:
            m = max(1, n - k)
            self.mgr.truncate(rid, m)
            req = self.reqs[rid]  # the caller drops the rejected tokens; the next ones may differ
            del req.all_token_ids[m:]
            req.num_computed_tokens = min(req.num_computed_tokens, m)

    @precondition(lambda self: self.live())
    @rule(pick=pick_st, behind=st.integers(0, 2))
    def commit(self, pick, behind):
        """The step computed the reserved tokens (all, or all but the last ``behind``): progress, then commit."""
        rid = self.pick(pick)
        req = self.reqs[rid]
        req.num_computed_tokens = max(req.num_computed_tokens, self.mgr.num_tokens(rid) - behind)
        self.mgr.commit(req)

    @precondition(lambda self: self.live())
    @rule(pick=pick_st, n=st.integers(1, 3))
    def fork(self, pick, n):
        rid = self.pick(pick)
        parent = self.reqs[rid]
        parent.num_computed_tokens = self.mgr.num_tokens(rid)
        self.mgr.commit(parent)  # fork needs written K/V
        before = {b: self.mgr.ref_cnt(b) for b in set(self.mgr.block_ids(rid))}
        children = [f"{rid}.{self.next_id}.{i}" for i in range(n)]
        self.next_id += 1
        self.mgr.fork(parent, children)
        for c in children:  # each child its own request: a copy of the parent's tokens and progress
            self.reqs[c] = KVRequest(c, list(parent.all_token_ids), parent.num_computed_tokens)
        for b, c in before.items():
            assert self.mgr.ref_cnt(b) == c + n, "fork must add exactly one reference per child per block"

    @precondition(lambda self: self.live())
    @rule(pick=pick_st)
    def free(self, pick):
        rid = self.pick(pick)
        self.mgr.free(rid)
        del self.reqs[rid]
        self.freed.append(rid)

    @precondition(lambda self: self.freed)
    @rule(pick=pick_st)
    def free_twice(self, pick):
        rid = self.freed[pick % len(self.freed)]
        before = self.mgr.snapshot()
        try:
            self.mgr.free(rid)
        except UnknownRequestError:
            pass
        else:
            raise AssertionError("double free was accepted")
        assert self.mgr.snapshot() == before

    @rule(prompt=tokens_st)
    def lookup(self, prompt):
        before = self.mgr.snapshot()
        hit = self.mgr.lookup(prompt)
        assert self.mgr.snapshot() == before, "lookup must not change state"
        assert hit.num_cached_tokens == len(hit.block_ids) * self.B < len(prompt)
        # The hit blocks really hold this prompt's tokens at these positions.
        for j, bid in enumerate(hit.block_ids):
            want = [encode(prompt[j * self.B + i], j * self.B + i) for i in range(self.B)]
            assert self.shadow[bid * self.B:(bid + 1) * self.B].tolist() == want

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        for bid in self.mgr.evict(n):
            assert self.mgr.ref_cnt(bid) == 0

    # ------------------------------------------------------------------ invariants, after every step
    @invariant()
    def all_invariants(self):
        """Checked after every step (one hypothesis invariant calling each check keeps the overhead down)."""
        if not hasattr(self, "mgr"):
            return
        self.refcounts_equal_table_holders()
        self.every_block_in_exactly_one_state()
        self.index_names_exactly_the_cached_blocks()
        self.every_request_reads_back_its_own_tokens()
        self.resident_within_budget_and_no_in_use_eviction()

    def refcounts_equal_table_holders(self):
        holders = [0] * self.mgr.num_blocks
        for rid in self.live():
            for bid in self.mgr.block_ids(rid):
                holders[bid] += 1
        assert [self.mgr.ref_cnt(b) for b in range(self.mgr.num_blocks)] == holders

    def every_block_in_exactly_one_state(self):
        mgr = self.mgr
        queue = [bid for bid, _ in mgr.free_queue()]
        in_queue = set(queue)
        assert len(in_queue) == len(queue), "a block is twice in the free queue"
        indexed = {e.block_id for e in mgr.index}
        in_use = {b for b in range(mgr.num_blocks) if mgr.ref_cnt(b) > 0}
        cached_free = in_queue & indexed
        free_empty = in_queue - indexed
        assert not (in_use & in_queue), "a block both in use and free"
        assert len(free_empty) + len(cached_free) + len(in_use) == mgr.num_blocks
        s = mgr.stats()
        assert (s.num_free_empty, s.num_cached_free, s.num_in_use) == (len(free_empty), len(cached_free),
                                                                      len(in_use))
        for b in range(mgr.num_blocks):
            state = mgr.block_state(b)
            expected = (BlockState.IN_USE if b in in_use else
                        BlockState.CACHED_FREE if b in cached_free else BlockState.FREE_EMPTY)
            assert state is expected

    def index_names_exactly_the_cached_blocks(self):
        mgr = self.mgr
        for entry in mgr.index:
            block = mgr.pool.blocks[entry.block_id]
            assert block.block_hash == entry.block_hash == entry.key.block_hash()
            # the indexed block really holds the tokens its key names (no stale entry: vLLM #4764)
            depth, parent = 0, entry.key.parent_hash
            while parent != ROOT_HASH:  # the block's place in its chain gives its tokens' positions
                depth += 1
                parent = mgr.index.entry_for_hash(parent).key.parent_hash
            want = [encode(t, depth * self.B + i) for i, t in enumerate(entry.key.token_ids)]
            got = self.shadow[entry.block_id * self.B:(entry.block_id + 1) * self.B].tolist()
            assert got == want, f"block {entry.block_id} indexed with K/V it does not hold"
        hashed = {b.block_id for b in mgr.pool.blocks if b.block_hash is not None}
        assert hashed == {e.block_id for e in mgr.index}
        if not mgr.enable_prefix_caching:
            assert len(mgr.index) == 0

    def every_request_reads_back_its_own_tokens(self):
        for rid in self.live():
            alloc_table = self.mgr.request(rid)
            slots = alloc_table.slot_mapping()
            toks = self.reqs[rid].all_token_ids[:alloc_table.num_tokens]
            assert len(toks) == alloc_table.num_tokens, f"{rid}: slots reserved for tokens it does not hold"
            assert self.shadow[slots].tolist() == [encode(t, p) for p, t in enumerate(toks)], f"{rid} corrupted"

    def resident_within_budget_and_no_in_use_eviction(self):
        s = self.mgr.stats()
        assert s.resident_tokens <= s.kv_budget_tokens
        assert s.evicted_tokens == s.evicted_blocks * self.B
        assert not self.evicted_in_use, f"blocks evicted while in use: {self.evicted_in_use}"
        self.mgr.check_invariants()


KVCacheMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=os.environ.get("MINIENV_STATEFUL_RANDOM") != "1",
)
TestKVCacheStateful = KVCacheMachine.TestCase

"""Notebook 14's capstone: grade a KV cache manager the student wrote from scratch, with the series' own proofs.

The student's class keeps a small contract (``CONTRACT`` below, stated in the notebook) shaped like the engine's
:class:`~minienv.kv.interface.KVManager` protocol: ``allocate`` / ``append_slots`` / ``commit`` take the caller's
request object and read its tokens and progress from it (the class keeps no copy), the rest take ids.
:func:`~minienv.exercises.capstone_plug.plug` turns the class into the ``kv_cache_manager_factory`` of a real
:class:`~minienv.engine.InferenceEngine`: the engine's calls reach it unchanged, and the plug adds only the
protocol's return records, counters and events around it.

Three checks, each an ``exercise`` (stub -> "not implemented yet", wrong -> the rule broken, right -> ✓):

* :func:`check_rules` — one small scenario per rule of the contract (each classic bug breaks exactly one);
* :func:`check_random_ops` — random admissions, appends, commits and frees on requests the check owns
  (:class:`~minienv.kv.interface.KVRequest`): the structural invariants after every operation, every prefix hit
  holds the right computed tokens, and a freed prompt is found again;
* :func:`check_in_engine` — the student's manager inside the engine: outputs == minienv's manager (cache on) ==
  cache off == each request generated alone, and again under a budget so tight that requests are preempted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import numpy as np

from minienv.exercises._check import ExerciseFailed, _NotYet, exercise, fail, require
from minienv.exercises.capstone_plug import PluggedManager, audit, plug
from minienv.kv.interface import KVRequest

__all__ = ["CONTRACT", "PluggedManager", "audit", "check_in_engine", "check_random_ops", "check_rules", "passed",
           "plug", "run_engine"]

CONTRACT = """\
A request is the caller's object; read it at each call, never keep a copy of its tokens:
  request.request_id, request.all_token_ids (prompt + output so far: the caller appends),
  request.num_computed_tokens (how many of them have K/V: the caller advances it after each step)
MyKVCacheManager(num_blocks, block_size, enable_prefix_caching=True): blocks 0 .. num_blocks-1, all in the free
                                    queue in that order (0 at the head)
lookup(token_ids) -> list[int]      the blocks of the longest cached run of FULL blocks of token_ids, found by chain
                                    hash, at most (len-1)//block_size of them; [] with caching off; changes nothing
allocate(request, n) -> int | None  admit: take lookup(request.all_token_ids)'s hit (refcount +1; a cached-free hit
                                    leaves the free queue), then new blocks from the free-queue HEAD for hit + n
                                    tokens; return the tokens served from cache, or None (changing nothing) if the
                                    blocks don't fit
append_slots(request, n) -> bool    blocks for num_computed_tokens + n tokens (new ones only when the last is full);
                                    False, changing nothing, if they don't fit
commit(request)                     index each FULL block of all_token_ids[:num_computed_tokens] not indexed yet
                                    under its chain hash (unless that hash is already indexed)
free(request_id)                    release the blocks LAST FIRST; a block whose refcount reaches 0 joins the free
                                    queue's TAIL, still findable if indexed (cached-free)
taking a block from the free queue evicts it: its hash leaves the index in that call
observers: block_table(request_id) -> list[int], ref_cnt(b) -> int, free_queue() -> list[int] (head first),
           is_cached(b) -> bool (b is in the prefix index)"""


@contextlib.contextmanager
def _student() -> Iterator[None]:
    """A ``NotImplementedError`` from any of the student's methods means the stub is still there."""
    try:
        yield
    except NotImplementedError as err:
        raise _NotYet from err


class _Scenario:
    """The rule the running scenario (or random operation) checks: a student exception is reported against it."""

    def __init__(self) -> None:
        self.rule = "the manager answers every call of the contract"


class _Watched:
    """The student's manager, with every method call watched: an exception from the student's code becomes
    ``✗ <the rule being checked>`` plus their error and the call — never their traceback out of the check."""

    def __init__(self, core: Any, scenario: _Scenario) -> None:
        self._core, self._scenario = core, scenario

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._core, name)
        if not callable(attr):
            return attr

        def call(*args: Any) -> Any:
            try:
                return attr(*args)
            except NotImplementedError as err:
                raise _NotYet from err
            except ExerciseFailed:
                raise
            except Exception as err:  # noqa: BLE001 - the student's bug, reported as the rule it broke
                shown = ", ".join(_shown(a) for a in args)
                fail(self._scenario.rule, f"your {name}({shown}) raised {type(err).__name__}: {err}")
        return call


def _shown(arg: Any) -> str:
    if hasattr(arg, "all_token_ids"):  # a request: its id and progress, not its tokens
        return (f"<request {arg.request_id!r}: {len(arg.all_token_ids)} tokens, {arg.num_computed_tokens} "
                "computed>")
    return repr(arg) if len(repr(arg)) < 60 else repr(arg)[:57] + "…"


def _make(cls: Callable, scenario: _Scenario) -> Callable[..., _Watched]:
    return lambda *args: _Watched(cls(*args), scenario)


#: the check -> what it last passed with (the student's class, and for the engine check their 07 functions too)
_PASSED: dict[str, tuple] = {}


def passed(cls: type, victim_policy: Callable | None = None, plan_step: Callable | None = None) -> bool:
    """Whether all three gradings passed, in this session, for this very class (and these notebook-07 functions):
    what notebook 14 asks before it serves requests with the student's pieces. Redefining the class makes a new
    class object, which has passed nothing yet."""
    return (_PASSED.get("rules") == (cls,) and _PASSED.get("random_ops") == (cls,)
            and _PASSED.get("in_engine") == (cls, victim_policy, plan_step))


# ---------------------------------------------------------------------------------------------- the checks
B = 4  # block size of the scenarios


def _seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _admit(m: Any, req: KVRequest, commit: bool = True) -> int:
    """Admit ``req`` with every token not found in cache, as the engine does: allocate, then the caller sets
    ``num_computed_tokens`` to the tokens served from cache; ``commit``: the step computes the rest, then commit."""
    n = len(req.all_token_ids) - len(m.lookup(req.all_token_ids)) * B
    n_cached = m.allocate(req, n)
    require(n_cached is not None, "allocate succeeds when the free queue holds enough blocks",
            f"allocate({req.request_id!r}, {n}) returned None with {len(m.free_queue())} free blocks")
    req.num_computed_tokens = n_cached
    if commit:
        _computed(m, req)
    return n_cached


def _computed(m: Any, req: KVRequest) -> None:
    """The step computed every token of the request: the caller advances its progress, then commits."""
    req.num_computed_tokens = len(req.all_token_ids)
    m.commit(req)


@exercise("implement MyKVCacheManager's methods (the contract above), then run this cell again")
def check_rules(cls) -> str:
    """One scenario per rule; each classic bug breaks exactly one of them (tests/unit/test_capstone.py)."""
    _PASSED.pop("rules", None)
    student_class = cls.fn
    scene = _Scenario()
    cls = _make(cls, scene)
    R = KVRequest
    with _student():
        # 1. lifecycle + refcount on a shared block
        scene.rule = "scenario 1: allocate, lookup, commit and free keep a refcount per holder on a shared block"
        m = cls(8, B, True)
        a = _seq(0, 9)  # 2 full blocks + 1
        require(_admit(m, R("a", a)) == 0, "allocate returns the tokens served from cache: 0 for a cold prompt")
        ta = m.block_table("a")
        require(len(ta) == 3, "allocate reserves ceil(tokens / block_size) blocks", f"9 tokens -> {ta}")
        require(m.free_queue()[0] == 3, "new blocks come from the HEAD of the free queue (block 0, 1, 2 first)",
                f"table {ta}, free queue now {m.free_queue()}")
        got = _admit(m, R("b", a[:8] + [99, 98]))
        require(got == 8, "a committed full block is found by lookup: b shares a's 2 full blocks",
                f"allocate('b') served {got} tokens from cache, expected 8")
        audit(m, 8, {"a": ta, "b": m.block_table("b")})
        m.free("a")
        audit(m, 8, {"b": m.block_table("b")})
        # 2. index at commit, not at allocation
        scene.rule = "scenario 2: a block is indexed at commit, never at allocation"
        m = cls(8, B, True)
        ra = R("a", list(a))
        m.allocate(ra, len(a))
        early = m.lookup(a + [7, 7])
        require(early == [], "a block is indexed at commit, never at allocation: its K/V do not exist yet",
                f"lookup found {early} after allocate('a') but before commit('a')")
        _computed(m, ra)
        require(m.lookup(a + [7]) == m.block_table("a")[:2], "commit indexes every newly full block",
                f"after commit, lookup gave {m.lookup(a + [7])}, table {m.block_table('a')}")
        require(len(m.lookup(a[:8])) == 1, "lookup returns at most (len - 1) // block_size blocks: the last token "
                "is always computed, for its logits", f"lookup of 8 tokens gave {m.lookup(a[:8])}")
        # 3. chain hash: a block's key is its whole prefix
        x = _seq(100, 4) + _seq(200, 4) + [1]
        y = _seq(200, 4) + [1]  # x's 2nd block's tokens, but as a first block: no prefix before them
        scene.rule = "scenario 3: the hash of block j chains block j-1's hash"
        m = cls(8, B, True)
        _admit(m, R("x", x))
        hit = m.lookup(y)
        require(hit == [], "the hash of block j chains block j-1's hash: the same tokens after a different prefix "
                "must miss (their K/V differ)", f"x = {x}; lookup({y}) returned {hit}, but x's block 1 holds those "
                "tokens after x's block 0")
        # 4. free last-first + LRU: eviction cuts a cached prefix from its tail
        scene.rule = "scenario 4: free releases the last block first; eviction cuts a cached prefix from its tail"
        m = cls(4, B, True)
        p = _seq(0, 13)  # 3 full blocks + 1 -> 4 blocks: the whole pool
        _admit(m, R("p", p))
        m.free("p")
        kept = len(m.lookup(p))
        require(kept == 3, "a freed request's full blocks stay cached (cached-free) and findable until evicted",
                f"right after free('p'), lookup(p) finds {kept} of its 3 full blocks")
        _admit(m, R("q", _seq(500, 5)), commit=False)  # 2 blocks: p's partial one, then ONE cached block
        kept = len(m.lookup(p))
        require(kept != 3, "an evicted block leaves the index in the call that reuses it (its K/V get overwritten)",
                f"the pool of 4 is full again (q took 2 blocks, one of them cached), yet lookup(p) finds all 3 of "
                f"p's blocks: a reused block is still indexed")
        require(kept == 2, "free releases the LAST block first, so eviction (from the free-queue head) removes a "
                "cached prefix from its tail and the rest stays findable",
                f"after freeing p (3 cached blocks) and evicting one, lookup(p) finds {kept} blocks, not 2")
        # 5. LRU across requests + eviction drops the hash
        scene.rule = "scenario 5: allocation takes the least recently freed block first, and eviction drops its hash"
        m = cls(6, B, True)
        old, new = _seq(0, 5), _seq(40, 5)
        _admit(m, R("old", old))
        _admit(m, R("new", new))
        m.free("old")
        m.free("new")
        _admit(m, R("z", _seq(80, 8)), commit=False)  # 2 blocks: the free-empty ones first, then the LRU cached one
        _admit(m, R("w", _seq(90, 8)), commit=False)  # 2 more: old's partial block, then one cached block
        require(m.lookup(old) == [] and len(m.lookup(new)) == 1,
                "allocation takes the least recently freed block first (LRU), and an evicted block leaves the index",
                f"old freed before new; after evicting one cached block lookup(old) = {m.lookup(old)}, "
                f"lookup(new) = {m.lookup(new)}")
        # 6. a cached-free hit leaves the free queue
        scene.rule = ("scenario 6: a prefix hit on a cached-free block takes it out of the free queue (in use again: "
                      "it must not be evicted)")
        m = cls(4, B, True)
        _admit(m, R("a", a[:5]))
        m.free("a")
        a2 = R("a2", a[:5])
        _admit(m, a2, commit=False)
        hit_block = m.block_table("a2")[0]
        require(hit_block not in m.free_queue(), scene.rule,
                f"block {hit_block} is in a2's table and the free queue")
        # 7. an allocation that does not fit changes nothing — not even the prefix hit's refcount
        scene.rule = "scenario 7: allocate returns None and changes nothing when the blocks do not fit"
        state = lambda: (m.free_queue(), m.block_table("a2"), [m.ref_cnt(b) for b in range(4)])  # noqa: E731
        before = state()
        big = a[:4] + _seq(600, 40)  # its first block is a hit (a2's block, in use): its refcount must not move
        got = m.allocate(R("big", big), len(big) - B)
        require(got is None and state() == before, "allocate returns None and changes nothing when the blocks do not "
                "fit: decide before touching anything (here the hit block's refcount must not move)",
                f"allocate of 1 hit + 10 new blocks with 2 free returned {got}; (free queue, a2's table, refcounts) "
                f"went from {before} to {state()}")
        scene.rule = "scenario 7: append_slots takes a new block only when the last one is full"
        _computed(m, a2)
        a2.all_token_ids += [1, 2, 3]  # the caller's tokens; append_slots reserves their slots
        require(m.append_slots(a2, 3) and len(m.block_table("a2")) == 2,
                "append_slots takes a new block only when the last one is full",
                f"5 computed + 3 new tokens -> table {m.block_table('a2')}")
        # 8. a cached-free hit counts against the free blocks
        scene.rule = ("scenario 8: a cached-free hit counts against the free blocks: taking it out of the queue leaves "
                      "fewer for the new blocks")
        m = cls(3, B, True)
        _admit(m, R("a", a[:5]))  # blocks 0 (full, indexed) and 1
        m.free("a")  # free queue [2, 1, 0]: 0 is cached-free
        before = (m.free_queue(), [m.ref_cnt(b) for b in range(3)], m.lookup(a[:5]))
        got = m.allocate(R("long", a[:4] + _seq(700, 9)), 9)  # hit block 0, then 3 new blocks: 1 + 3 > 3 free
        after = (m.free_queue(), [m.ref_cnt(b) for b in range(3)], m.lookup(a[:5]))
        require(got is None and after == before, scene.rule + " (1 hit + 3 new > 3 free: None, "
                "changing nothing)", f"allocate returned {got}; (free queue, refcounts, lookup) went from {before} "
                f"to {after}")
        # 9. the hit is taken before the new blocks
        scene.rule = ("scenario 9: allocate takes the prefix hit before the new blocks (new blocks come from the "
                      "free-queue head, where the hit itself may be waiting)")
        m = cls(4, B, True)
        _admit(m, R("a", a[:5]))  # blocks 0 (indexed) and 1
        m.free("a")  # queue [2, 3, 1, 0]
        _admit(m, R("x", _seq(300, 12)), commit=False)  # takes 2, 3, 1: queue [0], 0 cached-free at the head
        m.free("x")  # queue [0, 1, 3, 2]
        got = _admit(m, R("a3", a[:5]), commit=False)  # hit [0] + 1 new block
        table = m.block_table("a3")
        require(got == B and len(table) == 2 and table[0] != table[1] and table[1] != 0 and m.is_cached(table[0])
                and 0 not in m.free_queue(), scene.rule,
                f"cached-free block 0 at the free-queue head was a3's hit; a3 got table {table}, cached "
                f"{[m.is_cached(b) for b in table]}, free queue {m.free_queue()}")
        audit(m, 4, {"a3": table})
        # 10. one block per hash: a twin computed at the same time stays private
        scene.rule = ("scenario 10: commit indexes a newly full block only when its chain hash is not indexed yet "
                      "(one block per hash: a twin computed at the same time stays private)")
        m = cls(8, B, True)
        t1, t2 = R("t1", list(a)), R("t2", list(a))
        m.allocate(t1, len(a))
        m.allocate(t2, len(a))  # both before either commits: each computes its own copy
        _computed(m, t1)
        _computed(m, t2)
        b1, b2 = m.block_table("t1"), m.block_table("t2")
        require(m.lookup(a) == b1[:2] and not any(m.is_cached(b) for b in b2), scene.rule,
                f"t1 = {b1} committed first, then its twin t2 = {b2}; lookup gives {m.lookup(a)}, is_cached of t2's "
                f"blocks {[m.is_cached(b) for b in b2]} (expected t1's blocks, and t2's private)")
        m.free("t1")
        m.free("t2")
        _admit(m, R("fill", _seq(800, 29)), commit=False)  # 8 blocks: every free block, the cached ones last
        audit(m, 8, {"fill": m.block_table("fill")})
        require(m.lookup(a) == [], "an evicted block leaves the index in the call that reuses it",
                f"every block was reused by 'fill', yet lookup(a) = {m.lookup(a)}")
        # 11. caching off
        scene.rule = "scenario 11: with enable_prefix_caching=False nothing is ever found"
        m = cls(8, B, False)
        _admit(m, R("a", a))
        m.free("a")
        require(m.lookup(a) == [], "with enable_prefix_caching=False nothing is ever found",
                f"lookup gave {m.lookup(a)}")
        # 12. the request is read at each call: its computed tokens as they are now
        scene.rule = ("scenario 12: commit reads the request at the call: the full blocks of "
                      "all_token_ids[:num_computed_tokens], tokens decoded since allocate included")
        m = cls(8, B, True)
        r = R("r", _seq(0, 7))
        _admit(m, r)  # 7 tokens computed: block 0 indexed, block 1 holds 3
        r.all_token_ids.append(7)  # the step sampled token 7: in the request, its K/V come with the next step
        m.commit(r)
        got = m.lookup(_seq(0, 9))
        require(len(got) == 1, scene.rule + " (a token sampled but not yet computed has no K/V: its block is not "
                "full of computed tokens)", f"7 of r's 8 tokens computed; lookup of its 8 tokens + 1 found {got}")
        require(m.append_slots(r, 1), "append_slots reserves the slot of the token after the computed ones",
                f"table {m.block_table('r')}, free queue {m.free_queue()}")
        r.num_computed_tokens = 8  # the next step computed token 7: block 1 is full now
        m.commit(r)
        got = m.lookup(_seq(0, 9))
        require(len(got) == 2, scene.rule + " (a copy of the tokens taken at allocate goes stale as the request "
                "decodes: read request.all_token_ids)", f"r decoded token 7 into block 1 and committed it; lookup "
                f"found {got}, expected r's 2 full blocks {m.block_table('r')}")
    _PASSED["rules"] = (student_class,)
    return "every rule of the contract holds on its scenario (refcounts, commit-time indexing, chain hashes, " \
           "last-first free, LRU eviction, cached-free hits, all-or-nothing allocation, one block per hash, " \
           "the request read at each call)"


@exercise("implement MyKVCacheManager first (check_rules), then run this cell again")
def check_random_ops(cls, *, seed: int = 0, num_ops: int = 400, num_blocks: int = 12) -> str:
    """Random admissions / appends / commits / frees over prompts that share prefixes, on requests the check owns
    (it appends their tokens and advances their progress; the manager only reads them). After every operation: the
    structural invariants; every block a lookup returns holds exactly the prompt's tokens and was computed; a prompt
    freed with nothing allocated since is found again in full."""
    _PASSED.pop("random_ops", None)
    rng = np.random.default_rng(seed)
    # prompts start with 0-3 "words" of one block each from a vocabulary of 3, so equal blocks recur both as a
    # shared prefix and at different positions after different prefixes
    words = [list(map(int, rng.integers(0, 50, B))) for _ in range(3)]
    content: dict[int, tuple[int, ...]] = {}  # block -> the computed tokens it holds as a full prefix block
    reqs: dict[str, KVRequest] = {}
    tables: dict[str, list[int]] = {}  # the block tables the check expects
    hits = found_again = 0
    scene = _Scenario()
    with _student():
        m = _make(cls, scene)(num_blocks, B, True)
        for op_no in range(num_ops):
            op = rng.integers(0, 4)
            scene.rule = (f"random operation {op_no} ({['admit', 'commit', 'append', 'free'][int(op)]}): the manager "
                          "keeps the contract on every sequence of calls")
            if op == 0 or not reqs:  # admit
                stem = [t for _ in range(int(rng.integers(0, 4))) for t in words[int(rng.integers(0, 3))]]
                prompt = stem + list(map(int, rng.integers(50, 99, int(rng.integers(1, 9)))))
                hit = m.lookup(prompt)
                for j, bid in enumerate(hit):
                    require(content.get(bid) == tuple(prompt[:(j + 1) * B]),
                            "a prefix hit returns only blocks whose computed K/V are exactly the prompt's tokens up "
                            "to that block's end", f"op {op_no}: lookup(prompt) block {j} = {bid} holds "
                            f"{content.get(bid, 'nothing computed')}, the prompt needs {tuple(prompt[:(j + 1) * B])}")
                rid = f"r{op_no}"
                req = KVRequest(rid, list(prompt))
                got = m.allocate(req, len(prompt) - len(hit) * B)
                if got is not None:
                    require(got == len(hit) * B, "allocate serves from cache exactly what lookup finds",
                            f"op {op_no}: lookup found {len(hit)} blocks, allocate reported {got} tokens")
                    hits += got
                    req.num_computed_tokens = got
                    reqs[rid], tables[rid] = req, m.block_table(rid)
                    require(tables[rid][:len(hit)] == hit, "allocate puts the lookup hit first in the table",
                            f"op {op_no}: hit {hit}, table {tables[rid]}")
            else:
                rid = list(reqs)[int(rng.integers(0, len(reqs)))]
                r, table = reqs[rid], tables[rid]
                tokens, computed = r.all_token_ids, r.num_computed_tokens
                if op == 1 and computed < len(tokens):  # the step computes the reserved tokens
                    r.num_computed_tokens = len(tokens)
                    m.commit(r)
                    for j in range(computed // B, len(tokens) // B):
                        content.setdefault(table[j], tuple(tokens[:(j + 1) * B]))
                        require(content[table[j]] == tuple(tokens[:(j + 1) * B]),
                                "a block in use is never handed to another request (its K/V would be overwritten)",
                                f"op {op_no}: block {table[j]} is in two live prefixes")
                elif op == 2 and computed == len(tokens):  # decode one token: the caller appends it, then asks
                    tokens.append(int(rng.integers(0, 99)))
                    if m.append_slots(r, 1):
                        tables[rid] = m.block_table(rid)
                    else:
                        tokens.pop()  # no room: the caller drops its token (the engine would preempt)
                else:  # free (committed or not)
                    m.free(rid)
                    del reqs[rid], tables[rid]
                    for b in table:  # a block's K/V are only valid if it stays out of allocation: forget the
                        if m.ref_cnt(b) == 0 and not m.is_cached(b):  # ones freed empty
                            content.pop(b, None)
                    full = (len(tokens) - 1) // B
                    # a block computed twice at once (two requests, same prefix, neither committed) stays private;
                    # its prompt is then findable only while the indexed twin is: check the untwinned ones
                    if computed == len(tokens) and full and all(m.is_cached(b) for b in table[:full]):
                        again = m.lookup(tokens)
                        require(len(again) == full, "a freed request's full blocks stay cached (cached-free) and "
                                "findable until evicted", f"op {op_no}: freed {rid} ({len(tokens)} tokens), lookup "
                                f"right after finds {len(again)} blocks, expected {full}")
                        found_again += 1
            live = {x for rid, rr in reqs.items() for x in tables[rid][:rr.num_computed_tokens // B]}
            for b in range(num_blocks):  # an evicted (reused) block no longer holds its old prefix
                if m.ref_cnt(b) > 0 and b not in live:
                    content.pop(b, None)
            audit(m, num_blocks, tables)
        require(found_again >= 5, "a freed request's full blocks stay cached (cached-free) and findable until evicted",
                f"only {found_again} freed prompts had their blocks still indexed right after free")
    _PASSED["random_ops"] = (cls.fn,)
    return (f"{num_ops} random operations: invariants after each, {hits} tokens of prefix hits all correct, "
            f"{found_again} freed prompts found again")


def _tiny_setup():
    from minienv.lab.tiny import TokenIdTokenizer, tiny_model
    return tiny_model(), TokenIdTokenizer()


def _workload() -> tuple[list[list[int]], Any]:
    from minienv.sampling import SamplingParams
    rng = np.random.default_rng(3)
    shared = list(map(int, rng.integers(1, 128, 16)))
    prompts = [(shared if i % 2 == 0 else []) + list(map(int, rng.integers(1, 128, int(rng.integers(3, 12)))))
               for i in range(8)]
    return prompts, SamplingParams(max_tokens=10, temperature=0)


def run_engine(factory: Callable | None, *, enable_prefix_caching: bool = True, kv_budget_tokens: int = 512,
               victim_policy: Callable | None = None, step_planner: Callable | None = None,
               max_num_batched_tokens: int = 64) -> tuple[list[list[int]], int, int]:
    """The capstone workload (8 greedy requests, half sharing a 16-token prefix) through a real engine; returns the
    outputs, the number of preemptions and the prompt tokens served from the prefix cache. ``victim_policy``: who
    is preempted when memory runs out (notebook 07's exercise; the engine's default when None); ``step_planner``:
    how each step's token budget is split over prefill chunks (07's ``plan_step``; the scheduler's rule when None)."""
    from minienv.engine import InferenceEngine
    model, tok = _tiny_setup()
    prompts, params = _workload()
    eng = InferenceEngine(model, tok, kv_budget_tokens=kv_budget_tokens, block_size=B, max_num_seqs=4,
                          max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                          history_size=0, kv_cache_manager_factory=factory, victim_policy=victim_policy,
                          step_planner=step_planner)
    ids = [eng.add_request(p, params) for p in prompts]
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.token_ids)
        eng.check_invariants()
    return [outs[i] for i in ids], eng.scheduler.num_preemptions, eng.kv_cache_manager.prefix_stats.hits


#: notebook 14's "your engine": a museum assistant's instructions, shared by three visitors' questions (chat model)
MUSEUM = ("You are the assistant of the city museum. Answer in one short sentence. The museum opens at 10 am and "
          "closes at 6 pm, every day but Monday; a ticket costs 12 euros.")
VISITORS = ("When does the museum open?", "How much is a ticket?", "Can I visit on Monday?")
#: the same for the bundled model, which continues Shakespeare: a scene's opening, then three speakers
SCENE = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n"
SPEAKERS = ("JULIET:\n", "NURSE:\n", "MERCUTIO:\n")


def serving_prompts(engine: Any) -> list[str]:
    """Three prompts whose first blocks are equal, for the engine's model: the museum's system prompt and a
    visitor's question in the chat template of a chat model; a scene's opening and a speaker for the bundled one."""
    if engine.chat_template is not None:
        return [engine.chat_template.render([{"role": "system", "content": MUSEUM}, {"role": "user", "content": q}])
                for q in VISITORS]
    return [SCENE + speaker for speaker in SPEAKERS]


def dense_outputs() -> list[list[int]]:
    """Each request generated alone by ``minienv.generate`` (a contiguous cache, no scheduler)."""
    from minienv.generate import generate_ids
    model, tok = _tiny_setup()
    prompts, params = _workload()
    return [list(generate_ids(model, p, params, eos_token_id=tok.eos_token_id)) for p in prompts]


TIGHT_BUDGET = 48  # tokens: the longest request fits alone, eight at once do not -> preemptions
CHUNKED_BATCH = 8  # tokens per step when the student's plan_step runs: prompts are prefilled in chunks beside decodes


@exercise("implement MyKVCacheManager first (check_rules), then run this cell again")
def check_in_engine(cls, victim_policy: Callable | None = None, plan_step: Callable | None = None) -> str:
    """The series' proofs with the student's manager inside the real engine — and, if given, the victim policy
    they wrote in notebook 07 choosing whom the tight budget preempts, and their 07 ``plan_step`` splitting each
    step's budget (a third run, at a small per-step budget, where prompts are prefilled in chunks beside decodes)."""
    from minienv.exercises.scheduling import plan_reference, plan_rule_broken
    _PASSED.pop("in_engine", None)
    dense = dense_outputs()
    policy, broken = None, []
    planner, plan_broken, planned = None, [], []
    if plan_step is not None:
        def planner(needs, budget):  # the student's notebook-07 function, held to its own rules
            try:
                got = plan_step(list(needs), budget)
                got = None if got is None else [int(x) for x in got]
                rule = plan_rule_broken(needs, budget, got)
            except Exception as err:  # noqa: BLE001 - reported after the run, with the rule
                got, rule = err, "plan_step runs without an exception"
            if rule is not None:
                plan_broken.append((rule, f"needs {needs}, budget {budget}: expected "
                                          f"{plan_reference(needs, budget)}, got {got!r}"))
                return plan_reference(needs, budget)  # keep the engine going; the verdict below names the rule
            planned.append(got)
            return got
    if victim_policy is not None:
        def policy(candidates):  # the student's notebook-07 function, held to its own rule
            try:
                pick = victim_policy(list(candidates))
            except Exception as err:  # noqa: BLE001 - reported after the run: the engine would roll the step back
                pick = err
            if not any(pick is c for c in candidates):
                broken.append(f"candidates {[c.request_id for c in candidates]}: got {pick!r}")
                return candidates[0]  # keep the engine going; the verdict below names the rule
            return pick
    with _student():
        try:
            mine, _, hits = run_engine(plug(cls), victim_policy=policy)
            mine_tight, preempted, _ = run_engine(plug(cls), kv_budget_tokens=TIGHT_BUDGET, victim_policy=policy)
            mine_chunked = None if planner is None else run_engine(
                plug(cls), victim_policy=policy, step_planner=planner, max_num_batched_tokens=CHUNKED_BATCH)[0]
        except (_NotYet, ExerciseFailed):
            raise
        except NotImplementedError as err:
            raise _NotYet from err
        except Exception as err:  # noqa: BLE001 - the engine's invariant check or a crash inside the manager
            fail("inside the engine, your manager keeps every invariant and never crashes",
                 f"{type(err).__name__}: {err}")
    require(not broken, "your victim policy (notebook 07) returns one of the candidates it is given (the request "
            "object itself)", broken[0] if broken else "")
    if plan_broken:
        fail(f"your plan_step (notebook 07), in the engine: {plan_broken[0][0]}", plan_broken[0][1])
    ref_on, _, _ = run_engine(None)
    ref_off, _, _ = run_engine(None, enable_prefix_caching=False)
    assert ref_on == ref_off == dense, "minienv's own manager disagrees with dense generation"
    for i, (got, want) in enumerate(zip(mine, dense, strict=True)):
        require(got == want, "the engine's output with your manager equals each request generated alone (and "
                "minienv's manager, cache on and off)", f"request {i}: yours {got}, dense {want}")
    require(hits > 0, "in the engine your manager serves the shared prefix from cache (lookup finds committed "
            "blocks)", f"{hits} prompt tokens served from cache; four prompts share a 16-token prefix")
    require(preempted > 0, "the tight budget preempts (otherwise it proves nothing)", f"{preempted} preemptions")
    for i, (got, want) in enumerate(zip(mine_tight, dense, strict=True)):
        require(got == want, "nothing is lost under a tight budget: preempted requests resume to the same output",
                f"request {i} at a {TIGHT_BUDGET}-token budget ({preempted} preemptions): yours {got}, dense {want}")
    if mine_chunked is not None:
        require(planned, "your plan_step sizes the prefill chunks of the steps where prompts are prefilled in chunks",
                f"{CHUNKED_BATCH} tokens per step, no chunk planned")
        for i, (got, want) in enumerate(zip(mine_chunked, dense, strict=True)):
            require(got == want, "prompts prefilled in the chunks your plan_step chose give the same output",
                    f"request {i} at {CHUNKED_BATCH} tokens per step: yours {got}, dense {want}")
    _PASSED["in_engine"] = (cls.fn, victim_policy, plan_step)
    yours = " chosen by your victim policy" if victim_policy is not None else ""
    if mine_chunked is not None:
        yours += f"; and at {CHUNKED_BATCH} tokens per step, {len(planned)} prefill chunks sized by your plan_step"
    return (f"8 requests: your manager ({hits} prompt tokens from cache) == minienv's (cache on) == cache off == "
            f"dense, and still equal at a {TIGHT_BUDGET}-token budget with {preempted} preemptions{yours}")


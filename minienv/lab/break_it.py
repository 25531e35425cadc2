"""Break it yourself: minienv's KV cache manager with one switch per classic bug, and the proofs that catch each.

:class:`BreakableKVCacheManager` is :class:`~minienv.kv.kv_cache_manager.KVCacheManager` with ``bug`` set to one of
:data:`BUGS` (or ``None``: unchanged). :func:`run_proofs` runs the series' proofs on the **real engine** (through
``InferenceEngine(kv_cache_manager_factory=...)``) and on the manager, and reports which hold:

* ``outputs``: every request's output == the same request generated alone (``minienv.generate``), on a workload
  that revisits blocks at other positions and runs under a budget that preempts and evicts;
* ``failed_step``: after a step interrupted mid-way (the stop button) and resumed, outputs are still dense's;
* ``invariants``: the manager's invariants after every engine step (refcounts, index, a chain's tail evicted
  before its parent);
* ``copy_on_write``: after a fork, a child's write leaves the parent's K/V untouched.

Which bug breaks which proof (``tests/unit/test_break_it.py`` pins it): ``index_at_allocation`` -> failed_step;
``hash_own_tokens`` -> outputs; ``free_head_first`` -> invariants; ``evict_in_use`` -> outputs and invariants;
``no_copy_on_write`` -> copy_on_write. A bug no proof catches would be a bug the series cannot see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from minienv.kv.hashing import ROOT_HASH
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import KVCacheManager, PrefixHit, SlotAllocation
from minienv.kv.prefix_cache import CachedBlockKey

#: The classic bugs, one switch each.
BUGS = ("index_at_allocation", "hash_own_tokens", "free_head_first", "evict_in_use", "no_copy_on_write")


class BreakableKVCacheManager(KVCacheManager):
    """minienv's manager with one classic bug switched on (``bug=None``: the real thing, unchanged)."""

    def __init__(self, num_blocks: int, block_size: int, *, bug: str | None = None, **kwargs: Any):
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug must be None or one of {BUGS}, got {bug!r}")
        super().__init__(num_blocks, block_size, **kwargs)
        self.bug = bug

    # index_at_allocation: full blocks become findable when reserved, before any step computed them
    def _index_now(self, request, alloc: SlotAllocation | None) -> SlotAllocation | None:
        if alloc is not None:  # commit as if every reserved token were computed already
            reserved = self._requests[request.request_id].num_tokens
            self.commit(KVRequest(request.request_id, request.all_token_ids, reserved))
        return alloc

    def allocate(self, request, num_new_tokens=None):
        alloc = super().allocate(request, num_new_tokens)
        return self._index_now(request, alloc) if self.bug == "index_at_allocation" else alloc

    def append_slots(self, request, num_new_tokens):
        if self.bug == "no_copy_on_write":  # write into the last block even when it is shared
            req = self._table(request, "append slots to")
            start, n = req.num_tokens, req.blocks_needed(num_new_tokens)
            if n > self.pool.num_free_blocks:
                return None
            ids = self._take_free_blocks(n, req.request_id)
            req.block_ids.extend(ids)
            req.num_tokens = start + num_new_tokens
            return self._slots(req, start, ids, (), 0)
        alloc = super().append_slots(request, num_new_tokens)
        return self._index_now(request, alloc) if self.bug == "index_at_allocation" else alloc

    # hash_own_tokens: a block's key is its own tokens, not its whole prefix
    def _lookup(self, ids: list[int]) -> PrefixHit:
        if self.bug != "hash_own_tokens" or not self.enable_prefix_caching:
            return super()._lookup(ids)
        B, block_ids, hashes = self.block_size, [], []
        for j in range((len(ids) - 1) // B):
            key = CachedBlockKey(ROOT_HASH, tuple(ids[j * B:(j + 1) * B]), self.extra_key)
            h = key.block_hash()
            bid = self.index.get(h, key)
            if bid is None:
                break
            block_ids.append(bid)
            hashes.append(h)
        return PrefixHit(tuple(block_ids), tuple(hashes), len(block_ids) * B)

    def commit(self, request):
        if self.bug != "hash_own_tokens":
            return super().commit(request)
        req, tokens = self._table(request, "commit"), request.all_token_ids
        B, indexed = self.block_size, []
        for j in range(len(req.block_hashes), min(request.num_computed_tokens, len(tokens)) // B):
            key = CachedBlockKey(ROOT_HASH, tuple(tokens[j * B:(j + 1) * B]), self.extra_key)
            h, bid = key.block_hash(), req.block_ids[j]
            if self.index.entry_for_hash(h) is None and self.pool.blocks[bid].block_hash is None:
                self.index.insert(bid, h, key)
                self.pool.blocks[bid].block_hash = h
                indexed.append(bid)
            req.block_hashes.append(h)
        return indexed

    # free_head_first: a chain's first block reaches the free queue first, so it is evicted first
    def free(self, request_id):
        if self.bug != "free_head_first":
            return super().free(request_id)
        req = self._requests.get(request_id)
        if req is None:
            raise UnknownRequestError(request_id, "free")
        released = list(req.block_ids)
        self._release(released, request_id)
        del self._requests[request_id]
        return released

    # evict_in_use: a prefix hit on a cached-free block leaves it in the free queue, where allocation takes it
    def _touch(self, block_ids: Sequence[int], request_id) -> None:
        if self.bug != "evict_in_use":
            return super()._touch(block_ids, request_id)
        for bid in block_ids:
            self.pool.blocks[bid].ref_cnt += 1


def factory(bug: str | None) -> Callable[[int, int, bool], BreakableKVCacheManager]:
    """The engine's ``kv_cache_manager_factory`` for a manager with ``bug`` switched on."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"bug must be None or one of {BUGS}, got {bug!r}")
    return lambda n, b, caching: BreakableKVCacheManager(n, b, bug=bug, enable_prefix_caching=caching)


# ---------------------------------------------------------------------------------------------- the proofs
BLOCK = 4
#: KV budget of the outputs and invariants proofs: small enough that the workload preempts and evicts
BUDGET = 48
_rng = np.random.default_rng(11)
_W, _Y, _P = (list(map(int, _rng.integers(1, 128, BLOCK))) for _ in range(3))
#: two waves: the second revisits the first's blocks — the same prefix, and the same tokens at other positions
WAVES = ([_P + _P + _W + [5, 6], _W + _Y + [7, 8, 9], list(map(int, _rng.integers(1, 128, 13)))],
         [_P + _P + _W + [11], _Y + _W + [12, 13], _W + _Y + _P + [14], list(map(int, _rng.integers(1, 128, 14)))])


class _FlakyModel:
    """The model, but its forward pass raises ``KeyboardInterrupt`` once, at call ``fail_at`` (the stop button)."""

    def __init__(self, model: Any, fail_at: int):
        self._model, self._fail_at, self.calls = model, fail_at, 0

    def forward_step(self, *args: Any, **kwargs: Any):
        self.calls += 1
        if self.calls == self._fail_at:
            raise KeyboardInterrupt
        return self._model.forward_step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _setup():
    from minienv.lab.tiny import TokenIdTokenizer, tiny_model
    return tiny_model(), TokenIdTokenizer()


def _dense(model, prompts, params) -> list[list[int]]:
    from minienv.generate import generate_ids
    return [list(generate_ids(model, p, params)) for p in prompts]


def _run(bug, model, tok, *, budget: int, check: bool = False, waves=WAVES) -> list[list[int]]:
    from minienv.engine import InferenceEngine
    from minienv.sampling import SamplingParams
    eng = InferenceEngine(model, tok, kv_budget_tokens=budget, block_size=BLOCK, max_num_seqs=3,
                          max_num_batched_tokens=32, history_size=0, kv_cache_manager_factory=factory(bug))
    outs: list[list[int]] = []
    for wave in waves:
        ids = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=0)) for p in wave]
        done: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            try:
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = list(o.token_ids)
            except KeyboardInterrupt:
                continue  # the step was rolled back; resume
            if check:
                eng.kv_cache_manager.check_invariants()
        outs += [done[i] for i in ids]
    return outs


@dataclass(frozen=True)
class ProofResult:
    name: str
    holds: bool
    detail: str


def proof_outputs(bug: str | None, budget: int = BUDGET) -> ProofResult:
    model, tok = _setup()
    from minienv.sampling import SamplingParams
    want = _dense(model, [p for w in WAVES for p in w], SamplingParams(max_tokens=8, temperature=0))
    try:
        got = _run(bug, model, tok, budget=budget)
    except Exception as err:  # noqa: BLE001 - a crash is a failed proof, shown
        return ProofResult("outputs", False, f"the engine crashed: {type(err).__name__}: {err}")
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    return ProofResult("outputs", not bad, f"{len(bad)} of {len(want)} outputs differ from dense generation"
                       + (f" (first: request {bad[0]})" if bad else ""))


def proof_failed_step(bug: str | None) -> ProofResult:
    model, tok = _setup()
    from minienv.sampling import SamplingParams
    waves = ([WAVES[0][0]],)
    want = _dense(model, waves[0], SamplingParams(max_tokens=8, temperature=0))
    got = _run(bug, _FlakyModel(model, fail_at=1), tok, budget=256, waves=waves)
    return ProofResult("failed_step", got == want, "after a step interrupted and resumed, the output "
                       + ("equals" if got == want else "differs from") + " dense generation")


def proof_invariants(bug: str | None, budget: int = BUDGET) -> ProofResult:
    model, tok = _setup()
    try:
        _run(bug, model, tok, budget=budget, check=True)
    except AssertionError as err:
        return ProofResult("invariants", False, f"invariant broken: {err}")
    except Exception as err:  # noqa: BLE001
        return ProofResult("invariants", False, f"the engine crashed: {type(err).__name__}: {err}")
    return ProofResult("invariants", True, "every invariant held after every step")


def proof_copy_on_write(bug: str | None) -> ProofResult:
    """Fork a 6-token request (its last block half full) and let the child write: the parent's K/V must not change."""
    from minienv.kv.kv_pool import KVPool
    mgr = BreakableKVCacheManager(8, BLOCK, bug=bug)
    pool = KVPool(num_layers=1, num_blocks=8, block_size=BLOCK, num_kv_heads=1, head_dim=2)
    parent = KVRequest("parent", list(range(1, 7)))
    alloc = mgr.allocate(parent)
    pool.write(0, alloc.slot_mapping, np.ones((6, 1, 2)), np.ones((6, 1, 2)))
    parent.num_computed_tokens = 6
    mgr.commit(parent)
    mgr.fork(parent, ["child"])
    before = pool.k_cache[0][mgr.block_ids("parent")].copy()
    child = mgr.append_slots(KVRequest("child", parent.all_token_ids + [9], 6), 1)
    pool.copy_blocks(child.blocks_to_copy)
    pool.write(0, child.slot_mapping, np.full((1, 1, 2), 7.0), np.full((1, 1, 2), 7.0))
    same = np.array_equal(pool.k_cache[0][mgr.block_ids("parent")], before)
    return ProofResult("copy_on_write", same, "the parent's K/V " + ("are untouched" if same else
                       "changed: the child wrote into the block they share") + " after the child's first write")


PROOFS = (proof_outputs, proof_failed_step, proof_invariants, proof_copy_on_write)


def run_proofs(bug: str | None) -> dict[str, ProofResult]:
    """Every proof on a manager with ``bug`` switched on: ``{name: ProofResult}``."""
    return {r.name: r for r in (proof(bug) for proof in PROOFS)}

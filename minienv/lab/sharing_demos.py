"""Scripted prefix-sharing scenes for notebook 05, played on the real :class:`KVCacheManager` (bookkeeping only).

* :class:`ArrivalScript` — requests that share a system prompt arrive, decode and finish at different times; each
  step records the refcounts of the system prompt's blocks and what each arrival hit.
* :class:`ForkScript` — one prompt forked into samples, each writing its own tokens: records every copy-on-write.
* :func:`common_prefix_len` — how many leading tokens a set of prompts share.
* :func:`sharing_trap_checks` — one small re-check per trap of notebook 05's table, on a fresh manager.

The scripts own no view: a notebook wires ``reset`` / ``step`` into a stepper and redraws its own view of
:attr:`mgr` after each step. No model runs here; the K/V the bookkeeping describes is never computed.
"""

from __future__ import annotations

import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from minienv.kv.hashing import ROOT_HASH, hash_block_tokens
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import KVCacheManager, UnknownRequestError

__all__ = ["common_prefix_len", "SHARING_SCRIPT", "ArrivalStep", "ArrivalScript", "FORK_SCRIPT", "ForkStep",
           "ForkScript", "sharing_trap_checks"]


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every sequence starts with."""
    seqs = [list(s) for s in seqs]
    if not seqs:
        raise ValueError("common_prefix_len needs at least one sequence")
    shortest = min(map(len, seqs))
    return next((i for i in range(shortest) if len({s[i] for s in seqs}) > 1), shortest)


class _View(Protocol):
    """What a script needs of a view (``minienv.viz.kv_views.ManagerView`` has it); the lab never imports viz."""

    def attach(self, mgr: KVCacheManager, *, caption: str = "") -> None: ...

    def update(self, caption: str | None = None) -> object: ...


class _Script(ABC):
    """A scene on a fresh manager: :meth:`reset`, then :meth:`step` ``0 … len(script) - 1``."""

    script: tuple
    mgr: KVCacheManager

    @abstractmethod
    def reset(self) -> KVCacheManager:
        """A fresh manager in the scene's first state."""

    @abstractmethod
    def step(self, i: int) -> str:
        """Apply line ``i`` of the script; return its caption."""

    def driving(self, view: _View) -> tuple[Callable[[int], str], Callable[[], None]]:
        """``(step, reset)`` callbacks for a stepper that also redraw ``view`` (reset re-attaches it)."""
        def step(i: int) -> str:
            caption = self.step(i)
            view.update(caption=caption)
            return caption

        def reset() -> None:
            view.attach(self.reset(), caption="empty pool")

        return step, reset


# ====================================================================== arrivals and finishes around one prefix
#: One tuple per step: ``"+r"`` admits request r (prefill), ``"d"`` = every running request decodes one token,
#: ``"-r"`` finishes r. ``r5`` arrives after everyone else has left.
SHARING_SCRIPT: tuple[tuple[str, ...], ...] = (
    ("+r0",), ("+r1",), ("d", "+r2"), ("d",), ("-r0", "+r3"), ("d",), ("-r1", "-r2"), ("d", "+r4"),
    ("-r3",), ("-r4",), ("+r5",), ("d",), ("-r5",))


@dataclass(frozen=True)
class ArrivalStep:
    """What one step of an :class:`ArrivalScript` left behind."""

    step: int
    num_running: int
    system_refcounts: dict[int, int]  # block id -> refcount, for the watched prompt's first blocks
    hits: dict[str, int]  # request admitted this step -> prompt tokens it took from the cache


class ArrivalScript(_Script):
    """Play :data:`SHARING_SCRIPT` (or another script) over ``prompts`` on a fresh manager.

    ``system_blocks`` full blocks of ``prompts[watch]`` are watched: after every step their refcounts are logged,
    so a reader (or a test) can compare them with the number of running requests.
    """

    def __init__(self, prompts: dict[str, list[int]], num_blocks: int, block_size: int, *, system_blocks: int,
                 script: Sequence[tuple[str, ...]] = SHARING_SCRIPT, watch: str = "r0") -> None:
        self.prompts, self.num_blocks, self.block_size = prompts, num_blocks, block_size
        self.script, self.watch, self.system_blocks = tuple(script), watch, system_blocks
        self.reset()

    def reset(self) -> KVCacheManager:
        """A new, empty manager (returned, and kept as :attr:`mgr`); the log is cleared."""
        self.mgr = KVCacheManager(self.num_blocks, self.block_size)
        self.reqs: dict[str, KVRequest] = {}  # each request's tokens and progress (the manager reads them)
        self.log: list[ArrivalStep] = []
        return self.mgr

    def step(self, i: int) -> str:
        """Play step ``i`` of the script; return a one-line caption of what happened."""
        mgr, notes, hits = self.mgr, [], {}
        for action in self.script[i]:
            if action == "d":
                for req in self.reqs.values():
                    req.all_token_ids.append(1000 + i)
                    mgr.append_slots(req, 1)
                    req.num_computed_tokens = req.num_tokens
                    mgr.commit(req)
                notes.append("all decode 1 token")
            elif action[0] == "+":
                rid = action[1:]
                req = self.reqs[rid] = KVRequest(rid, list(self.prompts[rid]))
                alloc = mgr.allocate(req)
                # (the model step that writes the K/V happens here, between allocate and commit)
                req.num_computed_tokens = req.num_tokens
                mgr.commit(req)
                hits[rid] = alloc.num_cached_tokens
                notes.append(f"{rid} arrives ({alloc.num_cached_tokens} of {len(self.prompts[rid])} tokens cached)")
            elif action[0] == "-":
                mgr.free(action[1:])
                del self.reqs[action[1:]]
                notes.append(f"{action[1:]} finishes")
            else:
                raise ValueError(f"unknown action {action!r}: use '+rid', '-rid' or 'd'")
        mgr.check_invariants()
        watched = mgr.lookup(self.prompts[self.watch]).block_ids[: self.system_blocks]
        self.log.append(ArrivalStep(i, len(mgr.request_ids()), {b: mgr.ref_cnt(b) for b in watched}, hits))
        return f"step {i + 1}: " + "; ".join(notes)


# ====================================================================== fork and copy-on-write
#: The fork scene, one caption per step (see :meth:`ForkScript.step`).
FORK_SCRIPT: tuple[str, ...] = (
    "prefill P", "fork P -> S1, S2", "S1 writes its first token", "S2 writes its first token",
    "P writes its first token", "each writes one more (fills its block)", "each writes two more (a new block each)",
    "each writes one more")


@dataclass(frozen=True)
class ForkStep:
    """What one step of a :class:`ForkScript` left behind."""

    copies: tuple[tuple[int, int], ...]  # copy-on-write (source block, private copy) made in this step
    tables: dict[str, list[int]]  # request -> block table
    refcounts: list[int]  # refcount of every block of the pool, by id


class ForkScript(_Script):
    """A prompt ``P`` prefilled, forked into samples ``S1``, ``S2``, then each writing its own tokens."""

    def __init__(self, prompt: Sequence[int], num_blocks: int, block_size: int) -> None:
        self.prompt, self.num_blocks, self.block_size = list(prompt), num_blocks, block_size
        self.script = FORK_SCRIPT
        self.reset()

    def reset(self) -> KVCacheManager:
        """A new, empty manager (returned, and kept as :attr:`mgr`); the log is cleared."""
        self.mgr = KVCacheManager(self.num_blocks, self.block_size)
        self.reqs: dict[str, KVRequest] = {}
        self.log: list[ForkStep] = []
        return self.mgr

    def step(self, i: int) -> str:
        """Play step ``i``; return its caption, naming any block copied on write."""
        mgr, reqs, copies = self.mgr, self.reqs, []

        def append(rid: str, tokens: list[int]) -> None:
            reqs[rid].all_token_ids.extend(tokens)
            copies.extend(mgr.append_slots(reqs[rid], len(tokens)).blocks_to_copy)

        if i == 0:
            reqs["P"] = KVRequest("P", list(self.prompt))
            mgr.allocate(reqs["P"])
        elif i == 1:
            mgr.fork(reqs["P"], ["S1", "S2"])
            for rid in ("S1", "S2"):  # each sample its own request: a copy of the parent's tokens and progress
                reqs[rid] = KVRequest(rid, list(reqs["P"].all_token_ids), reqs["P"].num_computed_tokens)
        elif i in (2, 3, 4):
            append({2: "S1", 3: "S2", 4: "P"}[i], [500 + i])
        elif i < len(self.script):
            for rid in ("P", "S1", "S2"):
                append(rid, [600 + i] * (2 if i == 6 else 1))
        else:
            raise IndexError(f"the fork script has {len(self.script)} steps, not {i + 1}")
        for req in reqs.values():
            req.num_computed_tokens = req.num_tokens
            mgr.commit(req)
        mgr.check_invariants()
        self.log.append(ForkStep(tuple(copies), {r: mgr.block_ids(r) for r in mgr.request_ids()},
                                 [mgr.ref_cnt(b) for b in range(mgr.num_blocks)]))
        cow = ", ".join(f"block {a} copied to {b}" for a, b in copies)
        return f"step {i + 1}: {self.script[i]}" + (f" → copy-on-write: {cow}" if cow else "")


# ====================================================================== the traps of notebook 05's table
def sharing_trap_checks(block_size: int = 4) -> dict[str, bool]:
    """One re-check per trap of notebook 05's table (the naive refcount is checked by the notebook itself).

    Each entry is ``True`` when minienv's manager avoids the trap. The regression tests with the full story are in
    ``tests/unit/test_kv_cache_manager.py``; these are the same checks, small enough to print beside the table.
    """
    b = block_size
    checks: dict[str, bool] = {}
    code = "from minienv.kv.hashing import *; print(hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]).hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    checks["#12621 hash stable across processes"] = other.strip() == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]).hex()
    t = KVCacheManager(16, b)
    p = KVRequest("p", list(range(2 * b + 1)))  # two full blocks + 1 token
    t.allocate(p)
    p.num_computed_tokens = p.num_tokens
    t.commit(p)
    t.fork(p, ["c1", "c2"])
    c1 = KVRequest("c1", list(p.all_token_ids), p.num_computed_tokens)
    checks["#1556 fork: +1 per child"] = [t.ref_cnt(x) for x in t.block_ids("p")] == [3, 3, 3]
    t.free("c2")
    before = t.snapshot()
    try:
        t.free("c2")
        checks["freeing twice refused, nothing changed"] = False
    except UnknownRequestError:
        checks["freeing twice refused, nothing changed"] = t.snapshot() == before
    c1.all_token_ids += [7] * (b - 1)
    t.append_slots(c1, b - 1)  # fills the shared partial block -> exactly one copy
    c1.all_token_ids.append(8)
    t.append_slots(c1, 1)  # c1's copy is full and private; the new token goes to a new block
    checks["copy only a shared partial block"] = t.stats().cow_copies == 1
    checks["#144 never the whole prompt"] = t.lookup(list(range(2 * b))).num_cached_tokens == b
    share = t.sharing()
    checks["#35270 physical blocks counted once"] = t.stats().num_in_use == share.physical_blocks < share.logical_blocks
    t.check_invariants()
    return checks

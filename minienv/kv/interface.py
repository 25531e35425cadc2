"""The ``KVManager`` protocol: what the scheduler and the engine ask of a KV cache manager, and nothing more.

minienv's :class:`~minienv.kv.kv_cache_manager.KVCacheManager` implements it, and so do the managers that run in
the real engine in its place: the capstone's student class (through ``minienv.exercises.capstone.plug``), the
bug switches of ``minienv.lab.break_it`` and the dynamic-block experiment (``minienv.lab.dynamic_blocks``). Hand
one to ``InferenceEngine(kv_cache_manager_factory=...)``.

The manager is bookkeeping only: it hands out block ids and the slots of new tokens; whoever owns the K/V arrays
applies them. Expected outcomes are return values (``None``: the blocks do not fit, nothing changed — the
scheduler preempts or waits); misuse raises before anything changes. The narrow types that cross the seam live
here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Protocol, Sequence, runtime_checkable

import numpy as np

RequestId = Hashable


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The cached run of full blocks of a prompt, and how many tokens it covers."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    num_cached_tokens: int
    #: the first missed full block's hash and key, when the lookup computed them (its admission's commit reuses
    #: them instead of hashing that block again); None after a hit on every block looked up
    miss: object = field(default=None, compare=False, repr=False)


@dataclass(slots=True)  # one per request per step: a plain record (a frozen __init__ costs twice as much)
class SlotAllocation:
    """The slots reserved for the next ``num_new_tokens`` tokens of one request, at positions ``start, start + 1,
    ...`` (the tokens themselves stay in the request: a reservation carries counts and blocks only): the table's
    blocks from the first one they touch (``block_ids``, as they were when reserved), the blocks newly taken, the
    copy-on-write ``blocks_to_copy`` to apply first, and an admission's prefix hit. ``positions`` and
    ``slot_mapping`` are derived on request (the engine computes a step's slots from its block tables). A value
    handed to the caller: every field is a tuple or a number, and nothing changes it after it is made."""

    request_id: RequestId
    num_new_tokens: int
    start: int
    block_ids: tuple[int, ...]
    block_size: int
    new_block_ids: tuple[int, ...]
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    num_cached_tokens: int = 0

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.num_new_tokens, dtype=np.int64)

    @property
    def slot_mapping(self) -> np.ndarray:
        """The pool slot of each new token (:func:`minienv.kv.block_table.slot_mapping`)."""
        from minienv.kv.block_table import slot_mapping

        first = self.start // self.block_size * self.block_size  # block_ids[0] holds position `first`
        return slot_mapping(self.block_ids, self.positions - first, self.block_size)

    def without_first(self, num_tokens: int) -> "SlotAllocation":
        """The same reservation for all but its first ``num_tokens`` tokens (whose K/V came from elsewhere)."""
        b, start = self.block_size, self.start + num_tokens
        return SlotAllocation(self.request_id, self.num_new_tokens - num_tokens, start,
                              self.block_ids[start // b - self.start // b:], b, self.new_block_ids,
                              self.blocks_to_copy, self.num_cached_tokens)


@dataclass(frozen=True)
class KVCacheStats:
    """A point-in-time summary; block counts are physical blocks, each counted once however many requests share it."""

    num_blocks: int
    block_size: int
    num_free_empty: int
    num_cached_free: int
    num_in_use: int
    num_requests: int
    prefix_requests: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    evicted_blocks: int
    evicted_tokens: int
    cow_copies: int

    @property
    def kv_budget_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def resident_tokens(self) -> int:
        """Token slots of in-use plus cached-free blocks: everything the budget holds."""
        return (self.num_in_use + self.num_cached_free) * self.block_size

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's ``kv_cache_usage``; cached-free blocks are reclaimable)."""
        return self.num_in_use / self.num_blocks


@dataclass(frozen=True, slots=True)
class KVEvent:
    """``kind``: ``"evict"`` (a cached block's hash dropped as it is reused), ``"cache"`` (a full block indexed),
    ``"hit"`` (a request took a cached block), ``"cow"`` (``src_block_id`` copied to ``block_id`` before a write)
    or ``"free"`` (a refcount reached 0)."""

    kind: str
    block_id: int
    request_id: RequestId | None = None
    block_hash: bytes | None = None
    src_block_id: int | None = None


class KVRequestState(Protocol):
    """What the manager reads of a request: its id, its tokens (prompt + output, as the caller appended them) and
    how many of them have K/V (vLLM's ``Request.all_token_ids`` / ``num_computed_tokens``). The caller owns and
    changes them; the manager never copies or writes them. minienv's engine passes its
    :class:`~minienv.request.Request`; standalone code passes a :class:`KVRequest`."""

    request_id: RequestId
    all_token_ids: list[int]
    num_computed_tokens: int


@dataclass(eq=False)
class KVRequest:
    """A request for driving a KV manager by hand (notebooks, tests, the draft model's cache, lab experiments).

    The caller owns it: append a token to ``all_token_ids`` and ask the manager for its slot
    (``append_slots(req, 1)``); once the step has computed the tokens, advance ``num_computed_tokens`` and
    ``commit(req)``. The manager only reads it, so its tokens and progress exist once, here."""

    request_id: RequestId
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class RequestBlocks(Protocol):
    """A request's block table as the manager shows it: physical block ids in logical order, and the slots they
    reserve (``num_tokens``: computed tokens plus those in flight in a step)."""

    block_ids: list[int]
    num_tokens: int


@runtime_checkable
class KVManager(Protocol):
    """The contract the engine calls. A request's life: ``lookup`` -> ``allocate`` (the prefix hit + slots of the
    first chunk) -> the step writes K/V, the caller advances ``num_computed_tokens`` -> ``commit`` ->
    ``append_slots`` -> ``commit`` ... -> ``free``; a step that fails is undone with ``undo_allocate`` (an
    admission) or ``undo_append_slots`` (a running request).

    The calls that read a request's tokens or progress take the request (a :class:`KVRequestState`); the others
    name it by id. The manager changes only its own state: block tables, reserved slots, hashes, counters."""

    block_size: int
    enable_prefix_caching: bool

    @property
    def num_blocks(self) -> int: ...

    @property
    def kv_budget_tokens(self) -> int: ...

    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """The longest cached run of full blocks of a prompt (never all of it), without taking or counting it."""

    def allocate(self, request: KVRequestState, num_new_tokens: int | None = None) -> SlotAllocation | None:
        """Admit: take the prefix hit of ``request.all_token_ids``, reserve slots for the next ``num_new_tokens``
        tokens (default: all the rest); None if no room."""

    def append_slots(self, request: KVRequestState, num_new_tokens: int) -> SlotAllocation | None:
        """Reserve slots for the request's next ``num_new_tokens`` tokens (drafts included: counted, never read);
        copy-on-write first; None if no room."""

    def commit(self, request: KVRequestState) -> list[int]:
        """Full blocks among ``request.all_token_ids[:request.num_computed_tokens]`` become findable. Returns the
        blocks indexed."""

    def truncate(self, request_id: RequestId, num_tokens: int) -> list[int]:
        """Roll a request back to its first ``num_tokens`` tokens; returns the blocks released, last first."""

    def free(self, request_id: RequestId) -> list[int]:
        """Release every block of a request, last first; returns them."""

    def undo_allocate(self, request_id: RequestId) -> list[int]:
        """``free`` an admission whose step failed (its blocks back where they were in the free queue), and uncount
        its lookup from the prefix-cache counters."""

    def undo_append_slots(self, request_id: RequestId, num_tokens: int, *, kv_written: bool) -> list[int]:
        """Roll a failed step's append back to ``num_tokens`` tokens (blocks back where allocation took them) and
        undo its copy-on-write; ``kv_written``: the step applied its copies and called the model. Returns the
        blocks released."""

    def has_request(self, request_id: RequestId) -> bool: ...

    def request(self, request_id: RequestId) -> RequestBlocks:
        """The request's live block table (read it; change it only through the manager)."""

    def stats(self) -> KVCacheStats: ...

    def add_listener(self, listener: Callable[[KVEvent], None]) -> None:
        """Call ``listener(event)`` on every :class:`KVEvent` (a manager that emits none may ignore it)."""

    def check_invariants(self) -> None: ...

"""The connector: the engine's seam to the persistent KV tier, shaped like vLLM's v1 KV connector.

vLLM's ``KVConnectorBase_V1`` splits the work between the scheduler (``get_num_new_matched_tokens``: how many more
prompt tokens the external store holds beyond the local prefix cache, *without side effects*;
``update_state_after_alloc``) and the worker (``start_load_kv`` into the freshly allocated blocks before the
forward pass; ``save_kv_layer`` / ``wait_for_save`` for new blocks). minienv runs in one process, so the connector
keeps that shape in three calls the engine makes:

1. **admission** (:meth:`KVTierConnector.prepare`, right after the local prefix-cache lookup): ask the store how
   many blocks beyond the local hit it holds (:meth:`get_num_new_matched_tokens`, no side effects), then read and
   *verify* them into a staging area. The answer is the number of tokens that verified — a record that fails any
   check ends the run there, so those tokens are simply computed (a failed load is a miss, never an error for the
   request).
2. **load** (:meth:`KVTierConnector.load`, after the KV cache manager allocated blocks for them): copy the staged
   K/V into the new blocks and hand back the slots of the tokens the step still computes.
3. **save** (:meth:`KVTierConnector.save_committed`, after the step committed): write every block that became
   full and whose tokens are final (committed K/V), in chain order, skipping blocks known to be stored.

Invariants:

* a block is loaded only from a record whose checksum, format version, model fingerprint, key, parent key, token
  ids, shape and dtype all match (:func:`~minienv.kv_tier.record.decode_record`);
* staged blocks belong to one request *instance*: they are reused only for exactly the token ids they were
  verified against, and :meth:`KVTierConnector.forget` (the engine calls it when a request finishes or is aborted)
  drops them, so an id reused for another prompt never loads the first prompt's K/V;
* only committed, full blocks are stored (a partly filled block's tokens are not final);
* the tier never fails a request: everything a store returns is untrusted input, and store errors are counted; a
  store that cannot recover (full, read-only) is switched off with a warning; one that may (Redis down, a lock
  held elsewhere) is skipped for ``retry_interval_s`` and then retried, with one warning per outage; one that
  misbehaves (an exception it does not document, an answer of the wrong shape) ``MAX_MISBEHAVIOURS`` times in a
  row is switched off with one warning;
* with the tier on, every output equals the output with the tier off (loaded K/V are the bytes computed before).
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from minienv.kv.hashing import ROOT_HASH, BlockHash
from minienv.kv_tier.record import (
    RecordChecksumError,
    RecordError,
    RecordVersionError,
    block_keys,
    decode_record,
    encode_record,
    model_fingerprint,
)
from minienv.kv_tier.stores import TierBackendError, TierConfigError, TierStore, open_store

__all__ = ["KVTierConnector", "KVTierStats", "TierEvent", "TierWarning"]


class TierWarning(UserWarning):
    """The KV tier stopped working for a while (or for good); serving goes on without it."""


@dataclass
class KVTierStats:
    """Counters of the tier, in the units vLLM's metrics use (tokens for hits, blocks for transfers).

    A plain dataclass, so a metrics exporter can read it without the tier knowing about the exporter.
    """

    lookups: int = 0  #: admissions that asked the tier
    queried_tokens: int = 0  #: prompt tokens asked for beyond the local prefix cache
    hit_tokens: int = 0  #: tokens whose K/V were loaded from the tier instead of computed
    loads: int = 0  #: blocks loaded
    stores: int = 0  #: blocks written
    store_skipped: int = 0  #: blocks already stored, or refused by the store (parent missing, too big)
    bytes_loaded: int = 0
    bytes_stored: int = 0
    evictions: int = 0  #: records the store evicted to stay within capacity (reported by this engine's writes)
    corrupt_records: int = 0  #: checksum or length failed -> recomputed
    mismatched_records: int = 0  #: another model/layout/key/tokens -> recomputed
    version_records: int = 0  #: another format version -> recomputed
    backend_errors: int = 0  #: store operations that failed (server down, disk full)
    load_seconds: float = 0.0  #: total time reading + verifying records
    max_load_seconds: float = 0.0  #: the slowest single admission's load

    @property
    def record_errors(self) -> int:
        """Records refused on load (each one a miss plus a recompute)."""
        return self.corrupt_records + self.mismatched_records + self.version_records

    @property
    def errors(self) -> int:
        return self.record_errors + self.backend_errors

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True)
class TierEvent:
    """For views: ``kind`` is "load", "refuse" (a record failed its checks) or "store"; ``block_index`` is the
    block's position in its request, ``block_id`` its pool block (None for "refuse")."""

    kind: str
    request_id: str
    block_index: int
    block_id: int | None
    key: BlockHash
    reason: str = ""


@dataclass
class _Staged:
    """Blocks read and verified for one admission attempt. Bound to the token ids they were verified against (not
    to the request id alone: an id can be aborted and reused for another prompt of the same length)."""

    token_ids: tuple[int, ...]  # the request's tokens the blocks were verified against
    num_local: int
    first_block: int
    arrays: list[np.ndarray]


@dataclass
class _Chain:
    """How far a request's blocks are known to be stored: blocks ``[0, num_blocks)``, the last one's key.
    ``stopped``: the store refused a block (its parent was evicted meanwhile, or it is too big), so every later
    block would be refused too; this request stores nothing more."""

    num_blocks: int = 0
    last_key: BlockHash = ROOT_HASH
    stopped: bool = False


class KVTierConnector:
    """One engine's view of a tier store: keys and checks for this model, loads into and saves from its KV pool.

    Parameters
    ----------
    store:
        A :class:`~minienv.kv_tier.stores.SQLiteStore` / :class:`~minienv.kv_tier.stores.RedisStore`, a directory
        path, or a ``redis://`` URL.
    model, kv_pool:
        The engine's model (fingerprinted) and KV pool (loaded into, saved from).
    retry_interval_s:
        After a store failure that may be transient, the tier is skipped for this long, then tried again.
    """

    def __init__(self, store: TierStore | str, *, model, kv_pool, retry_interval_s: float = 1.0):
        if not isinstance(retry_interval_s, (int, float)) or retry_interval_s < 0:
            raise TierConfigError(f"retry_interval_s must be a number >= 0, got {retry_interval_s!r}")
        self.store = open_store(store)
        self.kv_pool = kv_pool
        self.block_size = int(kv_pool.block_size)
        self.fingerprint = model_fingerprint(model, self.block_size, str(kv_pool.kv_cache.dtype))
        self.block_shape = (kv_pool.num_layers, 2, self.block_size, kv_pool.num_kv_heads, kv_pool.head_dim)
        self.dtype = kv_pool.kv_cache.dtype.str
        self.retry_interval_s = float(retry_interval_s)
        self.stats = KVTierStats()
        self.enabled = True
        self.disabled_reason: str | None = None
        self._down_until = 0.0
        self._misbehaviours = 0  # in a row; a well-formed answer resets it
        self._in_outage = False  # a transient failure was warned about and no call has succeeded since
        self._staged: OrderedDict[str, _Staged] = OrderedDict()
        self._chains: dict[str, _Chain] = {}
        self._bad: set[BlockHash] = set()  # keys whose record was refused: the next save replaces it
        self._listeners: list[Callable[[TierEvent], None]] = []

    # ------------------------------------------------------------------ state
    @property
    def available(self) -> bool:
        """On, and not waiting out a failure."""
        return self.enabled and time.monotonic() >= self._down_until

    def add_listener(self, fn: Callable[[TierEvent], None]) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[TierEvent], None]) -> None:
        self._listeners.remove(fn)

    def _emit(self, *args) -> None:
        if self._listeners:
            event = TierEvent(*args)
            for fn in self._listeners:
                fn(event)

    #: consecutive misbehaviours (an exception no store documents, an answer of the wrong shape) before the tier
    #: is switched off for good: a store that is broken, not down, would cost every admission a failed call.
    MAX_MISBEHAVIOURS = 3

    def _call(self, fn, *args):
        """A store call, treated as untrusted: a :class:`TierBackendError` is a counted failure (see :meth:`_failed`);
        any other exception is a misbehaviour (:meth:`_misbehaved`). Returns ``None`` on either."""
        try:
            result = fn(*args)
            self._in_outage = False  # the store answered: the next failure is a new outage
            return result
        except TierBackendError as exc:
            self._failed(exc)
        except Exception as exc:  # noqa: BLE001 - whatever a store does wrong, the request is served without it
            self._misbehaved(f"{type(exc).__name__}: {exc}")
        return None

    def _misbehaved(self, what: str) -> None:
        """Counted as a backend error (the admission is a miss); the MAX_MISBEHAVIOURS-th in a row switches the
        tier off, with the one warning it gives."""
        self.stats.backend_errors += 1
        self._misbehaviours += 1
        if self._misbehaviours >= self.MAX_MISBEHAVIOURS and self.enabled:
            self.enabled = False
            self.disabled_reason = f"the store misbehaved {self._misbehaviours} times in a row (last: {what})"
            warnings.warn(f"KV tier switched off: {self.disabled_reason}. Serving continues without it.",
                          TierWarning, stacklevel=4)

    def _failed(self, exc: TierBackendError) -> None:
        self.stats.backend_errors += 1
        if exc.permanent:
            self.enabled = False
            self.disabled_reason = str(exc)
            warnings.warn(f"KV tier switched off: {exc}. Serving continues without it.", TierWarning, stacklevel=3)
        else:
            if not self._in_outage:  # one warning per outage: a retry that fails again says nothing new
                self._in_outage = True
                warnings.warn(f"KV tier unavailable ({exc}); recomputing, retrying every {self.retry_interval_s:g} s",
                              TierWarning, stacklevel=3)
            self._down_until = time.monotonic() + self.retry_interval_s

    # ------------------------------------------------------------------ admission
    def _keys(self, token_ids: Sequence[int]) -> list[BlockHash]:
        max_blocks = (len(token_ids) - 1) // self.block_size  # like the local lookup: leave >= 1 token to compute
        return block_keys(token_ids, self.block_size, self.fingerprint, max_blocks=max_blocks)

    def get_num_new_matched_tokens(self, token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Prompt tokens the store holds beyond the first ``num_computed_tokens`` (whole blocks, never the last
        token). Reads only: no LRU refresh, no staging, no counters (except a failed store call)."""
        if not self.available:
            return 0
        keys = self._keys(token_ids)
        n = self._contains_prefix(keys)
        return max(0, n * self.block_size - num_computed_tokens)

    def _contains_prefix(self, keys: list[BlockHash]) -> int:
        n = self._call(self.store.contains_prefix, keys)
        if n is None:
            return 0
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= len(keys):
            self._misbehaved(f"contains_prefix answered {n!r} for {len(keys)} keys")
            return 0
        return int(n)

    def _get_many(self, keys: list[BlockHash]) -> list | None:
        records = self._call(self.store.get_many, keys)
        if records is None:
            return None
        try:
            records = list(records)
        except Exception:  # noqa: BLE001 - not even iterable
            records = None
        if records is None or len(records) != len(keys):
            self._misbehaved(f"get_many answered {len(records) if records is not None else 'no list'} records "
                             f"for {len(keys)} keys")
            return None
        self._misbehaviours = 0
        return records

    def prepare(self, request_id: str, token_ids: Sequence[int], num_local_tokens: int) -> int:
        """At admission, after the local lookup hit ``num_local_tokens``: stage the tier's next blocks, verified;
        return how many tokens they cover (0 when the tier has nothing, or is off). Call :meth:`load` once the
        blocks are allocated; a request that is not admitted after all keeps its staging for the next try."""
        B = self.block_size
        tokens = tuple(token_ids)
        staged = self._staged.get(request_id)
        if staged is not None and staged.token_ids == tokens and staged.num_local == num_local_tokens:
            return len(staged.arrays) * B  # the head of the queue waiting for memory: staged already
        self._staged.pop(request_id, None)
        self._chains.pop(request_id, None)  # a new admission: where its chain is stored is asked again below
        if not self.available:
            return 0
        keys = self._keys(token_ids)
        first = num_local_tokens // B
        s = self.stats
        s.lookups += 1
        s.queried_tokens += max(0, len(keys) * B - num_local_tokens)
        n_stored = self._contains_prefix(keys)
        if not n_stored:
            return 0
        # How far the request's chain is stored: saving starts there (local hits the tier lost are re-stored).
        known = min(n_stored, first)
        self._chains[request_id] = _Chain(known, keys[known - 1] if known else ROOT_HASH)
        if n_stored <= first:
            return 0
        want = keys[first:n_stored]
        t0 = time.perf_counter()
        records = self._get_many(want)
        if records is None:
            return 0
        arrays: list[np.ndarray] = []
        for j, (key, record) in enumerate(zip(want, records, strict=True), start=first):
            if record is None:
                break  # evicted between the two calls (another writer): the rest is computed
            parent = keys[j - 1] if j else ROOT_HASH
            try:
                kv = decode_record(record, fingerprint=self.fingerprint, key=key, parent_key=parent,
                                   token_ids=token_ids[j * B:(j + 1) * B], shape=self.block_shape, dtype=self.dtype)
            except Exception as exc:  # noqa: BLE001 - a record is untrusted input: anything wrong with it is a miss
                if isinstance(exc, RecordChecksumError) or not isinstance(exc, RecordError):
                    s.corrupt_records += 1
                elif isinstance(exc, RecordVersionError):
                    s.version_records += 1
                else:
                    s.mismatched_records += 1
                self._bad.add(key)
                self._emit("refuse", request_id, j, None, key, str(exc))
                break
            arrays.append(kv)
            s.bytes_loaded += len(record)
        dt = time.perf_counter() - t0
        s.load_seconds += dt
        s.max_load_seconds = max(s.max_load_seconds, dt)
        self._chains[request_id] = _Chain(first + len(arrays), keys[first + len(arrays) - 1] if first + len(arrays)
                                          else ROOT_HASH)
        if not arrays:
            return 0
        self._staged[request_id] = _Staged(tokens, num_local_tokens, first, arrays)
        while len(self._staged) > 8:
            self._staged.popitem(last=False)
        return len(arrays) * B

    def load(self, request_id: str, token_ids: Sequence[int], alloc, num_tokens: int):
        """Copy the staged K/V into the request's freshly allocated blocks (the first ``num_tokens //
        block_size`` of ``alloc.new_block_ids``); return ``alloc`` cut to the tokens the step still computes.
        ``token_ids``: the request's tokens now; the staging must have been verified against exactly these."""
        staged = self._staged.pop(request_id)
        B = self.block_size
        k = num_tokens // B
        assert k == len(staged.arrays) and len(alloc.new_block_ids) >= k, "load must follow prepare's answer"
        assert staged.token_ids == tuple(token_ids), f"{request_id}: staged blocks were verified for other tokens"
        block_ids = list(alloc.new_block_ids[:k])
        self.kv_pool.kv_cache[:, :, block_ids] = np.stack(staged.arrays, axis=2)
        self.stats.loads += k
        self.stats.hit_tokens += num_tokens
        for i, bid in enumerate(block_ids):
            self._emit("load", request_id, staged.first_block + i, bid, b"")
        return alloc.without_first(num_tokens)

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: nothing staged or chained for it may serve a later request that
        reuses its id."""
        self._staged.pop(request_id, None)
        self._chains.pop(request_id, None)

    # ------------------------------------------------------------------ after commit
    def save_committed(self, plan, kv_manager, requests) -> int:
        """Store the blocks the step just completed (full, committed) for every request it ran; return how many
        were written. ``requests``: the scheduler's requests by id, whose ``all_token_ids`` and
        ``num_computed_tokens`` say which blocks are computed (the manager holds only the block tables). Never
        raises for a store failure (counted; see the class invariants)."""
        if not self.available:
            return 0
        B = self.block_size
        written = 0
        kv = self.kv_pool.kv_cache
        for s in plan.scheduled:
            if s.kind == "padding" or not kv_manager.has_request(s.request_id):
                continue
            req, block_ids = requests[s.request_id], kv_manager.request(s.request_id).block_ids
            token_ids = req.all_token_ids
            chain = self._chains.setdefault(s.request_id, _Chain())
            # accepted drafts are computed before the engine appends them: only tokens the request holds count
            n_full = min(req.num_computed_tokens, len(token_ids)) // B
            if n_full <= chain.num_blocks or chain.stopped:
                continue
            keys = block_keys(token_ids[chain.num_blocks * B:n_full * B], B, self.fingerprint,
                              parent_key=chain.last_key)
            for j, key in enumerate(keys, start=chain.num_blocks):
                parent = chain.last_key
                record = encode_record(self.fingerprint, key, parent, token_ids[j * B:(j + 1) * B],
                                       kv[:, :, block_ids[j]])
                result = self._call(lambda: self.store.put(key, parent, record, replace=key in self._bad))
                if result is None:
                    return written
                if getattr(result, "status", None) not in ("stored", "replaced", "present", "orphan", "too_big"):
                    self._misbehaved(f"put answered {result!r}")
                    return written
                self.stats.evictions += result.evicted
                if result.status in ("stored", "replaced"):
                    written += 1
                    self.stats.stores += 1
                    self.stats.bytes_stored += len(record)
                    self._bad.discard(key)
                    self._emit("store", s.request_id, j, block_ids[j], key)
                else:
                    self.stats.store_skipped += 1
                    if result.status != "present":
                        chain.stopped = True  # orphan (evicted meanwhile) / too big: its children would be too
                        break
                chain.num_blocks, chain.last_key = j + 1, key
        if len(self._chains) > 2 * len(kv_manager.request_ids()) + 64:
            for rid in [r for r in self._chains if not kv_manager.has_request(r)]:
                del self._chains[rid]
        return written

    def __repr__(self) -> str:
        state = "on" if self.enabled else f"off ({self.disabled_reason})"
        return f"KVTierConnector({self.store!r}, {state})"

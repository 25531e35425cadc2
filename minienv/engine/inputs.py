"""Building one step's model inputs from the scheduler's plan.

The plan lists, in batch order, each scheduled request's new tokens, where they start and the pool slots the KV
cache manager reserved for them. The model wants them flattened: one token array, one
:class:`~minienv.kv.paged_attention.PagedAttentionMetadata` (block tables, context and query lengths, slot
mapping) and the rows whose logits are needed — the last token of every chunk that reaches the end of its request.
Copy-on-write copies the manager asked for are applied to the KV pool here, before the step writes into it.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np

from minienv.kv.block_table import pad_block_tables
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.kv.kv_pool import KVPool
from minienv.kv.paged_attention import PagedAttentionMetadata
from minienv.scheduler import SchedulerOutput


@dataclass(slots=True)  # built every step and read once by the engine: not frozen (a frozen __init__ costs 4x)
class StepInputs:
    token_ids: np.ndarray  # [N] the step's tokens, chunks concatenated in plan order
    metadata: PagedAttentionMetadata
    sampling: list[int]  # indices into plan.scheduled of the chunks that produce a token
    logits_indices: np.ndarray  # the rows of token_ids whose logits are computed (>= 1 row)
    #: logits rows per sampling chunk, in order: 1, or 1 + its drafts for a speculative decode (verification)
    num_logits: list[int]


def decode_metadata(block_tables: np.ndarray, context_lens: np.ndarray, slot_mapping: np.ndarray,
                    block_size: int) -> PagedAttentionMetadata:
    """The :class:`PagedAttentionMetadata` of a step in which every sequence decodes one token, its derived fields
    written directly: with every query length 1, sequence ``i``'s token is token ``i`` of the step, row 0 of its
    sequence, at position ``context_lens[i]``. The general constructor derives the same arrays with cumsum,
    repeat and checks, which cost more than the rest of a decode step's inputs; the engine's own tables need no
    checks. ``tests/unit/test_engine_fast_paths.py`` compares every field with the constructor's."""
    s = len(context_lens)
    consts = _DECODE_CONSTANTS.get(s)
    if consts is None:
        consts = _DECODE_CONSTANTS[s] = tuple(_read_only(a) for a in (
            np.ones(s, dtype=np.int64), np.arange(s + 1, dtype=np.int64), np.arange(s, dtype=np.int64),
            np.zeros(s, dtype=np.int64)))
    meta = object.__new__(PagedAttentionMetadata)
    meta.block_tables, meta.context_lens, meta.slot_mapping = block_tables, context_lens, slot_mapping
    meta.query_lens, meta.query_start_loc, meta.token_seq_idx, meta.token_row = consts
    meta.block_size = block_size
    meta.seq_lens = context_lens + 1
    meta.positions = context_lens.copy()
    meta.max_query_len, meta.is_decode, meta._plans = 1, True, {}
    return meta


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


#: per batch size, the decode metadata's arrays that depend on nothing else (query lengths 1, token ``i`` = sequence
#: ``i``, row 0), shared read-only across steps
_DECODE_CONSTANTS: dict[int, tuple[np.ndarray, ...]] = {}


class BlockTableCache:
    """The padded block tables of the previous step, carried into the next while the manager's tables only grew.

    A decode step leaves almost every table as it was (one gains a block every ``block_size`` tokens), yet
    padding the tables anew reads every block id of every request in Python, every step. This keeps the last
    padded array with the very list objects it was padded from, their lengths and the manager's
    ``table_epoch`` (bumped by every table change other than an append). While the epoch stands and the step's
    tables are the same lists in the same order, a table at least as long as before still starts with the ids it
    had: equal lengths give the same array, a table that grew gets its new ids written into a copy (the array a
    previous step was given is never changed: it is read-only). Anything else pads anew. Equal to
    :func:`pad_block_tables` of the same tables (``test_block_table_cache_equals_padding_anew``).
    """

    __slots__ = ("rows", "lens", "epoch", "array")

    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self.lens: list[int] = []
        self.epoch = -1
        self.array: np.ndarray | None = None

    def tables(self, rows: list[list[int]], epoch: int) -> np.ndarray:
        """``pad_block_tables(rows)``, where ``rows`` are a manager's live block-id lists and ``epoch`` its
        ``table_epoch`` now."""
        lens = list(map(len, rows))
        array = self.array
        if (epoch != self.epoch or array is None or len(rows) != len(self.rows)
                or not all(map(operator.is_, rows, self.rows))):
            array = pad_block_tables(rows)
        elif lens != self.lens:
            if max(lens) > array.shape[1] or any(map(operator.lt, lens, self.lens)):
                array = pad_block_tables(rows)  # wider (or, misused, shorter): pad anew
            else:
                array = array.copy()
                for i, (row, old, new) in enumerate(zip(rows, self.lens, lens)):
                    if new != old:
                        array[i, old:new] = row[old:new]
        else:
            return array
        array.flags.writeable = False
        self.rows, self.lens, self.epoch, self.array = rows, lens, epoch, array
        return array


def build_step_inputs(plan: SchedulerOutput, kv: KVCacheManager, kv_pool: KVPool,
                      table_cache: BlockTableCache | None = None) -> StepInputs:
    """The model inputs of one step. ``table_cache``: the engine's :class:`BlockTableCache`, used over a manager
    that keeps a ``table_epoch`` (minienv's own); without it the tables are padded anew."""
    sched = plan.scheduled
    n = len(sched)
    # The scheduler's leading run of one-token decodes is the whole step (the steady state): its slots are
    # already one array, and every chunk of the run samples its one token and copies no block.
    decode_slots = plan.decode_slots
    whole_run = decode_slots is not None and len(decode_slots) == n
    if not whole_run and any([s.blocks_to_copy for s in sched]):
        kv_pool.copy_blocks(pair for s in sched for pair in s.blocks_to_copy)
    rows = [kv.request(s.request_id).block_ids for s in sched]
    epoch = getattr(kv, "table_epoch", None) if table_cache is not None else None
    tables = pad_block_tables(rows) if epoch is None else table_cache.tables(rows, epoch)
    context_lens = np.array([s.num_computed_tokens for s in sched], dtype=np.int64)
    if whole_run:
        slot_mapping = decode_slots
    else:
        slot_mapping = sched[0].slot_mapping if n == 1 else np.concatenate([s.slot_mapping for s in sched])
    if len(slot_mapping) == n:  # every sequence computes one token: a decode step (the common case)
        meta = decode_metadata(tables, context_lens, slot_mapping, kv.block_size)
    else:
        meta = PagedAttentionMetadata(tables, context_lens,
                                      np.fromiter((s.num_new_tokens for s in sched), dtype=np.int64, count=n),
                                      slot_mapping, kv.block_size)
    if meta.is_decode:
        token_ids = np.array([s.token_ids[0] for s in sched], dtype=np.int64)
    else:
        token_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in sched), dtype=np.int64,
                                count=len(slot_mapping))  # one slot per token
    if whole_run or meta.is_decode and all([s.samples for s in sched]):
        # every sequence decodes one token and samples it (no drafts: one token each): token i is sequence i's
        # last row, so the rows are the shared read-only arange (what the general lines below compute)
        return StepInputs(token_ids, meta, list(range(n)), meta.token_seq_idx, [1] * n)
    return StepInputs(token_ids, meta, *_sampling_rows(sched, meta))


def _sampling_rows(sched: list, meta: PagedAttentionMetadata) -> tuple[list[int], np.ndarray, list[int]]:
    """The general derivation of ``StepInputs.sampling``, ``logits_indices`` and ``num_logits`` for any step."""
    sampling = [i for i, s in enumerate(sched) if s.samples]
    num_logits = [1 + sched[i].num_spec_tokens for i in sampling]
    # Every sequence mid-prefill: K/V only; one logits row keeps shapes simple (it is never sampled).
    ends = meta.query_start_loc[1:]
    if not sampling:
        rows = np.zeros(1, dtype=np.int64)
    elif len(num_logits) == sum(num_logits):  # no drafts: each chunk's last row
        rows = ends[sampling] - 1
    else:
        rows = np.concatenate([np.arange(ends[i] - m, ends[i]) for i, m in zip(sampling, num_logits, strict=True)])
    return sampling, rows, num_logits

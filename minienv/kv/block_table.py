"""Block tables: a sequence's logical blocks -> physical block ids, and the slot mapping derived from them.

A sequence's KV lives in fixed-size blocks scattered over one shared pool, not in one slab of ``max_len`` rows
(notebook 03's waste). Logical block ``j`` (tokens ``j*B .. j*B+B-1``) is physical block ``table[j]``, so token
``t`` lives in pool slot ``table[t // B] * B + t % B``.

:class:`BlockTable` is minienv's one block-table type: notebook 04 grows one straight from a
:class:`~minienv.kv.block_pool.BlockPool`; the KV cache manager's per-request record is one too. Invariant:
a table holds ``cdiv(num_tokens, B)`` blocks — a block is taken when a token crosses a block boundary, never
earlier — so at most ``B - 1`` slots per sequence are wasted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from minienv.kv.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` slots hold ``a`` tokens."""
    return -(-a // b)


def slot_mapping(block_table: Sequence[int] | np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The slot mapping, its one implementation: the token at position ``p`` of a sequence is in pool slot
    ``table[p // B] * B + p % B``."""
    positions = np.asarray(positions, dtype=np.int64)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def batch_slot_mapping(block_tables: np.ndarray, seq_idx: np.ndarray, positions: np.ndarray,
                       block_size: int) -> np.ndarray:
    """Slots of a flattened batch: token ``i`` is at ``positions[i]`` of sequence ``seq_idx[i]`` of the padded
    ``[num_seqs, width]`` tables (vLLM's ``BlockTable.compute_slot_mapping``). Row-major, block ``j`` of sequence
    ``s`` is entry ``s * width + j`` of the flat table, so position ``p`` of ``s`` is position ``s * width * B + p``
    of one long sequence: :func:`slot_mapping`, one fancy index."""
    tables = np.asarray(block_tables, dtype=np.int64)
    offsets = np.asarray(seq_idx, dtype=np.int64) * (tables.shape[1] * block_size)
    return slot_mapping(tables.reshape(-1), offsets + np.asarray(positions, dtype=np.int64), block_size)


def pad_block_tables(tables: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """Stack ragged block tables into ``[num_seqs, width]`` int64, padded with block 0 — a valid id, so the gather
    stays a plain ``np.take``; attention masks every slot past a sequence's length, so the padding is never read."""
    n = len(tables)
    if width is None:
        width = max(max(map(len, tables), default=0), 1)
    else:
        width = max(width, 1)
        if any([len(t) > width for t in tables]):
            raise ValueError(f"a block table of {max(map(len, tables))} blocks does not fit width {width}")
    if n == 0:
        return np.zeros((0, width), dtype=np.int64)
    # short rows extended with zeros in Python, then the rows' ids read into one array by np.fromiter: a zero array
    # and one numpy assignment per row, or np.array over a list of lists (which discovers the shape first), cost
    # more than the rest of a small decode step's inputs (the engine pads every step)
    return np.fromiter(itertools.chain.from_iterable([t if len(t) == width else [*t, *[0] * (width - len(t))]
                                                      for t in tables]),
                       dtype=np.int64, count=n * width).reshape(n, width)


@dataclass
class BlockTable:
    """The physical blocks of one sequence, in logical order, and how many tokens they hold.

    Invariant: ``len(block_ids) == cdiv(num_tokens, block_size)`` (checked at construction, kept by every method).
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if len(self.block_ids) != cdiv(self.num_tokens, self.block_size):
            raise ValueError(f"{len(self.block_ids)} blocks cannot hold exactly {self.num_tokens} tokens of block "
                             f"size {self.block_size} (need {cdiv(self.num_tokens, self.block_size)})")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_free_slots(self) -> int:
        """Reserved-but-empty slots in the last block (this sequence's internal fragmentation)."""
        return self.num_blocks * self.block_size - self.num_tokens

    def blocks_needed(self, num_new_tokens: int) -> int:
        """New blocks that appending ``num_new_tokens`` tokens takes (0 while the last block has room)."""
        return cdiv(self.num_tokens + num_new_tokens, self.block_size) - len(self.block_ids)

    def slot_mapping(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Pool slots of this sequence's tokens ``[start, end)`` (default: all of them), as int64."""
        end = self.num_tokens if end is None else end
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"token range [{start}, {end}) is outside this table's {self.num_tokens} tokens")
        return slot_mapping(self.block_ids, np.arange(start, end), self.block_size)

    def as_array(self) -> np.ndarray:
        return np.asarray(self.block_ids, dtype=np.int64)

    # ------------------------------------------------------------------ the plain pool path (notebook 04)
    def append_tokens(self, num_new_tokens: int, pool: BlockPool) -> list[int]:
        """Make room for ``num_new_tokens`` more tokens; return the blocks newly taken from ``pool``. All or nothing:
        if the pool is short, :class:`~minienv.kv.errors.OutOfBlocksError` propagates and nothing has changed."""
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, (int, np.integer)) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        need = self.blocks_needed(int(num_new_tokens))
        new_ids = pool.allocate(need) if need > 0 else []
        self.block_ids.extend(new_ids)
        self.num_tokens += int(num_new_tokens)
        return new_ids

    def truncate(self, num_tokens: int, pool: BlockPool) -> list[int]:
        """Keep the first ``num_tokens`` tokens; blocks no longer needed go back to ``pool`` last first (so a chain's
        tail is evicted before its parent). Returns their ids in table order."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a table of {self.num_tokens} tokens to {num_tokens}")
        keep = cdiv(num_tokens, self.block_size)
        dropped = self.block_ids[keep:]
        pool.free(dropped[::-1])  # validated before anything changes
        del self.block_ids[keep:]
        self.num_tokens = num_tokens
        return dropped

    def free(self, pool: BlockPool) -> list[int]:
        """Release every block, last first."""
        return self.truncate(0, pool)

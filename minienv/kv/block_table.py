"""Block tables: each sequence's logical blocks -> physical block ids, and the slot mapping derived from them.

A sequence's KV does not live in one contiguous slab (the contiguous cache of notebook 02 reserves ``max_len``
rows per request, which is where notebook 03's waste comes from). It lives in fixed-size blocks scattered over
one shared pool. The block table is the page table: logical block ``j`` of the sequence (its tokens
``j*B .. j*B+B-1``) is physical block ``table[j]``. Token ``t`` therefore lives in pool *slot*

    slot(t) = table[t // B] * B + t % B

and a sequence holds exactly ``ceil(num_tokens / B)`` blocks: a new block is taken exactly when a token crosses a
block boundary, so at most ``B - 1`` slots per sequence are ever wasted (internal fragmentation only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from minienv.kv.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` slots hold ``a`` tokens."""
    return -(-a // b)


def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Pool slots of tokens at ``positions`` of one sequence: ``table[p // B] * B + p % B``, vectorized."""
    positions = np.asarray(positions, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def batch_slot_mapping(
    block_tables: np.ndarray, seq_idx: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """Slots of a flattened batch of tokens: token ``i`` is at ``positions[i]`` of sequence ``seq_idx[i]``.

    ``block_tables`` is the padded ``[num_seqs, max_blocks]`` array (:func:`pad_block_tables`). One fancy index,
    no loop over tokens or sequences — the same arithmetic vLLM's ``BlockTable.compute_slot_mapping`` does.
    """
    positions = np.asarray(positions, dtype=np.int64)
    return block_tables[seq_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size


def pad_block_tables(tables: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """Stack ragged block tables into ``[num_seqs, width]`` int64, padded with block 0.

    The padding is never read as data: attention masks every slot at or beyond a sequence's length. Padding with
    a *valid* id (rather than -1) keeps the gather a plain ``np.take`` with no bounds juggling.
    """
    width = max((len(t) for t in tables), default=0) if width is None else width
    out = np.zeros((len(tables), max(width, 1)), dtype=np.int64)
    for i, t in enumerate(tables):  # one row copy per sequence (not per token)
        out[i, : len(t)] = t
    return out


@dataclass
class BlockTable:
    """The physical blocks of one sequence, in logical order, and how many tokens they hold.

    Invariant (kept by :meth:`append_tokens` and :meth:`truncate`): ``len(block_ids) == cdiv(num_tokens,
    block_size)`` — a new block is allocated exactly at each block boundary and never earlier.
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if len(self.block_ids) != cdiv(self.num_tokens, self.block_size):
            raise ValueError(
                f"{len(self.block_ids)} blocks cannot hold exactly {self.num_tokens} tokens of block size "
                f"{self.block_size} (need {cdiv(self.num_tokens, self.block_size)})"
            )

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_free_slots(self) -> int:
        """Reserved-but-empty slots in the last block (this sequence's internal fragmentation)."""
        return self.num_blocks * self.block_size - self.num_tokens

    def blocks_needed(self, num_new_tokens: int) -> int:
        """How many new blocks appending ``num_new_tokens`` tokens takes (0 while the last block has room)."""
        return cdiv(self.num_tokens + num_new_tokens, self.block_size) - len(self.block_ids)

    def append_tokens(self, num_new_tokens: int, pool: BlockPool) -> list[int]:
        """Make room for ``num_new_tokens`` more tokens; return the ids of the blocks newly taken from ``pool``.

        All or nothing: if the pool cannot supply every block needed, :class:`~minienv.kv.errors.OutOfBlocksError`
        propagates and neither the table nor the pool has changed.
        """
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, (int, np.integer)) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        need = self.blocks_needed(int(num_new_tokens))
        new_ids = pool.allocate(need) if need > 0 else []  # raises before anything changes
        self.block_ids.extend(new_ids)
        self.num_tokens += int(num_new_tokens)  # invariant: len(block_ids) == cdiv(num_tokens, B) again
        return new_ids

    def slot_mapping(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Pool slots of this sequence's tokens ``[start, end)`` (default: all of them), as int64."""
        end = self.num_tokens if end is None else end
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"token range [{start}, {end}) is outside this table's {self.num_tokens} tokens")
        return slot_mapping(np.asarray(self.block_ids, dtype=np.int64), np.arange(start, end), self.block_size)

    def truncate(self, num_tokens: int, pool: BlockPool) -> list[int]:
        """Keep only the first ``num_tokens`` tokens (roll back rejected speculative tokens, say).

        Blocks no longer needed go back to the pool, last block first; returns their ids.
        """
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a table of {self.num_tokens} tokens to {num_tokens}")
        keep = cdiv(num_tokens, self.block_size)
        dropped = self.block_ids[keep:]
        pool.free(dropped[::-1])  # validated before anything changes; reverse: tail first
        del self.block_ids[keep:]
        self.num_tokens = num_tokens  # invariant restored
        return dropped

    def free(self, pool: BlockPool) -> list[int]:
        """Release every block (last block first, so a chain's tail is evicted before its parent later)."""
        return self.truncate(0, pool)

    def as_array(self) -> np.ndarray:
        return np.asarray(self.block_ids, dtype=np.int64)

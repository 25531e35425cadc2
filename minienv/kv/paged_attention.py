"""Paged attention in numpy: attention whose K/V are read through block tables from the shared KV pool.

The model hands the backend each layer's Q, K, V for the N new tokens of a step (several sequences flattened,
each a prefill chunk — possibly starting mid-sequence — or a single decode token). The backend

1. writes the new K/V into the pool at their slots (``slot = table[t // B] * B + t % B``), then
2. for each sequence, gathers its blocks *in logical order* — one ``np.take`` of whole blocks on the block axis —
   which turns scattered physical blocks back into a contiguous ``[tokens, H, D]`` view, and
3. runs ordinary batched, padded, causal attention over that: the very same math as attention over contiguous
   per-sequence caches (:func:`batched_attention`), so paged == dense is true by construction and checkable.

Per-step inputs are an explicit :class:`PagedAttentionMetadata`, like vLLM's attention metadata: block tables,
context lengths (tokens cached before this step), query lengths (new tokens this step) and the slot mapping.

**Performance.** The gather is the only work paging adds. Gathering the whole batch at once would write and then
re-read a copy as large as the KV being attended (megabytes), so the kernel walks the batch in *tiles* of
sequences sized to stay in the L2 cache (``tile_bytes``): gather a tile's blocks into a reused buffer, attend
while it is hot, move on. The tile loop is over groups of sequences, sized by bytes — one iteration for small
batches; there is no loop over tokens, and decode needs no per-sequence Python work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from minienv.kv.block_table import BlockTable, cdiv, pad_block_tables
from minienv.kv.kv_pool import KVPool

#: Gathered K+V bytes per tile: about half a core's L2 on the machines this was tuned on (1 MiB L2 per core).
DEFAULT_TILE_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------------------- metadata
@dataclass(eq=False)
class PagedAttentionMetadata:
    """What one batched step must know about its sequences (vLLM: the attention metadata of a step).

    For sequence ``i``: ``block_tables[i]`` its physical blocks in logical order (padded with 0),
    ``context_lens[i]`` tokens already in the cache before this step, ``query_lens[i]`` new tokens in this step
    (a prefill chunk, or 1 for a decode). The step's tokens are the sequences' new tokens concatenated in order;
    ``slot_mapping[j]`` is the pool slot where token ``j``'s K/V is written.
    """

    block_tables: np.ndarray
    context_lens: np.ndarray
    query_lens: np.ndarray
    slot_mapping: np.ndarray
    block_size: int
    # derived
    seq_lens: np.ndarray = field(init=False)
    query_start_loc: np.ndarray = field(init=False)
    positions: np.ndarray = field(init=False)
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        self.block_tables = np.asarray(self.block_tables, dtype=np.int64)
        self.context_lens = np.asarray(self.context_lens, dtype=np.int64)
        self.query_lens = np.asarray(self.query_lens, dtype=np.int64)
        self.slot_mapping = np.asarray(self.slot_mapping, dtype=np.int64)
        s = len(self.query_lens)
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != s or self.context_lens.shape != (s,):
            raise ValueError(
                f"metadata for {s} sequences needs block_tables [{s}, max_blocks] and context_lens [{s}], got "
                f"{self.block_tables.shape} and {self.context_lens.shape}"
            )
        if s == 0 or (self.query_lens < 1).any() or (self.context_lens < 0).any():
            raise ValueError("a step needs >= 1 sequence, each with >= 1 new token and a context length >= 0")
        self.seq_lens = self.context_lens + self.query_lens
        if (self.seq_lens > self.block_tables.shape[1] * self.block_size).any():
            raise ValueError("a sequence is longer than its block table can hold")
        self.query_start_loc = np.concatenate([[0], np.cumsum(self.query_lens)])
        n = int(self.query_start_loc[-1])
        if self.slot_mapping.shape != (n,):
            raise ValueError(f"slot_mapping must have one slot per new token ({n}), got {self.slot_mapping.shape}")
        self.is_decode = bool((self.query_lens == 1).all())
        # position of each new token in its own sequence: context_len + 0, 1, ... (vectorized, no token loop)
        seq_idx = np.repeat(np.arange(s), self.query_lens)
        self.positions = self.context_lens[seq_idx] + (np.arange(n) - self.query_start_loc[seq_idx])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @classmethod
    def from_block_tables(cls, tables: Sequence[BlockTable], query_lens: Sequence[int]) -> "PagedAttentionMetadata":
        """Metadata for a step whose new tokens have *already* been appended to ``tables`` (``append_tokens``).

        Sequence ``i``'s new tokens are its last ``query_lens[i]`` tokens; the slot mapping is computed for all
        of them at once: ``table[seq, pos // B] * B + pos % B``.
        """
        if len(tables) != len(query_lens):
            raise ValueError(f"{len(tables)} block tables but {len(query_lens)} query lengths")
        block_size = tables[0].block_size if tables else 1
        if any(t.block_size != block_size for t in tables):
            raise ValueError("all block tables of a step must share one block size")
        q = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray([t.num_tokens for t in tables], dtype=np.int64) - q
        bt = pad_block_tables([t.block_ids for t in tables])
        seq_idx = np.repeat(np.arange(len(tables)), q)
        starts = np.concatenate([[0], np.cumsum(q)])
        pos = ctx[seq_idx] + (np.arange(int(starts[-1])) - starts[seq_idx])
        slots = bt[seq_idx, pos // block_size] * block_size + pos % block_size
        return cls(bt, ctx, q, slots, block_size)


# ---------------------------------------------------------------------------------------------------- the math
def batched_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    context_lens: np.ndarray,
    query_lens: np.ndarray,
    max_query_len: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Causal GQA attention for S sequences over *contiguous* per-sequence K/V, padded to a common length.

    ``q [S, Q, Hq, D]`` (Q = ``max_query_len``; sequence ``s``'s queries are rows ``0..query_lens[s]-1``, at
    positions ``context_lens[s] + row``), ``k, v [S, T, Hkv, D]`` with keys at positions ``0..T-1``. A query at
    position p sees keys ``0..p``; padded query rows are given a valid position and their output is garbage the
    caller drops. Returns ``[S, Q, Hq, D]``.

    This is the dense baseline *and* the inner kernel of paged attention: the paged path only differs in how
    ``k, v`` were produced (gathered from blocks), so the benchmark's ratio measures the cost of paging alone.
    """
    s, qn, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    # [S, Hkv, G*Q, D]: query heads sharing a KV head are stacked as extra rows of one matmul (GQA without
    # repeating K/V). For decode (Q = 1) this is a free reshape.
    if qn == 1:
        qg = q.reshape(s, hkv, group, d)
    else:
        qg = q.reshape(s, qn, hkv, group, d).transpose(0, 2, 3, 1, 4).reshape(s, hkv, group * qn, d)
    scores = qg @ k.transpose(0, 2, 3, 1)  # [S, Hkv, G*Q, T]: matmul reads K [T, D] per head in place
    scores *= np.float32(1.0 / np.sqrt(d))
    # key j is visible to query row r of sequence s iff j <= context_lens[s] + min(r, query_lens[s] - 1)
    last_visible = context_lens[:, None] + np.minimum(np.arange(qn)[None, :], query_lens[:, None] - 1)  # [S, Q]
    if (last_visible < t - 1).any():  # skipped when every query sees every key (decode of equal lengths)
        hidden = np.arange(t)[None, None, :] > last_visible[:, :, None]  # [S, Q, T]
        scores4 = scores.reshape(s, hkv, group, qn, t)
        np.copyto(scores4, np.float32(-np.inf), where=hidden[:, None, None])
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    o = scores @ v.transpose(0, 2, 1, 3)  # [S, Hkv, G*Q, D]
    if qn == 1:
        res = o.reshape(s, 1, hq, d)
    else:
        res = o.reshape(s, hkv, group, qn, d).transpose(0, 3, 1, 2, 4).reshape(s, qn, hq, d)
    if out is not None:
        out[...] = res
        return out
    return res


@dataclass
class Workspace:
    """A reused float32 scratch buffer (the gather target), grown on demand and never shrunk.

    Preallocating keeps the decode hot path free of large allocations: every step and layer gathers into the
    same memory, which is also what keeps it warm in cache.
    """

    buffer: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))

    def get(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        if self.buffer.size < size:
            self.buffer = np.empty(size, dtype=np.float32)
        return self.buffer[:size].reshape(shape)


def gather_kv(kv_layer: np.ndarray, block_tables: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """K and V of whole sequences, in logical order: ``[2, S, num_blocks * B, H, D]`` from ``[2, NB, B, H, D]``.

    One ``np.take`` on the block axis copies whole blocks (``B*H*D`` contiguous floats each). ``mode="clip"``
    matters: with the default ``"raise"`` numpy buffers ``out`` through an extra temporary copy.
    """
    s, nb = block_tables.shape
    _, _, b, h, d = kv_layer.shape
    if out is None:
        out = np.empty((2, s, nb, b, h, d), dtype=kv_layer.dtype)
    np.take(kv_layer, block_tables, axis=1, out=out, mode="clip")
    return out.reshape(2, s, nb * b, h, d)


def paged_attention(
    q: np.ndarray,
    kv_layer: np.ndarray,
    meta: PagedAttentionMetadata,
    workspace: Workspace | None = None,
    tile_bytes: int = DEFAULT_TILE_BYTES,
) -> np.ndarray:
    """Attention of the step's new tokens ``q [N, Hq, D]`` over the K/V in ``kv_layer [2, NB, B, H, D]``.

    The new tokens' own K/V must already be written (the backend writes, then attends). Handles any mix of
    prefill chunks (causal, starting at ``context_lens``) and decodes. Returns ``[N, Hq, D]``.
    """
    workspace = workspace if workspace is not None else Workspace()
    n, hq, d = q.shape
    _, _, block_size, hkv, _ = kv_layer.shape
    s = meta.num_seqs
    if meta.is_decode:
        q_pad = q.reshape(s, 1, hq, d)  # one query per sequence, already in sequence order: no scatter
        max_q = 1
    else:
        max_q = int(meta.query_lens.max())
        seq_idx = np.repeat(np.arange(s), meta.query_lens)
        row = np.arange(n) - meta.query_start_loc[seq_idx]
        q_pad = np.zeros((s, max_q, hq, d), dtype=q.dtype)
        q_pad[seq_idx, row] = q
    out = np.empty((s, max_q, hq, d), dtype=np.float32)
    seq_lens = meta.seq_lens
    # sequences per tile: as many as keep the gathered K+V within tile_bytes (at least one)
    widest = int(seq_lens.max())
    per_seq = 2 * cdiv(widest, block_size) * block_size * hkv * d * 4
    tile = max(1, min(s, tile_bytes // per_seq))
    for s0 in range(0, s, tile):  # one iteration unless the batch's KV outgrows the cache
        s1 = min(s, s0 + tile)
        nb = cdiv(int(seq_lens[s0:s1].max()), block_size)  # only the blocks this tile's sequences use
        tables = meta.block_tables[s0:s1, :nb]
        buf = workspace.get((2, s1 - s0, nb, block_size, hkv, d))
        kv = gather_kv(kv_layer, tables, out=buf)
        batched_attention(q_pad[s0:s1], kv[0], kv[1], meta.context_lens[s0:s1], meta.query_lens[s0:s1], max_q,
                          out=out[s0:s1])
    if meta.is_decode:
        return out.reshape(n, hq, d)
    return out[seq_idx, row]


# ---------------------------------------------------------------------------------------------------- backend
class PagedAttentionBackend:
    """The model's attention backend over a :class:`KVPool` for a batch of sequences.

    Before each ``model.forward_step`` the caller sets the step's metadata (:meth:`set_metadata`); the model then
    calls ``begin_step`` (positions are checked against the metadata), ``attend`` per layer (write the new K/V
    through the slot mapping, then paged attention), and ``end_step``.
    """

    def __init__(self, kv_pool: KVPool, tile_bytes: int = DEFAULT_TILE_BYTES):
        self.kv_pool = kv_pool
        self.tile_bytes = tile_bytes
        self.workspace = Workspace()
        self.metadata: PagedAttentionMetadata | None = None

    def set_metadata(self, metadata: PagedAttentionMetadata) -> None:
        if metadata.block_size != self.kv_pool.block_size:
            raise ValueError(f"metadata block size {metadata.block_size} != pool block size {self.kv_pool.block_size}")
        self.metadata = metadata

    def begin_step(self, positions: np.ndarray) -> None:
        if self.metadata is None:
            raise RuntimeError("set_metadata(...) must be called before each step of a paged backend")
        if not np.array_equal(np.asarray(positions), self.metadata.positions):
            raise ValueError("the model's positions disagree with the step metadata (context_lens / query_lens)")

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        meta = self.metadata
        self.kv_pool.write(layer_idx, meta.slot_mapping, k, v)
        return paged_attention(q, self.kv_pool.kv_cache[layer_idx], meta, self.workspace, self.tile_bytes)

    def end_step(self) -> None:
        self.metadata = None  # metadata describes one step; reusing it by mistake would double-write slots

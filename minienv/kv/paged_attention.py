"""Paged attention: attention whose K/V are read through block tables from the shared KV pool.

The model hands the backend each layer's Q, K, V for the N new tokens of a step (several sequences flattened,
each a prefill chunk — possibly starting mid-sequence — or a single decode token). The backend writes the new K/V
into the pool at their slots (``slot = table[t // B] * B + t % B``), then computes causal attention of the new
tokens over everything their sequences have cached, reading K/V through the block tables.

Per-step inputs are an explicit :class:`PagedAttentionMetadata`, like vLLM's attention metadata: block tables,
context lengths (tokens cached before this step), query lengths (new tokens this step) and the slot mapping.

**Two kernels, one answer** (a differential test holds them within 1e-5 of each other and of dense attention):

* ``"numpy"``, the reference (:func:`gather_attention`): gather every sequence's blocks in logical order with one
  ``np.take`` — scattered blocks become one contiguous ``[tokens, D]`` slab per sequence and head — then run
  :func:`batched_attention`, the same math as over contiguous caches, with a mask for the padding. It is the
  lesson of notebook 04, and in numpy the copy costs about as much as the attention itself.
* ``"numba"``, the fused block walk (:mod:`minienv.kv.block_walk`): no copy; every block is read where it lies
  (its keys scored, then after each row's softmax its values summed), blocks visited in physical-pool order. It
  needs the optional ``numba`` package.

``kernel="auto"`` is the block walk when numba imports, else the reference. There is no size threshold: the
choice depends on what is installed, never on the step or the machine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from minienv.kv.block_table import BlockTable, batch_slot_mapping, pad_block_tables
from minienv.kv.kv_pool import KVPool

try:  # the optional fused kernel (the `lab` extra installs numba); any failure means: use the numpy kernel
    from minienv.kv.block_walk import block_walk as _block_walk
    NUMBA_MISSING: str | None = None
except Exception as exc:  # noqa: BLE001 - ImportError, or numba unable to set up its cache (a read-only home)
    _block_walk = None
    NUMBA_MISSING = f"{type(exc).__name__}: {exc}"

KERNELS = ("auto", "numpy", "numba")


def resolve_kernel_name(kernel: str) -> str:
    """``"numpy"`` or ``"numba"`` for a kernel name; ``"numba"`` without numba is refused with the reason."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        return "numpy" if _block_walk is None else "numba"
    if kernel == "numba" and _block_walk is None:
        raise ValueError(f"kernel='numba' needs the numba package (pip install 'minienv[lab]'): {NUMBA_MISSING}")
    return kernel


# ---------------------------------------------------------------------------------------------------- metadata
@dataclass(eq=False)
class PagedAttentionMetadata:
    """What one batched step must know about its sequences (vLLM: the attention metadata of a step).

    For sequence ``i``: ``block_tables[i]`` its physical blocks in logical order (padded with 0),
    ``context_lens[i]`` tokens already in the cache before this step, ``query_lens[i]`` new tokens in this step
    (a prefill chunk, or 1 for a decode). The step's tokens are the sequences' new tokens concatenated in order;
    ``slot_mapping[j]`` is the pool slot where token ``j``'s K/V is written — computed here from the block tables
    when not given (:meth:`from_tables`: the one place the engine's step gets its slots).
    """

    block_tables: np.ndarray
    context_lens: np.ndarray
    query_lens: np.ndarray
    slot_mapping: np.ndarray | None
    block_size: int
    # derived
    seq_lens: np.ndarray = field(init=False)
    query_start_loc: np.ndarray = field(init=False)
    positions: np.ndarray = field(init=False)
    token_seq_idx: np.ndarray = field(init=False)  # [N] which sequence each new token belongs to
    token_row: np.ndarray = field(init=False)  # [N] its index among that sequence's new tokens
    max_query_len: int = field(init=False)
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        self.block_tables = np.asarray(self.block_tables, dtype=np.int64)
        self.context_lens = np.asarray(self.context_lens, dtype=np.int64)
        self.query_lens = np.asarray(self.query_lens, dtype=np.int64)
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
        self.max_query_len = int(self.query_lens.max())
        self.is_decode = self.max_query_len == 1
        # position of each new token in its own sequence: context_len + 0, 1, ... (vectorized, no token loop)
        self.token_seq_idx = np.repeat(np.arange(s), self.query_lens)
        self.token_row = np.arange(n) - self.query_start_loc[self.token_seq_idx]
        self.positions = self.context_lens[self.token_seq_idx] + self.token_row
        if self.slot_mapping is None:
            self.slot_mapping = batch_slot_mapping(self.block_tables, self.token_seq_idx, self.positions,
                                                   self.block_size)
        self.slot_mapping = np.asarray(self.slot_mapping, dtype=np.int64)
        if self.slot_mapping.shape != (n,):
            raise ValueError(f"slot_mapping must have one slot per new token ({n}), got {self.slot_mapping.shape}")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    # What a kernel derives from the metadata is made once per step, on first use, and every layer shares it
    # (the metadata describes one step: nothing changes it once made).
    @functools.cached_property
    def walk(self) -> tuple[np.ndarray, np.ndarray]:
        """The block walk's visiting order (:func:`walk_order`)."""
        return walk_order(self)

    @functools.cached_property
    def gather_plan(self) -> "GatherPlan":
        """The numpy kernel's groups, with their masks (:class:`GatherPlan`)."""
        return GatherPlan.of(self)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @classmethod
    def from_tables(cls, block_tables: np.ndarray, context_lens: Sequence[int], query_lens: Sequence[int],
                    block_size: int) -> "PagedAttentionMetadata":
        """The metadata of a step, its slot mapping computed from the (padded) block tables: the new tokens of
        sequence ``i`` are at positions ``context_lens[i] + 0, 1, ...``."""
        return cls(block_tables, context_lens, query_lens, None, block_size)

    @classmethod
    def from_block_tables(cls, tables: Sequence[BlockTable], query_lens: Sequence[int]) -> "PagedAttentionMetadata":
        """Metadata for a step whose new tokens have *already* been appended to ``tables`` (``append_tokens``):
        sequence ``i``'s new tokens are its last ``query_lens[i]`` tokens."""
        if len(tables) != len(query_lens):
            raise ValueError(f"{len(tables)} block tables but {len(query_lens)} query lengths")
        block_size = tables[0].block_size if tables else 1
        if any(t.block_size != block_size for t in tables):
            raise ValueError("all block tables of a step must share one block size")
        q = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray([t.num_tokens for t in tables], dtype=np.int64) - q
        return cls.from_tables(pad_block_tables([t.block_ids for t in tables]), ctx, q, block_size)


# ---------------------------------------------------------------------------------------------------- the math
def causal_hidden_mask(
    context_lens: np.ndarray, query_lens: np.ndarray, max_query_len: int, num_keys: int
) -> np.ndarray | None:
    """Which keys each (padded) query must *not* see: ``[S, Q, T]`` bool, or None if every query sees every key.

    Query row ``r`` of sequence ``s`` sits at position ``context_lens[s] + r`` and sees keys ``0..`` that position.
    Padded rows (``r >= query_lens[s]``) are given the last real row's position so no row is fully masked (a row of
    all ``-inf`` would turn into NaN); their output is dropped.
    """
    last_visible = context_lens[:, None] + np.minimum(np.arange(max_query_len)[None, :], query_lens[:, None] - 1)
    if (last_visible >= num_keys - 1).all():
        return None  # e.g. decode of equal-length sequences: nothing to hide
    return np.arange(num_keys)[None, None, :] > last_visible[:, :, None]


@functools.lru_cache(maxsize=None)
def softmax_scale(head_dim: int) -> np.float32:
    """``1 / sqrt(head_dim)`` as float32."""
    return np.float32(1.0 / np.sqrt(head_dim))


def hidden_bias(hidden: np.ndarray | None) -> np.ndarray | None:
    """:func:`causal_hidden_mask`'s ``[S, Q, T]`` as an additive float32 mask ``[S, 1, 1, Q, T]``: ``-inf`` where
    a key is hidden, 0 elsewhere (None stays None); ``x + -inf == -inf`` for finite x."""
    if hidden is None:
        return None
    bias = np.zeros(hidden.shape, dtype=np.float32)
    bias[hidden] = -np.inf
    return bias[:, None, None]


def batched_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, hidden: np.ndarray | None = None,
                      out: np.ndarray | None = None, bias: np.ndarray | None = None) -> np.ndarray:
    """Causal GQA attention for S sequences over *contiguous* per-sequence K/V, padded to a common length.

    ``q [S, Q, Hq, D]``, ``k, v [S, T, Hkv, D]``; the keys each query must not see are given either as
    ``hidden [S, Q, T]`` (:func:`causal_hidden_mask`) or as its additive form ``bias`` (:func:`hidden_bias`);
    neither: no mask. Query head ``h`` reads KV head ``h // (Hq // Hkv)``. Returns ``[S, Q, Hq, D]`` (into
    ``out`` if given). The dense baseline *and* the inner step of the numpy paged kernel, which differs only in
    how ``k, v`` were produced (gathered from blocks).
    """
    s, qn, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    if bias is None and hidden is not None:
        bias = hidden_bias(hidden)
    # [S, Hkv, G*Q, D]: query heads sharing a KV head become extra rows of one matmul (GQA without repeating K/V);
    # the softmax scale is folded into q, the smallest operand.
    qg = (q * softmax_scale(d)).reshape(s, qn, hkv, group, d).transpose(0, 2, 3, 1, 4).reshape(s, hkv, group * qn, d)
    scores = np.matmul(qg, k.transpose(0, 2, 3, 1))  # [S, Hkv, G*Q, T]
    if bias is not None:
        s5 = scores.reshape(s, hkv, group, qn, t)
        np.add(s5, bias, out=s5)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    sums = scores.sum(axis=-1, keepdims=True)
    o = np.matmul(scores, v.transpose(0, 2, 1, 3))  # [S, Hkv, G*Q, D], unnormalised: divide D floats, not T
    o /= sums
    res = o.reshape(s, hkv, group, qn, d).transpose(0, 3, 1, 2, 4).reshape(s, qn, hq, d)
    if out is None:
        return res
    out[...] = res
    return out


def layer_storage(kv_layer: np.ndarray) -> np.ndarray:
    """A layer of ``KVPool.kv_cache`` (``[2, NB, B, H, D]``) as the memory under it: ``[2, H, NB, B, D]``, heads
    outermost (see :mod:`minienv.kv.kv_pool`). A view for a pool's layer; another layout is copied."""
    hm = kv_layer.transpose(0, 3, 1, 2, 4)
    return hm if hm.flags.c_contiguous else np.ascontiguousarray(hm)


def gather_kv(kv_layer: np.ndarray, block_tables: np.ndarray) -> np.ndarray:
    """K and V of whole sequences, in logical order: ``[2, S, num_blocks * B, H, D]`` from a layer ``[2, NB, B,
    H, D]`` of the pool — one ``np.take`` on the block axis of the layer's storage (whole blocks, ``B * D``
    contiguous floats per block and head), seen in logical order."""
    s, nb = block_tables.shape
    _, _, b, h, d = kv_layer.shape
    out = layer_storage(kv_layer).take(block_tables, axis=2)  # [2, H, S, nb, B, D]
    return out.reshape(2, h, s, nb * b, d).transpose(0, 2, 3, 1, 4)


# ---------------------------------------------------------------------------------------------------- kernels
@dataclass(eq=False)
class GatherGroup:
    """Sequences the numpy kernel attends together: their tables trimmed to the longest of them, where each of
    their tokens' queries sits in the padded ``[S, max_q]`` block, and the causal mask."""

    tokens: np.ndarray  # the step's token rows of these sequences, in order
    block_tables: np.ndarray
    rows: tuple[np.ndarray, np.ndarray]  # (sequence within the group, row) of each token
    max_query_len: int
    bias: np.ndarray | None


@dataclass(eq=False)
class GatherPlan:
    """What the numpy kernel derives once per step and every layer reuses. The step's decodes and its prefill
    chunks are two groups, so a decode's single query is never padded to a chunk's length (a 64-token chunk
    among 15 decodes would otherwise make 16 x 64 query rows for 79 real ones)."""

    groups: list[GatherGroup]

    @classmethod
    def of(cls, meta: PagedAttentionMetadata) -> "GatherPlan":
        groups = []
        for seqs in (np.flatnonzero(meta.query_lens == 1), np.flatnonzero(meta.query_lens > 1)):
            if not len(seqs):
                continue
            q, ctx = meta.query_lens[seqs], meta.context_lens[seqs]
            nb = int(-(-int((ctx + q).max()) // meta.block_size))
            hidden = causal_hidden_mask(ctx, q, int(q.max()), nb * meta.block_size)
            in_group = np.repeat(np.arange(len(seqs)), q)
            tokens = (meta.query_start_loc[seqs][in_group] + (np.arange(len(in_group))
                      - np.concatenate([[0], np.cumsum(q)])[in_group]))
            groups.append(GatherGroup(tokens, meta.block_tables[seqs, :nb], (in_group, meta.token_row[tokens]),
                                      int(q.max()), hidden_bias(hidden)))
        return cls(groups)


def gather_attention(q: np.ndarray, kv_layer: np.ndarray, meta: PagedAttentionMetadata) -> np.ndarray:
    """The numpy reference: gather each sequence's blocks, attend. ``q [N, Hq, D]`` -> ``[N, Hq, D]``."""
    n, hq, d = q.shape
    out = np.empty((n, hq, d), dtype=np.float32)
    for g in meta.gather_plan.groups:
        kv = gather_kv(kv_layer, g.block_tables)  # [2, S, T, Hkv, D]
        q_pad = np.zeros((len(g.block_tables), g.max_query_len, hq, d), dtype=np.float32)
        q_pad[g.rows] = q[g.tokens]
        out[g.tokens] = batched_attention(q_pad, kv[0], kv[1], bias=g.bias)[g.rows]
    return out


def walk_order(meta: PagedAttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """The block walk's visiting order: every (sequence, logical block) pair that holds keys of the step, sorted
    by physical block id (stable: a shared block's holders in sequence order)."""
    blocks = -(-meta.seq_lens // meta.block_size)
    seq, blk = np.nonzero(np.arange(meta.block_tables.shape[1]) < blocks[:, None])
    order = np.argsort(meta.block_tables[seq, blk], kind="stable")
    return seq[order], blk[order]


def block_walk_attention(q: np.ndarray, kv_layer: np.ndarray, meta: PagedAttentionMetadata) -> np.ndarray:
    """The fused numba kernel (:mod:`minienv.kv.block_walk`) on one layer: ``q [N, Hq, D]`` -> ``[N, Hq, D]``."""
    if _block_walk is None:
        raise ValueError(f"the block walk needs the numba package (pip install 'minienv[lab]'): {NUMBA_MISSING}")
    walk = meta.walk
    storage = layer_storage(kv_layer)
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty_like(q)
    return _block_walk(q, storage[0], storage[1], meta.block_tables, meta.context_lens, meta.query_start_loc,
                       walk[0], walk[1], softmax_scale(q.shape[2]), out)


def paged_attention(q: np.ndarray, kv_layer: np.ndarray, meta: PagedAttentionMetadata,
                    kernel: str = "auto") -> np.ndarray:
    """Causal attention of the step's new tokens ``q [N, Hq, D]`` over their sequences' K/V in one layer of the
    pool (``kv_layer [2, NB, B, Hkv, D]``, the new tokens' K/V already written); returns ``[N, Hq, D]``."""
    if resolve_kernel_name(kernel) == "numba":
        return block_walk_attention(q, kv_layer, meta)
    return gather_attention(q, kv_layer, meta)


# ---------------------------------------------------------------------------------------------------- backend
class PagedAttentionBackend:
    """The model's attention backend over a :class:`KVPool` for a batch of sequences.

    Before each ``model.forward_step`` the caller sets the step's metadata (:meth:`set_metadata`); the model then
    calls ``begin_step`` (positions are checked against the metadata), ``attend`` per layer (write the new K/V
    through the slot mapping, then paged attention), and ``end_step``. What a kernel derives from the metadata
    (the numpy kernel's :class:`GatherPlan`, the block walk's order) is made once per step, by the metadata.
    """

    def __init__(self, kv_pool: KVPool, kernel: str = "auto"):
        self.kernel = resolve_kernel_name(kernel)
        self.kv_pool = kv_pool
        self.metadata: PagedAttentionMetadata | None = None

    def set_metadata(self, metadata: PagedAttentionMetadata) -> None:
        if metadata.block_size != self.kv_pool.block_size:
            raise ValueError(f"metadata block size {metadata.block_size} != pool block size {self.kv_pool.block_size}")
        self.metadata = metadata

    def begin_step(self, positions: np.ndarray) -> None:
        if self.metadata is None:
            raise RuntimeError("set_metadata(...) must be called before each step of a paged backend")
        if positions is not self.metadata.positions and not np.array_equal(np.asarray(positions),
                                                                            self.metadata.positions):
            raise ValueError("the model's positions disagree with the step metadata (context_lens / query_lens)")

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        meta = self.metadata
        self.kv_pool.write(layer_idx, meta.slot_mapping, k, v)
        return paged_attention(q, self.kv_pool.kv_cache[layer_idx], meta, self.kernel)

    def end_step(self) -> None:
        self.metadata = None  # metadata describes one step; reusing it would double-write slots

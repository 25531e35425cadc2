"""Paged attention in numpy: attention whose K/V are read through block tables from the shared KV pool.

The model hands the backend each layer's Q, K, V for the N new tokens of a step (several sequences flattened,
each a prefill chunk — possibly starting mid-sequence — or a single decode token). The backend writes the new K/V
into the pool at their slots (``slot = table[t // B] * B + t % B``), then computes causal attention of the new
tokens over everything their sequences have cached, reading K/V through the block tables.

Per-step inputs are an explicit :class:`PagedAttentionMetadata`, like vLLM's attention metadata: block tables,
context lengths (tokens cached before this step), query lengths (new tokens this step) and the slot mapping.
Everything derived from it (tiles, index arrays, masks) is computed once per step and reused by every layer;
between decode steps over equal block tables the backend carries the plan over and only updates its masks
(:class:`PagedAttentionBackend`).

**Two kernels, one answer.** Paging adds work only in *how K/V are reached*; two ways are implemented and the
property tests hold both to the dense reference:

* **gather** (any step: prefill chunks, decodes, shared blocks): copy each sequence's blocks, in logical order,
  into a reused buffer with one ``np.take`` on the block axis of the pool's storage — turning scattered blocks
  back into one contiguous ``[tokens, D]`` slab per sequence and head (the pool keeps heads outermost, see
  :mod:`minienv.kv.kv_pool`) — then run :func:`batched_attention`, the very same math as over contiguous
  per-sequence caches. The batch is walked in *tiles* of sequences sized to stay in the L2 cache
  (``tile_bytes``), so the copy is still hot when attention reads it. In numpy that copy costs about as much
  as the attention itself. A lone sequence whose blocks are one physical run needs no copy at all: it is read
  through a view; a lone decoding sequence needs no mask either: it attends over exactly its first ``seq_len``
  keys. A step that is nothing else (one request decoding: batch 1) skips the plan entirely and slices the
  layer's per-head views of the pool (:func:`_attend_lone_run`): at a few hundred keys the fixed cost of each
  numpy and Python call, not the arithmetic, is what separates it from a dense kernel. A step's decodes and
  prefill chunks are attended as two groups (a decode is never padded to a chunk's length), and a decode group
  of several tiles is walked shortest first (:class:`TilePlan`).
* **in place** (decode steps whose blocks are not shared and lie in a compact range of the pool): no K/V copy.
  Attention is a sum over keys, so it can be computed *per block*, reading every block where it lies and
  staying in pool order: each block's K times its owner's query (``[G, D] @ [D, B]`` per block and head), each
  sequence's softmax max and sum assembled from per-block partial maxima and sums, each block's unnormalised
  probabilities times its V, block outputs summed per sequence and normalised. This is the shape of the paper's
  CUDA kernel (thread blocks walk the block table and read blocks in place), written with numpy's batched matmul.

``kernel="auto"`` uses views for steps made of contiguous runs, in place for other decode steps over long
sequences, and gather otherwise. It decides once per step from facts that cost O(sequences) (is it a decode, the
mean sequence length); only a step it sends to the in-place kernel pays for that kernel's O(blocks) plan, which
also checks that no block is shared. ``benchmarks/bench_paged.py`` reports, per point, the median time of the
kernel auto chose over the faster kernel's, so a wrong threshold shows. There is no loop over tokens, and decode needs no
per-sequence Python work.

**What paging costs here.** Decode attention reads all of K and V once; a copy of them costs about as much as
that read, so the gather kernel is at best ``1 + copy / attention`` times the strongest dense kernel (whatever
its form or layout): close to 1 only where the copy hides behind memory reads the dense kernel makes anyway, and
near 2 where everything sits in cache. The in-place kernel avoids the copy but pays for many block-sized matmuls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from minienv.kv.block_table import BlockTable, batch_slot_mapping, cdiv, pad_block_tables
from minienv.kv.kv_pool import KVPool

#: Gathered K+V bytes per tile: about a core's L2 on the machines this was tuned on (1 MiB L2 per core).
DEFAULT_TILE_BYTES = 1 << 20
#: ``kernel="auto"`` reads blocks in place when a decode step's sequences hold at least this many tokens on
#: average (and are not all contiguous runs, which are read through views). Measured with
#: ``benchmarks/bench_paged.py`` (head dim 48, block 16): since the pool keeps each head's block as one contiguous
#: ``[B, D]`` slab (heads outermost), gathering copies twice as many, half-size pieces and the in-place kernel
#: reads each block's K and V as one dense operand; it beats gather + attention from 128 keys at batch 8 and 32
#: (by 6 % and 25 % at 128 keys, by 35-45 % from 512), the shortest context measured ...
INPLACE_MIN_MEAN_KEYS = 128
#: ... and the step's blocks span at most this many times as many pool blocks as they are (the in-place kernel
#: computes over the whole range ``[min id, max id]``; blocks of other requests inside it are wasted work).
INPLACE_MAX_SPAN_RATIO = 1.5
KERNELS = ("auto", "gather", "inplace")
#: Decode steps over at least this many keys use matrix-vector products (each query row against its head's K,
#: each softmax row against V) instead of ``q [G, D] @ Kᵀ [D, T]``: with Kᵀ as the right operand of a matrix-matrix
#: product OpenBLAS first repacks K into panels. Measured with the benchmark's head shape (4 query heads, 2 KV heads,
#: head dim 48; caches evicted before each call): the matrix-matrix form is 15-20 % faster up to 600 keys, then its
#: cost jumps by 60-90 % between 600 and 604 keys (OpenBLAS changes how it runs a ``[2, 48] @ [48, T]`` product
#: there) and the matrix-vector form is 25-40 % faster from 604 keys on — at batch 1 (64 vs 85 us at 768 keys),
#: 8 (259 vs 409 us at 608) and 32 (1.0 vs 1.55 ms at 640). Same dot products.
MATVEC_MIN_KEYS = 604


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
    token_seq_idx: np.ndarray = field(init=False)  # [N] which sequence each new token belongs to
    token_row: np.ndarray = field(init=False)  # [N] its index among that sequence's new tokens
    max_query_len: int = field(init=False)
    is_decode: bool = field(init=False)
    _plans: dict = field(init=False, default_factory=dict, repr=False)  # tile plans, computed once per step

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
        self.max_query_len = int(self.query_lens.max())
        self.is_decode = self.max_query_len == 1
        # position of each new token in its own sequence: context_len + 0, 1, ... (vectorized, no token loop)
        self.token_seq_idx = np.repeat(np.arange(s), self.query_lens)
        self.token_row = np.arange(n) - self.query_start_loc[self.token_seq_idx]
        self.positions = self.context_lens[self.token_seq_idx] + self.token_row

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
        return cls(bt, ctx, q, batch_slot_mapping(bt, seq_idx, pos, block_size), block_size)


# ---------------------------------------------------------------------------------------------------- the math
def causal_hidden_mask(
    context_lens: np.ndarray, query_lens: np.ndarray, max_query_len: int, num_keys: int
) -> np.ndarray | None:
    """Which keys each (padded) query must *not* see: ``[S, Q, T]`` bool, or None if every query sees every key.

    Query row ``r`` of sequence ``s`` sits at position ``context_lens[s] + r`` and sees keys ``0..`` that position.
    Padded rows (``r >= query_lens[s]``) are given the last real row's position so no row is fully masked (a row of
    all ``-inf`` would turn into NaN); their output is dropped. Computed once per step, reused by every layer.
    """
    last_visible = context_lens[:, None] + np.minimum(np.arange(max_query_len)[None, :], query_lens[:, None] - 1)
    if (last_visible >= num_keys - 1).all():
        return None  # e.g. decode of equal-length sequences: nothing to hide
    return np.arange(num_keys)[None, None, :] > last_visible[:, :, None]


@functools.lru_cache(maxsize=None)
def softmax_scale(head_dim: int) -> np.float32:
    """``1 / sqrt(head_dim)`` as float32, computed once per head size (numpy's scalar maths costs a microsecond
    a call, and the decode path needs it every layer)."""
    return np.float32(1.0 / np.sqrt(head_dim))


def hidden_bias(hidden: np.ndarray | None) -> np.ndarray | None:
    """:func:`causal_hidden_mask`'s ``[S, Q, T]`` as an additive float32 mask ``[S, 1, 1, Q, T]``: ``-inf`` where
    a key is hidden, 0 elsewhere (None stays None). Adding it to the scores is one contiguous broadcast add — about
    half the cost of ``np.copyto(..., where=hidden)`` — with the same result (``x + -inf == -inf`` for finite x)."""
    if hidden is None:
        return None
    bias = np.zeros(hidden.shape, dtype=np.float32)
    bias[hidden] = -np.inf
    return bias[:, None, None]


def _decode_bias(seq_lens: np.ndarray, num_keys: int) -> np.ndarray | None:
    """:func:`hidden_bias` of decode queries (sequence ``i`` sees keys ``0 .. seq_lens[i] - 1``), ``[S, 1, 1, 1,
    num_keys]``, made with one comparison instead of the general causal mask; None when every key is seen."""
    if int(seq_lens.min()) >= num_keys:
        return None
    bias = np.where(np.arange(num_keys) < seq_lens[:, None], np.float32(0.0), np.float32(-np.inf))
    return bias[:, None, None, None]


def batched_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    hidden: np.ndarray | None = None,
    out: np.ndarray | None = None,
    bias: np.ndarray | None = None,
) -> np.ndarray:
    """Causal GQA attention for S sequences over *contiguous* per-sequence K/V, padded to a common length.

    ``q [S, Q, Hq, D]``, ``k, v [S, T, Hkv, D]``; the keys each query must not see are given either as
    ``hidden [S, Q, T]`` from :func:`causal_hidden_mask` or as its additive form ``bias`` from :func:`hidden_bias`
    (cheaper; the paged kernel makes it once per step); neither: no mask. Query head ``h`` reads KV head
    ``h // (Hq // Hkv)``. Returns ``[S, Q, Hq, D]`` (into ``out`` if given).

    This is the dense baseline *and* the inner kernel of paged attention: the paged path only differs in how
    ``k, v`` were produced (gathered from blocks), so paged == dense holds by construction and the benchmark's
    ratio measures the cost of paging alone.
    """
    s, qn, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    if bias is None and hidden is not None:
        bias = hidden_bias(hidden)
    scale = softmax_scale(d)
    # [S, Hkv, G*Q, D]: query heads sharing a KV head become extra rows of one matmul (GQA without repeating K/V);
    # the softmax scale is folded into q, the smallest operand.
    if qn == 1:
        qg = q.reshape(s, hkv, group, d) * scale
        if out is None:
            out = np.empty((s, 1, hq, d), dtype=np.float32)
        return _decode_attention(qg, k, v, bias, out.reshape(s, hkv, group, d)).reshape(s, 1, hq, d)
    qg = (q * scale).reshape(s, qn, hkv, group, d).transpose(0, 2, 3, 1, 4).reshape(s, hkv, group * qn, d)
    t = k.shape[1]
    scores = np.matmul(qg, k.transpose(0, 2, 3, 1))  # [S, Hkv, G*Q, T]; matmul reads each head's K [T, D] in place
    if bias is not None:
        s5 = scores.reshape(s, hkv, group, qn, t)
        np.add(s5, bias, out=s5)
    sums = _exp_rows(scores)
    o = np.matmul(scores, v.transpose(0, 2, 1, 3))  # [S, Hkv, G*Q, D], unnormalised
    o /= sums
    res = o.reshape(s, hkv, group, qn, d).transpose(0, 3, 1, 2, 4).reshape(s, qn, hq, d)
    if out is None:
        return res
    out[...] = res
    return out


def _exp_rows(scores: np.ndarray) -> np.ndarray:
    """The softmax numerator in place: ``scores = exp(scores - rowmax)``; returns the row sums ``[..., 1]``.

    The division by the sum is left to the caller, who applies it to the attention *output* (``[.., D]`` per
    row instead of ``[.., T]``): ``(p / s) @ V == (p @ V) / s`` up to float32 rounding. One max and one sum
    reduction per call, over every sequence and head of the batch at once.

    The row maximum is ``np.fmax.reduce``, not ``max``: over the short rows of a decode batch (64 rows of 32 keys)
    it is ~30 % cheaper, because it need not check every element for NaN. The result is the same maximum; a NaN
    score (from a NaN in Q or K) still reaches the output through ``exp`` and the sum, and a row masked to
    ``-inf`` throughout gives ``-inf`` with either.
    """
    scores -= np.fmax.reduce(scores, axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    return np.add.reduce(scores, axis=-1, keepdims=True)


def _decode_attention(
    qg: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | None, out: np.ndarray
) -> np.ndarray:
    """Decode attention, one query per sequence: ``qg [S, Hkv, G, D]`` (already scaled), ``k, v [S, T, Hkv, D]``,
    ``bias [S, 1, 1, 1, T]`` or None; writes ``out [S, Hkv, G, D]``.

    Below ``MATVEC_MIN_KEYS`` keys: ``q [G, D] @ Kᵀ [D, T]`` per sequence and head (matrix-matrix). From there,
    matrix-vector products, ``scores[g] = K [T, D] @ q[g]``, ``out[g] = p[g] @ V [T, D]``: BLAS reads each head's
    K and V where they lie (in a gathered tile or a run of the pool, each head's ``[T, D]`` is contiguous),
    with no packing. The same dot products, so the two forms agree
    to float32 rounding (5e-7 in the tests). (``K @ qᵀ`` with K as the left operand of a matrix-matrix product was
    also tried: fast at head dim 64, no faster than ``q @ Kᵀ`` at head dim 48.)
    """
    s, hkv, group, d = qg.shape
    t = k.shape[1]
    if t >= MATVEC_MIN_KEYS:
        scores = np.matmul(k.transpose(0, 2, 1, 3)[:, :, None], qg[..., None])[..., 0]  # [S, Hkv, G, T]
    else:
        scores = np.matmul(qg, k.transpose(0, 2, 3, 1))  # [S, Hkv, G, T]
    if bias is not None:
        np.add(scores, bias.reshape(s, 1, 1, t), out=scores)
    sums = _exp_rows(scores)
    if t >= MATVEC_MIN_KEYS:
        np.matmul(scores[..., None, :], v.transpose(0, 2, 1, 3)[:, :, None], out=out[..., None, :])
    else:
        np.matmul(scores, v.transpose(0, 2, 1, 3), out=out)
    out /= sums
    return out


@dataclass
class Workspace:
    """A reused float32 scratch buffer (the gather target), grown on demand and never shrunk.

    Preallocating keeps the decode hot path free of large allocations: every step and layer gathers into the
    same memory, which is also what keeps it warm in cache.
    """

    buffer: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))
    named: dict = field(default_factory=dict)

    def get(self, size: int) -> np.ndarray:
        """A flat float32 view of at least ``size`` elements (the start of the buffer)."""
        if self.buffer.size < size:
            self.buffer = np.empty(size, dtype=np.float32)
        return self.buffer[:size]

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A reused float32 array of exactly ``shape`` (zero-filled when first made) for the in-place kernel."""
        arr = self.named.get(name)
        if arr is None or arr.shape != shape:
            arr = self.named[name] = np.zeros(shape, dtype=np.float32)
        return arr


def layer_storage(kv_layer: np.ndarray) -> np.ndarray:
    """A layer of ``KVPool.kv_cache`` (``[2, NB, B, H, D]``) as the memory under it: ``[2, H, NB, B, D]``, heads
    outermost (see :mod:`minienv.kv.kv_pool`). For a pool's layer this is a view; an array laid out another way
    (a token-major one made by hand, say) is copied into this order first — correct, and slow."""
    hm = kv_layer.transpose(0, 3, 1, 2, 4)
    return hm if hm.flags.c_contiguous else np.ascontiguousarray(hm)


def gather_kv(kv_layer: np.ndarray, block_tables: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """K and V of whole sequences, in logical order: ``[2, S, num_blocks * B, H, D]`` from a layer ``[2, NB, B,
    H, D]`` of the pool.

    One ``np.take`` on the block axis of the layer's storage copies whole blocks (``B*D`` contiguous floats per
    block and head) into ``out [2, H, S, num_blocks, B, D]``: per head and sequence one contiguous ``[tokens, D]``
    slab. The result is that buffer seen in logical order (a view). ``mode="clip"`` matters: with the default
    ``"raise"`` numpy routes ``out`` through an extra temporary copy.
    """
    s, nb = block_tables.shape
    _, _, b, h, d = kv_layer.shape
    if out is None:
        out = np.empty((2, h, s, nb, b, d), dtype=kv_layer.dtype)
    layer_storage(kv_layer).take(block_tables, axis=2, out=out, mode="clip")
    return out.reshape(2, h, s, nb * b, d).transpose(0, 2, 3, 1, 4)


@dataclass(eq=False)
class _Tile:
    """A group of sequences attended together (their gathered K/V fit in ``tile_bytes``): positions
    ``s0:s1`` of the step's tile order (:class:`TilePlan`), i.e. the step's sequences ``order[s0:s1]``.

    A decode tile of *one* sequence needs no mask: it attends over the first ``num_keys`` (its length) of its
    keys — a view — instead of over every slot of its blocks with ``-inf`` added past its length. The two agree to
    float32 rounding, not bit for bit: masked keys add exact zeros to the softmax sum and to ``p @ V``, but a
    shorter row changes how BLAS and numpy's pairwise sum split it (the property tests hold both to 1e-5 of dense).

    Everything but ``bias`` and ``num_keys`` depends only on the block tables and the blocks per sequence; those
    two depend on the sequence lengths too, and are what :func:`refresh_decode_plan` rewrites when a decode plan
    is carried to the next step.
    """

    s0: int
    s1: int
    block_tables: np.ndarray  # [n, nb], trimmed to the blocks these sequences use
    gather_buf: np.ndarray  # [2, Hkv, n, nb, B, D] view of the workspace: np.take writes here
    kv: np.ndarray  # the same memory seen as [2, n, nb*B, Hkv, D]: per sequence and head contiguous K and V
    bias: np.ndarray | None  # additive causal / length mask [n, 1, 1, Q, nb*B] (hidden_bias), None: no mask
    run_start: int | None = None  # one sequence whose blocks are physically consecutive: view them, no copy
    num_keys: int | None = None  # a lone decode: its length (attend over that many keys, no mask); None: nb*B

    def kv_of(self, storage: np.ndarray) -> np.ndarray:
        """This tile's K and V ``[2, n, T, Hkv, D]`` from the layer's ``storage [2, Hkv, NB, B, D]``
        (:func:`layer_storage`): a view of the pool for a run, else gathered (one take). ``T`` is ``nb*B``, or a
        lone decode's ``num_keys`` (a view of the first keys)."""
        if self.run_start is not None:
            h, _, nb, b, d = self.gather_buf.shape[1:]
            first = self.run_start * b  # the run as a range of the pool's token slots
            last = first + (nb * b if self.num_keys is None else self.num_keys)
            return storage.reshape(2, h, -1, d)[:, :, first:last].transpose(0, 2, 1, 3)[:, None]
        # = gather_kv. Here and on every per-layer path, ``x.take(...)``, not ``np.take(x, ...)``: the function is a
        # Python wrapper around the method, a microsecond a call at ~18 calls a step at batch 16.
        storage.take(self.block_tables, axis=2, out=self.gather_buf, mode="clip")
        return self.kv if self.num_keys is None else self.kv[:, :, :self.num_keys]


@dataclass(frozen=True)
class TilePlan:
    """How a step's sequences are walked, planned once per step and reused by every layer.

    Sequences decoding one token (the ``decode`` group) and sequences with a prefill chunk (the ``prefill``
    group) are attended separately: a mixed step would otherwise pad every decode's single query to the longest
    chunk (a 64-token chunk among 15 decodes made 16 x 64 query rows for 79 real ones). Decode tiles index
    positions of ``decode_rows``, prefill tiles positions of ``prefill_seqs``.

    A decode group too big for one tile is walked *shortest first*: each tile pads its sequences only to its
    own longest, so a batch of mixed lengths gathers (and attends over) fewer padding blocks than tiles of
    consecutive sequences, which each pad to whatever long sequence they happen to contain.
    """

    decode_tiles: list[_Tile]
    prefill_tiles: list[_Tile]
    use_views: bool  # every tile a contiguous run of the pool: no copy at all
    #: the step's token rows of the decode group, in tile order; None: the step is all decodes, in its own order
    decode_rows: np.ndarray | None
    #: a step of decodes only, walked in another order: ``out = take(tile-order out, decode_inverse)``
    decode_inverse: np.ndarray | None
    prefill_seqs: np.ndarray  # sequences of the prefill group, in tile order
    prefill_rows: np.ndarray  # the step's token rows of the prefill group ...
    prefill_pad: tuple[np.ndarray, np.ndarray]  # ... and where each sits in the padded [P, max_q] query block
    prefill_max_q: int

    @property
    def tiles(self) -> list[_Tile]:
        return self.decode_tiles + self.prefill_tiles


def _tile_bounds(nbs: np.ndarray, per_block: int, tile_bytes: int, ascending: bool) -> list[tuple[int, int]]:
    """Tiles of consecutive entries of ``nbs`` (blocks per sequence, in tile order), each as many sequences as
    keep ``n * max(nbs in tile) * per_block`` within ``tile_bytes`` (at least one)."""
    s = len(nbs)
    if not ascending:  # one tile size for all, from the longest sequence
        step = max(1, min(s, tile_bytes // (int(nbs.max()) * per_block)))
        return [(s0, min(s, s0 + step)) for s0 in range(0, s, step)]
    bounds, s0 = [], 0
    for j, nb in enumerate(nbs.tolist()):  # ascending: a tile's longest is its last
        if j > s0 and (j - s0 + 1) * nb * per_block > tile_bytes:
            bounds.append((s0, j))
            s0 = j
    bounds.append((s0, s))
    return bounds


def _plan_group(meta: PagedAttentionMetadata, seqs: np.ndarray | None, sort: bool, hkv: int, d: int, tile_bytes: int) -> tuple[np.ndarray | None, list[tuple]]:
    """Tiles of one group of sequences (``seqs``; None: all, in order): ``(order, [(s0, s1, idx, nb), ...])``.
    ``order`` is the group's sequences in tile order when sorted by length (else None); ``idx`` selects a tile's
    sequences from the metadata's arrays."""
    b = meta.block_size
    per_block = 2 * b * hkv * d * 4
    nbs = -(-(meta.seq_lens if seqs is None else meta.seq_lens[seqs]) // b)
    order = None
    if sort and len(nbs) > 1 and len(nbs) * int(nbs.max()) * per_block > tile_bytes:
        perm = np.argsort(nbs, kind="stable")
        order = perm if seqs is None else seqs[perm]
        nbs = nbs[perm]
    ids = order if order is not None else seqs
    tiles = []
    for s0, s1 in _tile_bounds(nbs, per_block, tile_bytes, ascending=order is not None):
        tiles.append((s0, s1, slice(s0, s1) if ids is None else ids[s0:s1], int(nbs[s0:s1].max())))
    return order, tiles


def plan_tiles(
    meta: PagedAttentionMetadata, num_kv_heads: int, head_dim: int, tile_bytes: int, workspace: Workspace
) -> TilePlan:
    """Split the step's sequences into tiles and precompute each tile's tables, buffers and mask.

    Done once per step (cached on the metadata): every layer of the model reuses it, so per-layer work is only
    gather + attention. A tile holds as many sequences as keep the gathered K+V within ``tile_bytes`` (at least
    one sequence per tile), so the copy is still in cache when attention reads it. Decodes and prefill chunks
    are planned as separate groups, decodes shortest first when they need several tiles (see :class:`TilePlan`).
    """
    b, hkv, d = meta.block_size, num_kv_heads, head_dim
    if meta.is_decode:
        order, decode = _plan_group(meta, None, True, hkv, d, tile_bytes)
        prefill = []
        decode_rows = inverse = order
        if order is not None:
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(order))
        pf_seqs = pf_rows = np.zeros(0, dtype=np.int64)
        pf_pad = (pf_rows, pf_rows)
        pf_max_q = 0
    else:
        single = meta.query_lens == 1
        d_seqs, pf_seqs = np.flatnonzero(single), np.flatnonzero(~single)
        decode = []
        decode_rows = inverse = None
        if len(d_seqs):
            order, decode = _plan_group(meta, d_seqs, True, hkv, d, tile_bytes)
            decode_rows = meta.query_start_loc[order if order is not None else d_seqs]
        pf_max_q = int(meta.query_lens[pf_seqs].max())
        _, prefill = _plan_group(meta, pf_seqs, False, hkv, d, tile_bytes)
        # the prefill group's tokens, and where each lands in the padded [P, max_q] query block
        pf_tok = np.flatnonzero(~single[meta.token_seq_idx])
        pos_in_group = np.empty(meta.num_seqs, dtype=np.int64)
        pos_in_group[pf_seqs] = np.arange(len(pf_seqs))
        pf_rows = pf_tok
        pf_pad = (pos_in_group[meta.token_seq_idx[pf_tok]], meta.token_row[pf_tok])
    groups = [(t, 1) for t in decode] + [(t, pf_max_q) for t in prefill]
    per_block_floats = 2 * b * hkv * d
    flat = workspace.get(max((s1 - s0) * nb * per_block_floats for (s0, s1, _, nb), _ in groups))
    made = []
    for (s0, s1, idx, nb), max_q in groups:  # once per step, one iteration per tile
        n = s1 - s0
        buf = flat[: n * nb * per_block_floats].reshape(2, hkv, n, nb, b, d)
        num_keys = None
        if max_q == 1 and n == 1:  # a lone decode: it sees its first seq_len keys, a view (no mask at all)
            bias, num_keys = None, int(meta.seq_lens[idx][0])
        elif max_q == 1:  # decodes: each sees a prefix of its keys, its seq_len (the general mask, made directly)
            bias = _decode_bias(meta.seq_lens[idx], nb * b)
        else:
            bias = hidden_bias(causal_hidden_mask(meta.context_lens[idx], meta.query_lens[idx], max_q, nb * b))
        table = np.ascontiguousarray(meta.block_tables[idx, :nb])
        # A lone sequence whose blocks are consecutive physical ids (typical after a prefill from a fresh pool)
        # is already a contiguous slab of the pool: no gather needed. (Last - first == nb - 1 first: O(1).)
        run = n == 1 and int(table[0, -1]) - int(table[0, 0]) == nb - 1 and bool(np.all(np.diff(table[0]) == 1))
        made.append(_Tile(s0, s1, table, buf, buf.reshape(2, hkv, n, nb * b, d).transpose(0, 2, 3, 1, 4), bias,
                          int(table[0, 0]) if run else None, num_keys))
    nd = len(decode)
    return TilePlan(made[:nd], made[nd:], all(t.run_start is not None for t in made), decode_rows, inverse,
                    pf_seqs, pf_rows, pf_pad, pf_max_q)


def refresh_decode_plan(plan: TilePlan, old_seq_lens: np.ndarray, new_seq_lens: np.ndarray) -> None:
    """Bring a decode step's plan up to date for a later decode step over *the same block tables and the same
    number of blocks per sequence*, whose sequences are now ``new_seq_lens`` long (in place).

    Tiles, tile order, gather buffers and runs depend only on the tables and the blocks per sequence, so they
    stay; only each tile's length mask changes (a lone sequence's tile: its key count). In a steady batch every
    sequence grew by one token: the newly visible key of each sequence is one column of the mask, set to 0. Any
    other change (a sequence rolled back, say) rebuilds the tile's mask (:func:`_decode_bias`). Either way the
    tile equals a fresh plan's, so the step's result is bit-identical to planning it from scratch.
    """
    grew_by_one = None  # computed for the first tile with a mask
    for tile in plan.decode_tiles:
        idx = slice(tile.s0, tile.s1) if plan.decode_rows is None else plan.decode_rows[tile.s0:tile.s1]
        if tile.num_keys is not None:
            tile.num_keys = int(new_seq_lens[idx][0])
            continue
        num_keys = tile.kv.shape[2]
        if grew_by_one is None:
            grew_by_one = _same_ints(new_seq_lens, old_seq_lens + 1)
        if grew_by_one and tile.bias is not None and int(new_seq_lens[idx].min()) < num_keys:
            n = tile.s1 - tile.s0
            tile.bias.reshape(n, num_keys)[np.arange(n), old_seq_lens[idx]] = 0.0  # the key each one now sees
        else:
            tile.bias = _decode_bias(new_seq_lens[idx], num_keys)


@dataclass(frozen=True)
class _InplacePlan:
    """Index arrays of the in-place decode kernel for one step (built once, reused by every layer).

    The kernel works on the pool range ``[lo, lo + span)``, which holds every block of the step, in *pool order*.
    ``owner[r]`` is the sequence whose query block ``lo + r`` meets (0 for blocks of other requests inside the
    range: they are masked out). ``hidden [span, 1, 1, B]`` marks slots that are not a live token of their
    block's owner (other requests' blocks, the unfilled tail of each last block), or None if there are none.
    ``seq_blocks [S, max_blocks]`` lists each sequence's blocks relative to ``lo``, padded with ``span`` (an extra
    row of the per-block buffers that is neutral for the reduction). ``onehot [S, span]`` (small steps only) sums
    block outputs per sequence with one matmul.
    """

    lo: int
    span: int
    owner: np.ndarray
    hidden: np.ndarray | None
    seq_blocks: np.ndarray
    onehot: np.ndarray | None


def _mean_keys_at_least(meta: PagedAttentionMetadata, keys: int) -> bool:
    """``mean(seq_lens) >= keys``, asked as ``sum >= keys * S`` in integers: the same answer without ``np.mean``'s
    Python wrapper, which costs several microseconds a step at decode sizes."""
    return int(np.add.reduce(meta.seq_lens)) >= keys * len(meta.seq_lens)


def plan_inplace(meta: PagedAttentionMetadata, force: bool = False) -> _InplacePlan | None:
    """The in-place plan for a decode step, or None when the gather kernel should run instead.

    Not eligible: prefill chunks (several queries per sequence), and blocks shared by two sequences (a block has
    one owner query here; prefix sharing uses the gather kernel). Not worth it unless ``force``: small steps, and
    steps whose blocks are spread over a much larger range of the pool.
    """
    if not meta.is_decode:
        return None
    # the cheap test first (O(sequences)): auto asks for this plan only when it expects in place to win
    if not force and not _mean_keys_at_least(meta, INPLACE_MIN_MEAN_KEYS):
        return None
    b = meta.block_size
    s = meta.num_seqs
    nbs = -(-meta.seq_lens // b)
    max_blocks = int(nbs.max())
    valid = np.arange(max_blocks)[None, :] < nbs[:, None]
    blk_seq, blk_j = np.nonzero(valid)
    ids = meta.block_tables[blk_seq, blk_j]
    lo, hi = int(ids.min()), int(ids.max()) + 1
    span = hi - lo
    if not force and span > INPLACE_MAX_SPAN_RATIO * len(ids):
        return None
    if np.bincount(ids - lo, minlength=span).max() > 1:  # a shared block (O(blocks + span), no sort)
        return None
    rel = ids - lo
    owner = np.zeros(span, dtype=np.int64)
    owner[rel] = blk_seq
    live = np.zeros((span, b), dtype=bool)  # slot holds a token of its block's owner
    live[rel] = (blk_j[:, None] * b + np.arange(b)[None, :]) < meta.seq_lens[blk_seq][:, None]
    hidden = None if live.all() else ~live[:, None, None, :]
    seq_blocks = np.full((s, max_blocks), span, dtype=np.int64)
    seq_blocks[blk_seq, blk_j] = rel
    onehot = None
    if s <= 8:  # few sequences: one small matmul sums block outputs per sequence, cheaper than gather + sum
        onehot = np.zeros((s, span), dtype=np.float32)
        onehot[blk_seq, rel] = 1.0
    return _InplacePlan(lo, span, owner, hidden, seq_blocks, onehot)


def _max_last_axis(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``x.max(axis=-1)`` into ``out``, by halving: elementwise maxima of the two halves until one column is left.

    The in-place kernel's last axis is one block (16 slots): numpy's reduction over a short last axis pays a
    per-row cost that made this the kernel's most expensive step after the two matmuls; ``log2(B)`` elementwise
    ``np.maximum`` calls over whole arrays are several times cheaper. Same result (max is exact).
    """
    m = x
    n = m.shape[-1]
    while n > 1:
        h = n // 2
        nxt = np.maximum(m[..., :h], m[..., h:2 * h])
        if n % 2:  # an odd column out: fold it into the first
            np.maximum(nxt[..., 0], m[..., 2 * h], out=nxt[..., 0])
        m, n = nxt, h
    out[...] = m[..., 0]
    return out


_ONES: dict[int, np.ndarray] = {}


def _ones(n: int) -> np.ndarray:
    """A cached float32 vector of ``n`` ones (row sums as one matrix-vector product)."""
    v = _ONES.get(n)
    if v is None:
        v = _ONES[n] = np.ones(n, dtype=np.float32)
    return v


def inplace_decode_attention(q: np.ndarray, kv_layer: np.ndarray, plan: _InplacePlan, workspace: Workspace) -> np.ndarray:
    """Decode attention reading every K/V block where it lies in the pool (no K/V copy). ``q [S, Hq, D]``.

    Attention is a sum over keys, so it splits by block and everything stays in pool order: each block's scores
    against its owner's query; each sequence's max and sum over its blocks (reductions over per-block partial
    maxima and sums — ``B`` times smaller than the scores); each block's unnormalised probabilities times its V;
    block outputs summed per sequence and divided by the sequence's sum.
    """
    s, hq, d = q.shape
    _, _, b, hkv, _ = kv_layer.shape
    g = hq // hkv
    span, lo = plan.span, plan.lo
    qg = q.reshape(s, hkv, g, d) * softmax_scale(d)
    q_blocks = qg.take(plan.owner, axis=0)  # each block's owner query [span, Hkv, G, D] (G/B of K's size)
    scores = workspace.array("scores", (span, hkv, g, b))
    np.matmul(q_blocks, kv_layer[0, lo:lo + span].transpose(0, 2, 3, 1), out=scores)  # K read in place
    if plan.hidden is not None:
        np.copyto(scores, np.float32(-np.inf), where=plan.hidden)
    block_max = workspace.array("block_max", (span + 1, hkv, g))
    block_max[span] = -np.inf  # padding row: neutral for max
    _max_last_axis(scores, block_max[:span])
    seq_max = np.maximum.reduce(block_max.take(plan.seq_blocks, axis=0), axis=1)  # [S, Hkv, G]
    scores -= seq_max.take(plan.owner, axis=0)[..., None]
    np.exp(scores, out=scores)
    block_sum = workspace.array("block_sum", (span + 1, hkv, g))
    block_sum[span] = 0.0  # padding row: neutral for sum
    np.matmul(scores, _ones(b), out=block_sum[:span])  # a matrix-vector product: the BLAS sums the rows
    seq_sum = np.add.reduce(block_sum.take(plan.seq_blocks, axis=0), axis=1)  # [S, Hkv, G]
    block_out = workspace.array("block_out", (span + 1, hkv, g, d))
    np.matmul(scores, kv_layer[1, lo:lo + span].transpose(0, 2, 1, 3), out=block_out[:span])  # V read in place
    if plan.onehot is not None:
        out = (plan.onehot @ block_out[:span].reshape(span, hq * d)).reshape(s, hkv, g, d)
    else:
        block_out[span] = 0.0  # padding row: neutral for sum
        out = np.add.reduce(block_out.take(plan.seq_blocks, axis=0), axis=1)  # [S, Hkv, G, D]
    out /= seq_sum[..., None]
    return out.reshape(s, hq, d)


def _tile_plan(meta: PagedAttentionMetadata, hkv: int, d: int, tile_bytes: int, workspace: Workspace) -> TilePlan:
    """The step's :class:`TilePlan` for this workspace, planned on first use and reused by every layer."""
    key = (hkv, d, tile_bytes, id(workspace))
    planned = meta._plans.get(key)
    if planned is None:
        planned = meta._plans[key] = plan_tiles(meta, hkv, d, tile_bytes, workspace)
    return planned


def _inplace_plan(meta: PagedAttentionMetadata, hkv: int, d: int, force: bool) -> _InplacePlan | None:
    key = ("inplace", force, hkv, d)
    if key not in meta._plans:
        meta._plans[key] = plan_inplace(meta, force)
    return meta._plans[key]


def _auto_choice(meta: PagedAttentionMetadata, hkv: int, d: int, use_views: bool) -> str:
    """``kernel="auto"``'s decision for a step, made once per step from facts that cost O(sequences).

    * every tile a contiguous run of the pool: "gather" (which then reads views: no copy, nothing to beat);
    * a decode step whose sequences average >= ``INPLACE_MIN_MEAN_KEYS`` keys, whose blocks are not shared and
      lie in a compact range: "inplace" (the in-place plan checks the last two; building it is the only
      O(blocks) work, and it is done only for such steps);
    * anything else: "gather".
    """
    key = ("auto", hkv, d, use_views)
    choice = meta._plans.get(key)
    if choice is None:
        choice = "gather"
        if not use_views and meta.is_decode and _mean_keys_at_least(meta, INPLACE_MIN_MEAN_KEYS):
            if _inplace_plan(meta, hkv, d, force=False) is not None:
                choice = "inplace"
        meta._plans[key] = choice
    return choice


def auto_kernel_of(meta: PagedAttentionMetadata, hkv: int, d: int, tile_bytes: int = DEFAULT_TILE_BYTES,
                   workspace: Workspace | None = None) -> str:
    """What ``kernel="auto"`` runs for this step: "views" (every tile a contiguous run: gather without a copy),
    "inplace" or "gather". For benchmarks and teaching; plans the step if it was not planned yet."""
    use_views = _tile_plan(meta, hkv, d, tile_bytes, workspace if workspace is not None else Workspace()).use_views
    return "views" if use_views else _auto_choice(meta, hkv, d, use_views)


def paged_attention(
    q: np.ndarray,
    kv_layer: np.ndarray,
    meta: PagedAttentionMetadata,
    workspace: Workspace | None = None,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    kernel: str = "auto",
) -> np.ndarray:
    """Attention of the step's new tokens ``q [N, Hq, D]`` over the K/V in ``kv_layer [2, NB, B, H, D]``.

    The new tokens' own K/V must already be written (the backend writes, then attends). Handles any mix of
    prefill chunks (causal, starting at ``context_lens``) and decodes. Returns ``[N, Hq, D]``.
    ``kernel``: "gather", "inplace" (decode steps without shared blocks; others fall back to gather) or "auto".
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    workspace = workspace if workspace is not None else Workspace()
    hkv, d = kv_layer.shape[3], q.shape[2]
    key = ("step", kernel, hkv, d, tile_bytes, id(workspace))  # the step's resolved kernel: one lookup per layer
    step = meta._plans.get(key)
    if step is None:
        step = meta._plans[key] = resolve_kernel(meta, hkv, d, tile_bytes, workspace, kernel)
    if step.lone_run is not None:  # batch 1 (run_kernel's first case, one Python frame sooner)
        return _attend_lone_run(q, *pool_run_views(kv_layer, *step.lone_run))
    return run_kernel(q, kv_layer, meta, step, workspace)


@dataclass(frozen=True)
class StepKernel:
    """What a step runs, decided once and reused by every layer: the gather kernel's tile plan, and the in-place
    kernel's plan when that kernel runs instead (else None).

    ``lone_run``: a step that is one sequence decoding over one physical run of blocks (a single request after
    its prefill, typically) is attention over the pool slots ``[first, last)`` — the step is then run with no
    plan, tile or group walk at all (:func:`_attend_lone_run`). Its per-call overhead is most of a short
    sequence's attention time, so this is worth a special case.
    """

    plan: TilePlan
    inplace: _InplacePlan | None
    lone_run: tuple[int, int] | None = None


def resolve_kernel(meta: PagedAttentionMetadata, hkv: int, d: int, tile_bytes: int, workspace: Workspace,
                   kernel: str) -> StepKernel:
    """The step's :class:`StepKernel` for ``kernel`` ("auto" decides here; an explicit "inplace" on a step it
    cannot run falls back to gather). Plans are cached on the metadata, so asking again costs two dict lookups."""
    plan = _tile_plan(meta, hkv, d, tile_bytes, workspace)
    chosen = _auto_choice(meta, hkv, d, plan.use_views) if kernel == "auto" else kernel
    # auto's in-place plan was built when it chose (force=False); an explicit "inplace" plans regardless of size
    inplace = _inplace_plan(meta, hkv, d, force=kernel == "inplace") if chosen == "inplace" else None
    return StepKernel(plan, inplace, lone_run_of(meta) if inplace is None else None)


def lone_run_of(meta: PagedAttentionMetadata, block_ids: np.ndarray | None = None) -> tuple[int, int] | None:
    """The pool slots ``[first, last)`` of a step that is one sequence decoding over one physical run of blocks
    (:class:`StepKernel`'s ``lone_run``; it needs no plan), else None. "The sequence's blocks are ``first, first +
    1, ...``" is one comparison of bytes with an ``arange``: ``block_ids``, one of at least the pool's block count
    that the backend keeps, or one made here."""
    if not meta.is_decode or len(meta.seq_lens) != 1:
        return None
    b = meta.block_size
    seq_len = int(meta.seq_lens[0])
    nb = (seq_len + b - 1) // b
    row = meta.block_tables[0, :nb]
    first = int(row[0])
    run = np.arange(first, first + nb, dtype=row.dtype) if block_ids is None else block_ids[first:first + nb]
    if row.dtype != run.dtype or row.tobytes() != run.tobytes():
        return None
    return first * b, first * b + seq_len


def run_kernel(q: np.ndarray, kv_layer: np.ndarray, meta: PagedAttentionMetadata, step: StepKernel,
               workspace: Workspace) -> np.ndarray:
    """One layer of :func:`paged_attention` with the step's kernel already resolved (:func:`resolve_kernel`)."""
    if step.lone_run is not None:
        return _attend_lone_run(q, *pool_run_views(kv_layer, *step.lone_run))
    if step.inplace is not None:
        return inplace_decode_attention(q, kv_layer, step.inplace, workspace)
    plan = step.plan
    n, hq, d = q.shape
    od = None
    storage = layer_storage(kv_layer)
    if plan.decode_tiles:  # one query per sequence: no padding
        od = _attend_decodes(q, storage, plan)
        if meta.is_decode:
            return od if plan.decode_inverse is None else od.take(plan.decode_inverse, axis=0)
    # a step with prefill chunks: its chunk queries padded to the longest chunk, causal masks per tile
    pos, row = plan.prefill_pad
    q_pad = np.zeros((len(plan.prefill_seqs), plan.prefill_max_q, hq, d), dtype=np.float32)
    q_pad[pos, row] = q[plan.prefill_rows]
    o_pad = np.empty(q_pad.shape, dtype=np.float32)
    for tile in plan.prefill_tiles:
        kv = tile.kv_of(storage)
        batched_attention(q_pad[tile.s0:tile.s1], kv[0], kv[1], out=o_pad[tile.s0:tile.s1], bias=tile.bias)
    out = np.empty((n, hq, d), dtype=np.float32)
    out[plan.prefill_rows] = o_pad[pos, row]
    if od is not None:
        out[plan.decode_rows] = od
    return out


def pool_run_views(kv_layer: np.ndarray, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """The pool's token slots ``[first, last)`` of a layer ``[2, NB, B, Hkv, D]`` seen per head, as views: K as
    ``[Hkv, D, T]`` (each head's Kᵀ, the right operand of ``q @ Kᵀ``) and V as ``[Hkv, T, D]``; each head's keys
    are one contiguous ``[T, D]`` slab of the pool's storage, as in a dense cache. (The backend slices the same
    views from :meth:`KVPool.head_views`, made once per layer.)"""
    _, _, _, hkv, d = kv_layer.shape
    kv = layer_storage(kv_layer).reshape(2, hkv, -1, d)[:, :, first:last]  # [2, Hkv, T, D]
    return kv[0].transpose(0, 2, 1), kv[1]


def _attend_lone_run(q: np.ndarray, k_t: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One sequence's decode over one physical run of the pool's slots: ``q [1, Hq, D]`` against the run's
    per-head views ``k_t [Hkv, D, T]`` and ``v [Hkv, T, D]`` (:func:`pool_run_views`); returns ``[1, Hq, D]``.

    K and V are read where they lie, and the maths is :func:`_decode_attention`'s for one sequence
    (matrix-matrix below ``MATVEC_MIN_KEYS`` keys, matrix-vector from there; :func:`_exp_rows`'
    softmax) written as the shortest run of numpy calls in one Python frame: no batch axis, no mask, no ``out``
    arrays. At a few hundred keys the work is a dozen small calls over data that has left the core's caches since
    the previous layer, and fixed costs dominate: with cold caches a numpy call or a Python function call costs
    one to a few microseconds, as much as the dense kernel's whole margin (``benchmarks/bench_paged.py``, batch
    1). The same dot products as the group walk over the same view (bit-equal in practice; the tests hold them
    within 2e-6).
    """
    _, hq, d = q.shape
    hkv, t, _ = v.shape
    qg = q.reshape(hkv, hq // hkv, d) * softmax_scale(d)  # [Hkv, G, D]
    if t < MATVEC_MIN_KEYS:
        scores = np.matmul(qg, k_t)  # [Hkv, G, T]
        scores -= np.fmax.reduce(scores, axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        o = np.matmul(scores, v)  # [Hkv, G, D], unnormalised
    else:  # K [T, D] @ q[g] and p[g] @ V: no packing of K or V (see MATVEC_MIN_KEYS)
        scores = np.matmul(k_t.transpose(0, 2, 1)[:, None], qg[..., None])[..., 0]  # [Hkv, G, T]
        scores -= np.fmax.reduce(scores, axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        o = np.matmul(scores[..., None, :], v[:, None])[..., 0, :]  # [Hkv, G, D], unnormalised
    o /= np.add.reduce(scores, axis=-1, keepdims=True)
    return o.reshape(1, hq, d)


def _attend_decodes(q: np.ndarray, storage: np.ndarray, plan: TilePlan) -> np.ndarray:
    """The decode group of a step: one query row per sequence, tile by tile, over the layer's ``storage [2, Hkv,
    NB, B, D]``. Returns ``[nd, Hq, D]`` in tile order (the step's order unless the group was sorted)."""
    _, hq, d = q.shape
    hkv = storage.shape[1]
    qd = q if plan.decode_rows is None else q.take(plan.decode_rows, axis=0)  # tile order
    nd = len(qd)
    qg = qd.reshape(nd, hkv, hq // hkv, d) * softmax_scale(d)  # scaled once for every tile
    od = np.empty_like(qg)
    tiles = plan.decode_tiles
    if len(tiles) == 1:  # the usual case: the whole group in one tile (no per-tile slices of q and out)
        kv = tiles[0].kv_of(storage)
        _decode_attention(qg, kv[0], kv[1], tiles[0].bias, od)
    else:  # the group's K/V outgrew the cache: shortest sequences first
        for tile in tiles:
            kv = tile.kv_of(storage)
            _decode_attention(qg[tile.s0:tile.s1], kv[0], kv[1], tile.bias, od[tile.s0:tile.s1])
    return od.reshape(nd, hq, d)


# ---------------------------------------------------------------------------------------------------- backend
@dataclass(eq=False)
class _CarriedPlan:
    """The last decode step's tile plan, and what it was planned for (see :class:`PagedAttentionBackend`)."""

    metadata: PagedAttentionMetadata  # the step that holds the plan (it gives it up when the plan is carried)
    block_tables: np.ndarray
    blocks_per_seq: np.ndarray
    seq_lens: np.ndarray  # what the plan's masks describe
    buffer: np.ndarray  # the workspace buffer its gather buffers are views of
    plan: TilePlan


class PagedAttentionBackend:
    """The model's attention backend over a :class:`KVPool` for a batch of sequences.

    Before each ``model.forward_step`` the caller sets the step's metadata (:meth:`set_metadata`); the model then
    calls ``begin_step`` (positions are checked against the metadata), ``attend`` per layer (write the new K/V
    through the slot mapping, then paged attention), and ``end_step``.

    **The plan is carried across decode steps.** Between two decode steps of a steady batch the block tables are
    usually equal — the same sequences in the same order on the same blocks — and only the sequence lengths grew
    by one. The backend then reuses the previous step's tile plan (tiles, tile order, gather buffers, runs) and
    only updates its length masks (:func:`refresh_decode_plan`), instead of planning again. The test is on
    *content* (``np.array_equal`` of the tables and of the blocks per sequence), never on identity, and the plan
    holds no K/V: copy-on-write or a rollback that changes what a block holds changes nothing the plan knows.
    Prefill and mixed steps, changed tables, a regrown workspace, or a step that did not finish (no
    ``end_step``) plan from scratch. ``reused_plans`` counts the steps that carried a plan.

    The step's kernel (:func:`resolve_kernel`: its tile plan, auto's choice, the in-place plan) is resolved by the
    first layer's ``attend`` and kept for the other layers, which go straight to :func:`run_kernel`. A step that
    is one sequence decoding over one physical run of blocks (a lone request, the common batch-1 case) is
    recognised in ``set_metadata`` without planning (:func:`lone_run_of`, one comparison of bytes): every layer's
    K/V are sliced from the pool's per-head views there, and nothing is planned or carried.
    """

    def __init__(self, kv_pool: KVPool, tile_bytes: int = DEFAULT_TILE_BYTES, kernel: str = "auto"):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.kv_pool = kv_pool
        self.tile_bytes = tile_bytes
        self.kernel = kernel
        self.workspace = Workspace()
        self.metadata: PagedAttentionMetadata | None = None
        self.reused_plans = 0
        self._carried: _CarriedPlan | None = None  # offered by the last step that ended
        self._carrying: _CarriedPlan | None = None  # taken by the current step
        self._step_kernel: StepKernel | None = None  # the current step's, resolved by its first attend
        self._lone_views: list | None = None  # a batch-1 step's run of K/V per layer (views), with its kernel
        # the key paged_attention files this backend's tile plan under in a step's metadata (see _tile_plan)
        self._plan_key = (kv_pool.num_kv_heads, kv_pool.head_dim, tile_bytes, id(self.workspace))
        self._block_ids = np.arange(kv_pool.num_blocks, dtype=np.int64)  # lone_run_of's "one run" test

    def set_metadata(self, metadata: PagedAttentionMetadata) -> None:
        if metadata.block_size != self.kv_pool.block_size:
            raise ValueError(f"metadata block size {metadata.block_size} != pool block size {self.kv_pool.block_size}")
        self.metadata = metadata
        self._step_kernel = self._lone_views = None
        carried, self._carried = self._carried, None  # carried at most once, and only by a step that ends
        self._carrying = None
        if self.kernel != "inplace":  # batch 1 over one run: every layer's K/V sliced now, nothing planned
            run = lone_run_of(metadata, self._block_ids)
            if run is not None:
                first, last = run
                self._lone_views = [(k_heads[:, :, first:last], v_heads[:, first:last]) for k_heads, v_heads
                                    in map(self.kv_pool.head_views, range(self.kv_pool.num_layers))]
                return
        if carried is not None and metadata.is_decode:
            self._carry(carried, metadata)

    def _carry(self, carried: _CarriedPlan, metadata: PagedAttentionMetadata) -> None:
        """Give this decode step the last decode step's plan if it was planned for the same block tables and
        blocks per sequence (compared by content), on the workspace buffer that is still the current one."""
        if self.workspace.buffer is not carried.buffer or self._plan_key in metadata._plans \
                or not _same_ints(metadata.block_tables, carried.block_tables) \
                or not _same_ints(_blocks_per_seq(metadata), carried.blocks_per_seq):
            return
        # the old step gives up what it planned (its masks now describe this step); asked again, it plans anew
        carried.metadata._plans.clear()
        refresh_decode_plan(carried.plan, carried.seq_lens, metadata.seq_lens)
        metadata._plans[self._plan_key] = carried.plan
        carried.metadata, carried.seq_lens = metadata, metadata.seq_lens.copy()  # what the masks now describe
        self._carrying = carried
        self.reused_plans += 1

    def begin_step(self, positions: np.ndarray) -> None:
        if self.metadata is None:
            raise RuntimeError("set_metadata(...) must be called before each step of a paged backend")
        # the engine passes the metadata's own array: nothing to compare (any other array is compared)
        if positions is not self.metadata.positions and not np.array_equal(np.asarray(positions),
                                                                            self.metadata.positions):
            raise ValueError("the model's positions disagree with the step metadata (context_lens / query_lens)")

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        meta = self.metadata
        self.kv_pool.write(layer_idx, meta.slot_mapping, k, v)
        if self._lone_views is not None:  # batch 1 over one run (set_metadata sliced every layer's K/V)
            return _attend_lone_run(q, *self._lone_views[layer_idx])
        step = self._step_kernel
        if step is None:  # the step's first layer decides for every layer (paged_attention would per call)
            step = self._step_kernel = resolve_kernel(meta, self.kv_pool.num_kv_heads, q.shape[2],
                                                      self.tile_bytes, self.workspace, self.kernel)
        return run_kernel(q, self.kv_pool.kv_cache[layer_idx], meta, step, self.workspace)

    def end_step(self) -> None:
        meta = self.metadata
        if self._carrying is not None:  # offer the plan to the next step again
            self._carried = self._carrying
        elif meta is not None and meta.is_decode and self._plan_key in meta._plans:  # offer this step's plan
            # copies: a caller may refill its table array in place for the next step, and the comparison must
            # then see the old contents, not the same object
            self._carried = _CarriedPlan(meta, meta.block_tables.copy(), _blocks_per_seq(meta), meta.seq_lens.copy(),
                                         self.workspace.buffer, meta._plans[self._plan_key])
        self._carrying = None
        self.metadata = None  # metadata describes one step; reusing it by mistake would double-write slots
        self._step_kernel = self._lone_views = None


def _blocks_per_seq(meta: PagedAttentionMetadata) -> np.ndarray:
    return (meta.seq_lens + (meta.block_size - 1)) // meta.block_size  # ceil division: two numpy calls, not three


def _same_ints(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` for integer arrays: equal shape, dtype and content, compared as bytes (a step's tables
    are a few hundred bytes; this is a fraction of ``array_equal``'s fixed cost). Content, never identity."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()

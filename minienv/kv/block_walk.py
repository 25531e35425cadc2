"""The fused block walk: paged attention compiled with numba, reading K/V where they lie in the pool.

What vLLM's ``paged_attention_v1`` kernel does on a GPU (one thread block per sequence and head: every key's
logit into shared memory, their maximum and exps, then the weighted sum of V), written as plain loops in three
passes over the step:

1. **scores**: for every block a sequence holds, the dot product of its queries with each key of the block, read
   in place from ``KVPool.storage`` (per layer and head, block ``b`` is one contiguous ``[block_size, head_dim]``
   slab) into a ``[query, head, key]`` scratch row;
2. **softmax**: per query and head, the row's maximum, then ``exp(score - max)`` and their sum — one long loop
   per row, which LLVM vectorises (with :func:`exp_f32`, below);
3. **values**: for every block again, each key's weight times its V row, added to the output; the output is
   divided by the row's sum once at the end.

Nothing is copied. GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``; each key row is loaded once for the
whole group. Causality: a query at position ``p`` scores keys ``0..p`` only.

**Why three passes, not an online softmax** (a running max and sum folded block by block, as FlashAttention does
and as this kernel did before): with 16-key blocks the online form has loops of 16 — too short for LLVM's
vectoriser, which unrolls four 16-float vectors per iteration — so every ``exp`` was a scalar libm call, a quarter
of the kernel's time at 512 keys. A row of all a query's scores is long enough to vectorise.

**Walk order.** Passes 1 and 3 visit the step's (sequence, block) pairs sorted by *physical* block id, not sequence
by sequence: the sums are order-free, and reading the pool front to back keeps the CPU's hardware prefetchers
useful (sequence-major order jumps around the pool in 3 KB pieces and measured 2-3x slower here). Shared blocks
(a prefix hit, a fork) are simply visited once per sequence holding them.

numba is an optional extra (``pip install minienv[lab]`` brings it): :mod:`minienv.kv.paged_attention` imports
this module inside a ``try`` and falls back to its numpy kernel. ``cache=True`` keeps the compiled code on disk
(next to this file, or numba's per-user cache folder when the install is read-only; ``NUMBA_CACHE_DIR``
overrides), so only the first process of a machine compiles. Only top-level functions can be cached.
"""

from __future__ import annotations

import numba
import numpy as np

#: the float rewrites the kernel allows: reassociation lets LLVM vectorise the dot products and sums; no ``nnan`` /
#: ``ninf``, so a NaN or infinite score still reaches the output (the engine checks the logits for them)
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@numba.njit(cache=True, fastmath=_FASTMATH, error_model="numpy")
def exp_f32(x):
    """``exp(x)`` in float32 for ``x <= 0`` (a score minus its row's maximum), as arithmetic LLVM can vectorise.

    Why not ``np.exp``: numba lowers it to one call of libm's scalar ``expf`` per element; LLVM vectorises that
    only with Intel's SVML vector library, which the pip build of llvmlite does not link. This is the textbook
    method (Cephes' ``expf``): ``x = n ln2 + r`` with integer ``n`` and ``|r| <= ln2 / 2`` (``ln2`` split in two
    constants so ``n ln2`` stays exact), ``exp(r)`` by a degree-6 polynomial, and ``2**n`` built from the float's
    exponent bits. Within ~1e-7 relative of ``np.exp`` (tested); ``x < -87`` (where float32 ``exp`` leaves the
    normal range) gives 0; NaN stays NaN.
    """
    n = np.floor(max(x, np.float32(-87.0)) * np.float32(1.44269504) + np.float32(0.5))  # round(x / ln2)
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    two_n = np.int32((np.int32(n) + 127) << 23).view(np.float32)  # 2**n: n + 127 in the exponent field
    return np.float32(0.0) if x < np.float32(-87.0) else p * two_n


@numba.njit(cache=True, fastmath=_FASTMATH, error_model="numpy")
def block_walk(q, k_store, v_store, block_tables, context_lens, query_start, walk_seq, walk_blk, scale, out):
    """Paged attention of one layer: ``q [N, Hq, D]`` against ``k_store, v_store [Hkv, NB, B, D]`` (a layer of
    the pool's storage); writes ``out [N, Hq, D]``.

    Sequence ``s`` owns query rows ``query_start[s]:query_start[s + 1]``, at positions ``context_lens[s] + 0,
    1, ...``; a query at position ``p`` sees keys ``0..p``. The walk is ``(walk_seq[w], walk_blk[w])``: a
    sequence and one of its logical blocks, in physical-block order (:func:`walk_order`).
    """
    n, hq, d = q.shape
    hkv, _, bsz, _ = k_store.shape
    group = hq // hkv
    num_seqs = context_lens.shape[0]
    longest = 0
    for s in range(num_seqs):
        longest = max(longest, context_lens[s] + query_start[s + 1] - query_start[s])
    scores = np.empty((n, hq, longest), dtype=np.float32)
    # 1. scores, block by block in pool order; each key row read once for its group of query heads
    for h in range(hkv):
        for w in range(walk_seq.shape[0]):
            seq, first_key = walk_seq[w], walk_blk[w] * bsz
            block = block_tables[seq, walk_blk[w]]
            q0 = query_start[seq]
            for i in range(q0, query_start[seq + 1]):
                nk = min(bsz, context_lens[seq] + (i - q0) + 1 - first_key)  # causal: keys up to the query
                for t in range(nk):
                    for g in range(group):
                        s = np.float32(0.0)
                        for c in range(d):
                            s += q[i, h * group + g, c] * k_store[h, block, t, c]
                        scores[i, h * group + g, first_key + t] = s * scale
    # 2. softmax weights of each (query, head) row, unnormalised; 1 / their sum kept for the end
    inv_sum = np.empty((n, hq), dtype=np.float32)
    for seq in range(num_seqs):
        q0 = query_start[seq]
        for i in range(q0, query_start[seq + 1]):
            nk = context_lens[seq] + (i - q0) + 1
            for hh in range(hq):
                top = scores[i, hh, 0]
                for t in range(1, nk):
                    top = max(top, scores[i, hh, t])
                total = np.float32(0.0)
                for t in range(nk):
                    e = exp_f32(scores[i, hh, t] - top)
                    scores[i, hh, t] = e
                    total += e
                inv_sum[i, hh] = np.float32(1.0) / total
    # 3. the weighted sum of V, block by block in pool order
    out[...] = 0.0
    for h in range(hkv):
        for w in range(walk_seq.shape[0]):
            seq, first_key = walk_seq[w], walk_blk[w] * bsz
            block = block_tables[seq, walk_blk[w]]
            q0 = query_start[seq]
            for i in range(q0, query_start[seq + 1]):
                nk = min(bsz, context_lens[seq] + (i - q0) + 1 - first_key)
                for g in range(group):
                    hh = h * group + g
                    for t in range(nk):
                        p = scores[i, hh, first_key + t]
                        for c in range(d):
                            out[i, hh, c] += p * v_store[h, block, t, c]
    for i in range(n):
        for hh in range(hq):
            for c in range(d):
                out[i, hh, c] *= inv_sum[i, hh]
    return out

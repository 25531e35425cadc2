"""The fused block walk: paged attention compiled with numba, reading K/V where they lie in the pool.

What vLLM's ``paged_attention_v1`` kernel does on a GPU, written as plain loops: for every block a sequence
holds, score its keys against the sequence's queries and fold them into an **online softmax** (a running maximum
``m``, a running sum ``l`` and an unnormalised output ``acc`` per query and head: a block with a larger maximum
rescales what came before by ``exp(m_old - m_new)``), then divide ``acc`` by ``l`` once at the end. Nothing is
copied: each block's K and V are read in place from ``KVPool.storage`` (per layer and head, block ``b`` is one
contiguous ``[block_size, head_dim]`` slab). GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``; each key
row is loaded once for the whole group.

**Walk order.** The walk visits the step's (sequence, block) pairs sorted by *physical* block id, not sequence by
sequence: the softmax is order-free, and reading the pool front to back keeps the CPU's hardware prefetchers
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

#: the float rewrites the kernel allows: reassociation lets LLVM vectorise the dot products; no ``nnan`` /
#: ``ninf``, so a NaN or infinite score still reaches the output (the engine checks the logits for them)
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


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
    m = np.full((n, hq), -np.inf, dtype=np.float32)
    l = np.zeros((n, hq), dtype=np.float32)
    acc = np.zeros((n, hq, d), dtype=np.float32)
    scores = np.empty((group, bsz), dtype=np.float32)
    for h in range(hkv):
        for w in range(walk_seq.shape[0]):
            seq = walk_seq[w]
            first_key = walk_blk[w] * bsz
            block = block_tables[seq, walk_blk[w]]
            q0 = query_start[seq]
            for i in range(q0, query_start[seq + 1]):
                nk = min(bsz, context_lens[seq] + (i - q0) + 1 - first_key)  # causal: keys up to the query
                if nk <= 0:
                    continue
                for t in range(nk):  # scores of this block's keys, each key row read once for the group
                    for g in range(group):
                        s = np.float32(0.0)
                        for c in range(d):
                            s += q[i, h * group + g, c] * k_store[h, block, t, c]
                        scores[g, t] = s * scale
                for g in range(group):
                    hh = h * group + g
                    m_blk = scores[g, 0]
                    for t in range(1, nk):
                        m_blk = max(m_blk, scores[g, t])
                    m_new = max(m[i, hh], m_blk)
                    alpha = np.exp(m[i, hh] - m_new)  # rescale what earlier blocks contributed
                    total = l[i, hh] * alpha
                    for c in range(d):
                        acc[i, hh, c] *= alpha
                    for t in range(nk):
                        p = np.exp(scores[g, t] - m_new)
                        total += p
                        for c in range(d):
                            acc[i, hh, c] += p * v_store[h, block, t, c]
                    m[i, hh] = m_new
                    l[i, hh] = total
    for i in range(n):
        for hh in range(hq):
            inv = np.float32(1.0) / l[i, hh]
            for c in range(d):
                out[i, hh, c] = acc[i, hh, c] * inv
    return out

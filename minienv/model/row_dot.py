"""One token's projection compiled with numba: ``y = W @ x`` as one dot product per weight row.

A lone decode multiplies every weight matrix by a single column. That product has almost no arithmetic per byte
(two flops per float read), so its time is the time to stream ``W`` from memory — for SmolLM2-135M, 538 MB per
token. Measured on this project's 2-core machine (all 121 of its matrices, one pass, numpy on one BLAS thread):
numpy's ``W @ x`` (OpenBLAS ``sgemv`` on the ``[out, in]`` layout) took 37-40 ms, ``x @ W_t`` on a pre-transposed
copy 26 ms, and this loop 18-19 ms — faster than a 1 GiB ``np.sum`` reads memory (21 ms for the same bytes). Each weight row is read front to back, once, into one
accumulator: the simplest access pattern there is, and the one the CPU's prefetchers serve best.

numba is an optional extra (``pip install minienv[lab]`` brings it): :mod:`minienv.model.linear` imports this
module inside a ``try`` and falls back to ``np.matmul``. ``cache=True`` keeps the compiled code on disk, so only a
machine's first process compiles (about a second).
"""

from __future__ import annotations

import numba
import numpy as np

#: reassociation lets LLVM vectorise the dot product (several partial sums, added at the end); no ``nnan`` /
#: ``ninf``, so a NaN or an infinity in the weights or the activations still reaches the output
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


@numba.njit(cache=True, fastmath=_FASTMATH, error_model="numpy")
def row_dot(w, x, out):
    """``out[n] = sum_k w[n, k] * x[k]`` for ``w [N, K]`` (C-contiguous), ``x [K]``, ``out [N]`` (float32)."""
    n_rows, k_len = w.shape
    for n in range(n_rows):
        acc = np.float32(0.0)
        for k in range(k_len):
            acc += w[n, k] * x[k]
        out[n] = acc

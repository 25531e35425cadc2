"""Every projection of the model: ``Y = W @ X``, the weight as checkpoints store it times one column per token.

``W`` is ``[out, in]`` (``nn.Linear``'s and every checkpoint's layout) and the activations are **feature-major**,
``X [in, tokens]``: the math of the papers (``y = W x``), and the arrangement that suits a real model. Measured on
this project's 2-core machine, one BLAS thread, float32, SmolLM2-135M (weights read from DRAM): its LM head (the
tied embedding) took 27 ms at 16 tokens with ``W @ X`` against 38 ms with the row-major ``X @ W_t`` (``W_t``
pre-transposed); its other matrices are about even (84 vs 87 ms at 16 tokens, 64 vs 58 ms at 4); and one token
needs each weight's rows contiguous (below). The toy model's 8 MB of weights, which stay in the L3 cache, go the
other way: inside the engine ``X @ W_t`` runs its projections ~10 % faster (0–12 %, typically ~5 %, of a
``bench_engine`` run). One layout for both, chosen for the real model (``docs/BENCHMARKS.md``, sixth session).
(:mod:`minienv.model.llama` keeps the residual stream feature-major, and hands attention row-major copies of Q,
K and V.)

Two routes, chosen by the shape of the step and by what is installed — never by a machine-tuned size:

* several tokens (a prefill, a batch of decodes): ``np.matmul`` (BLAS ``sgemm``), whose arithmetic is the cost;
* one token (a lone decode, the common case of a chat): the product only streams ``W`` from memory, and the numba
  row-dot loop (:mod:`minienv.model.row_dot`) streams it ~2x as fast as numpy's ``sgemv`` on this layout (1.4x
  numpy's best, a pre-transposed copy): about the machine's full read bandwidth on a real model. Without numba,
  ``np.matmul``.
"""

from __future__ import annotations

import numpy as np

try:  # the optional kernel (the `lab` extra installs numba); any failure means: numpy's product
    from minienv.model.row_dot import row_dot as _row_dot
    NUMBA_MISSING: str | None = None
except Exception as exc:  # noqa: BLE001 - ImportError, or numba unable to set up its cache (a read-only home)
    _row_dot = None
    NUMBA_MISSING = f"{type(exc).__name__}: {exc}"


def linear(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out = w @ x`` for ``w [out, in]``, ``x [in, tokens]``, ``out [out, tokens]`` (float32, C-contiguous
    ``w`` and ``out``); returns ``out``.

    One token goes through the row-dot kernel when numba is installed; it reads ``x``'s only column, which must
    then be contiguous (any ``[in, 1]`` array is)."""
    if x.shape[1] == 1 and _row_dot is not None:
        _row_dot(w, x[:, 0], out[:, 0])
        return out
    return np.matmul(w, x, out=out)

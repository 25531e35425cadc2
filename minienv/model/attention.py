"""The attention *backend* seam, the vectorized causal-attention kernel, and the no-cache backend.

The model computes Q, K and V (RoPE already applied) and hands them to a backend; the backend decides where K and V
live and which earlier tokens each query sees. That single seam is what lets the contiguous cache here, and the
paged cache of the next notebook, plug into the *same* model code: the model knows nothing about sequences,
blocks or caches. Per model step the model calls::

    backend.begin_step(positions)            # once, before layer 0: positions of the N tokens in this step
    backend.attend(layer_idx, q, k, v)       # once per layer -> [N, Hq, D]
    backend.end_step()                       # once, after the last layer: commit what was written

A batched step over many sequences flattens their tokens into one ``[N, ...]`` array; the backend is the one that
knows where each sequence starts and ends (see :class:`minienv.model.kv_cache.ContiguousBatch`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class AttentionBackend(Protocol):
    """Where K/V are stored and how causal attention over them is computed."""

    def begin_step(self, positions: np.ndarray) -> None:
        """Called once per model step, before layer 0, with the absolute positions ``[N]`` of the step's tokens."""

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Store this step's ``k, v [N, Hkv, D]`` for ``layer_idx`` and return causal attention ``[N, Hq, D]``.

        ``q``, ``k`` and ``v`` are views into the model's per-step scratch, valid only during this call (the next
        layer overwrites them): a backend copies what it keeps."""

    def end_step(self) -> None:
        """Called once after the last layer: the step's K/V are now part of the cache."""


def causal_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_positions: np.ndarray,
    k_positions: np.ndarray | None = None,
) -> np.ndarray:
    """Grouped-query scaled-dot-product attention where a query at position p sees keys at positions <= p.

    ``q [N, Hq, D]``, ``k, v [T, Hkv, D]``, ``q_positions [N]``, ``k_positions [T]`` (default ``0..T-1``).
    Query head ``h`` reads KV head ``h // (Hq // Hkv)`` — HF's ``repeat_kv`` layout — done with a reshape instead
    of copying K/V ``Hq // Hkv`` times. All heads and tokens in a handful of batched matmuls; float32 throughout.
    """
    n, hq, d = q.shape
    t, hkv, _ = k.shape
    group = hq // hkv
    if k_positions is None:
        k_positions = np.arange(t)
    # [Hkv, G, N, D] @ [Hkv, 1, D, T] -> [Hkv, G, N, T]
    qg = q.reshape(n, hkv, group, d).transpose(1, 2, 0, 3)
    scores = qg @ k.transpose(1, 2, 0)[:, None]
    scores *= np.float32(1.0 / np.sqrt(d))
    future = k_positions[None, :] > np.asarray(q_positions)[:, None]  # [N, T]
    if future.any():
        scores = np.where(future, np.float32(-np.inf), scores)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ v.transpose(1, 0, 2)[:, None]  # [Hkv, G, N, D]
    return out.transpose(2, 0, 1, 3).reshape(n, hq, d).astype(np.float32, copy=False)


class NoCache:
    """The backend of the dense reference: each step attends only among its own tokens and keeps nothing.

    ``LlamaModel.forward(ids)`` is ``forward_step(ids, arange(len(ids)), NoCache())``: the whole sequence in one
    step, so every token's K/V is recomputed every time — what generating *without* a KV cache costs.
    """

    def begin_step(self, positions: np.ndarray) -> None:
        self._positions = np.asarray(positions)

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        return causal_attention(q, k, v, self._positions, self._positions)

    def end_step(self) -> None:
        self._positions = None

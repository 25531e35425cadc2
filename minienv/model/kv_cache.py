"""The contiguous KV cache: one preallocated ``[layers, max_len, Hkv, D]`` slab per request.

This is the simplest cache that makes decoding cheap — token t's K and V are computed once, written at row t, and
read by every later token — and the one notebook 03 takes apart: each request reserves ``max_len`` rows up
front, whether it ends up using 20 of them or all of them. ``ContiguousBatch`` shows the seam carries batched
steps too: flattened tokens of several sequences, each sequence backed by its own contiguous cache.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minienv.model.attention import causal_attention
from minienv.model.config import LlamaConfig


class CacheFullError(RuntimeError):
    """The step would write past the cache's reserved ``max_len``."""


class ContiguousKVCache:
    """KV cache of one sequence: K and V arrays ``[num_layers, max_len, num_kv_heads, head_dim]`` plus a length.

    Rows ``[0, length)`` hold committed tokens. A step of N tokens must continue the sequence (positions
    ``length .. length+N-1``); each layer writes its K/V into the next N rows and attends over rows
    ``[0, length+N)`` with a causal mask; ``end_step`` commits the N rows.
    """

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: np.dtype = np.float32):
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        self.k = np.zeros(shape, dtype=dtype)
        self.v = np.zeros(shape, dtype=dtype)
        self.max_len = max_len
        self.length = 0
        self._pending = 0

    @classmethod
    def from_config(cls, config: LlamaConfig, max_len: int | None = None) -> "ContiguousKVCache":
        """A cache for ``config``'s model reserving ``max_len`` tokens (default: ``max_position_embeddings``)."""
        max_len = config.max_position_embeddings if max_len is None else max_len
        return cls(config.num_hidden_layers, max_len, config.num_key_value_heads, config.head_dim)

    # ------------------------------------------------------------------ memory accounting
    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved up front for ``max_len`` tokens (what the request holds whatever it uses)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def used_bytes(self) -> int:
        """Bytes that hold real token states."""
        return self.reserved_bytes * self.length // self.max_len

    # ------------------------------------------------------------------ the backend protocol
    def begin_step(self, positions: np.ndarray) -> None:
        positions = np.asarray(positions)
        n = len(positions)
        if n == 0:
            raise ValueError("a step needs at least one token")
        if positions[0] != self.length or (n > 1 and np.any(np.diff(positions) != 1)):
            raise ValueError(
                f"a contiguous cache holding {self.length} tokens must be continued at positions "
                f"{self.length}..{self.length + n - 1}, got {positions.tolist()[:8]}"
            )
        if self.length + n > self.max_len:
            raise CacheFullError(
                f"KV cache full: {self.length} cached + {n} new tokens > max_len {self.max_len}"
            )
        self._pending = n

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        start, end = self.length, self.length + self._pending
        if len(q) != self._pending:
            raise ValueError(f"attend got {len(q)} tokens but begin_step announced {self._pending}")
        self.k[layer_idx, start:end] = k
        self.v[layer_idx, start:end] = v
        return causal_attention(q, self.k[layer_idx, :end], self.v[layer_idx, :end], np.arange(start, end))

    def end_step(self) -> None:
        self.length += self._pending
        self._pending = 0

    # ------------------------------------------------------------------ bookkeeping
    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on (roll back, e.g. rejected speculative tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0
        self._pending = 0

    def __repr__(self) -> str:
        L, T, H, D = self.k.shape
        return f"ContiguousKVCache(layers={L}, max_len={T}, kv_heads={H}, head_dim={D}, length={self.length})"


class ContiguousBatch:
    """A backend for one batched step over several sequences, each with its own :class:`ContiguousKVCache`.

    The model sees one flat ``[N, ...]`` array of tokens; ``query_lens[i]`` says how many of them belong to
    ``caches[i]`` (a prefill chunk, or 1 for a decode). The projections, MLP and LM head run once for the whole
    batch; only attention is split per sequence, because each reads its own cache.
    """

    def __init__(self, caches: Sequence[ContiguousKVCache], query_lens: Sequence[int]):
        if len(caches) != len(query_lens):
            raise ValueError(f"{len(caches)} caches but {len(query_lens)} query lengths")
        if any(n < 1 for n in query_lens):
            raise ValueError(f"every sequence in a step needs >= 1 token, got query_lens={list(query_lens)}")
        self.caches = list(caches)
        self.query_lens = [int(n) for n in query_lens]
        self._splits = np.cumsum(self.query_lens)[:-1]

    def begin_step(self, positions: np.ndarray) -> None:
        positions = np.asarray(positions)
        if len(positions) != sum(self.query_lens):
            raise ValueError(f"{len(positions)} positions but query_lens sum to {sum(self.query_lens)}")
        for cache, pos in zip(self.caches, np.split(positions, self._splits)):
            cache.begin_step(pos)

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        parts = zip(self.caches, np.split(q, self._splits), np.split(k, self._splits), np.split(v, self._splits))
        return np.concatenate([c.attend(layer_idx, qi, ki, vi) for c, qi, ki, vi in parts], axis=0)

    def end_step(self) -> None:
        for cache in self.caches:
            cache.end_step()

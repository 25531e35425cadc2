"""The ceiling an engine is measured against: the model's forward pass over one fixed batch, with nothing around it.

:func:`bare_greedy` generates ``n_new`` greedy tokens for every prompt of a batch in the tightest loop this numpy
model allows — one batched ``forward_step`` per token, dense per-sequence K/V (:class:`DenseBatchDecode`), an
``argmax`` per row — and no engine: no scheduler, no block tables, no paging, no sampler, no detokenizer, no
outputs, no invariant checks, no admission or preemption. Whatever an engine adds to serve real traffic costs on
top of this, so its tokens/s is an upper bound for *any* engine running this model with numpy, and its BLAS share
is the largest a profile of such an engine can show. ``bench_engine.py`` part 3 times it next to the engine and
``transformers``; ``profile_engine.py --run ceiling`` samples it.

It computes the same logits as the engine to float32 rounding (the same model code; only the attention's K/V
live in a padded dense array instead of blocks), and its greedy tokens are checked against the engine's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from minienv.kv.paged_attention import batched_attention, hidden_bias
from minienv.model import LlamaModel, causal_attention


class DenseBatchDecode:
    """An attention backend for a fixed batch of S sequences: per layer, K and V in ``[S, T_max, Hkv, D]`` arrays
    (each sequence's keys contiguous from slot 0), the strongest dense layout for numpy's batched matmul.
    (minienv's own :class:`~minienv.model.kv_cache.ContiguousBatch` attends each sequence on its own, a loop of S
    calls per layer: a fair cache for ``generate``, too slow to bound an engine that batches attention.)

    The first step is the prefill (every prompt, flattened, each attended causally on its own); every later step
    is one decode token per sequence, written at slot ``lens[i]`` and attended over the first ``max(lens) + 1``
    slots with an additive mask hiding each shorter sequence's padding.
    """

    def __init__(self, model: LlamaModel, prompt_lens: Sequence[int], max_len: int):
        c = model.config
        shape = (c.num_hidden_layers, len(prompt_lens), max_len, c.num_key_value_heads, c.head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.prompt_lens = [int(n) for n in prompt_lens]
        self.lens = np.zeros(len(prompt_lens), dtype=np.int64)  # keys cached per sequence before this step
        self.rows = np.arange(len(prompt_lens))
        self._bias: np.ndarray | None = None
        self._num_keys = 0

    def begin_step(self, positions: np.ndarray) -> None:
        if self.lens.any():  # a decode step: every sequence gains one key
            self._num_keys = int(self.lens.max()) + 1
            seen = np.arange(self._num_keys) < (self.lens + 1)[:, None]
            self._bias = None if seen.all() else hidden_bias(~seen[:, None, :])

    def attend(self, layer_idx: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if not self.lens.any():  # the prefill: each prompt on its own, causal
            out = np.empty_like(q)
            start = 0
            for i, n in enumerate(self.prompt_lens):
                kc[i, :n], vc[i, :n] = k[start:start + n], v[start:start + n]
                out[start:start + n] = causal_attention(q[start:start + n], kc[i, :n], vc[i, :n], np.arange(n))
                start += n
            return out
        kc[self.rows, self.lens], vc[self.rows, self.lens] = k, v
        t = self._num_keys
        return batched_attention(q[:, None], kc[:, :t], vc[:, :t], bias=self._bias)[:, 0]

    def end_step(self) -> None:
        self.lens += np.array(self.prompt_lens) if not self.lens.any() else 1


def bare_greedy(model: LlamaModel, prompts: Sequence[Sequence[int]], n_new: int) -> list[list[int]]:
    """``n_new`` greedy tokens per prompt, the whole batch in lockstep: 1 prefill step + ``n_new - 1`` decodes."""
    lens = [len(p) for p in prompts]
    backend = DenseBatchDecode(model, lens, max(lens) + n_new)
    ids = np.fromiter((t for p in prompts for t in p), dtype=np.int64)
    positions = np.concatenate([np.arange(n) for n in lens])
    logits = model.forward_step(ids, positions, backend, logits_indices=np.cumsum(lens) - 1)
    out = np.empty((len(prompts), n_new), dtype=np.int64)
    for step in range(n_new):
        out[:, step] = tokens = logits.argmax(axis=-1)
        if step + 1 < n_new:
            logits = model.forward_step(tokens, backend.lens.copy(), backend)
    return out.tolist()

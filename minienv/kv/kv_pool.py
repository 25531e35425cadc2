"""The KV pool: preallocated K and V arrays holding every layer's blocks.

Memory is reserved once, from a token budget: ``num_blocks = kv_budget_tokens // block_size`` blocks of
``block_size`` token slots, written once at construction so its pages are really there before any step.
Physical memory never moves afterwards; sequences only change which blocks their block tables point at.

Layout: one float32 array ``kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0
is K, 1 is V — per layer this is vLLM v1's FlashAttention layout ``[2, num_blocks, block_size, H, D]``);
``k_cache`` and ``v_cache`` are views ``[num_layers, num_blocks, block_size, H, D]``. Why this way round:

* a block's slots are contiguous, so gathering a sequence's blocks is a copy of whole blocks, and one ``np.take``
  on the block axis of ``kv_cache[layer]`` fetches K *and* V together (one call instead of two on the decode
  hot path, where per-call overhead is a visible fraction of a small step);
* a flat view ``[num_blocks * block_size, H, D]`` addresses single token slots, so writing N new tokens is one
  vectorized scatter through the slot mapping;
* a gathered ``[seqs, blocks, block_size, H, D]`` reshapes for free into per-sequence ``[seqs, tokens, H, D]``,
  which matmul reads head by head without another copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from minienv.kv.errors import KVBudgetError


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise KVBudgetError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def num_blocks_for_budget(kv_budget_tokens: int, block_size: int) -> int:
    """``kv_budget_tokens // block_size``, refusing a budget that cannot hold even one block."""
    block_size = _positive_int("block_size", block_size)
    if isinstance(kv_budget_tokens, bool) or not isinstance(kv_budget_tokens, (int, np.integer)):
        raise KVBudgetError(f"kv_budget_tokens must be an int (a number of tokens), got {kv_budget_tokens!r}")
    if kv_budget_tokens < block_size:
        raise KVBudgetError(
            f"a KV budget of {kv_budget_tokens} tokens is smaller than one block of {block_size} tokens: "
            "the pool would hold no blocks. Raise kv_budget_tokens or lower block_size."
        )
    return int(kv_budget_tokens) // block_size


@dataclass(eq=False)
class KVPool:
    """Preallocated K/V storage for ``num_blocks`` blocks of ``block_size`` slots, for every layer.

    ``k_cache[layer]`` and ``v_cache[layer]`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``. Unused
    tokens of the budget (``kv_budget_tokens % block_size``) are simply not allocated.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_cache: np.ndarray = field(init=False, repr=False)
    _checked_slots: object = field(init=False, repr=False, compare=False, default=None)
    _slot_views: list = field(init=False, repr=False, compare=False, default_factory=list)
    _head_views: list = field(init=False, repr=False, compare=False, default_factory=list)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            setattr(self, name, _positive_int(name, getattr(self, name)))
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = np.zeros(shape, dtype=np.float32)
        # np.zeros only maps the memory: each page is faulted in (and zeroed by the kernel) the first time a step
        # writes into it, which made a fresh engine's early steps pay for the pool piece by piece (10 ms for one
        # layer's write in the first step of a 16-request run). Writing it once here reserves it for real, as the
        # module docstring says: the cost moves to construction and no step pays it.
        self.kv_cache.fill(0.0)
        self._make_slot_views()

    def _make_slot_views(self) -> None:
        """Per layer, K and V as ``[num_slots, H, D]`` views of ``kv_cache``: a step's write is then one
        first-axis scatter each."""
        slots = self.kv_cache.reshape(self.num_layers, 2, self.num_slots, self.num_kv_heads, self.head_dim)
        self._slot_views = [(slots[layer, 0], slots[layer, 1]) for layer in range(self.num_layers)]
        # the same per head: K as [H, D, num_slots] (Kᵀ per head), V as [H, num_slots, D] (see head_views)
        self._head_views = [(k.transpose(1, 2, 0), v.transpose(1, 0, 2)) for k, v in self._slot_views]

    def head_views(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer ``layer``'s K as ``[H, D, num_slots]`` and V as ``[H, num_slots, D]``: views of ``kv_cache``,
        made once, from which the paged attention backend slices a sequence whose blocks are one physical run
        (``paged_attention.pool_run_views`` makes the same slices from a layer array)."""
        views = self._head_views[layer]
        if views[1].base is not self.kv_cache:  # a copied pool (its views were copied apart from its array)
            self._make_slot_views()
            views = self._head_views[layer]
        return views

    @property
    def k_cache(self) -> np.ndarray:
        """K of every layer, ``[num_layers, num_blocks, block_size, H, D]`` (a view into ``kv_cache``)."""
        return self.kv_cache[:, 0]

    @property
    def v_cache(self) -> np.ndarray:
        """V of every layer, ``[num_layers, num_blocks, block_size, H, D]`` (a view into ``kv_cache``)."""
        return self.kv_cache[:, 1]

    @classmethod
    def from_budget(
        cls, kv_budget_tokens: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int
    ) -> "KVPool":
        """A pool of ``kv_budget_tokens // block_size`` blocks (a budget below one block is a KVBudgetError)."""
        return cls(num_layers, num_blocks_for_budget(kv_budget_tokens, block_size), block_size, num_kv_heads,
                   head_dim)

    @classmethod
    def for_model(cls, config, kv_budget_tokens: int, block_size: int) -> "KVPool":
        """A pool shaped for a :class:`~minienv.model.LlamaConfig` (layers, KV heads, head dim)."""
        return cls.from_budget(kv_budget_tokens, block_size, config.num_hidden_layers, config.num_key_value_heads,
                               config.head_dim)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.kv_cache.nbytes

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def write(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k, v [N, num_kv_heads, head_dim]`` of N new tokens at pool slots ``slot_mapping [N]``.

        One vectorized scatter per array through a flat ``[num_slots, H, D]`` view (vLLM's
        ``reshape_and_cache``). Slots must be distinct; the block table guarantees it for live tokens.
        """
        slots = np.asarray(slot_mapping)
        n = slots.shape[0]
        if k.shape != (n, self.num_kv_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(
                f"write expects k, v of shape ({n}, {self.num_kv_heads}, {self.head_dim}), got {k.shape}, {v.shape}"
            )
        # NOTE: a step writes every layer through one slot array; its range is checked on the first layer only.
        if slots is not self._checked_slots:
            if n and (slots.min() < 0 or slots.max() >= self.num_slots):
                raise IndexError(f"slot out of range [0, {self.num_slots}): {slots.min()}..{slots.max()}")
            self._checked_slots = slots
        k_slots, v_slots = self._slot_views[layer]
        if k_slots.base is not self.kv_cache:  # a copied pool (its views were copied apart from its array)
            self._make_slot_views()
            k_slots, v_slots = self._slot_views[layer]
        if n == 1:  # one token (a lone decode): a plain index, half the cost of a one-slot scatter
            one = int(slots[0])
            k_slots[one] = k[0]
            v_slots[one] = v[0]
        else:
            k_slots[slots] = k
            v_slots[slots] = v

    def copy_blocks(self, blocks_to_copy: Iterable[tuple[int, int]]) -> None:
        """Apply the KV cache manager's copy-on-write copies: block ``dst`` gets block ``src``'s K and V in every
        layer, in one fancy-indexed assignment (vLLM's ``copy_blocks`` kernel). Whole blocks: the slots past the
        shared tokens are overwritten before they are read."""
        pairs = list(blocks_to_copy)
        if pairs:
            src, dst = (np.fromiter(col, dtype=np.int64, count=len(pairs)) for col in zip(*pairs))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # [layers, 2 (K, V), blocks, B, H, D]

    def read_slots(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V ``[len(slots), H, D]`` at the given slots (for tests and notebooks)."""
        flat = self.kv_cache[layer].reshape(2, self.num_slots, self.num_kv_heads, self.head_dim)
        return flat[0, slots], flat[1, slots]

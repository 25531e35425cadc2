"""The KV pool: preallocated K and V arrays holding every layer's blocks.

Memory is reserved once, from a token budget: ``num_blocks = kv_budget_tokens // block_size`` blocks of
``block_size`` token slots, written once at construction so its pages are really there before any step.
Physical memory never moves afterwards; sequences only change which blocks their block tables point at.

Two views of one array. What callers index is ``kv_cache [num_layers, 2, num_blocks, block_size, H, D]`` (index
0 is K, 1 is V — per layer vLLM v1's FlashAttention order ``[2, num_blocks, block_size, H, D]``), with
``k_cache``/``v_cache`` its ``[num_layers, num_blocks, block_size, H, D]`` halves: block ``b``, slot ``s``, head
``h`` is ``kv_cache[layer, 0, b, s, h]``, and fancy indexing by block ids fetches whole blocks. In memory the
heads are outermost: ``storage [num_layers, 2, H, num_blocks, block_size, D]``, and ``kv_cache`` is a transposed
view of it (no copy). Why memory is laid out this way round:

* per layer and head, block ``b`` is one contiguous ``[block_size, D]`` slab, and a run of consecutive blocks one
  contiguous ``[tokens, D]`` slab — what the block walk reads in place, front to back (with heads innermost,
  vLLM's order, each head's keys would be ``H * D`` floats apart);
* gathering a sequence's blocks copies ``block_size * D`` contiguous floats per block and head, and the gathered
  tile is again one contiguous slab per head and sequence;
* a flat view ``[H, num_blocks * block_size, D]`` per layer addresses single token slots, so writing N new
  tokens is one vectorized scatter through the slot mapping.

The paged attention kernels take a layer of ``kv_cache`` and read its storage through
``kv_layer.transpose(0, 3, 1, 2, 4)`` (``[2, H, num_blocks, block_size, D]``, contiguous for a pool's layer).
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

    ``k_cache[layer]`` and ``v_cache[layer]`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` views of
    ``storage`` (heads outermost in memory; see the module docstring). Unused tokens of the budget
    (``kv_budget_tokens % block_size``) are simply not allocated.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    #: the memory: ``[num_layers, 2, H, num_blocks, block_size, D]`` (``kv_cache`` is this, transposed)
    storage: np.ndarray = field(init=False, repr=False)
    _checked_slots: object = field(init=False, repr=False, compare=False, default=None)
    _slot_views: list = field(init=False, repr=False, compare=False, default_factory=list)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            setattr(self, name, _positive_int(name, getattr(self, name)))
        shape = (self.num_layers, 2, self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)
        self.storage = np.zeros(shape, dtype=np.float32)
        # np.zeros only maps the memory: each page is faulted in (and zeroed by the kernel) the first time a step
        # writes into it, which made a fresh engine's early steps pay for the pool piece by piece (10 ms for one
        # layer's write in the first step of a 16-request run). Writing it once here reserves it for real, as the
        # module docstring says: the cost moves to construction and no step pays it.
        self.storage.fill(0.0)
        self._make_slot_views()

    def _make_slot_views(self) -> None:
        """Per layer, K and V as ``[H, num_slots, D]`` views of ``storage``: a step's write is then one scatter
        on the slot axis each."""
        slots = self.storage.reshape(self.num_layers, 2, self.num_kv_heads, self.num_slots, self.head_dim)
        self._slot_views = [(slots[layer, 0], slots[layer, 1]) for layer in range(self.num_layers)]

    def _views_of_this_pool(self) -> None:
        if self._slot_views[0][1].base is not self.storage:  # a copied pool (its views were copied apart from it)
            self._make_slot_views()

    @property
    def kv_cache(self) -> np.ndarray:
        """K and V of every layer, ``[num_layers, 2, num_blocks, block_size, H, D]`` (a view of ``storage``)."""
        return self.storage.transpose(0, 1, 3, 4, 2, 5)

    @property
    def k_cache(self) -> np.ndarray:
        """K of every layer, ``[num_layers, num_blocks, block_size, H, D]`` (a view of ``storage``)."""
        return self.kv_cache[:, 0]

    @property
    def v_cache(self) -> np.ndarray:
        """V of every layer, ``[num_layers, num_blocks, block_size, H, D]`` (a view of ``storage``)."""
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
        return self.storage.nbytes

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def write(self, layer: int, slot_mapping: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k, v [N, num_kv_heads, head_dim]`` of N new tokens at pool slots ``slot_mapping [N]``.

        One vectorized scatter per array through a flat ``[H, num_slots, D]`` view (vLLM's
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
        self._views_of_this_pool()
        k_slots, v_slots = self._slot_views[layer]  # [H, num_slots, D]
        if n == 1:  # one token (a lone decode): a plain index, half the cost of a one-slot scatter
            one = int(slots[0])
            k_slots[:, one] = k[0]
            v_slots[:, one] = v[0]
        else:
            k_slots[:, slots] = k.transpose(1, 0, 2)
            v_slots[:, slots] = v.transpose(1, 0, 2)

    def copy_blocks(self, blocks_to_copy: Iterable[tuple[int, int]]) -> None:
        """Apply the KV cache manager's copy-on-write copies: block ``dst`` gets block ``src``'s K and V in every
        layer, in one fancy-indexed assignment (vLLM's ``copy_blocks`` kernel). Whole blocks: the slots past the
        shared tokens are overwritten before they are read."""
        pairs = list(blocks_to_copy)
        if pairs:
            src, dst = (np.fromiter(col, dtype=np.int64, count=len(pairs)) for col in zip(*pairs))
            self.storage[:, :, :, dst] = self.storage[:, :, :, src]  # [layers, 2 (K, V), H, blocks, B, D]

    def read_slots(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V ``[len(slots), H, D]`` at the given slots (for tests and notebooks)."""
        self._views_of_this_pool()
        k_slots, v_slots = self._slot_views[layer]
        return k_slots[:, slots].transpose(1, 0, 2).copy(), v_slots[:, slots].transpose(1, 0, 2).copy()

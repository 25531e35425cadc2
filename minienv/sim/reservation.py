"""The Orca-style baselines of the vLLM paper (§6): a KV manager that *reserves* each request's whole future at
admission, as a contiguous-allocation engine must — the paged manager with one rule added.

A contiguous engine cannot grow a request's cache in place, so it reserves slots for the request's longest
possible life when it admits it. Three reservation sizes (notebook 03 measures their memory waste):

* ``reserve-max``    — the model's maximum sequence length, whatever the request;
* ``reserve-pow2``   — prompt + the output length rounded up to a power of two (at most 2x over-reserved);
* ``reserve-oracle`` — exactly prompt + output length (knows the future; the best a reservation can do).

Here the blocks still come from the real pool one at a time (the bookkeeping is the paged manager's), but an
admission is refused unless the reservations of every admitted request *plus this one* fit in the pool:
``sum(reservations) <= num_blocks``. Reserved-but-unwritten slots hold no tokens yet are unavailable to anyone
else — exactly the internal fragmentation a contiguous reservation has. A request never outgrows its reservation,
so it never needs a block that is not there, and is never preempted.
"""

from __future__ import annotations

from typing import Callable

from minienv.kv.block_table import cdiv
from minienv.kv.kv_cache_manager import KVCacheManager

LAYOUTS = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def reservation_tokens(layout: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Token slots ``layout`` reserves for a request (at most ``max_model_len``)."""
    if layout == "reserve-max":
        return max_model_len
    if layout == "reserve-pow2":
        return min(max_model_len, prompt_len + next_pow2(output_len))
    if layout == "reserve-oracle":
        return prompt_len + output_len
    raise ValueError(f"unknown reservation layout {layout!r}; known: {', '.join(LAYOUTS[1:])}")


class ReservationKVManager(KVCacheManager):
    """A :class:`KVCacheManager` that admits a request only if its whole reservation fits beside the others'.

    Args:
        reserve: ``reserve(request_id) -> token slots`` to reserve for that request (the trace knows its lengths).
    """

    def __init__(self, num_blocks: int, block_size: int, reserve: Callable[[str], int], **kwargs):
        super().__init__(num_blocks, block_size, **kwargs)
        self._reserve = reserve
        self.reserved: dict[str, int] = {}  # request id -> blocks reserved
        self.reserved_blocks = 0

    def allocate(self, request, num_new_tokens=None):
        need = cdiv(self._reserve(request.request_id), self.block_size)
        if self.reserved_blocks + need > self.num_blocks:
            return None
        alloc = super().allocate(request, num_new_tokens)
        if alloc is not None:
            self.reserved[request.request_id] = need
            self.reserved_blocks += need
        return alloc

    def free(self, request_id):
        released = super().free(request_id)
        self.reserved_blocks -= self.reserved.pop(request_id)
        return released

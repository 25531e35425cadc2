"""Two allocators for one linear address space of KV slots: how a system that gives each request one contiguous
chunk places it (notebook 03, :mod:`minienv.lab.memory_accounting`'s ``ContiguousMemory``).

* :class:`BuddyAllocator` — a binary buddy allocator, which the vLLM paper assumed Orca uses: every chunk is
  rounded up to a power of two and aligned to it.
* :class:`FirstFitAllocator` — the lowest-addressed hole that is large enough; freed chunks merge with their free
  neighbours.

Either way, the holes between live chunks are external fragmentation.
"""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n >= 1``)."""
    if n < 1:
        raise ValueError(f"next_pow2 needs n >= 1, got {n}")
    return 1 << (n - 1).bit_length()


class FirstFitAllocator:
    """Contiguous ranges of ``[0, size)``: first fit (lowest address), coalescing frees.

    Holes are kept as a list of ``[start, length]`` sorted by ``start``; it stays short (a handful of holes for
    a pool holding tens of requests), so linear scans are the readable choice.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.holes: list[list[int]] = [[0, size]]
        self.free_slots = size

    def allocate(self, n: int) -> int | None:
        """Start address of a new range of ``n`` slots, or ``None`` if no hole is large enough."""
        if n < 1:
            raise ValueError(f"allocation size must be >= 1, got {n}")
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                if length == n:
                    del self.holes[i]
                else:
                    self.holes[i] = [start + n, length - n]
                self.free_slots -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        """Return ``[start, start + n)``; merges with adjacent holes. Freeing free memory is an error."""
        if n < 1 or start < 0 or start + n > self.size:
            raise ValueError(f"range [{start}, {start + n}) is outside [0, {self.size})")
        i = 0
        while i < len(self.holes) and self.holes[i][0] < start:
            i += 1
        prev = self.holes[i - 1] if i > 0 else None
        nxt = self.holes[i] if i < len(self.holes) else None
        if (prev and prev[0] + prev[1] > start) or (nxt and start + n > nxt[0]):
            raise ValueError(f"range [{start}, {start + n}) overlaps free memory (double free?)")
        self.free_slots += n
        if prev and prev[0] + prev[1] == start:
            prev[1] += n
            if nxt and start + n == nxt[0]:
                prev[1] += nxt[1]
                del self.holes[i]
        elif nxt and start + n == nxt[0]:
            nxt[0] = start
            nxt[1] += n
        else:
            self.holes.insert(i, [start, n])

    def block_size(self, n: int) -> int:
        """Slots a request for ``n`` slots actually occupies (exactly ``n``)."""
        return n

    def largest_hole(self) -> int:
        return max((length for _, length in self.holes), default=0)


class BuddyAllocator:
    """A binary buddy allocator over ``[0, size)``: every range is a power of two, aligned to its size.

    A request for ``n`` slots takes a block of ``next_pow2(n)`` (the rest of the block is the allocator's
    rounding waste); a larger free block is split in halves ("buddies") as needed, and a freed block merges
    with its buddy whenever both are free. A ``size`` that is not a power of two is covered by its binary
    decomposition (largest region first, so each region is aligned to its own size); blocks never merge
    across regions. The vLLM paper assumed Orca places KV caches with a buddy allocator.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.free_slots = size
        self._free: dict[int, set[int]] = {}  # order -> start addresses of free blocks of 2**order slots
        self._region_order: list[tuple[int, int]] = []  # (start, order) of the top-level regions
        self._allocated: dict[int, int] = {}  # start -> order
        start = 0
        for order in range(size.bit_length() - 1, -1, -1):
            if size >> order & 1:
                self._free.setdefault(order, set()).add(start)
                self._region_order.append((start, order))
                start += 1 << order

    def _region_max_order(self, addr: int) -> int:
        for start, order in self._region_order:
            if start <= addr < start + (1 << order):
                return order
        raise ValueError(f"address {addr} outside [0, {self.size})")

    def block_size(self, n: int) -> int:
        """Slots a request for ``n`` slots actually occupies."""
        return next_pow2(n)

    def allocate(self, n: int) -> int | None:
        """Start of a block of ``next_pow2(n)`` slots (lowest address among the smallest that fit), or ``None``."""
        if n < 1:
            raise ValueError(f"allocation size must be >= 1, got {n}")
        k = (n - 1).bit_length()
        for order in sorted(o for o, starts in self._free.items() if starts and o >= k):
            start = min(self._free[order])
            self._free[order].remove(start)
            while order > k:  # split, keeping the upper half free
                order -= 1
                self._free.setdefault(order, set()).add(start + (1 << order))
            self._allocated[start] = k
            self.free_slots -= 1 << k
            return start
        return None

    def free(self, start: int, n: int | None = None) -> None:
        """Free the block that starts at ``start`` (``n``, if given, must match its request); merges buddies."""
        if start not in self._allocated:
            raise ValueError(f"no allocated block starts at {start} (double free?)")
        order = self._allocated.pop(start)
        if n is not None and next_pow2(n) != 1 << order:
            raise ValueError(f"block at {start} holds {1 << order} slots, not a request of {n}")
        self.free_slots += 1 << order
        top = self._region_max_order(start)
        while order < top:
            buddy = start ^ (1 << order)
            if buddy not in self._free.get(order, ()):
                break
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free.setdefault(order, set()).add(start)

    def largest_hole(self) -> int:
        return max((1 << o for o, starts in self._free.items() if starts), default=0)

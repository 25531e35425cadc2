"""Typed errors of the KV-cache layer.

Each is raised *before* anything changes, so a caller that catches one finds the pool exactly as it was. Running
out of blocks is an expected outcome on the manager's path (``allocate`` returns ``None``); on the plain pool path
of notebook 04 it is :class:`OutOfBlocksError`. A double free or an unknown block id is a bug in the caller and
must never corrupt refcounts.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error the KV-cache layer raises on purpose."""


class KVBudgetError(KVCacheError, ValueError):
    """The KV budget (in tokens) or the block size cannot make a pool of at least one block."""


class OutOfBlocksError(KVCacheError):
    """Not enough free blocks for an allocation. Nothing was allocated (all or nothing)."""

    def __init__(self, requested: int, free: int, total: int):
        self.requested = requested
        self.free = free
        self.total = total
        super().__init__(
            f"out of KV blocks: asked for {requested} block(s) but only {free} of {total} are free; "
            "nothing was allocated"
        )


class DoubleFreeError(KVCacheError):
    """A block was freed that is already free (its refcount is 0). The pool is unchanged."""

    def __init__(self, block_id: int):
        self.block_id = block_id
        super().__init__(f"double free: block {block_id} is already free (refcount 0); the pool is unchanged")


class UnknownBlockError(KVCacheError):
    """A block id that is not in the pool (wrong type, negative, or >= num_blocks). The pool is unchanged."""

    def __init__(self, block_id: object, num_blocks: int):
        self.block_id = block_id
        super().__init__(
            f"unknown block {block_id!r}: block ids are integers in [0, {num_blocks}); the pool is unchanged"
        )

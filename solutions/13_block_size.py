"""Solution of notebook 13's exercise: predict the internal fragmentation of a trace at block size b."""

from __future__ import annotations


def predict_fragmentation(lengths: list[tuple[int, int]], block_size: int) -> float:
    """Wasted / allocated KV slots, summed over every step of every request.

    A request with prompt ``p`` and output ``o`` is in the cache at lengths ``p, p + 1, ..., p + o - 1`` (the
    prompt's step, then one decode step per further token; the last sampled token is never fed back). At length
    ``l`` it holds ``ceil(l / B)`` blocks, ``ceil(l / B) * B - l`` slots of them empty.
    """
    wasted = allocated = 0
    for p, o in lengths:
        for n in range(p, p + o):
            slots = -(-n // block_size) * block_size
            allocated += slots
            wasted += slots - n
    return wasted / allocated

"""Solutions of notebook 13's exercises: predict the internal fragmentation of a trace at block size b, and the
cost of a block size for a set of requests."""

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


def block_size_cost(requests: list[tuple[int, int, int]], B: int, entry_cost: float) -> float:
    """Empty slots + recomputed shared tokens + ``entry_cost`` per block-table entry, summed over the requests.

    Each request is ``(prompt_len, output_len, shared_len)``. At its final length ``L = prompt_len + output_len`` it
    holds ``ceil(L / B)`` blocks (that many table entries), the last one ``ceil(L / B) * B - L`` slots empty. Of its
    ``shared_len`` shared prompt tokens only whole blocks hit, and never the prompt's last token (it is computed to
    sample the first output token): ``min(shared_len, prompt_len - 1) // B * B``; the rest is recomputed.
    """
    cost = 0.0
    for prompt_len, output_len, shared_len in requests:
        length = prompt_len + output_len
        blocks = -(-length // B)
        hit = min(shared_len, prompt_len - 1) // B * B
        cost += (blocks * B - length) + (shared_len - hit) + entry_cost * blocks
    return cost

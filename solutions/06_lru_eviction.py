"""Solutions to notebook 06's exercises."""

from minienv.kv import OutOfBlocksError


def my_evictions(free_queue, n):
    return [block for block, cached in free_queue[:n] if cached]  # the n taken from the head; only cached evict


def safe_victims(lru_order, refcount, n):
    victims = [b for b in lru_order if refcount[b] == 0][:n]
    if len(victims) < n:
        raise OutOfBlocksError(n, len(victims), len(lru_order))
    return victims

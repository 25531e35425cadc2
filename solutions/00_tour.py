"""Solutions to notebook 00's exercises."""


def next_blocks(pool, n):
    return list(pool.free)[:n]  # the head of the free queue, in order; list() copies, so the pool is unchanged


def release(pool, req):
    for block in reversed(pool.tables.pop(req)):  # the table's last block first
        pool.refcount[block] -= 1
        if pool.refcount[block] == 0:  # nobody else holds it
            pool.free[block] = None  # to the tail of the free queue

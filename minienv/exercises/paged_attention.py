"""Notebook 04's exercises: gathering a token range of a sequence's K through its block table, and when a new
block is taken.

The gather's process rule (no Python loop over tokens) is checked by handing the student's function a pool that
counts how often it is indexed: a loop over tokens indexes it once per token, a gather of whole blocks a few times.
"""

from __future__ import annotations

import numpy as np

from minienv.exercises._check import exercise, fail, require


@exercise("write my_gather(k_layer, block_table, start, stop) -> K of tokens start..stop-1 as [stop - start, "
          "kv_heads, head_dim]")
def check_gather(fn) -> str:
    rng = np.random.default_rng(7)
    # (block size, tokens in the sequence, start, stop): whole sequence, both ends mid-block, both on boundaries,
    # one token, inside one block, block size 1, a long block, an empty range on and off a boundary
    cases = [(4, 12, 0, 12), (4, 12, 5, 11), (4, 12, 4, 8), (4, 12, 6, 7), (4, 12, 1, 3), (1, 5, 2, 4),
             (16, 40, 17, 40), (4, 13, 9, 13), (4, 12, 7, 7), (4, 12, 8, 8)]
    for poisoned in (False, True):
        for block_size, seq_len, start, stop in cases:
            num_blocks = 12
            k_layer = rng.standard_normal((num_blocks, block_size, 2, 3), dtype=np.float32)
            table = rng.permutation(num_blocks)[: -(-seq_len // block_size)]  # scattered, not sorted
            if len(table) > 1 and np.all(np.diff(table) > 0):
                table = table[::-1].copy()
            want = np.zeros((0, 2, 3), np.float32) if stop == start else np.stack(
                [k_layer[table[t // block_size], t % block_size] for t in range(start, stop)])
            first, last = start // block_size, -(-stop // block_size)
            where = f"block size {block_size}, table {table.tolist()}, tokens [{start}, {stop})"
            if poisoned:  # the blocks outside the range point past the pool: reading them raises
                table[:first] = num_blocks + 100
                table[last:] = num_blocks + 100
                where = f"block size {block_size}, table {table.tolist()} (ids past the pool: blocks outside the " \
                        f"range), tokens [{start}, {stop})"
            try:
                got = np.asarray(fn(k_layer, table, start, stop))
            except Exception as err:  # noqa: BLE001
                rule = "read only the blocks the range touches (start // block_size … (stop − 1) // block_size)" \
                    if poisoned else "the gather must work for any block size and token range"
                fail(rule, f"{where}: your function raised {type(err).__name__}: {err}")
            n = stop - start
            if got.ndim == 3 and got.shape[1:] == want.shape[1:] and got.shape[0] != n:
                if got.shape[0] > n:
                    fail("cut the range at stop: the rows after token stop − 1 are not asked for",
                         f"{where}: expected {n} rows, got {got.shape[0]}")
                fail("include the range's partial last block: it is block (stop − 1) // block_size, "
                     "i.e. ceil(stop / block_size) − 1", f"{where}: expected {n} rows, got {got.shape[0]}")
            require(got.shape == want.shape, "the result is [stop − start, kv_heads, head_dim]",
                    f"{where}: expected shape {want.shape}, got {got.shape}")
            if not np.array_equal(got, want):
                rows = np.take(k_layer, np.clip(table[first:last], 0, num_blocks - 1), axis=0).reshape(-1, 2, 3)
                if n and np.array_equal(got, rows[:n]):
                    fail("the range starts start % block_size slots into its first block (skip them)",
                         f"{where}: values differ — your rows start at the first block's slot 0")
                rule = "token t is slot t % block_size of block table[t // block_size]: take the blocks in the " \
                       "table's (logical) order"
                if not poisoned and np.array_equal(
                        got, np.take(k_layer, np.sort(table), axis=0).reshape(-1, 2, 3)[start:stop]):
                    rule += " — you took them in physical (sorted) order"
                fail(rule, f"{where}: values differ")
    # the process rule: whole blocks, not token by token. A loop over tokens indexes the pool once per token; one
    # np.take on the block axis (or a loop over the range's blocks) indexes it a handful of times.
    block_size, start, stop = 16, 5, 40
    pool = rng.standard_normal((12, block_size, 2, 3), dtype=np.float32).view(_CountingPool)
    table = np.array([7, 2, 9])
    pool.reads = 0
    fn.rule = "no Python loop over tokens: read the pool block by block"
    got = np.asarray(fn(pool, table, start, stop))
    require(got.shape == (stop - start, 2, 3) and np.array_equal(
        got, np.take(np.asarray(pool), table, axis=0).reshape(-1, 2, 3)[start:stop]),
        "token t is slot t % block_size of block table[t // block_size]",
        f"block size {block_size}, table {table.tolist()}, tokens [{start}, {stop}): values differ")
    require(pool.reads <= len(table) + 2, "no Python loop over tokens: read the pool block by block (one np.take "
                                          "on the block axis gathers them all)",
            f"block size {block_size}, tokens [{start}, {stop}) in {len(table)} blocks: your function indexed "
            f"the pool {pool.reads} times")
    return "my_gather reads exactly the range's tokens through the block table, only the blocks it touches, " \
           "a block at a time"


class _CountingPool(np.ndarray):
    """The K pool, counting how often the student's code indexes it (``pool[...]``); views share the count."""

    reads = 0

    def __getitem__(self, index):
        root = self._root()
        root.reads += 1
        return super().__getitem__(index)

    def _root(self) -> "_CountingPool":
        base = self
        while isinstance(base.base, _CountingPool):
            base = base.base
        return base


@exercise("write new_blocks_needed(num_tokens, num_new, block_size): blocks a request must take to grow")
def check_new_blocks_needed(fn) -> str:
    got = fn(0, 5, 4)
    require(got == 2, "a new request needs ceil(tokens / block_size) blocks", f"(0, 5, 4): expected 2, got {got}")
    got = fn(6, 1, 4)
    require(got == 0, "a token that fits in the last block's free slots takes no block",
            f"6 tokens in blocks of 4 (2 slots left), 1 new: expected 0, got {got}")
    got = fn(8, 1, 4)
    require(got == 1, "a token that crosses a block boundary takes a block — including when the last block is "
                      "exactly full", f"8 tokens in blocks of 4, 1 new: expected 1, got {got}")
    got = fn(6, 7, 4)
    require(got == 2, "use the free slots of the last block first, then whole new blocks",
            f"6 tokens in blocks of 4, 7 new (13 in all, 4 blocks): expected 2, got {got}")
    tried = 0
    for bs in (1, 2, 3, 4, 16):
        for n in range(0, 40):
            for k in range(0, 20):
                want = -(-(n + k) // bs) - -(-n // bs)
                got = fn(n, k, bs)
                require(got == want, "blocks after − blocks before: ceil((n + k) / B) − ceil(n / B)",
                        f"({n}, {k}, {bs}): expected {want}, got {got}")
                tried += 1
    return f"new_blocks_needed is right in all {tried} cases: a block is taken exactly when a token crosses a boundary"

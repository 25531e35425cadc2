"""The paged KV cache: a block pool (bookkeeping), a KV pool (the arrays), block tables, and paged attention.

Dependencies point one way: ``block_pool`` knows nothing of requests or tensors; ``block_table`` maps one
sequence onto pool blocks; ``kv_pool`` holds the K/V arrays; ``paged_attention`` reads and writes them through
block tables and is the model's attention backend (``block_walk``: its optional numba kernel).
"""

from minienv.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, PoolSnapshot
from minienv.kv.block_table import BlockTable, batch_slot_mapping, cdiv, pad_block_tables, slot_mapping
from minienv.kv.errors import DoubleFreeError, KVBudgetError, KVCacheError, OutOfBlocksError, UnknownBlockError
from minienv.kv.kv_pool import KVPool, num_blocks_for_budget
from minienv.kv.paged_attention import (
    PagedAttentionBackend,
    PagedAttentionMetadata,
    batched_attention,
    causal_hidden_mask,
    gather_kv,
    paged_attention,
)

__all__ = [
    "BlockPool", "BlockTable", "DoubleFreeError", "FreeBlockQueue", "KVBudgetError", "KVCacheBlock", "KVCacheError",
    "KVPool", "OutOfBlocksError", "PagedAttentionBackend", "PagedAttentionMetadata", "PoolSnapshot",
    "UnknownBlockError", "batch_slot_mapping", "batched_attention", "causal_hidden_mask", "cdiv", "gather_kv",
    "num_blocks_for_budget", "pad_block_tables", "paged_attention", "slot_mapping",
]

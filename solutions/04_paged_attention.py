"""Solutions to notebook 04's exercises."""

import numpy as np


def my_gather(k_layer, block_table, start, stop):
    block_size = k_layer.shape[1]
    first, last = start // block_size, -(-stop // block_size)  # the blocks the range touches, and no others
    blocks = np.take(k_layer, block_table[first:last], axis=0)  # [last - first, B, H, D], in logical order
    rows = blocks.reshape(-1, *k_layer.shape[2:])  # row r is token first * B + r
    offset = start - first * block_size  # the range starts this many slots into its first block
    return rows[offset:offset + stop - start]


def new_blocks_needed(num_tokens, num_new, block_size):
    return -(-(num_tokens + num_new) // block_size) - -(-num_tokens // block_size)

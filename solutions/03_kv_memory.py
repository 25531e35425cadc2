"""Solutions to notebook 03's exercises."""


def internal_frag(num_tokens, block_size):
    return -num_tokens % block_size  # slots left in the last block (0 when it is exactly full)


def slot_categories(now, final, allocated):
    used_eventually = min(allocated, final)
    return now, used_eventually - now, allocated - used_eventually

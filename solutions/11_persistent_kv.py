"""Solutions of notebook 11's exercises: which record does a full KV tier evict next, and how many prompt tokens a
restarted engine loads from it.

Only a *leaf* may go — a record no other stored record names as its parent — because evicting a parent would
strand its children (a lookup walks a chain from its root and stops at the first miss). Among the leaves, the least
recently used (smallest ``last_access``) goes first.
"""

from minienv.kv_tier import block_keys


def next_victim(records):
    """``records``: ``(key, parent_key, last_access)`` of every stored record -> the key evicted next."""
    parents = {parent for _, parent, _ in records}
    leaves = [(last_access, key) for key, _, last_access in records if key not in parents]
    return min(leaves)[1]


def num_tokens_to_load(prompt, num_local_tokens, verified, block_size, fingerprint):
    """Prompt tokens a restarted engine loads from the tier after its local prefix cache hit ``num_local_tokens``.

    Walk the tier's keys (the chain hash with the model fingerprint; never the block holding the prompt's last
    token, which is computed to sample from) from the first block, stop at the first one that is not verified, and
    count in tokens what the local cache does not already hold.
    """
    max_blocks = (len(prompt) - 1) // block_size
    run = 0
    for key in block_keys(prompt, block_size, fingerprint, max_blocks=max_blocks):
        if key not in verified:
            break
        run += 1
    return max(0, run * block_size - num_local_tokens)

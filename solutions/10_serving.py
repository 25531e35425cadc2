"""Solutions to notebook 10's exercises."""

from minienv.kv.hashing import ROOT_HASH, hash_block_tokens


def retry_ceilings(max_attempts, initial_backoff, multiplier, max_backoff):
    return [min(initial_backoff * multiplier ** (n - 1), max_backoff) for n in range(1, max_attempts)]


def pick_instance(prompt_ids, loads, block_size, max_load):
    least_loaded = min(range(len(loads)), key=lambda i: (loads[i], i))
    if len(prompt_ids) < block_size:
        return least_loaded
    key = hash_block_tokens(ROOT_HASH, prompt_ids[:block_size])
    home = int.from_bytes(key[:8], "big") % len(loads)
    return home if loads[home] < max_load else least_loaded

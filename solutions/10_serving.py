"""Solutions to notebook 10's exercises."""

import hashlib

from minienv.kv.hashing import ROOT_HASH, hash_block_tokens


def retry_ceilings(max_attempts, initial_backoff, multiplier, max_backoff):
    return [min(initial_backoff * multiplier ** (n - 1), max_backoff) for n in range(1, max_attempts)]


def pick_instance(prompt_ids, loads, block_size, max_load):
    if len(prompt_ids) < block_size:  # no full block: no home
        return min(loads, key=lambda name: (loads[name], name))
    key = hash_block_tokens(ROOT_HASH, prompt_ids[:block_size])
    home = max(loads, key=lambda name: hashlib.sha256(key + name.encode()).digest())  # rendezvous hashing
    if loads[home] < max_load:
        return home
    return min(loads, key=lambda name: (loads[name], name != home, name))  # the home wins a tie

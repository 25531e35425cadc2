"""Solutions to notebook 05's exercises."""

from minienv.kv.hashing import ROOT_HASH, hash_block_tokens


def chain_hashes(tokens, block_size):
    hashes, parent = [], ROOT_HASH
    for j in range(len(tokens) // block_size):  # full blocks only
        parent = hash_block_tokens(parent, tokens[j * block_size:(j + 1) * block_size])
        hashes.append(parent)
    return hashes


def my_cached_tokens(prompt, cached_hashes, block_size):
    parent, hits = ROOT_HASH, 0
    for j in range((len(prompt) - 1) // block_size):  # never the block holding the last token
        parent = hash_block_tokens(parent, prompt[j * block_size:(j + 1) * block_size])
        if parent not in cached_hashes:
            break  # stop at the first miss
        hits += 1
    return hits * block_size

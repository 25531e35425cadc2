"""Solutions to notebook 05's exercises."""

from minienv.kv.hashing import ROOT_HASH, hash_block_tokens


def chain_hashes(tokens, block_size):
    hashes, parent = [], ROOT_HASH
    for j in range(len(tokens) // block_size):  # full blocks only
        parent = hash_block_tokens(parent, tokens[j * block_size:(j + 1) * block_size])
        hashes.append(parent)
    return hashes


def my_append_slots(table, ref_cnt, num_tokens, num_new, block_size, free):
    # the first new token writes into the last block only if it is not full; copy it only if someone else holds it
    copy = num_tokens % block_size != 0 and ref_cnt[table[-1]] > 1
    new_blocks = -(-(num_tokens + num_new) // block_size) - -(-num_tokens // block_size)  # notebook 04's rule
    if copy + new_blocks > len(free):
        return None  # ask before you act: nothing has changed
    table, ref_cnt, taken = list(table), list(ref_cnt), list(free[:copy + new_blocks])  # head of the queue first
    copies = []
    if copy:
        shared, private = table[-1], taken.pop(0)
        table[-1] = private
        ref_cnt[shared] -= 1  # one holder moved to the copy; the others keep the original
        ref_cnt[private] = 1
        copies.append((shared, private))
    for block in taken:
        table.append(block)
        ref_cnt[block] = 1
    return table, ref_cnt, copies

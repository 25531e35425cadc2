"""Solution of notebook 11's exercise: which record does a full KV tier evict next?

Only a *leaf* may go — a record no other stored record names as its parent — because evicting a parent would
strand its children (a lookup walks a chain from its root and stops at the first miss). Among the leaves, the least
recently used (smallest ``last_access``) goes first.
"""


def next_victim(records):
    """``records``: ``(key, parent_key, last_access)`` of every stored record -> the key evicted next."""
    parents = {parent for _, parent, _ in records}
    leaves = [(last_access, key) for key, _, last_access in records if key not in parents]
    return min(leaves)[1]

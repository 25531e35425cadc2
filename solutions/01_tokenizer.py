"""Solutions to notebook 01's exercises."""

from collections import Counter


def merge_pair(seq, pair, new_id):
    """Replace every (a, b) in seq, left to right, without overlaps, by new_id (as in the notebook)."""
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def merge_step(words):
    counts = Counter()
    for w, c in words.items():
        for p in zip(w, w[1:]):
            counts[p] += c  # weighted by how often the word occurs
    if not counts:
        return None
    pair = min(counts, key=lambda p: (-counts[p], p))  # most frequent; ties -> smallest pair
    new_id = max(256, max(max(w) for w in words if w) + 1)
    return pair, new_id, {tuple(merge_pair(list(w), pair, new_id)): c for w, c in words.items()}


def encode_word(word, merges):
    rank = {pair: i for i, pair in enumerate(merges)}
    ids = list(word)
    while len(ids) > 1:
        pairs = [p for p in zip(ids, ids[1:]) if p in rank]
        if not pairs:
            break
        best = min(pairs, key=rank.__getitem__)  # the lowest-rank (earliest learned) merge present
        ids = merge_pair(ids, best, 256 + rank[best])
    return ids

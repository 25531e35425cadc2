"""Notebook 05's exercises: the hash chain of a prompt's full blocks, and the longest cached prefix."""

from __future__ import annotations

import numpy as np

from minienv.exercises._check import exercise, fail, require
from minienv.kv.hashing import ROOT_HASH, hash_block_chain


def cached_tokens_reference(prompt: list[int], cached_hashes: set, block_size: int) -> int:
    """The rule the exercise states, written plainly: walk the chain from the root, stop at the first miss,
    never cover the last prompt token. (``KVCacheManager.lookup`` agrees; tests/unit/test_exercises.py checks.)"""
    hits = 0
    for h in hash_block_chain(prompt, block_size, max_blocks=(len(prompt) - 1) // block_size):
        if h not in cached_hashes:
            break
        hits += 1
    return hits * block_size


@exercise("write chain_hashes(tokens, block_size): the chain hash of every full block, from ROOT_HASH")
def check_chain_hashes(fn) -> str:
    tokens = list(range(10, 22))
    got = fn(tokens[:4], 4)
    want = hash_block_chain(tokens[:4], 4)
    require(list(got) == want, "the first block's hash is hash_block_tokens(ROOT_HASH, its tokens)",
            f"tokens {tokens[:4]}, block size 4: expected {[h.hex()[:8] for h in want]}, "
            f"got {[getattr(h, 'hex', lambda: h)()[:8] for h in got]}")
    got = list(fn(tokens[:10], 4))
    require(len(got) == 2, "only full blocks get a hash: a partial block's K/V are not final yet",
            f"10 tokens in blocks of 4: expected 2 hashes, got {len(got)}")
    want = hash_block_chain(tokens[:10], 4)
    require(got == want, "each block's hash covers its parent's hash too (the chain): a block's K/V depend on "
                         "every token before it", "10 tokens in blocks of 4: the second hash differs")
    same_block = [1, 2, 3, 4] + [5, 6, 7, 8]
    other_prefix = [9, 9, 9, 9] + [5, 6, 7, 8]
    a, b = list(fn(same_block, 4)), list(fn(other_prefix, 4))
    require(a[1] != b[1], "the same tokens after a different prefix hash differently (the chain)",
            f"[5, 6, 7, 8] after [1, 2, 3, 4] and after [9, 9, 9, 9] got the same hash")
    rng = np.random.default_rng(3)
    for case in range(30):
        bs = int(rng.choice([1, 2, 4, 8]))
        toks = [int(t) for t in rng.integers(0, 50, int(rng.integers(0, 40)))]
        got, want = list(fn(toks, bs)), hash_block_chain(toks, bs)
        require(got == want, "the hashes equal minienv's hash_block_chain", f"case {case}: {len(toks)} tokens, "
                f"block size {bs}: {len(want)} hashes expected, {len(got)} given, first difference at "
                f"{next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))}")
    return "chain_hashes keys each full block by its whole prefix"


@exercise("write my_cached_tokens(prompt, cached_hashes, block_size): tokens a request can take from the cache")
def check_cached_tokens(fn) -> str:
    """Hand-made cases, one per rule, then random prompts against the rule written plainly."""

    def ask(prompt, cached, bs, rule_if_wrong):
        want = cached_tokens_reference(prompt, cached, bs)
        try:
            got = fn(list(prompt), set(cached), bs)
        except Exception as err:  # noqa: BLE001
            fail(rule_if_wrong, f"prompt {prompt}, block size {bs}: your function raised {type(err).__name__}: {err}")
        if got != want:
            rule = rule_if_wrong
            if got == len(prompt):
                rule = "never cover the last prompt token: the model must compute it to produce the next token"
            fail(rule, f"prompt {prompt}, block size {bs}, {len(cached)} hashes cached: expected {want}, got {got}")

    base = list(range(1, 13))  # 3 blocks of 4
    chain = hash_block_chain(base, 4)
    ask(base + [99], set(), 4, "an empty cache has nothing to give")
    ask(base + [99], set(chain[:1]), 4, "a block is cached when its chain hash is in the set")
    ask(base + [99], set(chain), 4, "walk the chain from ROOT_HASH: each block's hash takes its parent's hash")
    ask(base + [99], {chain[0], chain[2]}, 4, "stop at the first miss: a block after a missing one cannot be "
                                             "used (its K/V depend on the missing block)")
    ask(base, set(chain), 4, "never cover the last prompt token: the model must compute it to produce the next "
                             "token")
    rng = np.random.default_rng(11)
    for case in range(60):
        bs = int(rng.choice([1, 2, 4, 8]))
        cached: set = set()
        stem = [int(t) for t in rng.integers(0, 5, int(rng.integers(1, 30)))]
        for _ in range(int(rng.integers(0, 3))):
            cached |= set(hash_block_chain(stem[: int(rng.integers(1, len(stem) + 1))], bs))
        if cached and rng.random() < 0.3:
            cached.discard(sorted(cached)[0])  # a hole in the chain (an evicted block)
        prompt = stem[: int(rng.integers(1, len(stem) + 1))] + [int(t) for t in rng.integers(0, 5, int(rng.integers(0, 4)))]
        ask(prompt, cached, bs, "the longest cached prefix: chain hashes from the root, stop at the first miss, "
                                "leave the last token")
    return "my_cached_tokens agrees with the prefix cache's lookup"

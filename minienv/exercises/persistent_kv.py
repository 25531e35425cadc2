"""Notebook 11's exercises: which record a full store evicts next, and how many prompt tokens a restarted engine
loads from the KV tier.

The first (:func:`check_next_victim`) is about the store evicting: it fills real ``SQLiteStore`` s and compares the
student's prediction with the record the store actually evicts. The second is the engine's side of a restart: the connector's admission question — after the local prefix cache hit
``num_local_tokens``, how many more prompt tokens come from the tier, the rest being computed? The answer combines
the chapter's rules: keys are the tier's chain hashes with the model fingerprint, a load walks the chain from its
root and stops at the first block it cannot use (absent, or refused by the record's checks), never covers the
prompt's last token, and counts only what the local cache does not already have.

The check runs one hand-made case per rule, then random cases, against :func:`num_tokens_to_load_reference`;
``tests/unit/test_exercises.py`` shows that reference equals what the real engine loads after a record is
corrupted.
"""

from __future__ import annotations

import numbers
import tempfile
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np

from minienv.exercises._check import exercise, fail, require
from minienv.kv.hashing import ROOT_HASH
from minienv.kv_tier import SQLiteStore, block_keys, encode_record


# ------------------------------------------------------------------------------------------ exercise 1
_SHAPE = (1, 2, 2, 1, 2)  # a tiny record: the check is about which record goes, not its K/V
_FP = bytes(32)


def _chain_records(start: int, n: int, prefix: Sequence[int] = ()):
    tokens = list(prefix) + list(range(start, start + 2 * n))
    keys = block_keys(tokens, 2, _FP)
    kv = np.zeros(_SHAPE, dtype=np.float32)
    for j, key in enumerate(keys):
        parent = keys[j - 1] if j else ROOT_HASH
        yield key, parent, encode_record(_FP, key, parent, tokens[2 * j:2 * j + 2], kv)



_VICTIM_RULES = {
    "key": "return the key of one of the stored records",
    "leaf": "evict only a chain's tail: a record that another stored record names as its parent would strand it",
    "lru": "among the tails (records with no stored child), the least recently used goes first",
}


@exercise("write next_victim(records) -> the key of the record a full store evicts next")
def check_next_victim(fn) -> str:
    """``fn(records) -> key`` for 30 real stores filled with random chains (some sharing a prefix, some refreshed by
    a hit), each compared with the record the store evicts when one more block arrives."""
    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as tmp:
        for case in range(30):
            chains = [list(_chain_records(100 * c, int(rng.integers(1, 5)))) for c in range(3)]
            # a branch: shares the first block of chain 0, so that block can have two stored children
            chains.append(list(_chain_records(900, int(rng.integers(1, 4)), prefix=range(0, 2))))
            size = len(chains[0][0][2])
            store = SQLiteStore(Path(tmp) / f"case{case}", capacity_bytes=size * int(rng.integers(4, 9)))
            try:
                for _ in range(int(rng.integers(3, 8))):
                    chain = chains[int(rng.integers(0, len(chains)))]
                    if rng.random() < 0.7:
                        for item in chain[:int(rng.integers(1, len(chain) + 1))]:
                            store.put(*item)
                    else:
                        store.get_many([k for k, _, _ in chain[:int(rng.integers(1, len(chain) + 1))]])
                # fill up to capacity, so the next put evicts exactly one record
                extra = _chain_records(10_000 + case * 100, 40)
                while store.usage()[1] + size <= store.capacity_bytes:
                    store.put(*next(extra))
                records = [(k, p, t) for k, p, _, t in store.records()]
                fn.rule = _VICTIM_RULES["lru"]
                predicted = fn(list(records))
                before = {k for k, _, _ in records}
                store.put(*next(_chain_records(50_000 + case, 1)))
                evicted = before - {k for k, _, _, _ in store.records()}
            finally:
                store.close()
            assert len(evicted) == 1, f"case {case}: the store evicted {len(evicted)} records"
            (actual,) = evicted
            if predicted == actual:
                continue
            shown = predicted.hex()[:12] + "…" if isinstance(predicted, bytes) else repr(predicted)
            where = f"case {case} ({len(records)} records): the store evicted {actual.hex()[:12]}…, you said {shown}"
            require(predicted in before, _VICTIM_RULES["key"], where)
            require(predicted not in {p for _, p, _ in records}, _VICTIM_RULES["leaf"], where)
            fail(_VICTIM_RULES["lru"], where)
    return "next_victim predicts the store's eviction in 30 stores: the least recently used chain tail"


# ------------------------------------------------------------------------------------------ exercise 2


def num_tokens_to_load_reference(prompt: Sequence[int], num_local_tokens: int, verified: Collection[bytes],
                                 block_size: int, fingerprint: bytes) -> int:
    """The rule the notebook states, written plainly (the check compares against it).

    ``verified``: the keys whose records are stored *and* pass every check (a corrupt record counts as absent).
    Keys are ``block_keys(prompt, B, fingerprint)`` for the first ``(len(prompt) - 1) // B`` blocks (at least one
    prompt token is computed, to have logits to sample from); the run of verified keys from the first one, in
    tokens, minus what the local prefix cache already holds — never negative.
    """
    max_blocks = (len(prompt) - 1) // block_size
    run = 0
    for key in block_keys(prompt, block_size, fingerprint, max_blocks=max_blocks):
        if key not in verified:
            break
        run += 1
    return max(0, run * block_size - num_local_tokens)


_RULES = {
    "keys": "use the tier's keys: block_keys(prompt, B, fingerprint) — chain hashes with the model fingerprint",
    "stop": "stop at the first block that is not verified: a chain cannot skip a block",
    "last": "never load the prompt's last token: at most (len(prompt) − 1) // B blocks",
    "local": "count only the tokens beyond the local hit: stored run − num_local_tokens",
    "negative": "a local hit longer than the tier's run loads nothing: never a negative count",
    "tokens": "count tokens (blocks × block_size), not blocks",
    "number": "return one int",
}


@exercise("write num_tokens_to_load(prompt, num_local_tokens, verified, block_size, fingerprint): tokens from the tier")
def check_num_tokens_to_load(fn) -> str:
    def ask(prompt: list[int], local: int, verified: set[bytes], b: int, fp: bytes) -> int:
        try:
            got = fn(list(prompt), local, frozenset(verified), b, fp)
        except Exception as err:  # noqa: BLE001 — a crash on a valid case is a wrong answer, said plainly
            fail("the function must answer every case", f"{len(prompt)}-token prompt, {local} local tokens, "
                 f"block {b}: your function raised {type(err).__name__}: {err}")
        if isinstance(got, bool) or not isinstance(got, (numbers.Integral, np.integer)):
            fail(_RULES["number"], f"{len(prompt)}-token prompt, block {b}: returned {got!r}")
        return int(got)

    def expect(prompt: list[int], local: int, verified: set[bytes], b: int, fp: bytes, rule: str, why: str) -> None:
        got, want = ask(prompt, local, verified, b, fp), num_tokens_to_load_reference(prompt, local, verified, b, fp)
        if got == want:
            return
        detail = f"{why}: expected {want} tokens, got {got}"
        require(not (want > 0 and got * b == want), _RULES["tokens"], detail)
        fail(_RULES[rule], detail)

    rng = np.random.default_rng(11)
    fp_a, fp_b = bytes(rng.integers(0, 256, 32, dtype=np.uint8)), bytes(rng.integers(0, 256, 32, dtype=np.uint8))
    b = 4
    prompt = [int(t) for t in rng.integers(0, 5000, 10 * b + 2)]  # 10 full blocks and 2 tokens
    keys = block_keys(prompt, b, fp_a)
    everything = set(keys)
    expect(prompt, 0, everything, b, fp_a, "keys", "all 10 full blocks verified, nothing local")
    other_model = set(block_keys(prompt, b, fp_b))
    expect(prompt, 0, other_model, b, fp_a, "keys", "the same prompt stored by another model (other fingerprint)")
    gap = everything - {keys[3]}
    expect(prompt, 0, gap, b, fp_a, "stop", "block 3's record was refused (corrupt); blocks 4–9 verified")
    exact = prompt[:10 * b]
    expect(exact, 0, set(block_keys(exact, b, fp_a)), b, fp_a, "last",
           "a 40-token prompt whose 10 blocks are all verified: block 9 holds the last token")
    expect(prompt, 4 * b, everything, b, fp_a, "local", "10 blocks verified, the first 4 already in the local cache")
    expect(prompt, 6 * b, set(keys[:2]), b, fp_a, "negative", "6 blocks local, the tier verified only the first 2")

    tried = 6
    for _ in range(200):
        b = int(rng.choice([1, 2, 4, 16]))
        stem = [int(t) for t in rng.integers(0, 50, int(rng.integers(1, 12 * b)))]
        fp = fp_a if rng.random() < 0.8 else fp_b
        stored_prompt = stem + [int(t) for t in rng.integers(0, 50, int(rng.integers(0, 4 * b)))]
        stored = block_keys(stored_prompt, b, fp_a)
        verified = {k for k in stored if rng.random() < 0.9}  # a few records refused
        prompt = stem[:int(rng.integers(1, len(stem) + 1))] + [int(t) for t in rng.integers(0, 50, 3)]
        local = int(rng.integers(0, (len(prompt) - 1) // b + 1)) * b
        got, want = ask(prompt, local, verified, b, fp), num_tokens_to_load_reference(prompt, local, verified, b, fp)
        if got != want:
            fail("tokens to load = the verified run from the first block (tier keys, never the last token) − local",
                 f"{len(prompt)}-token prompt, block {b}, {local} local tokens: expected {want}, got {got}")
        tried += 1
    return (f"num_tokens_to_load is right in all {tried} cases: after a restart the engine loads the verified run "
            "of its prompt's chain past the local hit, and computes the rest")

"""Block hashes for the prefix cache: a sha256 *chain* over full blocks, stable across processes.

A block's K/V depend on every token before it, not only on its own tokens (attention mixed them in). So the key of
block ``j`` of a sequence must name the whole prefix ``tokens[0 : (j+1)*B]``. Hashing that prefix from scratch
would cost O(j·B) per block; a *chain* costs O(B):

    hash(block j) = sha256(VERSION | hash(block j-1) | extra_key | token ids of block j)

with ``hash(block -1) = ROOT_HASH``. Two sequences get the same hash for block ``j`` exactly when (barring a sha256
collision) they agree on every token up to the end of block ``j`` *and* on the extra key. The *extra key* carries
whatever makes K/V differ for the same tokens: the model id, the dtype, a user's cache salt (vLLM's
``cache_salt`` keeps tenants from probing each other's prompts through cache timing).

Why sha256 over a fixed byte encoding, never Python's ``hash()``:

* ``hash()`` of str/bytes is salted per process (PYTHONHASHSEED), so a persistent KV tier — which keys blocks by
  hash on disk — could never find them again in the next process;
* ``hash(None)`` became a *constant* in Python 3.12, so vLLM's chain (whose first parent was ``None``) produced
  forced collisions across users (vLLM #12621; fixed by switching to sha256). Here the chain's root is a real
  32-byte constant, and :mod:`minienv.kv.prefix_cache` also compares the stored tokens on every hit, so even a
  collision cannot hand a request the wrong K/V.

Only **full** blocks are hashed: a partly filled block's contents are still changing.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

__all__ = ["BlockHash", "HASH_VERSION", "ROOT_HASH", "hash_block_chain", "hash_block_tokens", "make_extra_key"]

#: A block hash: 32 raw sha256 bytes (``.hex()`` for display).
BlockHash = bytes

#: Bumped if the byte encoding ever changes, so stale persisted hashes can never match new ones.
HASH_VERSION = b"minienv.kv.block_hash.v1"

#: The parent of a sequence's first block (a real constant, not ``hash(None)``: see vLLM #12621).
ROOT_HASH: BlockHash = hashlib.sha256(HASH_VERSION + b"|root").digest()


def make_extra_key(model_id: str = "", *, cache_salt: str | None = None, dtype: str = "float32") -> bytes:
    """The extra key of every block hash: what must separate caches although the tokens are the same.

    ``model_id`` (two models never share K/V), ``dtype`` (float32 K/V differ from bfloat16 K/V) and an optional
    per-user ``cache_salt``. Encoded as length-prefixed UTF-8 fields, so ``("ab", "c")`` and ``("a", "bc")`` differ.
    """
    fields = [model_id, dtype, "" if cache_salt is None else "salt:" + cache_salt]
    out = bytearray()
    for field in fields:
        raw = field.encode("utf-8")
        out += len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """``sha256(VERSION | parent | len(extra)|extra | n|tokens as little-endian int64)`` — one link of the chain.

    The encoding is fixed-width and length-prefixed, so no two different inputs share a byte string, and it does
    not depend on the platform's endianness or on the process (the persistent KV tier relies on that).
    """
    if len(parent_hash) != 32:
        raise ValueError(f"parent_hash must be 32 sha256 bytes, got {len(parent_hash)} bytes")
    tokens = np.asarray(token_ids, dtype="<i8")
    h = hashlib.sha256(HASH_VERSION)
    h.update(parent_hash)
    h.update(len(extra_key).to_bytes(4, "little"))
    h.update(extra_key)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(tokens.tobytes())
    return h.digest()


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes = b"",
    *,
    parent_hash: BlockHash = ROOT_HASH,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """Hashes of the *full* blocks of ``token_ids`` (a trailing partial block gets none), in logical order.

    ``max_blocks`` stops early (a lookup never needs more hashes than it can use).
    """
    n_full = len(token_ids) // block_size
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    hashes: list[BlockHash] = []
    parent = parent_hash
    for j in range(n_full):
        parent = hash_block_tokens(parent, token_ids[j * block_size:(j + 1) * block_size], extra_key)
        hashes.append(parent)
    return hashes

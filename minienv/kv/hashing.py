"""Block hashes for the prefix cache: a sha256 *chain* over full blocks, stable across processes.

A block's K/V depend on every token before it, so block ``j``'s key must name the whole prefix up to its end. A
chain does that in O(B) per block: ``hash(j) = sha256(VERSION | hash(j-1) | extra_key | tokens of block j)``, with
``hash(-1) = ROOT_HASH``. Two sequences share block ``j``'s hash exactly when they agree on every token up to its
end and on the *extra key* (model id, dtype, a tenant's cache salt: whatever makes K/V differ for the same tokens).
Only full blocks are hashed; a partial block's contents still change.

sha256 over a fixed byte encoding, never Python's ``hash()``: that is salted per process (a persistent KV tier
could never find its blocks again) and not collision-resistant (``hash(None)`` is a constant since Python 3.12).
The root is a real constant, and :mod:`minienv.kv.prefix_cache` compares stored tokens on every hit besides.
"""

from __future__ import annotations

import hashlib
import struct
from functools import lru_cache
from typing import Callable, Sequence


#: A block hash: 32 raw sha256 bytes (``.hex()`` for display).
BlockHash = bytes

#: Bumped if the byte encoding ever changes, so stale persisted hashes never match new ones.
HASH_VERSION = b"minienv.kv.block_hash.v1"

#: The parent of a sequence's first block.
ROOT_HASH: BlockHash = hashlib.sha256(HASH_VERSION + b"|root").digest()


def make_extra_key(model_id: str = "", *, cache_salt: str | None = None, dtype: str = "float32") -> bytes:
    """What must separate caches although the tokens agree: ``model_id``, ``dtype`` and an optional per-user
    ``cache_salt``, as length-prefixed UTF-8 fields (so ``("ab", "c")`` and ``("a", "bc")`` differ)."""
    out = bytearray()
    for part in (model_id, dtype, "" if cache_salt is None else "salt:" + cache_salt):
        raw = part.encode("utf-8")
        out += len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """One link of the chain: ``sha256(VERSION | parent | len(extra)|extra | n|tokens as little-endian int64)``.
    Fixed-width and length-prefixed, so no two inputs share a byte string on any platform or in any process."""
    return hash_block_key(block_key_bytes(parent_hash, token_ids, extra_key))


def hash_block_key(key_bytes: bytes) -> BlockHash:
    """The block hash of an encoded key (:func:`block_key_bytes`): for callers that keep the key bytes too."""
    return hashlib.sha256(key_bytes).digest()


def block_key_bytes(parent_hash: BlockHash, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """The bytes :func:`hash_block_tokens` hashes. The encoding is injective, so equal bytes <=> equal
    ``(parent_hash, token_ids, extra_key)``: the prefix index stores these as each entry's key (one flat
    ``bytes`` object, which the cyclic garbage collector never tracks) and compares them on every hit."""
    if len(parent_hash) != 32:
        raise ValueError(f"parent_hash must be 32 sha256 bytes, got {len(parent_hash)} bytes")
    n = len(token_ids)
    packer = _INT64S.get(n) or _INT64S.setdefault(n, struct.Struct(f"<{n}q"))
    # One join over the fields: the same bytes as one sha256 update per field, packed without a numpy array
    # (this runs once per full block on the engine's path, so its constant matters).
    return b"".join((HASH_VERSION, parent_hash, len(extra_key).to_bytes(4, "little"), extra_key,
                     n.to_bytes(4, "little"), packer.pack(*token_ids)))


@lru_cache(maxsize=64)
def block_key_encoder(block_size: int, extra_key: bytes = b"") -> Callable[[BlockHash, Sequence[int]], bytes]:
    """``encode(parent_hash, token_ids)`` == ``block_key_bytes(parent_hash, token_ids, extra_key)`` for a *full*
    block of ``block_size`` tokens, with the fields that never change for one cache (version, extra key, length)
    joined once: the engine encodes every full block it computes, and this is about twice as fast. The parent is
    a hash the caller computed (32 bytes), so it is not checked again; ``len(token_ids) != block_size`` raises."""
    fixed = len(extra_key).to_bytes(4, "little") + extra_key + block_size.to_bytes(4, "little")
    pack = struct.Struct(f"<{block_size}q").pack
    join = b"".join

    def encode(parent_hash: BlockHash, token_ids: Sequence[int]) -> bytes:
        return join((HASH_VERSION, parent_hash, fixed, pack(*token_ids)))

    return encode


def parse_block_key_bytes(key: bytes) -> tuple[BlockHash, tuple[int, ...], bytes]:
    """``(parent_hash, token_ids, extra_key)`` back from :func:`block_key_bytes`' encoding."""
    at = len(HASH_VERSION)
    if key[:at] != HASH_VERSION:
        raise ValueError("not a block key of this hash version")
    parent_hash, at = key[at:at + 32], at + 32
    n_extra = int.from_bytes(key[at:at + 4], "little")
    extra_key, at = key[at + 4:at + 4 + n_extra], at + 4 + n_extra
    n = int.from_bytes(key[at:at + 4], "little")
    if len(key) != at + 4 + 8 * n:
        raise ValueError(f"a block key of {n} tokens must be {at + 4 + 8 * n} bytes, got {len(key)}")
    return parent_hash, struct.unpack_from(f"<{n}q", key, at + 4), extra_key


#: ``n`` little-endian int64s, by ``n``: ``np.asarray(ids, "<i8").tobytes()`` without the array.
_INT64S: dict[int, struct.Struct] = {}


def hash_block_chain(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"", *,
                     parent_hash: BlockHash = ROOT_HASH, max_blocks: int | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` (at most ``max_blocks``), in logical order."""
    n_full = len(token_ids) // block_size if max_blocks is None else min(len(token_ids) // block_size, max_blocks)
    hashes = [parent_hash]
    for j in range(n_full):
        hashes.append(hash_block_tokens(hashes[-1], token_ids[j * block_size:(j + 1) * block_size], extra_key))
    return hashes[1:]

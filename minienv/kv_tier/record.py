"""The on-disk / on-the-wire record of one KV block, its key, and the model fingerprint that guards both.

A record is plain bytes, little-endian, no pickle (a pickle from a shared store would run code on load)::

    offset  size  field
    0       8     magic            b"MNVKVBLK"
    8       2     format_version   FORMAT_VERSION (a reader refuses any other: a future record is a clean miss)
    10      2     flags            0
    12      32    fingerprint      model_fingerprint(): weights, config, dtype, block size, KV layout version
    44      32    key              the block's tier key (a record stored under another key is refused)
    76      32    parent_key       the key of the block before it (ROOT_HASH for a sequence's first block)
    108     4     num_tokens       = block_size
    112     1     ndim             = 5
    113     20    shape            5 x uint32: [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
    133     8     dtype            numpy dtype string, NUL-padded (b"<f4")
    141     8     payload_len      bytes of the payload
    149     8*n   token_ids        int64, the block's tokens
    ...     ...   payload          the K/V bytes, C order
    end-32  32    checksum         sha256 of every byte before it

Why each field (every one closes a trap real tiers shipped):

* **fingerprint** — a K/V block is only valid for the exact weights and layout that produced it; a record written by
  another model, another block size or another KV layout must never be loaded, even if someone reuses a key scheme.
  The key already mixes the fingerprint in (so such a record is not even found), and the header checks it again.
* **key, parent key and token ids** — a record is self-describing: the reader compares them with what it asked
  for, so a record copied under the wrong key, or a key collision, is refused instead of loaded.
* **checksum** — a flipped byte anywhere (disk, network, a half-written value from a crashed writer) fails it.

Invariant: :func:`decode_record` returns an array only if *every* field matches what the caller expects; anything
else raises a :class:`RecordError` subclass naming the field, which the connector turns into a miss plus a counted
error — never into wrong K/V.

Keys are block chain hashes (:func:`minienv.kv.hashing.hash_block_chain`) with the fingerprint as the extra key:
sha256 over fixed-width bytes, so the same tokens give the same key in every process, whatever PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from minienv.kv.hashing import ROOT_HASH, BlockHash, hash_block_chain

__all__ = [
    "FORMAT_VERSION", "KV_LAYOUT_VERSION", "MAGIC", "RecordChecksumError", "RecordError", "RecordHeader",
    "RecordMismatchError", "RecordVersionError", "block_keys", "decode_record", "encode_record",
    "model_fingerprint", "peek_header",
]

MAGIC = b"MNVKVBLK"
#: Bumped whenever the byte layout above changes; readers refuse every other version.
FORMAT_VERSION = 1
#: Names the in-memory layout the payload is copied from/to (``KVPool.kv_cache[:, :, block]``).
KV_LAYOUT_VERSION = "minienv.kv_pool[layers,2,blocks,block_size,kv_heads,head_dim].v1"
_KEY_DOMAIN = b"minienv.kv_tier.key.v1|"

_HEAD = struct.Struct("<8sHH32s32s32sIB5I8sQ")
_CHECKSUM_LEN = 32
HEADER_SIZE = _HEAD.size


class RecordError(ValueError):
    """A record that must not be loaded. The connector counts it (by subclass) and recomputes the block."""


class RecordVersionError(RecordError):
    """Not a record of this format version (a future writer, or not a minienv record at all)."""


class RecordChecksumError(RecordError):
    """The bytes are not the bytes that were written (a flipped bit, a truncated or half-written value)."""


class RecordMismatchError(RecordError):
    """A well-formed record for something else: another model/layout, another key, other tokens, other shape."""


@dataclass(frozen=True)
class RecordHeader:
    """The fixed header of a record (everything but the token ids, payload and checksum)."""

    format_version: int
    fingerprint: bytes
    key: BlockHash
    parent_key: BlockHash
    num_tokens: int
    shape: tuple[int, ...]
    dtype: str
    payload_len: int


def _digest_array(h, name: str, array: np.ndarray) -> None:
    a = np.ascontiguousarray(array)
    h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
    h.update(a.tobytes())


def model_fingerprint(model, block_size: int, dtype: str = "float32") -> bytes:
    """sha256 of everything that decides whether a stored K/V block is valid here (32 bytes).

    The weights (every array the forward pass reads, so two models with the same shapes but other weights differ),
    the config (as sorted JSON), the K/V dtype, the block size and :data:`KV_LAYOUT_VERSION`. O(weights): ~10 ms for
    the bundled model, once per engine.
    """
    h = hashlib.sha256(b"minienv.kv_tier.fingerprint.v1|")
    h.update(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    h.update(f"|dtype={dtype}|block_size={int(block_size)}|layout={KV_LAYOUT_VERSION}|".encode())
    _digest_array(h, "embed_tokens", model.embed_tokens)
    for i, layer in enumerate(model.layers):
        for name in ("input_norm", "w_qkv", "w_o", "post_norm", "w_gate_up", "w_down"):
            _digest_array(h, f"layers.{i}.{name}", getattr(layer, name))
    _digest_array(h, "norm", model.norm)
    _digest_array(h, "lm_head", model.lm_head)
    return h.digest()


def block_keys(token_ids: Sequence[int], block_size: int, fingerprint: bytes, *,
               max_blocks: int | None = None, parent_key: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Tier keys of the full blocks of ``token_ids``: the block chain hash with the fingerprint as extra key.

    ``parent_key`` continues a chain (the key of the block before ``token_ids[0]``)."""
    return hash_block_chain(token_ids, block_size, _KEY_DOMAIN + fingerprint, max_blocks=max_blocks,
                            parent_hash=parent_key)


def encode_record(fingerprint: bytes, key: BlockHash, parent_key: BlockHash, token_ids: Sequence[int],
                  kv: np.ndarray) -> bytes:
    """The bytes of one record (see the module docstring). ``kv`` is one block ``[L, 2, B, H, D]``."""
    kv = np.ascontiguousarray(kv)
    if kv.ndim != 5:
        raise ValueError(f"a KV block is [layers, 2, block_size, kv_heads, head_dim], got shape {kv.shape}")
    tokens = np.asarray(token_ids, dtype="<i8")
    dtype = kv.dtype.newbyteorder("<") if kv.dtype.byteorder == ">" else kv.dtype
    payload = kv.astype(dtype, copy=False).tobytes()
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, key, parent_key, len(tokens), 5, *kv.shape,
                      dtype.str.encode(), len(payload))
    body = head + tokens.tobytes() + payload
    return body + hashlib.sha256(body).digest()


def peek_header(record: bytes) -> RecordHeader:
    """Parse the fixed header only (no checksum, no payload): for views and for the version check."""
    if len(record) < HEADER_SIZE + _CHECKSUM_LEN:
        raise RecordChecksumError(f"record of {len(record)} bytes is shorter than a header ({HEADER_SIZE} bytes)")
    (magic, version, _flags, fp, key, parent, n, ndim, *rest) = _HEAD.unpack_from(record)
    shape, dtype, payload_len = tuple(rest[:5]), rest[5].rstrip(b"\0").decode("ascii", "replace"), rest[6]
    if magic != MAGIC:
        raise RecordVersionError(f"not a minienv KV record (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise RecordVersionError(f"record format version {version}; this reader understands only {FORMAT_VERSION}")
    if ndim != 5:
        raise RecordMismatchError(f"record has {ndim} dims, expected 5")
    return RecordHeader(version, fp, key, parent, n, shape, dtype, payload_len)


def decode_record(record: bytes, *, fingerprint: bytes, key: BlockHash, parent_key: BlockHash,
                  token_ids: Sequence[int], shape: tuple[int, ...], dtype: str = "<f4") -> np.ndarray:
    """The block's K/V ``shape`` if and only if every field of ``record`` matches; else a :class:`RecordError`.

    Checked in order of cheapness and of what the error should say: version, checksum (so a flipped byte in the
    header is reported as corruption, not as a mismatch), then fingerprint, key, parent, tokens, shape, dtype.
    """
    if not isinstance(record, (bytes, bytearray, memoryview)):  # a store is untrusted: SQLite returns any type
        raise RecordChecksumError(f"the store returned a {type(record).__name__}, not a record's bytes")
    header = peek_header(bytes(record[:HEADER_SIZE + _CHECKSUM_LEN]))
    body, checksum = record[:-_CHECKSUM_LEN], record[-_CHECKSUM_LEN:]
    if hashlib.sha256(body).digest() != bytes(checksum):
        raise RecordChecksumError("record checksum mismatch: the stored bytes are not the bytes written")
    if header.fingerprint != fingerprint:
        raise RecordMismatchError("record written by another model, dtype, block size or KV layout (fingerprint)")
    if header.key != key or header.parent_key != parent_key:
        raise RecordMismatchError("record stored under another key than the one it was written for")
    n = header.num_tokens
    expected_len = HEADER_SIZE + 8 * n + header.payload_len + _CHECKSUM_LEN
    if len(record) != expected_len:
        raise RecordChecksumError(f"record length {len(record)} != {expected_len} announced by its header")
    tokens = np.frombuffer(record, dtype="<i8", count=n, offset=HEADER_SIZE)
    if n != len(token_ids) or not np.array_equal(tokens, np.asarray(token_ids, dtype=np.int64)):
        raise RecordMismatchError("record holds other token ids than the block asked for")
    if header.shape != tuple(shape) or header.dtype != np.dtype(dtype).str:
        raise RecordMismatchError(f"record shape/dtype {header.shape} {header.dtype} != expected {tuple(shape)} "
                                  f"{np.dtype(dtype).str}")
    payload = np.frombuffer(record, dtype=header.dtype, count=int(np.prod(shape)), offset=HEADER_SIZE + 8 * n)
    return payload.reshape(shape)

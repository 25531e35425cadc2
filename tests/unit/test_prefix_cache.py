"""Block-hash chain and prefix index: stability across processes, chain semantics, collision safety."""

from __future__ import annotations

import gc
import struct
import subprocess
import sys

import pytest

from minienv.kv import prefix_cache
from minienv.kv.hashing import (ROOT_HASH, block_key_bytes, block_key_encoder, hash_block_chain, hash_block_key,
                                hash_block_tokens, make_extra_key, parse_block_key_bytes)
from minienv.kv.prefix_cache import CachedBlock, CachedBlockKey, PrefixIndex


def test_hash_is_sha256_bytes_and_deterministic():
    h = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], b"m")
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(ROOT_HASH, (1, 2, 3, 4), b"m")


def test_hash_stable_across_processes_with_different_hash_seeds():
    """The persistent KV tier keys on these hashes: they must not depend on PYTHONHASHSEED (builtin hash() does)."""
    code = ("from minienv.kv.hashing import hash_block_chain, make_extra_key;"
            "print(b''.join(hash_block_chain(list(range(40)), 8, make_extra_key('m', cache_salt='s'))).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("0", "1", "12345")}
    assert len(outs) == 1
    assert outs.pop() == b"".join(hash_block_chain(list(range(40)), 8, make_extra_key("m", cache_salt="s"))).hex()


def test_chain_depends_on_whole_prefix_and_extra_key():
    a = hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_block_chain([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1], "same block tokens after a different prefix must hash differently"
    assert hash_block_chain([1, 2, 3, 4], 4, make_extra_key("m1"))[0] != hash_block_chain([1, 2, 3, 4], 4,
                                                                                          make_extra_key("m2"))[0]
    assert hash_block_chain([1, 2, 3, 4], 4, make_extra_key("m", cache_salt="alice")) != hash_block_chain(
        [1, 2, 3, 4], 4, make_extra_key("m", cache_salt="bob"))


def test_only_full_blocks_are_hashed():
    assert len(hash_block_chain(list(range(11)), 4)) == 2
    assert hash_block_chain([1, 2, 3], 4) == []
    assert len(hash_block_chain(list(range(100)), 4, max_blocks=3)) == 3


def test_extra_key_fields_are_length_prefixed():
    assert make_extra_key("ab", cache_salt="c") != make_extra_key("a", cache_salt="bc")
    assert make_extra_key("m") != make_extra_key("m", cache_salt="")


def test_root_is_not_hash_of_none():
    """vLLM #12621: the chain's first parent was ``None`` and ``hash(None)`` is a constant in Python 3.12+."""
    assert ROOT_HASH != hash(None).to_bytes(8, "little", signed=True)
    assert len(ROOT_HASH) == 32
    with pytest.raises(ValueError):
        hash_block_tokens(b"short", [1], b"")


def test_index_insert_get_remove_inverse_maps():
    idx = PrefixIndex()
    key = CachedBlockKey(ROOT_HASH, (1, 2), b"")
    h = key.block_hash()
    assert idx.insert(7, h, key)
    assert idx.get(h, key) == 7 and h in idx and len(idx) == 1
    assert not idx.insert(8, h, key), "one block per hash"
    assert not idx.insert(7, b"x" * 32, key), "one hash per block"
    assert idx.remove(7).block_id == 7
    assert idx.get(h, key) is None and len(idx) == 0 and idx.remove(7) is None


def test_index_key_check_turns_collision_into_miss():
    idx = PrefixIndex()
    key_a = CachedBlockKey(ROOT_HASH, (1, 2), b"")
    key_b = CachedBlockKey(ROOT_HASH, (3, 4), b"")
    forced = b"\0" * 32  # pretend both keys hash to the same value
    idx.insert(5, forced, key_a)
    assert idx.get(forced, key_a) == 5
    assert idx.get(forced, key_b) is None


def test_longest_prefix_stops_at_first_miss():
    idx = PrefixIndex()
    toks = list(range(12))
    hashes = hash_block_chain(toks, 4)
    parents = [ROOT_HASH] + hashes
    for j in (0, 2):  # block 1 missing: block 2 is unreachable
        idx.insert(10 + j, hashes[j], CachedBlockKey(parents[j], tuple(toks[4 * j:4 * j + 4]), b""))
    ids, hs = idx.longest_prefix(toks, 4, b"", max_blocks=3)
    assert ids == [10] and hs == [hashes[0]]


def test_module_exposes_index_names():
    assert prefix_cache.PrefixIndex is PrefixIndex


@pytest.mark.parametrize("parent, tokens, extra", [
    (ROOT_HASH, (), b""), (ROOT_HASH, (1, 2, 3), b""), (b"\x07" * 32, (0, 2**63 - 1, 5), make_extra_key("m")),
    (ROOT_HASH, (1,), b"x" * 300)])
def test_block_key_bytes_round_trips_and_is_what_the_hash_hashes(parent, tokens, extra):
    key = block_key_bytes(parent, list(tokens), extra)
    assert parse_block_key_bytes(key) == (parent, tokens, extra)
    assert hash_block_key(key) == hash_block_tokens(parent, tokens, extra) == CachedBlockKey(parent, tokens,
                                                                                             extra).block_hash()


def test_block_key_bytes_differ_for_different_keys_of_the_same_total_length():
    """The index compares these bytes instead of the keys: fields that shift between token ids and the extra key
    (or the extra key's length) must never encode alike."""
    keys = [(ROOT_HASH, (1, 2), b"ab" * 4), (ROOT_HASH, (1, 2, 0x6261626162616261), b""),
            (ROOT_HASH, (0x6261626162616261, 1, 2), b""), (b"\x00" * 32, (1, 2), b"ab" * 4)]
    encoded = [block_key_bytes(*k) for k in keys]
    assert len(set(encoded)) == len(keys)
    assert [parse_block_key_bytes(e) for e in encoded] == keys
    with pytest.raises(ValueError):
        parse_block_key_bytes(encoded[0][:-1])


def test_index_entries_read_back_equal_and_hold_nothing_the_garbage_collector_tracks():
    idx = PrefixIndex()
    toks = list(range(40))
    hashes = hash_block_chain(toks, 4)
    parents = [ROOT_HASH] + hashes
    keys = [CachedBlockKey(parents[j], tuple(toks[4 * j:4 * j + 4]), b"m") for j in range(10)]
    for j, key in enumerate(keys):
        assert idx.insert(100 + j, hashes[j], key)
    assert sorted(idx) == [CachedBlock(100 + j, hashes[j], keys[j]) for j in range(10)]
    assert idx.entry_for_block(103) == idx.entry_for_hash(hashes[3]) == CachedBlock(103, hashes[3], keys[3])
    stored = [obj for table in (idx._by_hash, idx._by_block, idx._keys) for obj in gc.get_referents(table)]
    assert len(stored) == 60 and not any(gc.is_tracked(obj) for obj in stored)
    assert idx.remove(103) == CachedBlock(103, hashes[3], keys[3]) and idx.entry_for_block(103) is None
    idx.discard(104)
    assert idx.entry_for_hash(hashes[4]) is None and len(idx) == 8


@pytest.mark.parametrize("block_size, extra", [(1, b""), (4, b""), (16, make_extra_key("m", cache_salt="s"))])
def test_block_key_encoder_equals_block_key_bytes(block_size, extra):
    encode = block_key_encoder(block_size, extra)
    parent = ROOT_HASH
    for j in range(3):
        tokens = list(range(j * block_size, (j + 1) * block_size))
        assert encode(parent, tokens) == block_key_bytes(parent, tokens, extra)
        parent = hash_block_tokens(parent, tokens, extra)
    with pytest.raises(struct.error):  # only full blocks of block_size tokens
        encode(ROOT_HASH, list(range(block_size + 1)))

"""The persistent KV tier's storage layer: records that cannot lie, stable keys, the SQLite store's invariants.

Everything here runs on the embedded store (no server); the Redis store gets the same checks in
``test_kv_tier_redis.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minienv.kv.hashing import ROOT_HASH
from minienv.kv_tier import (
    FORMAT_VERSION,
    RecordChecksumError,
    RecordError,
    RecordMismatchError,
    RecordVersionError,
    SQLiteStore,
    TierConfigError,
    block_keys,
    decode_record,
    encode_record,
    model_fingerprint,
    peek_header,
)
from minienv.kv_tier.record import HEADER_SIZE
from minienv.model import LlamaConfig, LlamaModel, random_weights

REPO = Path(__file__).resolve().parents[2]
SHAPE = (2, 2, 4, 2, 8)  # [layers, K/V, block_size, kv_heads, head_dim]
FP = bytes(range(32))


def _block(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def _record(tokens=(1, 2, 3, 4), seed=0, fp=FP):
    key = block_keys(list(tokens), 4, fp)[0]
    return key, encode_record(fp, key, ROOT_HASH, tokens, _block(seed))


def _decode(record, key, tokens=(1, 2, 3, 4), fp=FP):
    return decode_record(record, fingerprint=fp, key=key, parent_key=ROOT_HASH, token_ids=tokens, shape=SHAPE)


# ------------------------------------------------------------------------------------------------ records
def test_record_round_trip_is_bit_exact():
    key, rec = _record()
    out = _decode(rec, key)
    assert out.dtype == np.float32 and np.array_equal(out, _block(0))
    h = peek_header(rec)
    assert (h.format_version, h.key, h.parent_key, h.num_tokens, h.shape, h.dtype) == (
        FORMAT_VERSION, key, ROOT_HASH, 4, SHAPE, "<f4")
    assert b"pickle" not in rec and rec[:8] == b"MNVKVBLK"


def test_every_flipped_byte_is_refused():
    """A flip anywhere — header, tokens, payload, checksum — is refused; none decodes to other K/V."""
    key, rec = _record()
    for i in range(0, len(rec), 7):
        bad = bytearray(rec)
        bad[i] ^= 0x10
        with pytest.raises(RecordError):
            _decode(bytes(bad), key)
    with pytest.raises(RecordChecksumError):
        _decode(rec[:-1], key)  # truncated (a half-written value)


def test_future_format_version_is_a_version_error():
    key, rec = _record()
    future = bytearray(rec)
    future[8:10] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    with pytest.raises(RecordVersionError, match="format version 2"):
        _decode(bytes(future), key)
    with pytest.raises(RecordVersionError, match="not a minienv KV record"):
        _decode(b"X" * len(rec), key)


def test_mismatches_are_refused_even_with_a_valid_checksum():
    key, rec = _record()
    with pytest.raises(RecordMismatchError, match="fingerprint"):
        _decode(rec, key, fp=bytes(32))
    with pytest.raises(RecordMismatchError, match="another key"):
        _decode(rec, block_keys([9, 9, 9, 9], 4, FP)[0])
    with pytest.raises(RecordMismatchError, match="other token ids"):
        decode_record(rec, fingerprint=FP, key=key, parent_key=ROOT_HASH, token_ids=(1, 2, 3, 5), shape=SHAPE)
    with pytest.raises(RecordMismatchError, match="shape"):
        decode_record(rec, fingerprint=FP, key=key, parent_key=ROOT_HASH, token_ids=(1, 2, 3, 4),
                      shape=(2, 2, 4, 1, 16))


def _tiny_model(seed: int) -> LlamaModel:
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    return LlamaModel(cfg, random_weights(cfg, seed=seed))


def test_fingerprint_separates_weights_block_size_and_dtype():
    a, b = _tiny_model(0), _tiny_model(1)  # same shapes, other weights
    fa = model_fingerprint(a, 16)
    assert fa == model_fingerprint(_tiny_model(0), 16)  # deterministic
    assert len({fa, model_fingerprint(b, 16), model_fingerprint(a, 8), model_fingerprint(a, 16, "bfloat16")}) == 4
    tokens = list(range(32))
    assert block_keys(tokens, 16, fa) != block_keys(tokens, 16, model_fingerprint(b, 16))


def test_keys_are_chain_hashes_and_prefix_stable():
    tokens = list(range(40))
    keys = block_keys(tokens, 8, FP)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert block_keys(tokens[:24] + [0] * 16, 8, FP)[:3] == keys[:3]  # same prefix, same keys
    assert block_keys([1] + tokens[1:], 8, FP)[4] != keys[4]  # an earlier token changes every later key
    assert block_keys(tokens[16:], 8, FP, parent_key=keys[1]) == keys[2:]  # a chain can be continued


def test_keys_do_not_depend_on_pythonhashseed():
    code = ("from minienv.kv_tier import block_keys; "
            "print(b''.join(block_keys(list(range(64)), 16, bytes(32))).hex())")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert len(outs) == 1 and outs.pop() == b"".join(block_keys(list(range(64)), 16, bytes(32))).hex()


# ------------------------------------------------------------------------------------------------ SQLite store
def _chain(n, start=0, seed=0):
    """n chained (key, parent, record) of one sequence."""
    tokens = list(range(start, start + 4 * n))
    keys = block_keys(tokens, 4, FP)
    out = []
    for j, key in enumerate(keys):
        parent = keys[j - 1] if j else ROOT_HASH
        out.append((key, parent, encode_record(FP, key, parent, tokens[4 * j:4 * j + 4], _block(seed + j))))
    return out


def test_sqlite_put_get_and_contains_prefix(tmp_path):
    store = SQLiteStore(tmp_path / "tier")
    chain = _chain(4)
    for key, parent, rec in chain:
        assert store.put(key, parent, rec).status == "stored"
    assert store.put(*chain[0]).status == "present"
    keys = [k for k, _, _ in chain]
    assert store.contains_prefix(keys) == 4
    assert store.contains_prefix(keys[:2] + [bytes(32)] + keys[3:]) == 2
    assert store.get_many(keys + [bytes(32)]) == [r for _, _, r in chain] + [None]
    assert store.usage() == (4, sum(len(r) for _, _, r in chain))
    store.check_invariants()
    store.close()
    again = SQLiteStore(tmp_path / "tier")  # reopened: everything is still there
    assert again.contains_prefix(keys) == 4


def test_sqlite_refuses_orphans(tmp_path):
    store = SQLiteStore(tmp_path)
    chain = _chain(3)
    assert store.put(*chain[1]).status == "orphan"  # its parent is not stored
    assert store.usage() == (0, 0)
    store.check_invariants()


def test_sqlite_evicts_chain_tails_first_and_refreshes_lru(tmp_path):
    a, b = _chain(3, start=0), _chain(3, start=100, seed=10)
    size = len(a[0][2])
    store = SQLiteStore(tmp_path, capacity_bytes=6 * size)
    for item in a + b:
        store.put(*item)
    store.get_many([k for k, _, _ in a])  # a is now the most recently used
    c = _chain(2, start=200, seed=20)
    evicted = sum(store.put(*item).evicted for item in c)
    assert evicted == 2
    # b lost its tail blocks (2, then 1): never its first block while a child is stored; a untouched
    assert store.contains_prefix([k for k, _, _ in b]) == 1
    assert store.contains_prefix([k for k, _, _ in a]) == 3
    assert store.evictions() == 2
    store.check_invariants()


def test_sqlite_random_operations_keep_invariants(tmp_path):
    rng = random.Random(0)
    chains = [_chain(5, start=100 * i, seed=i) for i in range(6)]
    size = len(chains[0][0][2])
    store = SQLiteStore(tmp_path, capacity_bytes=9 * size)
    for _ in range(150):
        chain = rng.choice(chains)
        if rng.random() < 0.6:
            n = rng.randint(1, 5)
            for item in chain[:n]:
                store.put(*item)
        else:
            store.get_many([k for k, _, _ in chain[:rng.randint(1, 5)]])
        store.check_invariants()
    assert store.usage()[1] <= 9 * size


def test_a_record_bigger_than_capacity_is_refused(tmp_path):
    key, parent, rec = _chain(1)[0]
    store = SQLiteStore(tmp_path, capacity_bytes=len(rec) - 1)
    assert store.put(key, parent, rec).status == "too_big"
    assert store.usage() == (0, 0)


def test_bad_tier_paths_are_clear_errors(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("not a directory")
    with pytest.raises(TierConfigError, match="is a file"):
        SQLiteStore(f)
    with pytest.raises(TierConfigError, match="cannot create"):
        SQLiteStore(f / "below_a_file")
    with pytest.raises(TierConfigError, match="cannot create"):
        SQLiteStore("/proc/minienv_kv_tier")  # a place nobody can write, not even root
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "kv_tier.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(TierConfigError, match="cannot use"):
        SQLiteStore(tmp_path / "garbage")
    with pytest.raises(TierConfigError, match="capacity_bytes"):
        SQLiteStore(tmp_path / "ok", capacity_bytes=0)
    assert f.read_text() == "not a directory"  # nothing lost


def _writer(path: str, seed: int, rounds: int) -> None:
    store = SQLiteStore(path, capacity_bytes=20 * 1200)
    chains = [_chain(4, start=100 * i, seed=i) for i in range(8)]  # the same blocks in every writer
    rng = random.Random(seed)
    for _ in range(rounds):
        for item in rng.choice(chains):
            store.put(*item)


def test_concurrent_writers_never_leave_a_bad_record(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s, 40)) for s in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = SQLiteStore(tmp_path, capacity_bytes=20 * 1200)
    store.check_invariants()
    records = store.records()
    assert records
    expected = {}  # key -> (parent, tokens) of every block any writer wrote
    for i in range(8):
        tokens = list(range(100 * i, 100 * i + 16))
        for j, (key, parent, _) in enumerate(_chain(4, start=100 * i, seed=i)):
            expected[key] = (parent, tokens[4 * j:4 * j + 4])
    for key, parent, _, _ in records:
        assert expected[key][0] == parent
        decode_record(store.raw(key), fingerprint=FP, key=key, parent_key=parent, token_ids=expected[key][1],
                      shape=SHAPE)


def test_header_size_is_what_the_docstring_says():
    assert HEADER_SIZE == 149

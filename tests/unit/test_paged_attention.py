"""Paged attention == dense attention, and the two kernels == each other: hypothesis properties over random
batches, lengths (prefill chunks that start mid-sequence, decodes), block sizes 1/2/16/64, GQA ratios, physical
block orders and blocks shared between sequences."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minienv.kv import (
    BlockPool,
    BlockTable,
    KVPool,
    PagedAttentionBackend,
    PagedAttentionMetadata,
    gather_kv,
    paged_attention,
)
from minienv.model.attention import causal_attention

pa = importlib.import_module("minienv.kv.paged_attention")  # the module (minienv.kv re-exports its function)

needs_numba = pytest.mark.skipif(pa.NUMBA_MISSING is not None, reason=f"numba missing: {pa.NUMBA_MISSING}")
KERNELS = ["numpy", pytest.param("numba", marks=needs_numba)]

def build_batch(rng, block_size, context_lens, query_lens, hkv, group, head_dim, scramble, layers=1):
    """A pool whose blocks were handed out in a scrambled order, sequences' old K/V already written, new K/V
    written through the step's slot mapping. Returns the pool, the metadata, the queries, and the dense K/V."""
    s = len(context_lens)
    need = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens, strict=True))
    pool = BlockPool(need + scramble + 1)
    # scramble the free queue: allocate some blocks and free them in a random order
    if scramble:
        held = pool.allocate(scramble)
        pool.free(list(rng.permutation(held)))
    kv = KVPool(layers, pool.num_blocks, block_size, hkv, head_dim)
    tables = [BlockTable(block_size) for _ in range(s)]
    dense_k, dense_v = [], []
    # grow the sequences' contexts interleaved, chunk by chunk, so their blocks interleave in the pool
    for i in range(s):
        total = context_lens[i] + query_lens[i]
        dense_k.append(rng.standard_normal((layers, total, hkv, head_dim), dtype=np.float32))
        dense_v.append(rng.standard_normal((layers, total, hkv, head_dim), dtype=np.float32))
    written = [0] * s
    while any(w < c for w, c in zip(written, context_lens, strict=True)):
        for i in range(s):
            n = min(int(rng.integers(1, 2 * block_size + 1)), context_lens[i] - written[i])
            if n > 0:
                tables[i].append_tokens(n, pool)
                for layer in range(layers):
                    slots = tables[i].slot_mapping(written[i], written[i] + n)
                    kv.write(layer, slots, dense_k[i][layer, written[i]:written[i] + n],
                             dense_v[i][layer, written[i]:written[i] + n])
                written[i] += n
    for i in range(s):
        tables[i].append_tokens(query_lens[i], pool)
    meta = PagedAttentionMetadata.from_block_tables(tables, query_lens)
    new_k = [np.concatenate([dense_k[i][layer, context_lens[i]:] for i in range(s)]) for layer in range(layers)]
    new_v = [np.concatenate([dense_v[i][layer, context_lens[i]:] for i in range(s)]) for layer in range(layers)]
    q = rng.standard_normal((meta.num_tokens, hkv * group, head_dim), dtype=np.float32)
    return kv, meta, q, new_k, new_v, dense_k, dense_v, tables, pool


def dense_reference(q, meta, dense_k, dense_v, layer=0):
    outs = []
    for i in range(meta.num_seqs):  # the reference may loop: it is the slow obvious version
        lo, hi = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        ctx = int(meta.context_lens[i])
        outs.append(causal_attention(q[lo:hi], dense_k[i][layer], dense_v[i][layer], np.arange(ctx, ctx + hi - lo)))
    return np.concatenate(outs)


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 16, 64]),
    num_seqs=st.integers(1, 4),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([2, 8]),
    decode=st.booleans(),
    kernel=st.sampled_from(["auto", "numpy"] + ([] if pa.NUMBA_MISSING else ["numba"])),
    scramble=st.integers(0, 6),
    data=st.data(),
)
def test_paged_attention_equals_dense(seed, block_size, num_seqs, hkv, group, head_dim, decode, kernel, scramble,
                                      data):
    rng = np.random.default_rng(seed)
    context_lens = data.draw(st.lists(st.integers(0, 80), min_size=num_seqs, max_size=num_seqs))
    if decode:
        query_lens = [1] * num_seqs
    else:
        # about half the sequences decode: mixed steps (decodes beside prefill chunks) are the engine's usual ones
        query_lens = data.draw(st.lists(st.one_of(st.just(1), st.integers(1, 12)), min_size=num_seqs,
                                        max_size=num_seqs))
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, block_size, context_lens, query_lens, hkv, group, head_dim, scramble)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    got = paged_attention(q, kv.kv_cache[0], meta, kernel)
    want = dense_reference(q, meta, dense_k, dense_v)
    assert got.shape == want.shape == q.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@needs_numba
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 4, 16]), num_seqs=st.integers(1, 6),
       hkv=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3]), shared_blocks=st.integers(0, 4),
       data=st.data())
def test_the_block_walk_equals_the_numpy_kernel_on_ragged_shared_gqa_steps(seed, block_size, num_seqs, hkv, group,
                                                                          shared_blocks, data):
    """The differential proof of the two kernels: random ragged lengths, prefill chunks beside decodes, GQA, and
    the first ``shared_blocks`` blocks of every table one physical copy (a prefix hit / a fork), in random pool
    order."""
    rng = np.random.default_rng(seed)
    d = data.draw(st.sampled_from([16, 20, 48]))  # 48: the bundled model's; 20: rows no vector width divides
    lens = data.draw(st.lists(st.integers(1, 90), min_size=num_seqs, max_size=num_seqs))
    query_lens = [min(n, data.draw(st.sampled_from([1, 1, 3, 17]))) for n in lens]
    shared = min(shared_blocks, min(n - q for n, q in zip(lens, query_lens)) // block_size)
    need = shared + sum(-(-n // block_size) - shared for n in lens)
    ids = rng.permutation(need + 3).tolist()  # physical ids in a random order, a few never used
    prefix, rest = ids[:shared], iter(ids[shared:])
    tables = [prefix + [next(rest) for _ in range(-(-n // block_size) - shared)] for n in lens]
    kv = KVPool(1, need + 3, block_size, hkv, d)
    kv.storage[...] = rng.standard_normal(kv.storage.shape, dtype=np.float32)
    bt = np.zeros((num_seqs, max(map(len, tables))), dtype=np.int64)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    ctx = np.array(lens) - np.array(query_lens)
    pos = np.concatenate([np.arange(c, n) for c, n in zip(ctx, lens)])
    seq = np.repeat(np.arange(num_seqs), query_lens)
    slots = bt[seq, pos // block_size] * block_size + pos % block_size
    meta = PagedAttentionMetadata(bt, ctx, query_lens, slots, block_size)
    q = rng.standard_normal((meta.num_tokens, hkv * group, d), dtype=np.float32)
    walked = paged_attention(q, kv.kv_cache[0], meta, "numba")
    gathered = paged_attention(q, kv.kv_cache[0], meta, "numpy")
    np.testing.assert_allclose(walked, gathered, atol=1e-5, rtol=0)


@needs_numba
def test_the_block_walks_exp_is_np_exp_on_the_scores_it_sees():
    """The softmax pass's vectorisable ``exp`` (a polynomial, see ``minienv/kv/block_walk.py``): within 2e-7
    relative of ``np.exp`` on ``x <= 0`` (scores minus their row's maximum); 0 below float32's normal range; NaN
    stays NaN, so a broken score still reaches the output."""
    from minienv.kv.block_walk import exp_f32

    xs = np.concatenate([-np.logspace(-9, np.log10(87.0), 4000), [0.0, -0.0, -0.5, -np.log(2.0), -86.99]])
    xs = xs.astype(np.float32)
    got = np.array([exp_f32(x) for x in xs], dtype=np.float64)
    want = np.exp(xs.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2e-7
    assert exp_f32(np.float32(0.0)) == 1.0
    for x in (-87.5, -100.0, -1e30, -np.inf):
        assert exp_f32(np.float32(x)) == 0.0
    assert np.isnan(exp_f32(np.float32(np.nan)))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_nan_in_one_sequences_keys_reaches_its_output_and_no_other(kernel):
    """No ``nnan`` fast-math: a NaN key poisons its own sequence's attention (the engine's logit check sees it)
    and leaves every other sequence's output as it was."""
    rng = np.random.default_rng(3)
    kv, meta, q, new_k, new_v, *_ = build_batch(rng, 4, [9, 13, 6], [1, 1, 1], 2, 2, 16, 5)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    clean = paged_attention(q, kv.kv_cache[0], meta, kernel)
    kv.kv_cache[0, 0, meta.block_tables[1, 1], 2, 0, 5] = np.nan  # sequence 1, key 6, KV head 0
    got = paged_attention(q, kv.kv_cache[0], meta, kernel)
    assert np.isnan(got[1, :2]).all() and not np.isnan(got[1, 2:]).any()  # query heads 0-1 read KV head 0
    assert np.array_equal(got[[0, 2]], clean[[0, 2]])


def test_the_walk_visits_every_block_once_per_holder_in_physical_order():
    bt = np.array([[7, 2, 9, 0], [7, 4, 0, 0]])  # block 7 shared; sequence 0 holds 3 blocks, 1 holds 2
    meta = PagedAttentionMetadata(bt, [40, 20], [1, 1], [9 * 16 + 8, 4 * 16 + 4], 16)
    seq, blk = pa.walk_order(meta)
    assert bt[seq, blk].tolist() == [2, 4, 7, 7, 9]
    assert sorted(zip(seq.tolist(), blk.tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_steps_plan_is_made_once_and_shared_by_every_layer(kernel, monkeypatch):
    """The walk order / the gather groups belong to the step's metadata: made on the first layer's call and reused
    by every other layer and by bare ``paged_attention`` calls on the same metadata (not rebuilt per call)."""
    rng = np.random.default_rng(5)
    kv, meta, q, new_k, new_v, *_ = build_batch(rng, 4, [9, 13, 6], [1, 2, 1], 2, 2, 16, 5)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    made = []

    class CountedPlan(pa.GatherPlan):
        @classmethod
        def of(cls, m):
            made.append(m)
            return super().of(m)

    monkeypatch.setattr(pa, "GatherPlan", CountedPlan)
    monkeypatch.setattr(pa, "walk_order", lambda m, real=pa.walk_order: made.append(m) or real(m))
    first = paged_attention(q, kv.kv_cache[0], meta, kernel)
    for _ in range(3):
        assert np.array_equal(paged_attention(q, kv.kv_cache[0], meta, kernel), first)
    assert len(made) == 1
    other = PagedAttentionMetadata(meta.block_tables, meta.context_lens, meta.query_lens, None, meta.block_size)
    paged_attention(q, kv.kv_cache[0], other, kernel)
    assert len(made) == 2  # a new step's metadata gets its own plan


def test_auto_is_the_block_walk_exactly_when_numba_imports(monkeypatch):
    assert pa.resolve_kernel_name("auto") == ("numpy" if pa.NUMBA_MISSING else "numba")
    monkeypatch.setattr(pa, "_block_walk", None)
    monkeypatch.setattr(pa, "NUMBA_MISSING", "ModuleNotFoundError: No module named 'numba'")
    assert pa.resolve_kernel_name("auto") == "numpy"
    assert PagedAttentionBackend(KVPool(1, 2, 2, 1, 2)).kernel == "numpy"
    with pytest.raises(ValueError, match="needs the numba package"):
        PagedAttentionBackend(KVPool(1, 2, 2, 1, 2), kernel="numba")
    with pytest.raises(ValueError, match="kernel must be one of"):
        pa.resolve_kernel_name("inplace")


@pytest.mark.parametrize("kernel", KERNELS)
def test_chunked_prefill_from_mid_sequence_equals_one_shot_prefill(kernel):
    rng = np.random.default_rng(0)
    b, hkv, group, d, total = 4, 2, 2, 8, 23
    k = rng.standard_normal((total, hkv, d), dtype=np.float32)
    v = rng.standard_normal((total, hkv, d), dtype=np.float32)
    q = rng.standard_normal((total, hkv * group, d), dtype=np.float32)
    want = causal_attention(q, k, v, np.arange(total))
    pool, kv, table = BlockPool(16), KVPool(1, 16, b, hkv, d), BlockTable(b)
    pool.allocate(5)
    got = []
    for lo, hi in [(0, 6), (6, 7), (7, 19), (19, 23)]:  # chunks straddling block boundaries, and a decode
        table.append_tokens(hi - lo, pool)
        meta = PagedAttentionMetadata.from_block_tables([table], [hi - lo])
        assert meta.positions.tolist() == list(range(lo, hi))
        kv.write(0, meta.slot_mapping, k[lo:hi], v[lo:hi])
        got.append(paged_attention(q[lo:hi], kv.kv_cache[0], meta, kernel))
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-5, rtol=0)


def test_gather_kv_returns_blocks_in_logical_order():
    kv = KVPool(1, 6, 2, 1, 1)
    kv.kv_cache[0, 0, :, :, 0, 0] = np.arange(12, dtype=np.float32).reshape(6, 2)
    out = gather_kv(kv.kv_cache[0], np.array([[4, 1], [0, 5]]))
    assert out.shape == (2, 2, 4, 1, 1)
    assert out[0, :, :, 0, 0].tolist() == [[8, 9, 2, 3], [0, 1, 10, 11]]


def test_metadata_validation():
    with pytest.raises(ValueError, match="one slot per new token"):
        PagedAttentionMetadata(np.zeros((1, 2)), [0], [3], [0, 1], block_size=2)
    with pytest.raises(ValueError, match=">= 1 new token"):
        PagedAttentionMetadata(np.zeros((1, 2)), [0], [0], [], block_size=2)
    with pytest.raises(ValueError, match="longer than its block table"):
        PagedAttentionMetadata(np.zeros((1, 1)), [2], [1], [0], block_size=2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_backend_checks_the_step_protocol(kernel):
    kv = KVPool(1, 4, 2, 1, 2)
    pool, table = BlockPool(4), BlockTable(2)
    backend = PagedAttentionBackend(kv, kernel)
    with pytest.raises(RuntimeError, match="set_metadata"):
        backend.begin_step(np.array([0]))
    table.append_tokens(3, pool)
    backend.set_metadata(PagedAttentionMetadata.from_block_tables([table], [3]))
    with pytest.raises(ValueError, match="positions disagree"):
        backend.begin_step(np.array([1, 2, 3]))
    backend.begin_step(np.array([0, 1, 2]))
    backend.begin_step(backend.metadata.positions)  # the engine's call: the metadata's own array
    x = np.ones((3, 1, 2), dtype=np.float32)
    out = backend.attend(0, x, x, x)
    assert out.shape == (3, 1, 2)
    backend.end_step()
    assert backend.metadata is None


def test_kv_pool_memory_keeps_heads_outermost_and_every_write_lands_in_its_own_pool():
    """The layout ``KVPool``'s docstring promises: ``kv_cache[l, kv, b, s, h]`` is ``storage[l, kv, h, b, s]``, so
    a run of blocks is, per head, one contiguous ``[tokens, D]`` slab; ``write``, ``read_slots`` and
    ``copy_blocks`` go through that memory, also in a deep-copied pool (whose views are its own)."""
    import copy

    rng = np.random.default_rng(16)
    pool = KVPool(2, 6, 4, 3, 5)
    twin = copy.deepcopy(pool)
    assert not np.shares_memory(pool.storage, twin.storage)
    for target in (pool, twin):
        assert np.shares_memory(target.kv_cache, target.storage) and target.storage.shape == (2, 2, 3, 6, 4, 5)
        slots = np.array([9, 2, 17])  # block 2 slot 1, block 0 slot 2, block 4 slot 1
        k, v = (rng.standard_normal((3, 3, 5), dtype=np.float32) for _ in range(2))
        target.write(1, slots, k, v)
        target.write(1, np.array([23]), k[:1] + 1, v[:1] + 1)
        got_k, got_v = target.read_slots(1, np.array([9, 2, 17, 23]))
        assert np.array_equal(got_k, np.concatenate([k, k[:1] + 1])) and np.array_equal(got_v[:3], v)
        for i, slot in enumerate(slots):
            b, s = divmod(int(slot), 4)
            for h in range(3):
                assert np.array_equal(target.storage[1, 0, h, b, s], k[i, h])
                assert np.array_equal(target.kv_cache[1, 1, b, s, h], v[i, h])
        run = target.storage[1, 0, 2, 1:4].reshape(12, 5)  # head 2's keys in blocks 1..3: reshapes without a copy
        assert np.shares_memory(run, target.storage) and run.flags.c_contiguous
        target.copy_blocks([(2, 5)])
        assert np.array_equal(target.kv_cache[:, :, 5], target.kv_cache[:, :, 2])
    assert not np.array_equal(pool.storage, twin.storage)  # each pool got its own random writes




@needs_numba
def test_the_block_walk_caches_its_compiled_code_where_numba_cache_dir_says(tmp_path):
    """``cache=True``: the first process compiles and writes the cache into ``NUMBA_CACHE_DIR`` (what a read-only
    install or a Binder image points at a writable folder), a second process loads it instead of compiling."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import time, numpy as np
t0 = time.perf_counter()
from minienv.kv import KVPool, PagedAttentionMetadata, paged_attention
kv = KVPool(1, 4, 4, 1, 8)
meta = PagedAttentionMetadata(np.array([[2, 0]]), [4], [1], [2 * 4 + 0], 4)
paged_attention(np.ones((1, 2, 8), dtype=np.float32), kv.kv_cache[0], meta, "numba")
print(round(time.perf_counter() - t0, 3))
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    cached = list(tmp_path.rglob("*block_walk*.nbi"))
    assert cached, f"no index file under {tmp_path}: {list(tmp_path.rglob('*'))}"
    compiled = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.nbc")}
    assert compiled
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    # loaded, not compiled again: the same cache entries, none rewritten
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*.nbc")} == compiled

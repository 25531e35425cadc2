"""Paged attention == dense attention: a hypothesis property over random batches, lengths (prefill chunks that
start mid-sequence, decodes), block sizes 1/2/16/64, GQA ratios and physical block orders."""

from __future__ import annotations

import dataclasses
import sys

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
    Workspace,
    causal_hidden_mask,
    gather_kv,
    paged_attention,
)
from minienv.model.attention import causal_attention


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


def tile_plan_of(meta):
    """The step's one tile plan (the metadata also caches auto's choice and the resolved step kernel)."""
    from minienv.kv.paged_attention import TilePlan

    (plan,) = [p for p in meta._plans.values() if isinstance(p, TilePlan)]
    return plan


def dense_reference(q, meta, dense_k, dense_v, layer=0):
    outs = []
    for i in range(meta.num_seqs):  # the reference may loop: it is the slow obvious version
        lo, hi = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        ctx = int(meta.context_lens[i])
        outs.append(causal_attention(q[lo:hi], dense_k[i][layer], dense_v[i][layer], np.arange(ctx, ctx + hi - lo)))
    return np.concatenate(outs)


@settings(max_examples=500, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 16, 64]),
    num_seqs=st.integers(1, 4),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([2, 8]),
    decode=st.booleans(),
    tile_bytes=st.sampled_from([1, 4096, 1 << 20]),
    kernel=st.sampled_from(["auto", "gather", "inplace"]),
    scramble=st.integers(0, 6),
    data=st.data(),
)
def test_paged_attention_equals_dense(seed, block_size, num_seqs, hkv, group, head_dim, decode, tile_bytes, kernel,
                                      scramble, data):
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
    got = paged_attention(q, kv.kv_cache[0], meta, Workspace(), tile_bytes, kernel)
    want = dense_reference(q, meta, dense_k, dense_v)
    assert got.shape == want.shape == q.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_chunked_prefill_from_mid_sequence_equals_one_shot_prefill():
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
        got.append(paged_attention(q[lo:hi], kv.kv_cache[0], meta))
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-5, rtol=0)


def test_batched_decode_of_different_lengths_uses_one_gather_per_tile():
    rng = np.random.default_rng(1)
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, 16, [3, 40, 0, 17, 100], [1] * 5, hkv=2, group=2, head_dim=8, scramble=4)
    assert meta.is_decode
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    ws = Workspace()
    got = paged_attention(q, kv.kv_cache[0], meta, ws, kernel="gather")
    np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)
    plan = tile_plan_of(meta)
    assert len(plan.tiles) == 1 and not plan.use_views  # a small batch is one tile: one np.take, one attention call
    buf = ws.buffer
    paged_attention(q, kv.kv_cache[0], meta, ws, kernel="gather")
    assert ws.buffer is buf  # the workspace is reused, not reallocated


def test_a_mixed_step_attends_its_decodes_unpadded_beside_its_prefill_chunks():
    """Decodes of a mixed step form their own group (one query row each), not rows padded to the longest chunk."""
    rng = np.random.default_rng(3)
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, 4, [9, 0, 30, 5, 17], [1, 11, 1, 6, 1], hkv=2, group=2, head_dim=8, scramble=3)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    got = paged_attention(q, kv.kv_cache[0], meta, Workspace(), kernel="gather")
    np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)
    plan = tile_plan_of(meta)
    assert plan.decode_rows.tolist() == [0, 12, 19]  # the decodes' token rows (tokens 0, 1+11, 1+11+1+6)
    assert plan.prefill_seqs.tolist() == [1, 3] and plan.prefill_max_q == 11
    assert [t.kv.shape[1] for t in plan.decode_tiles] == [3]


def test_a_decode_batch_of_several_tiles_is_walked_shortest_first():
    """Each tile pads only to its own longest sequence: fewer blocks gathered than tiles in batch order."""
    rng = np.random.default_rng(4)
    lens = [70, 3, 60, 5, 40, 2, 65, 7]
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, 4, lens, [1] * len(lens), hkv=2, group=2, head_dim=8, scramble=5)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    tile_bytes = 2 * 18 * 4 * 2 * 8 * 4 * 2  # two sequences of 18 blocks
    got = paged_attention(q, kv.kv_cache[0], meta, Workspace(), tile_bytes, kernel="gather")
    np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)
    plan = tile_plan_of(meta)
    blocks = [-(-(n + 1) // 4) for n in lens]  # each sequence holds its context and the new token
    assert plan.decode_rows.tolist() == np.argsort(blocks, kind="stable").tolist()
    assert (plan.decode_rows[plan.decode_inverse] == np.arange(len(lens))).all()
    gathered = sum(t.block_tables.size for t in plan.decode_tiles)
    in_batch_order = sum(-(-(max(lens[i:i + 2]) + 1) // 4) * 2 for i in range(0, len(lens), 2))
    assert gathered < in_batch_order


def test_inplace_decode_reads_blocks_where_they_lie():
    """The in-place kernel copies no K/V: it runs on a view of the pool range holding the step's blocks."""
    from minienv.kv.paged_attention import plan_inplace

    rng = np.random.default_rng(2)
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, pool = build_batch(
        rng, 4, [30, 5, 61, 12], [1] * 4, hkv=2, group=2, head_dim=8, scramble=3)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    plan = plan_inplace(meta, force=True)
    assert plan is not None and plan.span >= int((plan.seq_blocks < plan.span).sum()) == sum(-(-n // 4) for n in meta.seq_lens)
    got = paged_attention(q, kv.kv_cache[0], meta, Workspace(), kernel="inplace")
    np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)
    # not eligible: a prefill chunk, or a block shared by two sequences -> None (the gather kernel runs)
    shared = PagedAttentionMetadata(np.array([[3, 4], [3, 5]]), [5, 6], [1, 1], [9, 10], block_size=4)
    assert plan_inplace(shared, force=True) is None
    prefill = PagedAttentionMetadata(np.array([[3, 4]]), [2], [3], [2, 3, 4], block_size=4)
    assert plan_inplace(prefill, force=True) is None
    with pytest.raises(ValueError, match="kernel"):
        paged_attention(q, kv.kv_cache[0], meta, kernel="magic")


def test_a_sequence_whose_blocks_are_consecutive_is_attended_without_a_copy():
    rng = np.random.default_rng(3)
    b, hkv, d = 4, 2, 8
    pool, kv, table = BlockPool(16), KVPool(1, 16, b, hkv, d), BlockTable(b)
    pool.allocate(2)
    table.append_tokens(13, pool)  # blocks 2, 3, 4, 5: one physical run
    k = rng.standard_normal((13, hkv, d), dtype=np.float32)
    v = rng.standard_normal((13, hkv, d), dtype=np.float32)
    kv.write(0, table.slot_mapping(), k, v)
    meta = PagedAttentionMetadata.from_block_tables([table], [1])
    q = rng.standard_normal((1, 2 * hkv, d), dtype=np.float32)
    ws = Workspace()
    got = paged_attention(q, kv.kv_cache[0], meta, ws, kernel="auto")
    (plan,) = [v for key, v in meta._plans.items() if isinstance(key[0], int)]  # the tile plan
    assert plan.use_views and plan.tiles[0].run_start == 2 and ws.buffer.size == 2 * 4 * b * hkv * d  # buffer planned ...
    storage = sys.modules["minienv.kv.paged_attention"].layer_storage(kv.kv_cache[0])
    assert np.shares_memory(plan.tiles[0].kv_of(storage), kv.storage)  # ... but the K/V read is a view
    np.testing.assert_allclose(got, causal_attention(q, k, v, np.array([12])), atol=1e-5, rtol=0)


def test_auto_decides_short_steps_without_planning_in_place():
    """auto's decision for a step of short sequences costs O(sequences): no in-place plan (an O(blocks) pass)."""
    from minienv.kv.paged_attention import auto_kernel_of

    rng = np.random.default_rng(7)
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, 4, [30, 5, 61, 12], [1] * 4, hkv=2, group=2, head_dim=8, scramble=3)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    ws = Workspace()
    got = paged_attention(q, kv.kv_cache[0], meta, ws, kernel="auto")
    assert not any(key[0] == "inplace" for key in meta._plans)  # never planned
    assert auto_kernel_of(meta, 2, 8, workspace=ws) == "gather"
    np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)


def test_auto_on_long_scattered_decodes_runs_the_in_place_kernel_and_agrees(monkeypatch):
    """Where auto picks in place (threshold lowered so small sequences qualify), it runs exactly that kernel."""
    pa = sys.modules["minienv.kv.paged_attention"]

    monkeypatch.setattr(pa, "INPLACE_MIN_MEAN_KEYS", 8)
    rng = np.random.default_rng(8)
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, 4, [30, 25, 61, 12], [1] * 4, hkv=2, group=2, head_dim=8, scramble=0)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    ws = Workspace()
    got = paged_attention(q, kv.kv_cache[0], meta, ws, kernel="auto")
    assert pa.auto_kernel_of(meta, 2, 8, workspace=ws) == "inplace"
    assert [key for key in meta._plans if key[0] == "inplace"] == [("inplace", False, 2, 8)]  # planned once
    np.testing.assert_array_equal(got, paged_attention(q, kv.kv_cache[0], meta, Workspace(), kernel="inplace"))
    np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)
    # a shared block makes the in-place kernel ineligible: auto falls back to gather, still correct
    shared = PagedAttentionMetadata(np.array([[3, 4, 6], [3, 5, 7]]), [10, 10], [1, 1], [6 * 4 + 2, 7 * 4 + 2],
                                    block_size=4)
    assert pa.auto_kernel_of(shared, 2, 8) == "gather"


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.integers(1, 600))
@settings(max_examples=200, deadline=None)
def test_auto_mean_keys_test_equals_numpys_mean(lens, keys):
    """auto's "do these sequences average >= keys?" is an integer sum compared with ``keys * S``: the answer of
    ``np.mean(seq_lens) >= keys`` at every length mix, the boundary (mean exactly ``keys``) included."""
    pa = sys.modules["minienv.kv.paged_attention"]
    for lens_ in (lens, [keys] * len(lens)):  # any mix, and one whose mean is exactly at the threshold
        context = [n - 1 for n in lens_]  # + one decode token each: seq_lens == lens_
        meta = PagedAttentionMetadata(np.zeros((len(lens_), 1), dtype=np.int64), context, [1] * len(lens_),
                                      context, block_size=max(lens_))
        assert meta.seq_lens.tolist() == lens_
        assert pa._mean_keys_at_least(meta, keys) == (float(np.mean(lens_)) >= keys)


@pytest.mark.parametrize("kernel", ["gather", "inplace"])
def test_batched_decode_of_many_sequences(kernel):
    """More than 8 sequences: the in-place kernel sums block outputs with a gather instead of a one-hot matmul."""
    rng = np.random.default_rng(6)
    context = rng.integers(0, 70, 12).tolist()
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, 4, context, [1] * 12, hkv=1, group=4, head_dim=8, scramble=5)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    got = paged_attention(q, kv.kv_cache[0], meta, Workspace(), tile_bytes=2048, kernel=kernel)
    np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel", ["gather", "inplace"])
def test_decode_over_long_contexts(kernel):
    """Contexts of more than a thousand keys (the benchmark's sizes) agree too."""
    LONG_KEYS = 1024
    rng = np.random.default_rng(5)
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, 16, [LONG_KEYS + 37, LONG_KEYS - 50, 5], [1] * 3, hkv=2, group=2, head_dim=8, scramble=2)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    got = paged_attention(q, kv.kv_cache[0], meta, Workspace(), kernel=kernel)
    np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("tile_bytes", [4096, 1 << 20])
def test_long_decode_as_matrix_vector_products_equals_the_matrix_matrix_form(block_size, tile_bytes, monkeypatch):
    """The long-context decode form (matrix-vector products) is the same maths as ``q @ Kᵀ``: equal within 5e-7 over ragged
    contexts on both sides of the switch-over, and equal to the dense reference."""
    pa = sys.modules["minienv.kv.paged_attention"]
    assert pa.MATVEC_MIN_KEYS <= 2048  # the benchmark's longest context takes the new form
    rng = np.random.default_rng(block_size)
    lens = [pa.MATVEC_MIN_KEYS + 37, pa.MATVEC_MIN_KEYS - 1, pa.MATVEC_MIN_KEYS, 5, 0]
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, block_size, lens, [1] * len(lens), hkv=2, group=2, head_dim=8, scramble=3)
    kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
    new = paged_attention(q, kv.kv_cache[0], meta, Workspace(), tile_bytes, "gather")
    for min_keys in (1, 10**9):  # every tile as matrix-vector products, then none
        monkeypatch.setattr(pa, "MATVEC_MIN_KEYS", min_keys)
        meta._plans.clear()
        other = paged_attention(q, kv.kv_cache[0], meta, Workspace(), tile_bytes, "gather")
        np.testing.assert_allclose(new, other, atol=5e-7, rtol=0)
    np.testing.assert_allclose(new, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)


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


def test_backend_checks_the_step_protocol():
    kv = KVPool(1, 4, 2, 1, 2)
    pool, table = BlockPool(4), BlockTable(2)
    backend = PagedAttentionBackend(kv)
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


def test_decode_bias_equals_the_general_causal_mask():
    """The decode group's mask, made with one comparison, is the general causal mask's additive form."""
    from minienv.kv.paged_attention import _decode_bias, hidden_bias

    rng = np.random.default_rng(5)
    for _ in range(50):
        seq_lens = rng.integers(1, 40, int(rng.integers(1, 6)))
        num_keys = int(seq_lens.max()) + int(rng.integers(0, 9))
        want = hidden_bias(causal_hidden_mask(seq_lens - 1, np.ones_like(seq_lens), 1, num_keys))
        got = _decode_bias(seq_lens, num_keys)
        if want is None:
            assert got is None
        else:
            assert got.shape == want.shape and got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("width", [1, 2, 3, 5, 7, 16, 17, 64])
def test_max_by_halving_equals_numpy_max(width):
    """The in-place kernel's per-block maxima (halving) == ``max(axis=-1)`` exactly, at odd widths too."""
    pa = sys.modules["minienv.kv.paged_attention"]
    x = np.random.default_rng(width).standard_normal((6, 2, 3, width)).astype(np.float32)
    x[0, 0, 0, -1] = np.inf  # an extreme in the odd column out is not lost
    x[1, 1, 1] = -np.inf  # a fully masked row stays -inf
    out = np.empty(x.shape[:-1], dtype=np.float32)
    np.testing.assert_array_equal(pa._max_last_axis(x, out), x.max(axis=-1))


class _Sequence:
    """A test sequence: its block table and the dense K/V of every token it holds, per layer."""

    def __init__(self, block_size: int, layers: int, hkv: int, head_dim: int):
        self.table = BlockTable(block_size)
        self.k = np.zeros((layers, 0, hkv, head_dim), dtype=np.float32)
        self.v = np.zeros_like(self.k)


def _run_step(rng, backend, kv, pool, seqs, query_lens, layers, hkv, group, head_dim):
    """One step through ``backend`` and through a fresh backend (a fresh plan) on the same pool: equal exactly at
    every layer, and equal to dense attention within the property test's tolerance."""
    b = kv.block_size
    new_k, new_v = [], []
    for seq, n in zip(seqs, query_lens, strict=True):
        seq.table.append_tokens(n, pool)
        k = rng.standard_normal((layers, n, hkv, head_dim), dtype=np.float32)
        v = rng.standard_normal((layers, n, hkv, head_dim), dtype=np.float32)
        seq.k, seq.v = np.concatenate([seq.k, k], axis=1), np.concatenate([seq.v, v], axis=1)
        new_k.append(k)
        new_v.append(v)
    meta = PagedAttentionMetadata.from_block_tables([s.table for s in seqs], query_lens)
    fresh_meta = PagedAttentionMetadata(meta.block_tables.copy(), meta.context_lens, meta.query_lens,
                                        meta.slot_mapping, b)
    fresh = PagedAttentionBackend(kv, backend.tile_bytes, backend.kernel)
    for be, m in ((backend, meta), (fresh, fresh_meta)):
        be.set_metadata(m)
        be.begin_step(m.positions)
    for layer in range(layers):
        q = rng.standard_normal((meta.num_tokens, hkv * group, head_dim), dtype=np.float32)
        k = np.concatenate([k[layer] for k in new_k])
        v = np.concatenate([v[layer] for v in new_v])
        got = backend.attend(layer, q, k, v)
        np.testing.assert_array_equal(got, fresh.attend(layer, q, k, v))  # fresh writes the same K/V again
        want = dense_reference(q, meta, [s.k for s in seqs], [s.v for s in seqs], layer)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    backend.end_step()
    fresh.end_step()
    return meta


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4, 16]),
    tile_bytes=st.sampled_from([1, 4096, 1 << 20]),
    kernel=st.sampled_from(["auto", "gather", "inplace"]),
    group=st.sampled_from([1, 2]),
)
def test_a_backend_carrying_its_plan_across_steps_equals_a_fresh_plan_at_every_step(seed, block_size, tile_bytes,
                                                                                      kernel, group):
    """A run of steps through one backend — steady decodes (tables equal), decodes that take a new block,
    reordered, dropped and added sequences, prefill and mixed steps, rolled-back sequences, and the same tables
    over rewritten pool contents — equals, step by step and bit for bit, a fresh backend that plans every step;
    and the backend carries its plan exactly when two consecutive decode steps that plan (not a lone sequence over
    one run of blocks, which is sliced instead) have equal tables."""
    rng = np.random.default_rng(seed)
    layers, hkv, head_dim = 2, 2, 8
    pool = BlockPool(6 * (160 // block_size + 2))
    kv = KVPool(layers, pool.num_blocks, block_size, hkv, head_dim)
    backend = PagedAttentionBackend(kv, tile_bytes=tile_bytes, kernel=kernel)
    seqs: list[_Sequence] = []
    previous = None  # the last step's metadata if it was a decode step
    expected_reuse = 0
    for _ in range(30):
        event = rng.random()
        if seqs and event < 0.08 and len(seqs) > 1:  # reorder
            seqs = [seqs[i] for i in rng.permutation(len(seqs))]
        elif seqs and event < 0.14:  # drop a sequence
            seqs.pop(int(rng.integers(len(seqs)))).table.free(pool)
        elif seqs and event < 0.22:  # roll a sequence back a few tokens (speculative rejection): tables may stay
            seq = seqs[int(rng.integers(len(seqs)))]
            keep = max(1, seq.table.num_tokens - int(rng.integers(1, 4)))
            seq.table.truncate(keep, pool)
            seq.k, seq.v = seq.k[:, :keep], seq.v[:, :keep]
        elif seqs and event < 0.32:  # the same tables over new contents (copy-on-write, a rewritten block)
            seq = seqs[int(rng.integers(len(seqs)))]
            lo = int(rng.integers(seq.table.num_tokens))
            for layer in range(layers):
                seq.k[layer, lo:] = rng.standard_normal(seq.k[layer, lo:].shape, dtype=np.float32)
                seq.v[layer, lo:] = rng.standard_normal(seq.v[layer, lo:].shape, dtype=np.float32)
                kv.write(layer, seq.table.slot_mapping(lo), seq.k[layer, lo:], seq.v[layer, lo:])
        if not seqs or (len(seqs) < 5 and rng.random() < 0.15):  # a new sequence's prefill, beside decodes
            seqs.append(_Sequence(block_size, layers, hkv, head_dim))
            query_lens = [1] * (len(seqs) - 1) + [int(rng.integers(2, 40))]
        elif rng.random() < 0.1:  # a mixed step: one sequence takes a chunk
            query_lens = [1] * len(seqs)
            query_lens[int(rng.integers(len(seqs)))] = int(rng.integers(2, 8))
        else:
            query_lens = [1] * len(seqs)
        if max(s.table.num_tokens for s in seqs) > 150:  # keep the pool big enough: end the longest
            longest = max(range(len(seqs)), key=lambda i: seqs[i].table.num_tokens)
            seqs.pop(longest).table.free(pool)
            previous = None
            continue
        meta = _run_step(rng, backend, kv, pool, seqs, query_lens, layers, hkv, group, head_dim)
        # a lone sequence decoding over one run of blocks is sliced, not planned: nothing to carry either way
        lone = kernel != "inplace" and sys.modules["minienv.kv.paged_attention"].lone_run_of(
            meta, np.arange(kv.num_blocks)) is not None
        if meta.is_decode and not lone and previous is not None \
                and np.array_equal(meta.block_tables, previous.block_tables) \
                and np.array_equal(-(-meta.seq_lens // block_size), -(-previous.seq_lens // block_size)):
            expected_reuse += 1
        previous = meta if meta.is_decode and not lone else None
    assert backend.reused_plans == expected_reuse


def test_a_steady_decode_batch_carries_its_plan_and_a_step_that_did_not_end_does_not():
    rng = np.random.default_rng(11)
    layers, hkv, head_dim, b = 1, 2, 8, 4
    pool = BlockPool(64)
    kv = KVPool(layers, pool.num_blocks, b, hkv, head_dim)
    backend = PagedAttentionBackend(kv, kernel="gather")
    seqs = [_Sequence(b, layers, hkv, head_dim) for _ in range(3)]
    _run_step(rng, backend, kv, pool, seqs, [5, 9, 1], layers, hkv, 2, head_dim)  # prefill: planned
    first = _run_step(rng, backend, kv, pool, seqs, [1, 1, 1], layers, hkv, 2, head_dim)  # 6, 10, 2: planned
    second = _run_step(rng, backend, kv, pool, seqs, [1, 1, 1], layers, hkv, 2, head_dim)  # 7, 11, 3: same blocks
    assert backend.reused_plans == 1
    assert first._plans.get(backend._plan_key) is None  # the plan moved to the later step
    assert second._plans[backend._plan_key].decode_tiles[0].bias is not None
    # a step that never ends (an exception in the model): the next step plans from scratch
    for seq in seqs:
        seq.table.append_tokens(1, pool)
    meta = PagedAttentionMetadata.from_block_tables([s.table for s in seqs], [1, 1, 1])
    backend.set_metadata(meta)
    assert backend.reused_plans == 2  # carried into the step that then fails ...
    for seq in seqs:  # ... which is rolled back
        seq.table.truncate(seq.table.num_tokens - 1, pool)
    _run_step(rng, backend, kv, pool, seqs, [1, 1, 1], layers, hkv, 2, head_dim)
    assert backend.reused_plans == 2


def test_a_table_row_that_grows_onto_its_padding_block_id_is_planned_again():
    """Tables are padded with block 0, so a sequence that takes block 0 as its new block leaves the table array
    unchanged: the blocks per sequence differ, and the backend plans the step from scratch (tile sizes and order
    come from them)."""
    rng = np.random.default_rng(12)
    b, hkv, d = 4, 2, 8
    kv = KVPool(1, 8, b, hkv, d)
    kv.kv_cache[...] = rng.standard_normal(kv.kv_cache.shape, dtype=np.float32)
    backend = PagedAttentionBackend(kv, tile_bytes=1, kernel="gather")  # one tile per sequence, sorted by blocks
    tables = np.array([[3, 0], [1, 2]])
    for ctx, slots in (([3, 5], [15, 9]), ([4, 6], [0, 10])):  # seq 0's token 4 lands in block 0
        meta = PagedAttentionMetadata(tables.copy(), ctx, [1, 1], slots, b)
        q = rng.standard_normal((2, 2 * hkv, d), dtype=np.float32)
        k = rng.standard_normal((2, hkv, d), dtype=np.float32)
        backend.set_metadata(meta)
        got = backend.attend(0, q, k, k)
        backend.end_step()
        fresh = PagedAttentionMetadata(tables.copy(), ctx, [1, 1], slots, b)
        np.testing.assert_array_equal(got, paged_attention(q, kv.kv_cache[0], fresh, Workspace(), 1, "gather"))
    assert backend.reused_plans == 0


@pytest.mark.parametrize("scramble", [0, 3])  # one physical run (a view of the pool), and gathered blocks
def test_a_lone_decode_attends_over_its_own_length_without_a_mask(scramble):
    """A decode tile of one sequence reads the first ``seq_len`` keys (a view) instead of masking the tail of its
    last block: equal to the masked form within float32 rounding (5e-7), and to dense within 1e-5."""
    from minienv.kv.paged_attention import _decode_attention, _decode_bias, softmax_scale

    pa = sys.modules["minienv.kv.paged_attention"]
    rng = np.random.default_rng(13)
    b, hkv, group, d = 16, 2, 2, 8
    for context in (0, 5, 37, 1030):
        kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
            rng, b, [context], [1], hkv, group, d, scramble)
        kv.write(0, meta.slot_mapping, new_k[0], new_v[0])
        got = paged_attention(q, kv.kv_cache[0], meta, Workspace(), kernel="gather")
        plan = tile_plan_of(meta)
        (tile,) = plan.decode_tiles
        assert tile.bias is None and tile.num_keys == context + 1
        assert tile.run_start is not None or scramble  # a fresh pool hands out one physical run
        step = pa.resolve_kernel(meta, hkv, d, pa.DEFAULT_TILE_BYTES, Workspace(), "gather")
        assert (step.lone_run is not None) == (tile.run_start is not None)
        if step.lone_run is not None:  # its no-plan path == the group walk over the same tile, bit for bit
            walked = pa.run_kernel(q, kv.kv_cache[0], meta, dataclasses.replace(step, lone_run=None), Workspace())
            np.testing.assert_array_equal(got, walked)
        full = gather_kv(kv.kv_cache[0], tile.block_tables)
        masked = _decode_attention(q.reshape(1, hkv, group, d) * softmax_scale(d), full[0], full[1],
                                   _decode_bias(meta.seq_lens, full.shape[2]), np.empty((1, hkv, group, d), np.float32))
        np.testing.assert_allclose(got, masked.reshape(got.shape), atol=5e-7, rtol=0)
        np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)


def test_softmax_rows_with_fmax_equal_the_max_form_and_keep_nans():
    """``_exp_rows`` takes the row maximum with ``fmax`` (cheaper on short rows): bit-equal to ``max`` on finite and
    ``-inf``-masked rows, and a NaN score still makes its row's output NaN."""
    pa = sys.modules["minienv.kv.paged_attention"]
    rng = np.random.default_rng(14)
    scores = rng.standard_normal((5, 2, 3, 17)).astype(np.float32) * 10
    scores[0, 0, :, 9:] = -np.inf  # masked tails
    scores[1, 1, 2, 3] = np.nan
    want = scores.copy()
    with np.errstate(invalid="ignore"):
        want -= want.max(axis=-1, keepdims=True)
        np.exp(want, out=want)
        want_sums = np.add.reduce(want, axis=-1, keepdims=True)
        got = scores.copy()
        got_sums = pa._exp_rows(got)
    finite = ~np.isnan(want_sums[..., 0])
    np.testing.assert_array_equal(got[finite], want[finite])
    np.testing.assert_array_equal(got_sums[finite], want_sums[finite])
    assert np.isnan(got_sums[1, 1, 2, 0]) and finite.sum() == finite.size - 1


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    # a few blocks; around MATVEC_MIN_KEYS (604), where the forms switch; long runs
    length=st.one_of(st.integers(1, 70), st.integers(570, 640), st.integers(1000, 1100)),
    block_size=st.sampled_from([1, 4, 16]),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([2, 8, 48]),
)
def test_a_lone_run_decode_equals_dense_and_the_gather_kernel(seed, length, block_size, hkv, group, head_dim):
    """The batch-1 path (one sequence decoding over one physical run of blocks: ``_attend_lone_run`` over views
    of the pool; the backend's, per layer, bit-equal to ``paged_attention``'s) equals dense attention within 1e-5,
    the group walk over the same tile within 2e-6, and the gather kernel's masked form over a copy of its blocks
    within 2e-6 + 4e-6 relative (its padded length may take the other side of ``MATVEC_MIN_KEYS``) — for lengths
    on both sides of the switch."""
    from minienv.kv.paged_attention import _decode_attention, _decode_bias, softmax_scale

    pa = sys.modules["minienv.kv.paged_attention"]
    assert 570 < pa.MATVEC_MIN_KEYS <= 640  # the lengths drawn straddle the switch to the matrix-vector form
    rng = np.random.default_rng(seed)
    kv, meta, q, new_k, new_v, dense_k, dense_v, _, _ = build_batch(
        rng, block_size, [length - 1], [1], hkv, group, head_dim, scramble=0, layers=2)
    q *= np.float32(rng.uniform(0.1, 4.0))  # sharper and flatter softmaxes
    backend = PagedAttentionBackend(kv)  # the same kernel on the pool's own per-head views (KVPool.head_views)
    backend.set_metadata(meta)
    backend.begin_step(meta.positions)
    by_backend = [backend.attend(layer, q, new_k[layer], new_v[layer]) for layer in (0, 1)]
    backend.end_step()
    got = paged_attention(q, kv.kv_cache[0], meta, Workspace())
    np.testing.assert_array_equal(by_backend[0], got)
    np.testing.assert_array_equal(by_backend[1], paged_attention(q, kv.kv_cache[1], meta, Workspace()))
    np.testing.assert_allclose(by_backend[1], dense_reference(q, meta, dense_k, dense_v, layer=1), atol=1e-5, rtol=0)
    step = pa.resolve_kernel(meta, hkv, head_dim, pa.DEFAULT_TILE_BYTES, Workspace(), "auto")
    assert step.lone_run is not None and step.lone_run[1] - step.lone_run[0] == length  # a fresh pool: one run
    np.testing.assert_allclose(got, dense_reference(q, meta, dense_k, dense_v), atol=1e-5, rtol=0)
    walked = pa.run_kernel(q, kv.kv_cache[0], meta, dataclasses.replace(step, lone_run=None), Workspace())
    np.testing.assert_allclose(got, walked, atol=2e-6, rtol=0)
    full = gather_kv(kv.kv_cache[0], meta.block_tables)  # the gather kernel's copy, masked past the length
    masked = _decode_attention(q.reshape(1, hkv, group, head_dim) * softmax_scale(head_dim), full[0], full[1],
                               _decode_bias(meta.seq_lens, full.shape[2]),
                               np.empty((1, hkv, group, head_dim), np.float32))
    # A padded length may take the other form (matrix-vector from MATVEC_MIN_KEYS): float32 rounding of two forms.
    # Relative to each output's own scale, sum_t p_t |V_t| / sum_t p_t (attention over |V|), not to the output, which
    # cancellation can make small: 2.2e-6 apart on an output of 0.0066 whose terms are ~100x larger (seed=2,
    # length=599, block_size=16, hkv=2, group=4, head_dim=48).
    abs_v = [[np.abs(v) for v in layers] for layers in dense_v]
    scale = np.maximum(np.abs(got), dense_reference(q, meta, dense_k, abs_v))
    assert np.all(np.abs(got - masked.reshape(got.shape)) <= 2e-6 + 4e-6 * scale)


def test_kv_pool_head_views_are_the_pool_per_head_also_in_a_copied_pool():
    """``KVPool.head_views(layer)``: K as ``[H, D, slots]`` and V as ``[H, slots, D]``, views of the pool's own
    array (a copied pool's are rebuilt on its array); sliced to a run they equal ``pool_run_views`` of the layer
    array."""
    import copy

    from minienv.kv.paged_attention import pool_run_views

    rng = np.random.default_rng(15)
    pool = KVPool(3, 5, 4, 2, 3)
    twin = copy.deepcopy(pool)
    for target in (pool, twin):
        target.kv_cache[...] = rng.standard_normal(target.kv_cache.shape, dtype=np.float32)
        for layer in range(3):
            k_t, v = target.head_views(layer)
            slots = target.kv_cache[layer].reshape(2, 20, 2, 3)  # [2, slots, H, D]
            assert np.array_equal(k_t, slots[0].transpose(1, 2, 0)) and np.array_equal(v, slots[1].transpose(1, 0, 2))
            assert np.shares_memory(k_t, target.kv_cache) and np.shares_memory(v, target.kv_cache)
            for first, last in ((0, 20), (4, 11), (7, 8)):
                want_k_t, want_v = pool_run_views(target.kv_cache[layer], first, last)
                assert np.array_equal(k_t[:, :, first:last], want_k_t) and np.array_equal(v[:, first:last], want_v)
    assert not np.shares_memory(pool.head_views(0)[0], twin.kv_cache)


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


@settings(max_examples=300, deadline=None)
@given(
    first=st.integers(0, 40),
    seq_len=st.integers(1, 80),
    block_size=st.sampled_from([1, 4, 16]),
    queries=st.integers(1, 3),
    bend=st.sampled_from([None, "swap", "bump_last", "bump_first", "pad_after"]),
    kernel=st.sampled_from(["auto", "gather", "inplace"]),
)
def test_the_backends_lone_run_test_agrees_with_planning_the_step(first, seq_len, block_size, queries, bend, kernel):
    """``lone_run_of`` (the test for "one sequence decoding over one physical run", made without planning the step)
    gives exactly what the step's tile plan finds (one decode tile of one sequence, a run, its key count) — on
    runs, on tables one change away from a run
    (two blocks swapped, the first or last id moved, ids past the sequence's blocks), with padded rows, for a
    decode of one sequence, and never for a chunk or a batch; and the backend's answer through it is bit-equal to
    ``paged_attention``'s for every kernel (an explicit "inplace" never takes the lone path)."""
    pa = sys.modules["minienv.kv.paged_attention"]
    nb = -(-seq_len // block_size)
    row = list(range(first, first + nb))
    if bend == "swap" and nb > 1:
        row[0], row[1] = row[1], row[0]
    elif bend == "bump_last" and nb > 1:
        row[-1] += 1
    elif bend == "bump_first" and nb > 1:
        row[0] += 100
    row += [7] * 2 if bend == "pad_after" else [0] * 2  # padding past the sequence's blocks is never read
    q_len = queries if seq_len > queries else 1
    ctx = seq_len - q_len
    slots = np.array([row[p // block_size] * block_size + p % block_size for p in range(ctx, seq_len)])
    meta = PagedAttentionMetadata(np.array([row]), [ctx], [q_len], slots, block_size)
    ids = np.arange(max(row) + 1, dtype=np.int64)
    plan = pa.plan_tiles(meta, 2, 8, pa.DEFAULT_TILE_BYTES, Workspace())
    tile = plan.decode_tiles[0] if meta.is_decode and len(plan.decode_tiles) == 1 else None
    expected = None if tile is None or tile.run_start is None or tile.num_keys is None else \
        (tile.run_start * block_size, tile.run_start * block_size + tile.num_keys)
    assert pa.lone_run_of(meta, ids) == expected
    assert pa.lone_run_of(meta) == expected  # with an arange made for the call (resolve_kernel's)
    assert pa.resolve_kernel(meta, 2, 8, pa.DEFAULT_TILE_BYTES, Workspace(), "auto").lone_run == expected
    assert pa.lone_run_of(meta, ids.astype(np.int32)) is None  # another dtype is never taken for equal bytes
    if expected is not None:
        assert expected == (first * block_size, first * block_size + seq_len) and bend in (None, "pad_after") or nb == 1
    # the backend over a pool holding these blocks: the lone path (or not) == paged_attention, bit for bit
    rng = np.random.default_rng(seed=seq_len * 7 + first)
    kv = KVPool(1, max(row) + 1, block_size, 2, 8)
    kv.kv_cache[...] = rng.standard_normal(kv.kv_cache.shape).astype(np.float32)
    q = rng.standard_normal((q_len, 4, 8)).astype(np.float32)
    new_k, new_v = (rng.standard_normal((q_len, 2, 8)).astype(np.float32) for _ in range(2))
    backend = PagedAttentionBackend(kv, kernel=kernel)
    backend.set_metadata(meta)
    assert (backend._lone_views is not None) == (expected is not None and kernel != "inplace")
    backend.begin_step(meta.positions)
    got = backend.attend(0, q, new_k, new_v)
    backend.end_step()
    fresh = PagedAttentionMetadata(np.array([row]), [ctx], [q_len], slots, block_size)
    np.testing.assert_array_equal(got, paged_attention(q, kv.kv_cache[0], fresh, Workspace(), kernel=kernel))

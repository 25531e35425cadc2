"""The model's fast forward pass gives *bit-identical* logits to its plain form (``np.array_equal``, not a tolerance).

Notebook outputs and many tests compare exact numbers, so a speed-up of the model's elementwise work (buffers
reused across layers, RoPE with a signed sine table, SiLU with one multiply fewer) must not move a single bit.
The reference is :func:`plain_forward_step` below: a frozen copy of the model's forward pass as it was before those
tricks, written with the textbook form of every operation. It is compared against ``LlamaModel.forward_step`` on
the bundled model — a prefill, decodes on a contiguous cache, a batched step over several caches, and every step
of the engine (paged attention, mixed prefill + decode batches).
"""

from __future__ import annotations

import numpy as np
import pytest

from minienv.engine import InferenceEngine
from minienv.model import ContiguousBatch, ContiguousKVCache, LlamaConfig, LlamaModel, NoCache, random_weights
from minienv.model.linear import linear
from minienv.model.llama import apply_rope, rms_norm, rope_cos_sin, silu, silu_and_mul
from minienv.sampling import SamplingParams


# ---------------------------------------------------------------------- the plain forward pass (frozen)
def plain_rms_norm(x, weight, eps, axis=-1):
    variance = np.mean(x * x, axis=axis, keepdims=True)
    return weight * (x / np.sqrt(variance + np.float32(eps)))


def plain_silu(x):
    return x * (np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x)))


def plain_apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def project(w, x):
    """``w @ x`` through the model's own :func:`~minienv.model.linear.linear` (BLAS, or the numba row-dot kernel
    for one token): the products are the same calls on both sides; the elementwise work around them is under test."""
    return linear(w, x, np.empty((w.shape[0], x.shape[1]), dtype=np.float32))


def plain_forward_step(model: LlamaModel, token_ids, positions, backend, logits_indices=None) -> np.ndarray:
    """``LlamaModel.forward_step`` without its elementwise optimizations: one fresh array per operation.
    Feature-major like the model (``x [H, N]``, one column per token)."""
    c = model.config
    ids, pos = np.asarray(token_ids, dtype=np.int64), np.asarray(positions)
    n, hq, hkv, d, inter = len(ids), c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    k_end = (hq + hkv) * d
    cos, sin = rope_cos_sin(pos, d, c.rope_theta)
    x = np.ascontiguousarray(model.embed_tokens[ids].T)  # [H, N]
    backend.begin_step(pos)
    for layer_idx, layer in enumerate(model.layers):
        h = plain_rms_norm(x, layer.input_norm, c.rms_norm_eps, axis=0)
        qkv = project(layer.w_qkv, h).T  # [N, (Hq + 2 Hkv) D]
        qk = plain_apply_rope(qkv[:, :k_end].reshape(n, hq + hkv, d), cos, sin)
        attn = backend.attend(layer_idx, qk[:, :hq], qk[:, hq:], qkv[:, k_end:].reshape(n, hkv, d))
        x = x + project(layer.w_o, attn.reshape(n, hq * d).T)
        gate_up = project(layer.w_gate_up, plain_rms_norm(x, layer.post_norm, c.rms_norm_eps, axis=0))
        x = x + project(layer.w_down, plain_silu(gate_up[:inter]) * gate_up[inter:])
    backend.end_step()
    if logits_indices is not None:
        x = x[:, np.asarray(logits_indices, dtype=np.int64)]
    return project(model.lm_head, plain_rms_norm(x, model.norm, c.rms_norm_eps, axis=0)).T


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


# ---------------------------------------------------------------------- the public functions
def test_public_ops_equal_their_plain_forms_bit_for_bit():
    rng = np.random.default_rng(0)
    for n in (1, 3, 16):
        x = (rng.standard_normal((n, 192)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
        w = rng.standard_normal(192).astype(np.float32)
        assert same_bits(rms_norm(x, w, 1e-5), plain_rms_norm(x, w, 1e-5))
        out = np.empty_like(x)
        assert rms_norm(x, w, 1e-5, out=out) is out and same_bits(out, plain_rms_norm(x, w, 1e-5))
        gate_up = (rng.standard_normal((n, 1024)) * 6).astype(np.float32)
        gate_up[0, :4] = [np.inf, -np.inf, 1e-40, -100.0]  # the extremes: silu(-inf) is nan in both forms
        with np.errstate(invalid="ignore"):
            want = plain_silu(gate_up[:, :512]) * gate_up[:, 512:]
            np.testing.assert_array_equal(silu(gate_up[:, :512]), plain_silu(gate_up[:, :512]))
            np.testing.assert_array_equal(silu_and_mul(gate_up), want)  # nan == nan here, same positions
        qk = rng.standard_normal((n, 6, 48)).astype(np.float32)
        cos, sin = rope_cos_sin(rng.integers(0, 1024, n), 48, 10000.0)
        assert same_bits(apply_rope(qk, cos, sin), plain_apply_rope(qk, cos, sin))


def test_one_row_rms_norm_in_scalar_arithmetic_equals_the_plain_form():
    """A single row's statistic is computed on float32 scalars (a decode's fast path): the same bits, row by row."""
    rng = np.random.default_rng(4)
    rows = (rng.standard_normal((3000, 192)) * rng.choice([1e-20, 1e-3, 1.0, 1e3, 1e18], (3000, 1))).astype(np.float32)
    w = rng.standard_normal(192).astype(np.float32)
    want = plain_rms_norm(rows, w, 1e-5)
    assert all(same_bits(rms_norm(row[None], w, 1e-5), want[i:i + 1]) for i, row in enumerate(rows))
    assert same_bits(rms_norm(rows[7], w, 1e-5), want[7])  # a 1-D row too


def test_silu_and_mul_equals_silu_times_up_on_every_kind_of_float32():
    """Random bit patterns: every exponent, subnormals included — where halving a gate could lose a bit."""
    bits = np.random.default_rng(3).integers(0, 2**32, 2 * 200_000, dtype=np.uint64).astype(np.uint32)
    gate_up = bits.view(np.float32).reshape(2, -1)
    gate_up = np.where(np.isfinite(gate_up), gate_up, np.float32(1.0)).T.reshape(-1, 2 * 1000)
    with np.errstate(over="ignore", under="ignore"):
        got, want = silu_and_mul(gate_up), plain_silu(gate_up[:, :1000]) * gate_up[:, 1000:]
    assert same_bits(got, want)


def test_rope_table_rotation_equals_apply_rope_bit_for_bit(model):
    from minienv.model.llama import rotate_in_place

    rng = np.random.default_rng(1)
    for positions in ([0], [1023], rng.integers(0, 1024, 16), np.arange(40)):
        pos = np.asarray(positions, dtype=np.int64)
        qkv = rng.standard_normal((len(pos), 8 * 48)).astype(np.float32)
        want = apply_rope(qkv[:, :6 * 48].reshape(len(pos), 6, 48), *rope_cos_sin(pos, 48, 10000.0))
        v_before = qkv[:, 6 * 48:].copy()
        cos, signed_sin = model.rope.rows(pos)
        rotate_in_place(qkv[:, :6 * 48].reshape(len(pos), 6, 2, 24), cos, signed_sin)
        assert same_bits(qkv[:, :6 * 48].reshape(len(pos), 6, 48), want)
        assert same_bits(qkv[:, 6 * 48:], v_before)  # V, next to Q and K in the same rows, is untouched


# ---------------------------------------------------------------------- the whole model
PROMPTS = [[5, 17, 901, 3, 44, 1200, 7, 7, 2047, 0, 12, 600], [1, 2, 3], [1500], list(range(100, 160))]


def test_prefill_and_contiguous_decode_are_bit_identical(model):
    for ids in PROMPTS:
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        assert same_bits(model.forward(ids), plain_forward_step(model, ids, np.arange(n), NoCache()))
        fast, plain = model.new_kv_cache(n + 8), model.new_kv_cache(n + 8)
        assert same_bits(model.forward_step(ids, np.arange(n), fast),
                         plain_forward_step(model, ids, np.arange(n), plain))
        token = int(ids[-1])
        for t in range(n, n + 8):  # decodes as minienv.generate calls them: Python lists
            got = model.forward_step([token], [t], fast)
            assert same_bits(got, plain_forward_step(model, [token], [t], plain))
            token = int(np.argmax(got[0]))
        assert np.array_equal(fast.k[:, :n + 8], plain.k[:, :n + 8]) and np.array_equal(fast.v, plain.v)


def test_batched_contiguous_step_is_bit_identical(model):
    caches = {name: [model.new_kv_cache(80) for _ in PROMPTS] for name in ("fast", "plain")}
    flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in PROMPTS])
    pos = np.concatenate([np.arange(len(p)) for p in PROMPTS])
    last = np.cumsum([len(p) for p in PROMPTS]) - 1
    got = model.forward_step(flat, pos, ContiguousBatch(caches["fast"], [len(p) for p in PROMPTS]), last)
    want = plain_forward_step(model, flat, pos, ContiguousBatch(caches["plain"], [len(p) for p in PROMPTS]), last)
    assert same_bits(got, want)
    for _ in range(3):  # batched decodes: one token per sequence, positions all different
        toks = np.argmax(got, axis=-1).astype(np.int64)
        pos = np.array([c.length for c in caches["fast"]], dtype=np.int64)
        got = model.forward_step(toks, pos, ContiguousBatch(caches["fast"], [1] * len(PROMPTS)))
        assert same_bits(got, plain_forward_step(model, toks, pos, ContiguousBatch(caches["plain"], [1] * 4)))


class _Recording:
    """Stands in for the engine's model: runs ``forward_step`` (fast or plain) and keeps every step's logits."""

    def __init__(self, model: LlamaModel, plain: bool):
        self.model, self.plain, self.config, self.logits = model, plain, model.config, []

    def forward_step(self, *args, **kwargs):
        run = plain_forward_step if self.plain else LlamaModel.forward_step
        self.logits.append(run(self.model, *args, **kwargs))
        return self.logits[-1]


def test_every_engine_step_is_bit_identical(model, tok):
    """Paged attention, prefill chunks mixed with decodes, 16-wide decode batches: the same logits at every step."""
    prompts = [f"{w} " * (1 + i % 5) + "the" for i, w in enumerate("To be or not ROMEO O Romeo wherefore art thou "
                                                                       "JULIET my lord good night sweet".split())]
    runs = {}
    for plain in (False, True):
        engine = InferenceEngine(model, tok, kv_budget_tokens=4096, block_size=16, max_num_seqs=16,
                                 max_num_batched_tokens=48)
        engine.model = _Recording(model, plain)
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
        runs[plain] = (engine.model.logits, [tuple(o.token_ids) for o in outs])
    (fast, fast_ids), (plain, plain_ids) = runs[False], runs[True]
    assert len(fast) == len(plain) > 12 and max(len(x) for x in fast) == 16  # several steps, some 16 wide
    assert all(same_bits(a, b) for a, b in zip(fast, plain, strict=True))
    assert fast_ids == plain_ids


@pytest.mark.parametrize("heads,kv_heads,tied", [(4, 4, False), (8, 2, True), (4, 1, False)])
def test_other_shapes_are_bit_identical(heads, kv_heads, tied):
    cfg = LlamaConfig(vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    model = LlamaModel(cfg, random_weights(cfg, seed=heads + kv_heads, scale=0.25))
    ids = np.random.default_rng(2).integers(0, 53, 20)
    assert same_bits(model.forward(ids), plain_forward_step(model, ids, np.arange(20), NoCache()))
    fast, plain = ContiguousKVCache.from_config(cfg, 24), ContiguousKVCache.from_config(cfg, 24)
    for a, b in ((0, 13), (13, 14), (14, 20)):
        assert same_bits(model.forward_step(ids[a:b], np.arange(a, b), fast),
                         plain_forward_step(model, ids[a:b], np.arange(a, b), plain))


def test_single_token_checks_still_name_the_bad_input():
    """A decode's one token and one position are checked with scalar comparisons; bad ones still fail clearly."""
    cfg = LlamaConfig(vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = LlamaModel(cfg, random_weights(cfg, seed=0))
    cache = model.new_kv_cache(8)
    for ids, pos, match in (([53], [0], "token id 53 out of range"), (np.array([-1]), [0], "token id -1 out of range"),
                            ([3], [64], "position 64 is outside"), ([3], np.array([-2]), "position -2 is outside")):
        with pytest.raises(ValueError, match=match):
            model.forward_step(ids, pos, cache)
    assert cache.length == 0
    assert model.forward_step(np.array([52]), np.array([0]), cache).shape == (1, 53) and cache.length == 1

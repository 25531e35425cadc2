"""Unit tests for the numpy Llama: config validation, checkpoint round trips, cached == dense, batched steps."""

from __future__ import annotations

import json
from itertools import pairwise

import numpy as np
import pytest

from minienv.model import (
    CacheFullError,
    CheckpointError,
    ConfigError,
    ContiguousBatch,
    ContiguousKVCache,
    LlamaConfig,
    LlamaModel,
    causal_attention,
    load_model,
    random_weights,
    read_safetensors,
    save_checkpoint,
    write_safetensors,
)


def make_config(heads: int = 4, kv_heads: int = 2, head_dim: int = 8, tied: bool = False, **kw) -> LlamaConfig:
    base = dict(vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=64,
                tie_word_embeddings=tied, rope_theta=10000.0)
    base.update(kw)
    return LlamaConfig(**base)


def make_model(seed: int = 0, **kw) -> LlamaModel:
    cfg = make_config(**kw)
    return LlamaModel(cfg, random_weights(cfg, seed=seed, scale=0.25))


CASES = [  # (heads, kv_heads, tied): GQA ratios 1, 2, 4
    (4, 4, False), (4, 2, True), (8, 2, False), (4, 1, True),
]


# ---------------------------------------------------------------------- attention kernel
def naive_attention(q, k, v, q_pos, k_pos):
    """One head and one query at a time: the definition, for checking the vectorized kernel."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros_like(q)
    for i in range(n):
        for h in range(hq):
            visible = k_pos <= q_pos[i]
            s = k[visible, h // group] @ q[i, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[visible, h // group]
    return out


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (4, 1)])
def test_causal_attention_matches_definition(hq, hkv):
    rng = np.random.default_rng(hq * 10 + hkv)
    t, n, d = 9, 4, 6
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    q_pos = np.arange(t - n, t)
    got = causal_attention(q, k, v, q_pos)
    np.testing.assert_allclose(got, naive_attention(q, k, v, q_pos, np.arange(t)), atol=1e-5)


# ---------------------------------------------------------------------- cached == dense
@pytest.mark.parametrize("heads,kv_heads,tied", CASES)
def test_cached_paths_reproduce_dense_logits(heads, kv_heads, tied):
    model = make_model(seed=heads + kv_heads, heads=heads, kv_heads=kv_heads, tied=tied)
    ids = np.random.default_rng(1).integers(0, 53, size=30)
    dense = model.forward(ids)
    assert dense.shape == (30, 53) and dense.dtype == np.float32

    one_chunk = model.forward_step(ids, np.arange(30), model.new_kv_cache(32))
    assert np.abs(one_chunk - dense).max() < 1e-5

    cache = model.new_kv_cache(40)
    chunks, start = [], 0
    for size in (7, 1, 11, 5, 6):  # uneven prefill chunks
        chunks.append(model.forward_step(ids[start : start + size], np.arange(start, start + size), cache))
        start += size
    assert cache.length == 30
    assert np.abs(np.concatenate(chunks) - dense).max() < 1e-5

    cache = model.new_kv_cache(30)
    decode = [model.forward_step(ids[t : t + 1], [t], cache) for t in range(30)]  # token-by-token
    assert np.abs(np.concatenate(decode) - dense).max() < 1e-5


def test_dense_forward_is_causal():
    model = make_model()
    ids = np.arange(20) % 53
    a = model.forward(ids)
    b = model.forward(np.concatenate([ids[:12], (ids[12:] + 5) % 53]))
    np.testing.assert_array_equal(a[:12], b[:12])  # changing the future never changes the past
    assert np.abs(a[12:] - b[12:]).max() > 1e-3


def test_logits_indices_select_rows():
    model = make_model()
    ids = np.arange(10)
    full = model.forward_step(ids, np.arange(10), model.new_kv_cache(16))
    some = model.forward_step(ids, np.arange(10), model.new_kv_cache(16), logits_indices=[3, 9])
    np.testing.assert_allclose(some, full[[3, 9]], atol=1e-6)


def test_batched_step_over_several_sequences_matches_separate_runs():
    """Flattened tokens of three sequences in one step; the backend knows the boundaries, the model does not."""
    model = make_model(heads=8, kv_heads=2)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 53, size=n) for n in (6, 11, 3)]
    dense = [model.forward(s) for s in seqs]
    caches = [model.new_kv_cache(32) for _ in seqs]
    # step 1: prefill all but the last two tokens of every sequence together
    pre = [s[:-2] for s in seqs]
    out = model.forward_step(np.concatenate(pre), np.concatenate([np.arange(len(p)) for p in pre]),
                             ContiguousBatch(caches, [len(p) for p in pre]))
    got = np.split(out, np.cumsum([len(p) for p in pre])[:-1])
    for g, d, p in zip(got, dense, pre, strict=True):
        assert np.abs(g - d[: len(p)]).max() < 1e-5
    # steps 2-3: batched decode, one token per sequence
    for back in (2, 1):
        toks = [s[-back] for s in seqs]
        pos = [len(s) - back for s in seqs]
        out = model.forward_step(toks, pos, ContiguousBatch(caches, [1, 1, 1]))
        for row, d, p in zip(out, dense, pos, strict=True):
            assert np.abs(row - d[p]).max() < 1e-5


def test_cache_rejects_gaps_overflow_and_truncates():
    model = make_model()
    cache = model.new_kv_cache(8)
    model.forward_step([1, 2, 3], [0, 1, 2], cache)
    with pytest.raises(ValueError, match="continued at positions 3"):
        model.forward_step([4], [5], cache)
    with pytest.raises(CacheFullError, match="max_len 8"):
        model.forward_step(list(range(6)), np.arange(3, 9), cache)
    assert cache.length == 3
    cache.truncate(1)
    ref = model.forward([1, 9])
    np.testing.assert_allclose(model.forward_step([9], [1], cache)[0], ref[1], atol=1e-5)
    assert cache.reserved_bytes == 2 * 2 * 8 * 2 * 8 * 4
    assert cache.used_bytes == cache.reserved_bytes * 2 // 8


def test_contiguous_cache_shape_from_config():
    cfg = make_config()
    cache = ContiguousKVCache.from_config(cfg)
    assert cache.k.shape == (2, 64, 2, 8) and cache.k.dtype == np.float32
    assert cfg.kv_bytes_per_token() == 2 * 2 * 2 * 8 * 4
    assert cfg.kv_bytes_per_token(2) == 128


# ---------------------------------------------------------------------- input validation
def test_bad_token_ids_are_clear_errors():
    model = make_model()
    with pytest.raises(ValueError, match="empty"):
        model.forward([])
    with pytest.raises(ValueError, match="token id 53 out of range"):
        model.forward([1, 53])
    with pytest.raises(ValueError, match="token id -1 out of range"):
        model.forward([-1])
    with pytest.raises(ValueError, match="integers"):
        model.forward([1.5])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.forward(np.zeros(65, dtype=int))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.forward_step([1], [64], model.new_kv_cache(8))


# ---------------------------------------------------------------------- config
def test_config_from_hf_dict_variants():
    raw = make_config().to_dict()
    assert LlamaConfig.from_dict(raw) == make_config()
    legacy = {k: v for k, v in raw.items() if k not in ("rope_parameters", "head_dim")}
    legacy["rope_theta"] = 5e5
    legacy["hidden_size"] = 32
    cfg = LlamaConfig.from_dict(legacy)
    assert cfg.head_dim == 8 and cfg.rope_theta == 5e5


@pytest.mark.parametrize("change,field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ({"vocab_size": 0}, "vocab_size"),
])
def test_config_errors_name_the_field(change, field):
    raw = make_config().to_dict()
    raw.update(change)
    with pytest.raises(ConfigError, match=field):
        LlamaConfig.from_dict(raw)


def test_config_missing_field():
    raw = make_config().to_dict()
    del raw["intermediate_size"]
    with pytest.raises(ConfigError, match="intermediate_size"):
        LlamaConfig.from_dict(raw)


# ---------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_round_trip(tmp_path, tied):
    cfg = make_config(tied=tied)
    weights = random_weights(cfg, seed=3)
    save_checkpoint(tmp_path, cfg, weights)
    assert ("lm_head.weight" in read_safetensors(tmp_path / "model.safetensors")) is not tied
    model = load_model(tmp_path)
    assert model.config == cfg
    np.testing.assert_array_equal(model.forward([1, 2, 3]), LlamaModel(cfg, weights).forward([1, 2, 3]))


def test_safetensors_header_is_aligned_and_f16_widens(tmp_path):
    arr = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float16)
    path = write_safetensors(tmp_path / "t.safetensors", {"x": arr, "y": arr.astype(np.float32)})
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0
    got = read_safetensors(path)
    assert got["x"].dtype == np.float32
    np.testing.assert_array_equal(got["x"], arr.astype(np.float32))


def test_bf16_is_widened_exactly(tmp_path):
    vals = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    raw = (vals.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"b": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "b.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + raw)
    np.testing.assert_array_equal(read_safetensors(tmp_path / "b.safetensors")["b"], vals)


def test_unsupported_dtype_and_bad_offsets_are_named(tmp_path):
    header = json.dumps({"w": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}).encode()
    (tmp_path / "a.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0")
    with pytest.raises(CheckpointError, match="'w' has unsupported dtype 'I8'"):
        read_safetensors(tmp_path / "a.safetensors")
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "b.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match="'w' byte range"):
        read_safetensors(tmp_path / "b.safetensors")


def test_missing_wrong_shape_and_unexpected_tensors_are_named(tmp_path):
    cfg = make_config()
    w = random_weights(cfg)
    del w["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.v_proj\.weight'"):
        save_checkpoint(tmp_path, cfg, w)
    w = random_weights(cfg)
    w["model.norm.weight"] = w["model.norm.weight"][:-1]
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \(23,\), expected \(24,\)"):
        save_checkpoint(tmp_path, cfg, w)
    w = random_weights(cfg)
    w["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        save_checkpoint(tmp_path, cfg, w)


def test_load_model_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    make_config().save_json(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path / "m")


# ---------------------------------------------------------------------- property: any chunking == dense
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PROP_MODELS = {ratio: make_model(seed=ratio, heads=4, kv_heads=4 // ratio, tied=ratio == 2) for ratio in (1, 2, 4)}


@settings(max_examples=40, deadline=None)
@given(ratio=st.sampled_from([1, 2, 4]), data=st.data())
def test_any_chunking_of_a_sequence_reproduces_dense(ratio, data):
    model = _PROP_MODELS[ratio]
    n = data.draw(st.integers(1, 24), label="length")
    ids = data.draw(st.lists(st.integers(0, 52), min_size=n, max_size=n), label="ids")
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=6), label="cuts")) - {n})
    cache = model.new_kv_cache(n)
    bounds = [0, *cuts, n]
    out = [model.forward_step(ids[a:b], np.arange(a, b), cache) for a, b in pairwise(bounds) if b > a]
    assert np.abs(np.concatenate(out) - model.forward(ids)).max() < 1e-5

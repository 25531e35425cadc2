"""Reference tier: minienv's numpy Llama == transformers' LlamaForCausalLM on the same saved weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minienv.model import CheckpointError, ConfigError, load_model, read_safetensors

try:
    import safetensors.numpy as safetensors_numpy
    import torch
    import transformers
except ImportError:  # the autouse fixture below skips every test (per test, so MINIENV_REQUIRE_TIERS sees it)
    torch = transformers = safetensors_numpy = None

pytestmark = pytest.mark.reference


@pytest.fixture(autouse=True)
def _reference_dependencies():
    for module in ("torch", "transformers", "safetensors"):
        pytest.importorskip(module)

# (num_heads, num_kv_heads, head_dim, hidden, tied, rope_theta): GQA ratios 1, 2, 4; tied and untied;
# head_dim explicit and different from hidden // heads; several rope_theta.
CONFIGS = [
    dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8, hidden_size=32, tie_word_embeddings=False, rope_theta=10000.0),
    dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=48, tie_word_embeddings=True, rope_theta=500000.0),
    dict(num_attention_heads=8, num_key_value_heads=2, head_dim=4, hidden_size=32, tie_word_embeddings=False, rope_theta=1000.0),
    dict(num_attention_heads=4, num_key_value_heads=1, head_dim=12, hidden_size=40, tie_word_embeddings=True, rope_theta=10000.0),
    dict(num_attention_heads=6, num_key_value_heads=3, head_dim=10, hidden_size=24, tie_word_embeddings=True, rope_theta=1e6),
]


def _save_hf_model(tmp_path, seed: int, **kw) -> tuple[object, str]:
    rope_theta = kw.pop("rope_theta")
    cfg = transformers.LlamaConfig(
        vocab_size=97, intermediate_size=56, num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **kw,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-init weights so differences are not hidden by tiny activations
        for p in model.parameters():
            p.normal_(0.0, 0.15) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model, str(tmp_path)


@pytest.mark.parametrize("idx", range(len(CONFIGS)))
def test_logits_match_transformers(tmp_path, idx):
    hf, path = _save_hf_model(tmp_path, seed=idx, **dict(CONFIGS[idx]))
    ours = load_model(path)
    assert ours.config.tie_word_embeddings == CONFIGS[idx]["tie_word_embeddings"]
    assert ours.config.rope_theta == CONFIGS[idx]["rope_theta"]
    ids = np.random.default_rng(idx).integers(0, 97, size=40)
    with torch.no_grad():
        expected = hf(torch.tensor(ids)[None]).logits[0].float().numpy()
    got = ours.forward(ids)
    assert got.dtype == np.float32
    assert np.abs(got - expected).max() < 1e-4
    # the cached path too (prefill a chunk, then decode)
    cache = ours.new_kv_cache(64)
    steps = [ours.forward_step(ids[:25], np.arange(25), cache)]
    steps += [ours.forward_step(ids[t : t + 1], [t], cache) for t in range(25, 40)]
    assert np.abs(np.concatenate(steps) - expected).max() < 1e-4


def test_greedy_generation_matches_transformers(tmp_path):
    hf, path = _save_hf_model(tmp_path, seed=7, **dict(CONFIGS[1]))
    ours = load_model(path)
    prompt = [3, 14, 15, 9, 26]
    with torch.no_grad():
        x = torch.tensor([prompt])  # explicit all-ones mask: never infer padding from pad_token_id
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0].tolist()[len(prompt):]
    cache = ours.new_kv_cache(64)
    logits = ours.forward_step(prompt, np.arange(len(prompt)), cache)[-1]
    mine = []
    for t in range(12):
        tok = int(np.argmax(logits))
        mine.append(tok)
        logits = ours.forward_step([tok], [len(prompt) + t], cache)[-1]
    assert mine == out


def test_numpy_reader_equals_safetensors(tmp_path):
    _, path = _save_hf_model(tmp_path, seed=3, **dict(CONFIGS[0]))
    ours = read_safetensors(f"{path}/model.safetensors")
    ref = safetensors_numpy.load_file(f"{path}/model.safetensors")
    assert ours.keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(ours[name], ref[name])


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_half_precision_checkpoints_widen_to_float32(tmp_path, dtype_name):
    from safetensors.torch import save_file

    dtype = getattr(torch, dtype_name)
    t = {"a": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)).to(dtype)}
    save_file(t, tmp_path / "x.safetensors")
    got = read_safetensors(tmp_path / "x.safetensors")["a"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, t["a"].float().numpy())


def test_written_checkpoint_loads_in_transformers(tmp_path):
    """minienv's numpy writer produces a directory transformers loads, with the same logits."""
    from minienv.model import LlamaConfig, random_weights, save_checkpoint

    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)
    save_checkpoint(tmp_path, cfg, random_weights(cfg, seed=1, scale=0.2))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = np.arange(30) % 61
    with torch.no_grad():
        expected = hf(torch.tensor(ids)[None]).logits[0].numpy()
    assert np.abs(load_model(tmp_path).forward(ids) - expected).max() < 1e-4


# ---------------------------------------------------------------------- malformed checkpoints
def _resave_without(path: str, drop: str | None = None, reshape: str | None = None) -> None:
    from safetensors.numpy import save_file

    tensors = safetensors_numpy.load_file(f"{path}/model.safetensors")
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    _, path = _save_hf_model(tmp_path, seed=0, **dict(CONFIGS[0]))
    _resave_without(path, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(path)


def test_wrong_shape_is_named(tmp_path):
    _, path = _save_hf_model(tmp_path, seed=0, **dict(CONFIGS[0]))
    _resave_without(path, reshape="model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape"):
        load_model(path)


def test_unsupported_architecture_is_named(tmp_path):
    _, path = _save_hf_model(tmp_path, seed=0, **dict(CONFIGS[0]))
    cfg = json.loads(open(f"{path}/config.json").read())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    open(f"{path}/config.json", "w").write(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'architectures'.*GPT2LMHeadModel"):
        load_model(path)

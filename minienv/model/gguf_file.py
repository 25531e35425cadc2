"""Read a Llama model out of a GGUF file with the ``gguf`` package (llama.cpp's own reader): config, weights,
tokenizer and chat template.

minienv does not parse GGUF itself: ``gguf.GGUFReader`` maps the file and ``gguf.quants.dequantize`` turns each
quantized tensor (Q4_1, Q8_0, ...) into float32, which is what minienv computes in. Three things need care:

* **names**: llama.cpp calls the tensors ``blk.N.attn_q.weight`` etc.; they are renamed to the Hugging Face names
  :class:`~minienv.model.LlamaModel` reads (``model.layers.N.self_attn.q_proj.weight``), so one model class reads
  both formats;
* **the Q/K permutation**: llama.cpp's converter reorders the rows of the Q and K projections so that each head's
  rotary pairs are adjacent (``x0, x1`` interleaved), while Hugging Face's RoPE rotates the two *halves* of a head.
  Left as it is, RoPE would rotate the wrong pairs and attention would be silently garbled; :func:`unpermute`
  undoes it exactly as ``transformers``' GGUF loader does;
* **the tokenizer**: a GGUF carries no ``tokenizer.json``; its ``tokenizer.ggml.*`` metadata holds the vocabulary
  (in the byte-level alphabet), the merges, which ids are control tokens, the end token and the name of the
  pre-tokenizer, from which :meth:`minienv.tokenizer.BPETokenizer.from_vocab` builds minienv's own BPE.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minienv.model.checkpoint import CheckpointError
from minienv.model.config import LlamaConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")
_CONTROL = 3  # llama.cpp's token type of a control (special) token


@dataclass
class GGUFModel:
    """What a GGUF file holds, in minienv's terms. ``weights`` are float32 with Hugging Face names."""

    config: LlamaConfig
    weights: dict[str, np.ndarray]
    tokenizer: Any  # minienv.tokenizer.BPETokenizer
    chat_template: str | None
    name: str


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row order of a Q or K projection ``[n_head * head_dim, hidden]`` (``n_head`` = KV heads for
    K): inside each head, rows ``(pair i, half j)`` go back to ``(half j, pair i)`` — transformers'
    ``_reverse_permute_weights``."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    m = _BLOCK.match(gguf_name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.weight"
    if gguf_name.endswith(".weight") and gguf_name[:-7] in _TOP_NAMES:
        return _TOP_NAMES[gguf_name[:-7]] + ".weight"
    return None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _open(path: Path) -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("reading a .gguf file needs the `gguf` package (pip install 'minienv[realmodel]')") from exc
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file fails in many ways inside the reader
        raise CheckpointError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(exc).__name__}: {exc}); if it was "
                              "downloaded, download it again") from exc


def read_config(reader: Any, path: Path) -> LlamaConfig:
    """The :class:`LlamaConfig` the file's ``llama.*`` metadata describes (a non-Llama file is refused)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: general.architecture is {arch!r}; minienv runs only Llama-architecture "
                              "models ('llama')")
    if _field(reader, "llama.rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"{path}: uses RoPE scaling ({_field(reader, 'llama.rope.scaling.type')!r}); minienv "
                              "implements only plain RoPE")
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None
    hidden, heads = _field(reader, "llama.embedding_length"), _field(reader, "llama.attention.head_count")
    raw = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": _field(reader, "llama.vocab_size", n_tokens),
        "hidden_size": hidden, "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv", heads),
        "max_position_embeddings": _field(reader, "llama.context_length", 2048),
        "rope_theta": _field(reader, "llama.rope.freq_base", 10000.0),
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    head_dim = _field(reader, "llama.rope.dimension_count")
    if head_dim is not None:
        raw["head_dim"] = head_dim
    try:
        return LlamaConfig.from_dict(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def read_weights(reader: Any, config: LlamaConfig, path: Path) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, renamed to Hugging Face names, Q and K un-permuted."""
    import gguf

    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            raise CheckpointError(f"{path}: tensor {t.name!r} is not part of a Llama model minienv implements")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions fastest-first
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except Exception as exc:  # noqa: BLE001 - a short or garbled tensor
            raise CheckpointError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}, shape {shape}) cannot be "
                                  f"read: {exc}") from exc
        if name.endswith("q_proj.weight"):
            w = unpermute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, config.num_key_value_heads)
        weights[name] = np.ascontiguousarray(w)
    return weights


def read_tokenizer(reader: Any, path: Path) -> Any:
    """minienv's BPE from ``tokenizer.ggml.*`` (a byte-level ``gpt2`` tokenizer; others are refused)."""
    from minienv.tokenizer import BPETokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: tokenizer.ggml.model is {kind!r}; minienv implements byte-level BPE "
                              "('gpt2') only")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges", [])
    types = _field(reader, "tokenizer.ggml.token_type", [])
    special = [i for i, kind in enumerate(types) if kind == _CONTROL]
    return BPETokenizer.from_vocab(tokens, merges, special, pre_tokenizer=_field(reader, "tokenizer.ggml.pre",
                                   "default"), eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
                                   source=str(path))


def read_gguf(path: str | Path) -> GGUFModel:
    """Config, float32 weights, tokenizer and chat template of a Llama GGUF file; errors name the file."""
    path = Path(path)
    reader = _open(path)
    config = read_config(reader, path)
    tokenizer = read_tokenizer(reader, path)
    template = _field(reader, "tokenizer.chat_template")
    weights = read_weights(reader, config, path)
    del reader  # the memory map: only the float32 copies stay
    return GGUFModel(config=config, weights=weights, tokenizer=tokenizer, chat_template=template, name=path.stem)

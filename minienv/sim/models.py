"""Model shapes: what the roofline counts (layers, widths, heads, vocabulary) — the numbers of each model's
Hugging Face ``config.json``, written here so a simulation needs no download.

Only the shape matters to the clock: parameters (-> weight bytes read per step, FLOPs per token), KV heads and
head dim (-> KV bytes per token; grouped-query attention shrinks them), attention heads (-> attention FLOPs).
The two bundled models are read from their own ``assets/*/config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from minienv.paths import assets_dir


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. ``gated_mlp``: SwiGLU (three matrices, Llama/Qwen) or a plain two-matrix
    MLP (OPT). ``dtype_bytes``: bytes per weight and per KV element (2 = BF16/FP16, what the GPUs serve in)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    learned_positions: bool = False  # OPT: a position-embedding table of max_model_len rows
    biases: bool = False  # OPT: every linear layer has a bias; Qwen2: only q/k/v
    qkv_bias: bool = False
    dtype_bytes: int = 2
    source: str = ""

    # ------------------------------------------------------------------ parameter counts
    @property
    def layer_params(self) -> int:
        """One decoder layer: attention projections + MLP + its norms (and biases where the model has them)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        bias = 0
        if self.biases:
            bias = q + 2 * kv + h + self.intermediate_size + h
        elif self.qkv_bias:
            bias = q + 2 * kv
        return attn + mlp + bias + 2 * h * (2 if self.biases else 1)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size + (self.max_model_len * self.hidden_size
                                                     if self.learned_positions else 0)

    @property
    def lm_head_params(self) -> int:
        """The output projection's weights (the embedding matrix itself when tied: read again, not stored twice)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Stored parameters: layers + embeddings + (an untied) LM head + the final norm."""
        return (self.num_layers * self.layer_params + self.embedding_params
                + (0 if self.tied_embeddings else self.lm_head_params) + self.hidden_size)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers: ``2 x layers x kv_heads x head_dim x dtype``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def with_dtype(self, dtype_bytes: int) -> "ModelSpec":
        return replace(self, dtype_bytes=dtype_bytes)

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict, *, source: str = "") -> "ModelSpec":
        """A Llama-style ``config.json`` (Llama, Qwen2, minienv's bundled models)."""
        heads = cfg["num_attention_heads"]
        return cls(name, cfg["num_hidden_layers"], cfg["hidden_size"], heads, cfg.get("num_key_value_heads", heads),
                   cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg["intermediate_size"], cfg["vocab_size"],
                   cfg["max_position_embeddings"], tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   source=source)


def _bundled(which: str) -> ModelSpec:
    path = assets_dir() / which / "config.json"
    return ModelSpec.from_hf_config(f"minienv-{which}", json.loads(path.read_text()), source=f"assets/{which}/config.json")


_HF = "https://huggingface.co/{}/blob/main/config.json"

MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, 8192, source=_HF.format("meta-llama/Meta-Llama-3-8B")),
    ModelSpec("Llama-2-13B", 40, 5120, 40, 40, 128, 13824, 32000, 4096, source=_HF.format("meta-llama/Llama-2-13b-hf")),
    ModelSpec("OPT-13B", 40, 5120, 40, 40, 128, 20480, 50272, 2048, tied_embeddings=True, gated_mlp=False,
              learned_positions=True, biases=True, source=_HF.format("facebook/opt-13b")),
    ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, 32768, qkv_bias=True,
              source=_HF.format("Qwen/Qwen2.5-7B")),
    ModelSpec("Mistral-7B", 32, 4096, 32, 8, 128, 14336, 32768, 32768,
              source=_HF.format("mistralai/Mistral-7B-Instruct-v0.3")),
    ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, 8192,
              source=_HF.format("meta-llama/Meta-Llama-3-70B")),
)}


def get_model(name: str) -> ModelSpec:
    """The model called ``name`` (case-insensitive), including ``minienv-target`` / ``minienv-draft`` (the bundled
    ones), or a ``ValueError`` listing the known ones."""
    if isinstance(name, ModelSpec):
        return name
    low = str(name).lower()
    for which in ("target", "draft"):
        if low in (f"minienv-{which}", which):
            return _bundled(which)
    key = {k.lower(): k for k in MODELS}.get(low)
    if key is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}, minienv-target, minienv-draft")
    return MODELS[key]

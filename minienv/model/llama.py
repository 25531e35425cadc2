"""A Llama-style decoder in numpy float32: embeddings, RMSNorm, RoPE, grouped-query attention, SwiGLU, LM head.

Every operation matches ``transformers``' ``LlamaForCausalLM`` (the reference tier checks logits to 1e-4), so a
real Llama-family checkpoint gives the same logits here. The model is written against an *attention backend*
(:mod:`minienv.model.attention`): it projects Q/K/V, rotates Q and K, and asks the backend for attention. The
backend owns the KV storage, which is why the same model runs with no cache, a contiguous cache, or the paged
cache later, and why it never needs to know which tokens belong to which sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from minienv.model.attention import AttentionBackend, NoCache
from minienv.model.checkpoint import check_weights, load_weights
from minienv.model.config import LlamaConfig
from minienv.model.kv_cache import ContiguousKVCache
from minienv.model.linear import linear


# Constants made once: a np.float32 built inside a hot function costs a constructor call every time.
_HALF, _ONE = np.float32(0.5), np.float32(1.0)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None,
             axis: int = -1) -> np.ndarray:
    """``weight * x / sqrt(mean(x²) + eps)`` over ``axis`` (float32, like HF's ``LlamaRMSNorm``).

    The model's activations are feature-major (``[hidden, tokens]``: one column per token), so it norms over
    ``axis=0`` with ``weight`` as a column ``[hidden, 1]``; the default is HF's row-major form.
    ``out`` (same shape as ``x``, not ``x`` itself) receives the result and, first, ``x²``: at decode sizes each numpy
    call costs more than its arithmetic, so a caller that norms every layer passes one buffer and skips allocations.
    """
    # np.mean's own arithmetic (a float32 sum, then a division by the count) without its Python wrapper, which
    # costs more than the sum at decode sizes; the bits are np.mean's.
    squares = np.multiply(x, x, out=out)
    size = x.shape[axis]
    if x.size == size:  # one token (a decode): float32 *scalar* arithmetic — the same operations, the same
        # bits, at a fraction of the cost of three ufunc calls on a [1, 1] array
        rms = np.sqrt(np.add.reduce(squares, axis=None) / np.float32(size) + np.float32(eps))
    else:
        rms = np.add.reduce(squares, axis=axis, keepdims=True)
        rms /= size
        rms += np.float32(eps)
        np.sqrt(rms, out=rms)
    out = np.divide(x, rms, out=out)  # x² is no longer needed: overwrite it
    out *= weight  # in place: the same products as weight * (...), one temporary fewer
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)`` written with tanh, which never overflows."""
    return x * (_HALF * (_ONE + np.tanh(_HALF * x)))


def silu_and_mul(gate_up: np.ndarray, out: np.ndarray | None = None, axis: int = -1) -> np.ndarray:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along ``axis`` (vLLM's ``SiluAndMul``), bit for bit, one
    operation fewer. (The model's activations are feature-major, ``[2I, tokens]``: it passes ``axis=0``.)

    :func:`silu` computes ``gate * (0.5 * (1 + t))`` with ``t = tanh(0.5 * gate)``; here it is
    ``(0.5 * gate) * (1 + t)``, reusing the ``0.5 * gate`` that tanh needed anyway. Both round the same real
    product ``gate * (1 + t) / 2`` once, because each halving is exact: ``1 + t`` is 0 or at least 2⁻²⁴ (never
    subnormal), and ``gate`` loses a bit when halved only below 2⁻¹²⁵, where ``1 + t`` is exactly 1 and both forms
    give ``0.5 * gate``. ``out`` (``gate``'s shape) receives the result.
    """
    if axis == 0:
        inter = gate_up.shape[0] // 2
        gate, up = gate_up[:inter], gate_up[inter:]
    else:
        inter = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :inter], gate_up[..., inter:]
    half_gate = gate * _HALF
    out = np.tanh(half_gate, out=out)
    out += _ONE
    out *= half_gate
    out *= up
    return out


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """RoPE tables ``[N, 1, head_dim]`` in HF's layout (frequencies repeated: ``cat(freqs, freqs)``)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    freqs = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x [N, H, D]`` by position: ``x*cos + rotate_half(x)*sin`` with ``rotate_half(x) = [-x2, x1]``."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rotate_in_place(x: np.ndarray, cos: np.ndarray, signed_sin: np.ndarray) -> None:
    """:func:`apply_rope` written into ``x`` itself, bit for bit, in three numpy calls instead of seven.

    ``x`` is ``[N, H, 2, D/2]`` (the two halves of each head on their own axis; it may be a view into the rows of
    a bigger array), ``cos`` and ``signed_sin`` are ``[N, 1, 2, D/2]`` (:meth:`RopeTable.rows`). Two tricks:

    * ``rotate_half`` is a view: reversing the halves axis (``x[:, :, ::-1]``) gives ``[x2, x1]`` with no copy;
    * its sign lives in the table: ``signed_sin = [-sin1, sin2]``, and ``(-x2) * s == x2 * (-s)`` exactly in IEEE
      arithmetic, so nothing is negated per step.

    The sum is ``x*cos + rotated*sin`` in the same order of rounding as :func:`apply_rope`.
    """
    rotated = x[:, :, ::-1] * signed_sin  # [x2, x1] * [-sin, sin]: reads x before it is overwritten
    x *= cos
    x += rotated


@dataclass
class LlamaLayer:
    """One decoder layer's weights in the checkpoint's ``[out, in]`` layout (Q|K|V and gate|up fused, as vLLM's
    ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` fuse them), so each projection is one ``W @ X``;
    the norms' weights are columns, to scale feature-major activations."""

    input_norm: np.ndarray  # [H, 1]
    w_qkv: np.ndarray  # [(Hq + 2*Hkv) * D, H]
    w_o: np.ndarray  # [H, Hq*D]
    post_norm: np.ndarray  # [H, 1]
    w_gate_up: np.ndarray  # [2*I, H]
    w_down: np.ndarray  # [H, I]


class RopeTable:
    """:func:`rope_cos_sin` for positions ``0 .. P-1``, computed once and grown (doubling) when a step needs a
    later position, so a step indexes rows instead of evaluating cos and sin. Row ``p`` is bit-identical to
    ``rope_cos_sin([p])``: the same float32 operations, element by element.

    It also keeps the rows in the form :func:`rotate_in_place` uses — cos and the *signed* sin ``[-sin1, sin2]``
    stacked in one ``[P, 2, 1, 2, D/2]`` array — so a step of many positions gathers both with one indexing call.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.cos = self.sin = np.zeros((0, 1, head_dim), dtype=np.float32)
        self._cos_signed_sin = np.zeros((0, 2, 1, 2, head_dim // 2), dtype=np.float32)

    def _grow(self, need: int) -> None:
        size = min(max(need, 2 * len(self.cos), 256), max(need, self.max_positions))
        self.cos, self.sin = rope_cos_sin(np.arange(size), self.head_dim, self.theta)
        signed_sin = self.sin.copy()
        signed_sin[..., :self.head_dim // 2] *= np.float32(-1.0)  # rotate_half's minus sign, applied once here
        both = np.stack([self.cos, signed_sin], axis=1)  # [P, 2, 1, D]
        self._cos_signed_sin = both.reshape(size, 2, 1, 2, self.head_dim // 2)

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(cos, sin)`` rows ``[N, 1, head_dim]`` for ``positions`` (non-negative, below ``max_positions``)."""
        need = int(positions.max()) + 1
        if need > len(self.cos):
            self._grow(need)
        if len(positions) == 1:  # a decode: a slice is a view, no gather
            p = int(positions[0])
            return self.cos[p:p + 1], self.sin[p:p + 1]
        return self.cos[positions], self.sin[positions]

    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(cos, signed_sin)`` rows ``[N, 1, 2, head_dim/2]`` for :func:`rotate_in_place`."""
        if len(positions) == 1:  # a decode: a slice is a view, no gather and no reduction
            p = int(positions[0])
            if p >= len(self._cos_signed_sin):
                self._grow(p + 1)
            both = self._cos_signed_sin[p:p + 1]
        else:
            need = int(positions.max()) + 1
            if need > len(self._cos_signed_sin):
                self._grow(need)
            both = self._cos_signed_sin[positions]
        return both[:, 0], both[:, 1]


class LlamaModel:
    """The numpy Llama. ``forward(ids)`` is the dense reference; ``forward_step`` runs through a backend.

    >>> logits = model.forward([1, 2, 3])                     # [3, vocab], no cache
    >>> cache = model.new_kv_cache(max_len=64)
    >>> logits = model.forward_step([1, 2, 3], [0, 1, 2], cache)   # prefill: same logits, K/V kept
    >>> logits = model.forward_step([4], [3], cache)               # decode: one token's work
    """

    def __init__(self, config: LlamaConfig, weights: Mapping[str, np.ndarray]):
        """Build from HF-named weights; they are checked first (names, shapes, finite values), so a bad
        checkpoint fails here with a :class:`CheckpointError` naming the tensor, never inside the forward pass."""
        weights = check_weights(config, weights, source="LlamaModel weights")
        self.config = config
        self.embed_tokens = np.ascontiguousarray(weights["model.embed_tokens.weight"], dtype=np.float32)
        self.layers: list[LlamaLayer] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            w = lambda name: np.asarray(weights[p + name], dtype=np.float32)  # noqa: E731
            self.layers.append(LlamaLayer(
                input_norm=np.ascontiguousarray(w("input_layernorm.weight")[:, None]),
                w_qkv=np.ascontiguousarray(np.concatenate(
                    [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")])),
                w_o=np.ascontiguousarray(w("self_attn.o_proj.weight")),
                post_norm=np.ascontiguousarray(w("post_attention_layernorm.weight")[:, None]),
                w_gate_up=np.ascontiguousarray(np.concatenate([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])),
                w_down=np.ascontiguousarray(w("mlp.down_proj.weight")),
            ))
        self.norm = np.ascontiguousarray(np.asarray(weights["model.norm.weight"], dtype=np.float32)[:, None])
        self.rope = RopeTable(config.head_dim, config.rope_theta, config.max_position_embeddings)
        # [vocab, H]: with tied embeddings the LM head *is* the embedding table (one copy in memory, not two)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else np.ascontiguousarray(weights["lm_head.weight"], dtype=np.float32))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "LlamaModel":
        """Load an HF Llama directory (``config.json`` + ``model.safetensors``)."""
        config = LlamaConfig.from_json(Path(model_dir) / "config.json")
        return cls(config, load_weights(model_dir, config))

    def new_kv_cache(self, max_len: int | None = None) -> ContiguousKVCache:
        """A contiguous cache for one sequence of this model (default ``max_position_embeddings`` tokens)."""
        return ContiguousKVCache.from_config(self.config, max_len)

    @property
    def num_parameters(self) -> int:
        return self.config.num_parameters()

    def __repr__(self) -> str:
        c = self.config
        return (f"LlamaModel(layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}, "
                f"kv_heads={c.num_key_value_heads}, head_dim={c.head_dim}, vocab={c.vocab_size}, "
                f"params={self.num_parameters:,})")

    # ------------------------------------------------------------------ validation
    def _check_tokens(self, token_ids: object) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.dtype == np.int64 and ids.ndim == 1:  # the engine's arrays, generate's lists: no copies
            if len(ids) == 1:  # a single decode: one scalar comparison instead of two reductions
                if 0 <= ids[0] < self.config.vocab_size:
                    return ids
            elif ids.size and ids.min() >= 0 and ids.max() < self.config.vocab_size:
                return ids
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be a 1-D sequence of ints, got shape {ids.shape}")
        if ids.size == 0:
            raise ValueError("token_ids is empty: the model needs at least one token")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            raise ValueError(
                f"token id {int(ids[bad][0])} out of range: vocab_size is {self.config.vocab_size}"
            )
        return ids.astype(np.int64, copy=False)

    def _check_positions(self, positions: object, n: int) -> np.ndarray:
        pos = np.asarray(positions)
        if pos.dtype == np.int64 and pos.shape == (n,) and n:  # the engine's arrays (the general checks below)
            if n == 1:  # a single decode: one scalar comparison instead of two reductions
                if 0 <= pos[0] < self.config.max_position_embeddings:
                    return pos
            elif pos.min() >= 0 and pos.max() < self.config.max_position_embeddings:
                return pos
        if pos.shape != (n,) or (n and not np.issubdtype(pos.dtype, np.integer)):
            raise ValueError(f"positions must be {n} integers (one per token), got shape {pos.shape}")
        if pos.min() < 0 or pos.max() >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {int(pos.max() if pos.max() >= 0 else pos.min())} is outside the model's context: "
                f"max_position_embeddings is {self.config.max_position_embeddings}"
            )
        return pos.astype(np.int64, copy=False)

    # ------------------------------------------------------------------ compute
    def forward(self, token_ids: object) -> np.ndarray:
        """Dense reference: logits ``[len(token_ids), vocab]`` for a whole sequence, causal, no cache."""
        ids = self._check_tokens(token_ids)
        if len(ids) > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {len(ids)} tokens is longer than max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        return self.forward_step(ids, np.arange(len(ids)), NoCache())

    def forward_step(
        self,
        token_ids: object,
        positions: object,
        backend: AttentionBackend,
        logits_indices: object | None = None,
    ) -> np.ndarray:
        """Run N tokens (one or many sequences, flattened) through the model with K/V kept by ``backend``.

        ``positions[i]`` is token i's absolute position in its own sequence (RoPE needs it; the backend's causal
        mask does too). Returns logits ``[N, vocab]``, or only the rows ``logits_indices`` (e.g. each sequence's
        last token) — the LM head is the biggest matmul of a small model, so skipping unused rows matters.
        """
        ids = self._check_tokens(token_ids)
        pos = self._check_positions(positions, len(ids))
        c = self.config
        n, hq, hkv, d = len(ids), c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos, signed_sin = self.rope.rows(pos)  # rows of a table made once (rope_cos_sin's values, bit for bit)

        # Activations are feature-major — one column per token, ``x [H, N]`` — so each projection is ``W @ X`` with
        # the weight as stored (:mod:`minienv.model.linear` says why). One set of buffers per call, reused by every
        # layer: at decode sizes a numpy call's fixed cost dominates, so each allocation saved matters. (Per call,
        # not per model: two threads may share one model.)
        x = np.ascontiguousarray(self.embed_tokens.take(ids, 0).T)  # [H, N]: this call's own copy of the rows
        h = np.empty_like(x)  # each RMSNorm's output
        proj = np.empty_like(x)  # o_proj's and down_proj's outputs, before they are added to x
        qkv_cols = np.empty(((hq + 2 * hkv) * d, n), dtype=np.float32)
        qkv = np.empty((n, (hq + 2 * hkv) * d), dtype=np.float32)  # the same, token-major, for RoPE and attention
        gate_up = np.empty((2 * c.intermediate_size, n), dtype=np.float32)
        act = np.empty((c.intermediate_size, n), dtype=np.float32)
        # Views into qkv, made once: RoPE rotates Q and K in place (halves on their own axis), and the backend
        # reads Q, K, V where the copy put them. Backends must not keep them past attend (the next layer
        # overwrites qkv) — every backend copies K and V into its cache.
        heads = qkv.reshape(n, hq + 2 * hkv, d)  # Q heads, then K heads, then V heads
        q, k, v = heads[:, :hq], heads[:, hq:hq + hkv], heads[:, hq + hkv:]
        qk_halves = qkv.reshape(n, hq + 2 * hkv, 2, d // 2)[:, :hq + hkv]
        eps = np.float32(c.rms_norm_eps)

        backend.begin_step(pos)
        for layer_idx, layer in enumerate(self.layers):
            linear(layer.w_qkv, rms_norm(x, layer.input_norm, eps, out=h, axis=0), qkv_cols)
            np.copyto(qkv, qkv_cols.T)  # token-major: each token's heads side by side
            rotate_in_place(qk_halves, cos, signed_sin)  # Q and K heads rotated at once
            attn = backend.attend(layer_idx, q, k, v)  # [N, Hq, D]
            x += linear(layer.w_o, attn.reshape(n, hq * d).T, proj)
            linear(layer.w_gate_up, rms_norm(x, layer.post_norm, eps, out=h, axis=0), gate_up)
            x += linear(layer.w_down, silu_and_mul(gate_up, out=act, axis=0), proj)
        backend.end_step()

        if logits_indices is not None:
            x = x[:, np.asarray(logits_indices, dtype=np.int64)]
        h = rms_norm(x, self.norm, eps, axis=0)
        logits = linear(self.lm_head, h, np.empty((len(self.lm_head), h.shape[1]), dtype=np.float32))
        return np.ascontiguousarray(logits.T)  # [rows, vocab]


def load_model(path: str | Path | None = None) -> LlamaModel:
    """Load a Llama model directory; no path loads the bundled target model (``assets/target``)."""
    if path is None:
        from minienv.paths import assets_dir

        path = assets_dir() / "target"
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    return LlamaModel.from_pretrained(path)

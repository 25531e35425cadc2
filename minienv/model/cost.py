"""A deterministic cost model of generation: matmul FLOPs and tokens pushed through the model, with and without a
KV cache. Timings vary from machine to machine; these counts do not, so notebooks can check them.

FLOPs count 2 per multiply-add and only the matmuls (projections, attention scores and weighted sums, MLP, LM
head) — everything else (norms, RoPE, softmax) is a rounding error at this size and at real sizes alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from minienv.model.config import LlamaConfig


def linear_flops_per_token(config: LlamaConfig) -> int:
    """FLOPs of every weight matmul for one token through all layers (not the LM head, not attention)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    per_layer = 2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h + 2 * 3 * h * i
    return per_layer * config.num_hidden_layers


def attention_flops(config: LlamaConfig, context_len: int) -> int:
    """FLOPs for one query token attending ``context_len`` cached tokens, in every layer (QKᵀ and PV)."""
    return 2 * 2 * config.num_attention_heads * config.head_dim * context_len * config.num_hidden_layers


def lm_head_flops(config: LlamaConfig) -> int:
    return 2 * config.hidden_size * config.vocab_size


@dataclass(frozen=True)
class GenerationCost:
    """What generating ``new_tokens`` after a ``prompt_len`` prompt pushes through the model."""

    forward_calls: int
    tokens_processed: int  # token rows that went through the layers
    flops: int

    @property
    def gflops(self) -> float:
        return self.flops / 1e9


def generation_cost(config: LlamaConfig, prompt_len: int, new_tokens: int, use_cache: bool) -> GenerationCost:
    """Cost of minienv's :func:`~minienv.generate.generate_ids` loop (greedy, no early stop).

    With a cache: one prefill of the prompt (LM head on its last row only), then one single-token step per new
    token except the last (the last sampled token needs no forward). Without: every new token re-runs
    ``model.forward`` over the whole sequence so far (LM head on every row, as ``forward`` returns them all).
    """
    if prompt_len < 1 or new_tokens < 1:
        raise ValueError("prompt_len and new_tokens must be >= 1")
    lin, head = linear_flops_per_token(config), lm_head_flops(config)
    if use_cache:
        prefill = prompt_len * lin + sum(attention_flops(config, t) for t in range(1, prompt_len + 1)) + head
        decode = sum(lin + attention_flops(config, prompt_len + s + 1) + head for s in range(new_tokens - 1))
        return GenerationCost(new_tokens, prompt_len + new_tokens - 1, prefill + decode)
    flops, rows = 0, 0
    for s in range(new_tokens):
        n = prompt_len + s
        rows += n
        flops += n * (lin + head) + attention_flops(config, n * (n + 1) // 2)  # token j attends j+1 tokens
    return GenerationCost(new_tokens, rows, flops)

"""Notebook 15's exercises: a real model's KV bytes per token, and the prefix-cache hits a shared system prompt earns."""

from __future__ import annotations

from minienv.exercises._check import exercise, fail, require
from minienv.model.config import LlamaConfig


def _config(layers: int, heads: int, kv_heads: int, head_dim: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=100, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=64)


@exercise("write kv_bytes_per_token(config): float32 K/V bytes one token occupies in the cache")
def check_kv_bytes_per_token(fn) -> str:
    cases = [(1, 1, 1, 2), (30, 9, 3, 64), (4, 8, 2, 16), (2, 4, 4, 8), (7, 6, 1, 10)]
    for layers, heads, kv_heads, d in cases:
        cfg = _config(layers, heads, kv_heads, d)
        got = fn(cfg)
        want = cfg.kv_bytes_per_token()
        if got == want:
            continue
        require(got != want // 2, "store K and V: two vectors per head", f"{cfg}: expected {want}, got {got}")
        require(got != 2 * layers * heads * d * 4, "only the KV heads are cached (grouped-query attention), "
                "not every query head", f"{heads} query heads share {kv_heads} KV heads: expected {want}, got {got}")
        require(got != want // layers, "every layer keeps its own K and V", f"{layers} layers: expected {want}, "
                f"got {got}")
        require(got != want // 4, "count bytes: float32 is 4 bytes per number", f"expected {want}, got {got}")
        fail("2 (K and V) × layers × KV heads × head_dim × 4 bytes", f"{cfg}: expected {want}, got {got}")
    smol = _config(30, 9, 3, 64)
    return f"kv_bytes_per_token is right: SmolLM2-135M keeps {fn(smol):,} bytes per token"


def prefix_hit_tokens_reference(shared_len: int, prompt_lens: list[int], block_size: int) -> int:
    """Prompt tokens served from the prefix cache when requests sharing their first ``shared_len`` tokens run one
    after another: every request after the first finds the shared prefix's full blocks, never its own last token."""
    total = 0
    for i, n in enumerate(prompt_lens):
        if i == 0:
            continue
        total += min(shared_len // block_size, (n - 1) // block_size) * block_size
    return total


@exercise("write prefix_hit_tokens(shared_len, prompt_lens, block_size): prompt tokens the prefix cache serves")
def check_prefix_hit_tokens(fn) -> str:
    cases = [(40, [50], 16), (40, [50, 60], 16), (32, [40, 33, 50], 16), (48, [48, 48], 16), (10, [20, 30], 16),
             (100, [120, 140, 160, 180], 4), (17, [17, 40], 16), (64, [65, 200, 80], 32)]
    for shared, lens, b in cases:
        got = fn(shared, list(lens), b)
        want = prefix_hit_tokens_reference(shared, lens, b)
        if got == want:
            continue
        first = min(shared // b, (lens[0] - 1) // b) * b
        require(got != want + first, "the first request finds nothing cached: it computes the shared prefix",
                f"shared {shared}, prompts {lens}, blocks of {b}: expected {want}, got {got}")
        capless = sum(shared // b * b for _ in lens[1:])
        require(got != capless, "the prompt's last token is never a hit (its logits are needed)",
                f"shared {shared}, prompts {lens}, blocks of {b}: expected {want}, got {got}")
        require(got != (len(lens) - 1) * shared, "only whole blocks are hits: a partly filled block is not "
                "hashed", f"shared {shared} tokens in blocks of {b}: expected {want}, got {got}")
        fail("every later request hits the shared prefix's full blocks, capped below its own last token",
             f"shared {shared}, prompts {lens}, blocks of {b}: expected {want}, got {got}")
    return f"prefix_hit_tokens is right in all {len(cases)} cases"

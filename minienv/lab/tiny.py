"""A tiny random model and a token-id "tokenizer": what exercises and lab proofs run the real engine on when the
point is the bookkeeping, not the text (seconds on any machine, deterministic)."""

from __future__ import annotations

from minienv.model import LlamaConfig, LlamaModel, random_weights


class TokenIdTokenizer:
    """Prompts are token ids; text is the ids (notebook 07's stand-in tokenizer). No end-of-text token."""

    eos_token_id = None
    vocab_size = 128

    def encode(self, text):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


def tiny_model() -> LlamaModel:
    """A 2-layer random Llama (vocab 128, GQA 4:2, head dim 8), seeded: the same weights every call."""
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    return LlamaModel(cfg, random_weights(cfg, seed=0, scale=0.3))

"""A model that does no arithmetic, and the tokenizer that goes with it: what lets minienv's real engine run a
trace of ten thousand requests at a GPU's scale on a laptop.

:class:`SimulatedModel` answers ``forward_step`` with one zero logit per row: the engine's sampler picks token 0,
there is no end-of-sequence token, so each request generates exactly its ``max_tokens`` (the trace's output
length) and stops. Its config declares one layer, one KV head and a head dim of one, so the engine's KV pool is
a placeholder of one float per K and V slot (a few MB at H100 scale) that nothing reads or writes — the KV that
matters is bookkeeping: the real block manager, prefix cache, preemption and eviction, in blocks of the real size.
``max_position_embeddings`` is the simulated model's real context length, so the engine's validation is real too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: prompt token ids are drawn below this; wide enough that random prompts never share a 16-token block by chance
SIM_VOCAB = 1 << 20


@dataclass(frozen=True)
class SimConfig:
    """The fields of a model config the engine reads."""

    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 1


class SimulatedModel:
    """The engine's model seam with no math: ``forward_step`` returns ``[rows, 1]`` zeros (every row samples 0)."""

    def __init__(self, max_model_len: int, vocab_size: int = SIM_VOCAB):
        self.config = SimConfig(vocab_size, max_model_len)

    def forward_step(self, token_ids, positions, backend, logits_indices=None) -> np.ndarray:
        rows = len(token_ids) if logits_indices is None else len(logits_indices)
        return np.zeros((rows, 1), dtype=np.float32)


class SimTokenizer:
    """Token ids in, empty text out: no end-of-sequence token (a request stops at its ``max_tokens``)."""

    eos_token_id = None
    vocab_size = None  # every id of the simulated model's vocabulary is valid

    def encode(self, text: str) -> list[int]:
        raise ValueError("the simulated model takes token ids, not text")

    def decode(self, ids) -> str:
        return ""

"""minienv's numpy Llama: config, safetensors checkpoints, the model, and its attention backends / KV caches."""

from minienv.model.attention import AttentionBackend, NoCache, causal_attention
from minienv.model.checkpoint import (
    CheckpointError,
    random_weights,
    read_safetensors,
    save_checkpoint,
    write_safetensors,
)
from minienv.model.config import ConfigError, LlamaConfig
from minienv.model.kv_cache import CacheFullError, ContiguousBatch, ContiguousKVCache
from minienv.model.llama import LlamaModel, load_model

__all__ = [
    "AttentionBackend", "CacheFullError", "CheckpointError", "ConfigError", "ContiguousBatch", "ContiguousKVCache",
    "LlamaConfig", "LlamaModel", "NoCache", "causal_attention", "load_model", "random_weights", "read_safetensors",
    "save_checkpoint", "write_safetensors",
]

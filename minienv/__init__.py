"""minienv: a small numpy LLM inference engine, built layer by layer in the notebooks.

Public names follow vLLM where a counterpart exists. They are imported lazily, so ``import minienv`` is cheap
and needs numpy only; the live views in ``minienv.viz`` need the ``lab`` extra.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "assets_dir": "minienv.paths",
    # model core (notebook 02)
    "load_model": "minienv.model",
    "LlamaModel": "minienv.model",
    "LlamaConfig": "minienv.model",
    "ContiguousKVCache": "minienv.model",
    "AttentionBackend": "minienv.model",
    "CheckpointError": "minienv.model",
    "ConfigError": "minienv.model",
    # sampling (single-request generation: minienv.generate.generate)
    "SamplingParams": "minienv.sampling",
    "Sampler": "minienv.sampling",
    # the paged KV cache: block pool, block tables, KV pool, paged attention (notebooks 03-04)
    "BlockPool": "minienv.kv",
    "BlockTable": "minienv.kv",
    "KVPool": "minienv.kv",
    "PagedAttentionBackend": "minienv.kv",
    "PagedAttentionMetadata": "minienv.kv",
    "OutOfBlocksError": "minienv.kv",
    "KVBudgetError": "minienv.kv",
    # the KV cache: prefix-aware refcounting, copy-on-write, LRU eviction (notebooks 05-06)
    "KVCacheManager": "minienv.kv.kv_cache_manager",
    "make_extra_key": "minienv.kv.hashing",
    # the scheduler and the engine (notebooks 07-08)
    "InferenceEngine": "minienv.engine",
    "RequestOutput": "minienv.engine",
    "EngineStats": "minienv.engine",
    "EngineSnapshot": "minienv.engine",
    "StepRecord": "minienv.engine",
    "Scheduler": "minienv.scheduler",
    "SchedulerOutput": "minienv.scheduler",
    "InvalidRequestError": "minienv.request",
    "RequestNotFoundError": "minienv.request",
    # the tokenizer (notebook 01)
    "BPETokenizer": "minienv.tokenizer",
    "load_tokenizer": "minienv.tokenizer",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'minienv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__

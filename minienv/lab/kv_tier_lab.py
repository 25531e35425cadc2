"""Exhibits of notebook 11 (the persistent KV tier): serve-and-restart runs, where each block came from, the
record's layout (the exercises' checks are in ``minienv.exercises.persistent_kv``).

Everything here drives the real engine and the real stores; nothing on the engine path imports it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from minienv.kv_tier import KVTierStats, TierEvent, block_keys

__all__ = ["RECORD_FIELDS", "ServeRun", "keys_in_fresh_processes", "serve_with_tier"]

@dataclass
class ServeRun:
    """One request served by a fresh engine: its output, and where each of its prompt's full blocks came from.

    ``origins[j]`` is "tier" (loaded), "refused" (its record failed a check; recomputed), "local" (a hit in this
    engine's own prefix cache) or "computed"; ``pool_blocks[j]`` the pool block that held it.
    """

    token_ids: tuple[int, ...]
    prompt_tokens: int
    loaded_tokens: int
    local_hit_tokens: int
    stats: KVTierStats | None
    origins: list[str] = field(default_factory=list)
    pool_blocks: list[int] = field(default_factory=list)
    events: list[TierEvent] = field(default_factory=list)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens that ran through the model."""
        return self.prompt_tokens - self.loaded_tokens - self.local_hit_tokens


def serve_with_tier(model: Any, tokenizer: Any, prompt: Sequence[int], tier: Any, *, block_size: int = 16,
                    max_tokens: int = 8) -> ServeRun:
    """Serve ``prompt`` greedily on a *new* engine whose tier is ``tier`` (None: no tier); report the run."""
    from minienv.engine import InferenceEngine
    from minienv.sampling import SamplingParams

    engine = InferenceEngine(model, tokenizer, block_size=block_size, kv_tier=tier)
    events: list[TierEvent] = []
    if engine.kv_tier is not None:
        engine.kv_tier.add_listener(events.append)
    out = engine.generate([list(prompt)], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    n_blocks = len(prompt) // block_size
    origins = ["computed"] * n_blocks
    local = engine.kv_cache_manager.prefix_stats.hits
    for j in range(local // block_size):
        origins[j] = "local"
    for e in events:
        if e.kind == "load":
            origins[e.block_index] = "tier"
        elif e.kind == "refuse":
            origins[e.block_index] = "refused"
    hit = engine.kv_cache_manager.lookup(list(prompt))
    pool_blocks = list(hit.block_ids) + [-1] * (n_blocks - len(hit.block_ids))
    stats = engine.kv_tier.stats if engine.kv_tier is not None else None
    return ServeRun(tuple(out.token_ids), len(prompt), stats.hit_tokens if stats else 0, local, stats, origins,
                    pool_blocks, events)


#: The fields of a record, in order, with their sizes (for the layout picture).
RECORD_FIELDS: list[tuple[str, str]] = [
    ("magic", "8 B  b'MNVKVBLK': is this a minienv KV record at all?"),
    ("format version", "2 B (+2 B flags): a reader refuses any version it does not know"),
    ("model fingerprint", "32 B  sha256(weights, config, dtype, block size, KV layout)"),
    ("key · parent key", "32 B + 32 B  the block's chain hash and its parent's"),
    ("shape · dtype · lengths", "4 B tokens, 1+20 B shape [L,2,B,H,D], 8 B dtype, 8 B payload length"),
    ("token ids", "8 B × block_size  the block's own tokens"),
    ("payload", "the K/V bytes, C order  (L·2·B·H·D·4 B)"),
    ("checksum", "32 B  sha256 of every byte above"),
]


def keys_in_fresh_processes(token_ids: Sequence[int], block_size: int, fingerprint: bytes,
                            seeds: Sequence[str] = ("0", "1")) -> dict[str, dict[str, str]]:
    """For each PYTHONHASHSEED, a new Python process computes the first block's tier key and ``hash()`` of the
    same bytes. Returns ``{seed: {"tier_key": hex, "python_hash": str}}``."""
    code = ("import sys, json; from minienv.kv_tier import block_keys; "
            "t = json.loads(sys.argv[1]); fp = bytes.fromhex(sys.argv[2]); b = int(sys.argv[3]); "
            "k = block_keys(t, b, fp)[0]; print(json.dumps({'tier_key': k.hex(), 'python_hash': str(hash(k))}))")
    import json

    root = str(Path(__file__).resolve().parents[2])
    out = {}
    for seed in seeds:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        res = subprocess.run([sys.executable, "-c", code, json.dumps(list(token_ids)[:block_size]), fingerprint.hex(),
                              str(block_size)], env=env, capture_output=True, text=True, check=True)
        out[seed] = json.loads(res.stdout)
    return out

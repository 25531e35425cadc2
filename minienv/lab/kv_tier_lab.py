"""Exhibits of notebook 11 (the persistent KV tier): serve-and-restart runs, where each block came from, the
record's layout, and the exercise's checker.

Everything here drives the real engine and the real stores; nothing on the engine path imports it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from minienv.kv.hashing import ROOT_HASH
from minienv.kv_tier import KVTierStats, SQLiteStore, TierEvent, block_keys, encode_record

__all__ = ["RECORD_FIELDS", "ServeRun", "check_next_victim", "keys_in_fresh_processes", "load_solution",
           "serve_with_tier"]

#: The exercise's solution, beside the notebooks in the repository (not part of the installed package).
SOLUTION_PATH = Path(__file__).resolve().parents[2] / "solutions" / "11_persistent_kv.py"


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


# ---------------------------------------------------------------------------------------------------- exercise
_SHAPE = (1, 2, 2, 1, 2)
_FP = bytes(32)


def _chain_records(start: int, n: int, prefix: Sequence[int] = ()):
    tokens = list(prefix) + list(range(start, start + 2 * n))
    keys = block_keys(tokens, 2, _FP)
    kv = np.zeros(_SHAPE, dtype=np.float32)
    for j, key in enumerate(keys):
        parent = keys[j - 1] if j else ROOT_HASH
        yield key, parent, encode_record(_FP, key, parent, tokens[2 * j:2 * j + 2], kv)


def check_next_victim(fn: Callable[[list[tuple[bytes, bytes, int]]], bytes]) -> str:
    """Check ``fn(records) -> key``: the record a full store evicts next.

    ``records`` are ``(key, parent_key, last_access)`` of every stored record (``parent_key`` is ``ROOT_HASH``
    for a sequence's first block). The checker fills real :class:`~minienv.kv_tier.SQLiteStore` s with random
    chains, some of them sharing prefixes, refreshes random prefixes (a hit), asks ``fn``, then stores one more
    block and compares with the record the store actually evicted. Raises AssertionError on a wrong answer;
    returns a "not implemented yet" message if ``fn`` raises NotImplementedError.
    """
    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as tmp:
        for case in range(30):
            chains = [list(_chain_records(100 * c, int(rng.integers(1, 5)))) for c in range(3)]
            # a branch: shares the first block of chain 0, so that block can have two stored children
            chains.append(list(_chain_records(900, int(rng.integers(1, 4)), prefix=range(0, 2))))
            size = len(chains[0][0][2])
            store = SQLiteStore(Path(tmp) / f"case{case}", capacity_bytes=size * int(rng.integers(4, 9)))
            for _ in range(int(rng.integers(3, 8))):
                chain = chains[int(rng.integers(0, len(chains)))]
                if rng.random() < 0.7:
                    for item in chain[:int(rng.integers(1, len(chain) + 1))]:
                        store.put(*item)
                else:
                    store.get_many([k for k, _, _ in chain[:int(rng.integers(1, len(chain) + 1))]])
            # fill up to capacity, so the next put evicts exactly one record
            extra = _chain_records(10_000 + case * 100, 40)
            while store.usage()[1] + size <= store.capacity_bytes:
                store.put(*next(extra))
            records = [(k, p, t) for k, p, _, t in store.records()]
            try:
                predicted = fn(list(records))
            except NotImplementedError:
                return "check_next_victim: not implemented yet — write next_victim, then run this cell again"
            before = {k for k, _, _ in records}
            newcomer = next(_chain_records(50_000 + case, 1))
            store.put(*newcomer)
            evicted = before - {k for k, _, _, _ in store.records()}
            assert len(evicted) == 1, f"case {case}: the store evicted {len(evicted)} records"
            (actual,) = evicted
            if predicted != actual:
                parents = {p for _, p, _ in records}
                hint = ""
                if predicted in parents:
                    hint = (" — that record still has a stored child: evicting it would strand the child "
                            "(evict chain tails only)")
                elif predicted in before:
                    hint = " — a leaf, but not the least recently used one"
                raise AssertionError(f"case {case}: expected key {actual.hex()[:12]}…, got "
                                     f"{predicted.hex()[:12] if isinstance(predicted, bytes) else predicted!r}{hint}")
            store.close()
    return "check_next_victim: correct"


def load_solution() -> Callable[[list[tuple[bytes, bytes, int]]], bytes]:
    """``next_victim`` from ``solutions/11_persistent_kv.py`` (found from the package, wherever the notebook runs)."""
    import importlib.util

    if not SOLUTION_PATH.is_file():
        raise FileNotFoundError(f"the solution is not at {SOLUTION_PATH} (it ships with the repository, not the wheel)")
    spec = importlib.util.spec_from_file_location("solution_11_persistent_kv", SOLUTION_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.next_victim

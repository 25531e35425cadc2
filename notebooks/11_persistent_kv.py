# %% [markdown]
# # 11 · A persistent KV tier: the prefix cache survives a restart, and is shared
#
# Notebooks 05 and 06 kept the K/V of finished requests in **cached-free** blocks, so the next request with the
# same prefix skips its prefill. But that cache lives in the engine's memory: restart the engine and every cached
# prefix is gone; start a second instance and it gets nothing from the first. Real systems grew a tier *under* the
# KV pool for this — LMCache (local disk, Redis and more), SGLang's HiCache, Mooncake — plugged into vLLM through
# its **KV connector** API. This notebook builds one and shows that it can be trusted.
#
# **Learning goals.** After this notebook you can
# 1. say where the tier plugs into the engine — *after* the local prefix lookup, *before* the prefill, *after* the
#    commit — and why asking the tier has no side effects;
# 2. key a block so the key is the same in every process, and say why Python's `hash()` cannot do it;
# 3. read a record's layout and say which trap each header field closes (wrong model, wrong key, a flipped bit, a
#    half-written value, a future format);
# 4. explain why a full tier evicts the **tails** of chains first;
# 5. show that the tier changes how much is computed and never what is generated.

# %% [markdown]
# ## The problem, with a number
#
# A long prompt (a system prompt and documents, 808<!--out--> tokens) served by the bundled model, then the engine restarts
# and the same prompt comes again. Without a tier the new engine computes everything again; with one, it loads:

# %%
# NBVAL_CHECK_OUTPUT
import tempfile
from pathlib import Path

import numpy as np

from minienv.lab.kv_tier_lab import serve_with_tier
from minienv.model import load_model
from minienv.tokenizer import load_tokenizer

model, tok = load_model(), load_tokenizer()
prompt = [int(t) for t in np.random.default_rng(0).integers(0, 2000, 808)]
workdir = Path(tempfile.mkdtemp(prefix="minienv-nb11-"))
tier_dir = workdir / "tier"

no_tier = serve_with_tier(model, tok, prompt, None)  # the first engine, no tier
before = serve_with_tier(model, tok, prompt, tier_dir)  # first engine with a tier: computes, stores
after = serve_with_tier(model, tok, prompt, tier_dir)  # a *new* engine: an empty pool, the same tier
for name, run in (("restart, no tier", no_tier), ("first run, tier", before), ("restart, tier", after)):
    print(f"{name:17s} prompt {run.prompt_tokens} tokens: computed {run.computed_tokens:3d}, "
          f"loaded from the tier {run.loaded_tokens:3d}")
print("outputs identical:", no_tier.token_ids == before.token_ids == after.token_ids)

# %%
assert after.loaded_tokens >= 0.9 * len(prompt) and after.computed_tokens == len(prompt) - after.loaded_tokens
assert no_tier.token_ids == after.token_ids

# %% [markdown]
# 800<!--out:above--> of 808<!--out:above--> prompt tokens come back from disk (50 full blocks of 16); the last
# 8<!--out:above--> tokens, a partial block, are
# computed — and at least one prompt token always is, since the model must run something to produce logits. The
# output is the same.
#
# ## Build it small: a tier in twenty lines
#
# A tier is a map from *block key* to *block bytes*. The key must name the whole prefix up to the end of the block
# (a block's K/V depend on every earlier token), so it is a **chain hash**, as in notebook 05 — computed with
# sha256 over fixed-width bytes, never with Python's `hash()`. The value carries a checksum, so a damaged value is
# refused instead of loaded.

# %%
import hashlib

TOY_B = 4  # tokens per block


def toy_keys(tokens, model_id=b"toy-model"):
    keys, parent = [], b"\0" * 32  # a fixed root, not a random one
    for j in range(len(tokens) // TOY_B):
        block = np.asarray(tokens[j * TOY_B:(j + 1) * TOY_B], dtype="<i8").tobytes()
        parent = hashlib.sha256(model_id + parent + block).digest()
        keys.append(parent)
    return keys


toy_store = {}  # key -> payload + sha256(payload)


def toy_save(tokens, kv_blocks):
    for key, kv in zip(toy_keys(tokens), kv_blocks):
        payload = kv.astype("<f4").tobytes()
        toy_store[key] = payload + hashlib.sha256(payload).digest()


def toy_load(tokens):
    """The verified K/V of the longest stored prefix (stop at the first miss or bad value)."""
    out = []
    for key in toy_keys(tokens):
        value = toy_store.get(key)
        if value is None or hashlib.sha256(value[:-32]).digest() != value[-32:]:
            break
        out.append(np.frombuffer(value[:-32], dtype="<f4"))
    return out


toy_tokens = list(range(12))
toy_kv = [np.full(3, j, dtype=np.float32) for j in range(3)]
toy_save(toy_tokens, toy_kv)
print("stored blocks:", len(toy_store), "| loaded for the same prompt:", len(toy_load(toy_tokens)),
      "| for a prompt differing in token 5:", len(toy_load(toy_tokens[:5] + [99] + toy_tokens[6:])))
bad_key = toy_keys(toy_tokens)[1]
toy_store[bad_key] = b"\x01" + toy_store[bad_key][1:]  # flip bits of block 1's value
print("after damaging block 1, loaded:", len(toy_load(toy_tokens)), "block(s): the damage is refused")

# %%
assert len(toy_load(toy_tokens)) == 1 and len(toy_load(list(range(4)) + [7] * 8)) == 1

# %% [markdown]
# ## minienv's version
#
# `minienv.kv_tier` keeps that shape and closes the gaps of the toy:
#
# * **keys** — `block_keys(tokens, block_size, fingerprint)`: the chain hash of `minienv.kv.hashing`, with the
#   **model fingerprint** (a sha256 of the weights, the config, the dtype, the block size and the KV layout) as the
#   extra key, so another model or layout never even finds our records;
# * **records** — a header that repeats everything the reader expects, then the token ids, the payload and a
#   checksum (the layout below); `decode_record` returns K/V only if *every* field matches;
# * **stores** — `SQLiteStore(directory)` (embedded: one file, transactions, no server) and
#   `RedisStore("redis://…")` (a server several engines share); both refuse a block whose parent is not stored and
#   evict **leaves** (chain tails) in LRU order;
# * **the connector** — the engine's seam, shaped like vLLM's `KVConnectorBase_V1`:
#
# | engine moment | connector call | what it does |
# |---|---|---|
# | admission, after the local prefix lookup | `get_num_new_matched_tokens(tokens, n_local)` | how many more tokens the tier holds — *reads only* |
# | | `prepare(request, tokens, n_local)` | read and verify those blocks into a staging area; stop at the first bad one |
# | blocks allocated | `load(request, allocation, n)` | copy the verified K/V into the fresh blocks; the step computes the rest |
# | after the step commits | `save_committed(plan, manager)` | store blocks that became full (their tokens are final) |
#
# Turning it on is one argument: `InferenceEngine(kv_tier="/some/dir")` or `kv_tier="redis://host:6379/0"`.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.engine import InferenceEngine
from minienv.kv_tier import SQLiteStore, block_keys, decode_record, peek_header
from minienv.sampling import SamplingParams

engine = InferenceEngine(model, tok, kv_tier=tier_dir)
tier = engine.kv_tier
keys = block_keys(prompt, 16, tier.fingerprint)
store = SQLiteStore(tier_dir)
record = store.raw(keys[3])
header = peek_header(record)
print(f"{len(keys)} keys; block 3's record: {len(record)} bytes, format v{header.format_version}, "
      f"shape {header.shape} {header.dtype}, {header.num_tokens} token ids")
print("header repeats the key and the parent's key:", header.key == keys[3], header.parent_key == keys[2])
kv = decode_record(record, fingerprint=tier.fingerprint, key=keys[3], parent_key=keys[2],
                   token_ids=prompt[48:64], shape=tier.block_shape)
print("payload:", kv.shape, kv.dtype, f"= {kv.nbytes} bytes = {kv.nbytes // 16} bytes per token")
print("records stored:", store.usage()[0])

# %% [markdown]
# The layout of one record (every field is checked before a byte of payload is used):

# %%
from minienv.lab.kv_tier_lab import RECORD_FIELDS
from minienv.viz import Stage, flow_diagram

flow_diagram([Stage(name, text) for name, text in RECORD_FIELDS], title="one KV tier record (little-endian, no pickle)",
             start="read from the store", end="→ K/V of one block, or a miss")

# %% [markdown]
# ## Live: restart the engine, corrupt a record, watch the blocks come back
#
# Each cell is one full block of the prompt, in order. **Restart** builds a new engine on the same tier and serves
# the prompt: blocks loaded from the tier are green, computed ones orange, a block whose record was refused red.
# **Corrupt** flips one byte of the chosen block's stored record; the next restart refuses it, and computes it and
# every block after it (a chain cannot skip a block), and stores it again — so the restart after that is all green.
# **Wipe** empties the tier.

# %%
import ipywidgets as widgets

from minienv.viz import BlockCell, BlockGrid

ORIGIN_COLORS = {"tier": "#59a14f", "computed": "#f28e2b", "refused": "#e15759", "local": "#4e79a7"}
n_blocks = len(prompt) // 16
grid = BlockGrid(n_blocks, columns=10, cell_px=52, owner_colors=ORIGIN_COLORS,
                 title=f"the prompt's {n_blocks} full blocks, by origin")
live = {"dir": workdir / "live-tier", "restarts": 0}


def draw(run, caption):
    grid.update([BlockCell(j, owner=o, refcount=1, label=f"#{j}") for j, o in enumerate(run.origins)],
                caption=caption)


def restart(_=None):
    run = serve_with_tier(model, tok, prompt, live["dir"])
    live["restarts"] += 1
    live["last"] = run
    draw(run, f"restart {live['restarts']}: loaded {run.loaded_tokens}, computed {run.computed_tokens}, "
              f"refused {run.stats.record_errors}, same output: {run.token_ids == no_tier.token_ids}")


def corrupt(_=None):
    s = SQLiteStore(live["dir"])
    key = block_keys(prompt, 16, tier.fingerprint)[block_slider.value]
    raw = s.raw(key)
    if raw is not None:
        s.overwrite_raw(key, raw[:200] + bytes([raw[200] ^ 0xFF]) + raw[201:])
    s.close()


def wipe(_=None):
    s = SQLiteStore(live["dir"])
    s.clear()
    s.close()


block_slider = widgets.IntSlider(value=20, min=0, max=n_blocks - 1, description="block to corrupt",
                                 style={"description_width": "initial"})
buttons = [widgets.Button(description=d) for d in ("Restart", "Corrupt", "Wipe")]
for b, fn in zip(buttons, (restart, corrupt, wipe)):
    b.on_click(fn)
restart()  # fills the tier (all computed)
restart()  # all loaded
widgets.VBox([widgets.HBox([*buttons, block_slider]), grid.widget])

# %% [markdown]
# The same moves, scripted, so the picture below is reproducible: corrupt block 20, restart (blocks 0–19 load,
# 20 is refused, 20–49 are computed), restart again (all load: the recomputed block replaced the bad record).

# %%
# NBVAL_CHECK_OUTPUT
block_slider.value = 20
corrupt()
restart()
refused_run = live["last"]
print(grid.caption)
restart()
print(grid.caption)

# %%
assert refused_run.origins[:20] == ["tier"] * 20 and refused_run.origins[20] == "refused"
assert set(refused_run.origins[21:]) == {"computed"} and refused_run.stats.corrupt_records == 1
assert live["last"].origins == ["tier"] * n_blocks and live["last"].token_ids == no_tier.token_ids
draw(refused_run, "restart after corrupting block 20: 0–19 loaded, 20 refused, 20–49 computed")
grid.static()

# %% [markdown]
# ## Why tails first: eviction that never strands a block
#
# A lookup walks a prompt's chain from the root and stops at the first miss. So if a full tier evicted block 3 of a
# stored chain, blocks 4, 5, … would stay on disk and never be found again: space wasted, and the prefix shortened to
# 3 blocks anyway. The stores evict only **leaves** — records no stored record names as parent — least recently
# used first; and they refuse to store a block whose parent is missing.

# %%
# NBVAL_CHECK_OUTPUT
small = SQLiteStore(workdir / "small", capacity_bytes=30 * len(record))  # room for 30 blocks of this model
eng = InferenceEngine(model, tok, kv_tier=small)
other = [int(t) for t in np.random.default_rng(1).integers(0, 2000, 400)]
eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
eng.generate([other], SamplingParams(max_tokens=1, temperature=0.0))
small.check_invariants()  # no record without its parent; byte total exact; within capacity
for name, p in (("808-token prompt", prompt), ("400-token prompt", other)):
    ks = block_keys(p, 16, tier.fingerprint)
    present = [k in {r[0] for r in small.records()} for k in ks]
    print(f"{name}: stored prefix {small.contains_prefix(ks):2d} of {len(ks)} blocks; "
          f"stored blocks past the first gap: {sum(present[small.contains_prefix(ks):])}")
print("evictions:", small.evictions(), "| counted by the engine:", eng.kv_tier.stats.evictions)

# %% [markdown]
# Every stored block is reachable: the first prompt kept a shorter prefix, nothing past a gap.
#
# ## Two instances, one Redis
#
# The embedded store helps one machine across restarts. A Redis server makes the cache **shared**: a second engine
# — another process, another machine — loads what the first computed (what LMCache and Mooncake provide as a
# distributed prefix cache). This cell starts a private `redis-server` on 127.0.0.1 if the machine has one
# (Debian: `apt-get install redis-server`), and skips with a message otherwise.

# %%
from minienv.kv_tier.local_redis import LocalRedis, redis_server_binary

if redis_server_binary() is None:
    print("skipped: no redis-server on this machine (Debian: apt-get install redis-server). "
          "The embedded store above needs no server.")
    shared = None
else:
    with LocalRedis(workdir / "redis") as server:
        instance_a = serve_with_tier(model, tok, prompt, server.url)
        instance_b = serve_with_tier(model, tok, prompt, server.url)
    shared = (instance_a, instance_b)
    print(f"instance A: computed {instance_a.computed_tokens}, stored {instance_a.stats.stores} blocks")
    print(f"instance B: loaded {instance_b.loaded_tokens} of {instance_b.prompt_tokens} prompt tokens from Redis; "
          f"same output: {instance_b.token_ids == instance_a.token_ids == no_tier.token_ids}")

# %%
if shared is not None:
    assert shared[1].loaded_tokens >= 0.9 * len(prompt) and shared[1].token_ids == no_tier.token_ids

# %% [markdown]
# ## The traps, each with its one-sentence lesson
#
# | trap (real systems shipped each) | the lesson, in one sentence |
# |---|---|
# | keys from Python's `hash()` or a random root hash: nothing found after a restart (LMCache shipped a random root hash and `None` in extra keys) | Key blocks with a cryptographic hash of **canonical bytes** from a **fixed root**. |
# | records outlived a model or KV-layout change and were loaded into the wrong model | Put a **fingerprint** of weights, config, dtype, block size and layout in the key *and* the header. |
# | a flipped bit or a half-written value was loaded as K/V | A **checksum** over the whole record; a failed load is a **miss**, and the block is recomputed. |
# | a write made visible before it was complete (metadata before payload) | Make a record appear **all at once**: a transaction, or one atomic script. |
# | evicting a chunk from the middle of a prefix made every later chunk useless | Evict **chain tails** first; never store a block whose parent is missing. |
# | a tier error failed the request | The tier is an optimisation: count the error, **recompute**, retry later; switch off when full. |

# %%
from minienv.kv_tier import RecordChecksumError, RecordVersionError, encode_record
from minienv.lab.kv_tier_lab import keys_in_fresh_processes
from minienv.model import LlamaModel, random_weights

trap = {}
procs = keys_in_fresh_processes(prompt, 16, tier.fingerprint, seeds=("0", "1"))
trap["same key in two processes, hash() differs"] = (procs["0"]["tier_key"] == procs["1"]["tier_key"]
                                                     and procs["0"]["python_hash"] != procs["1"]["python_hash"])
other_model = LlamaModel(model.config, random_weights(model.config, seed=3))  # same shapes, other weights
trap["another model: 0 hits"] = serve_with_tier(other_model, tok, prompt, tier_dir, max_tokens=1).loaded_tokens == 0
trap["another block size: 0 hits"] = serve_with_tier(model, tok, prompt, tier_dir, block_size=8,
                                                     max_tokens=1).loaded_tokens == 0
good = encode_record(tier.fingerprint, keys[3], keys[2], prompt[48:64], kv)
for name, bad, error in (("half-written record refused", good[:len(good) // 2], RecordChecksumError),
                         ("future format version refused", good[:8] + (99).to_bytes(2, "little") + good[10:],
                          RecordVersionError)):
    try:
        decode_record(bad, fingerprint=tier.fingerprint, key=keys[3], parent_key=keys[2], token_ids=prompt[48:64],
                      shape=tier.block_shape)
        trap[name] = False
    except error:
        trap[name] = True
try:
    small.check_invariants()  # every record's parent is stored (or it is a first block)
    trap["no record without its parent"] = True
except AssertionError:
    trap["no record without its parent"] = False
trap["corrupt record: miss + recompute, same output"] = (refused_run.stats.corrupt_records == 1
                                                         and refused_run.token_ids == no_tier.token_ids)
for name, ok in trap.items():
    print(f"{name:<48} {'ok' if ok else 'FAILED'}")

# %%
assert all(trap.values()) and len(trap) == 7

# %% [markdown]
# ## Exercise 1: which record goes next?
#
# (How exercises work — stubs, checks, hints, solutions — is explained in notebook 00.)
#
# A store is full and must evict one record. Write `next_victim(records)`: given `(key, parent_key, last_access)`
# of every stored record (`parent_key` is `ROOT_HASH` for a sequence's first block; a larger `last_access` is more
# recent), return the key the store evicts next. Rules: (1) return one of the stored keys; (2) only a chain's
# **tail** may go — a record another stored record names as its parent would strand it; (3) among the tails, the
# least recently used goes first. The check fills 30 real stores with random chains (some sharing a prefix, some
# refreshed by a hit), asks yours, stores one more block and compares with what the store actually evicted.

# %%
from minienv.exercises.persistent_kv import check_next_victim, check_num_tokens_to_load


def next_victim(records):
    """The key of the record a full store evicts next."""
    raise NotImplementedError("your code here")


# %%
check_next_victim(next_victim)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# First find the records that may go at all: a record is a **tail** (a leaf) if no stored record names it as its
# `parent_key`. Build the set of parent keys once.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Among the tails, the least recently used goes: the smallest `last_access`. `min` over `(last_access, key)`
# pairs gives it.
# </details>
#
# ## Exercise 2: what does a restarted engine load?
#
# A fresh engine admits a prompt. Its local prefix cache already holds the first `num_local_tokens` (a multiple
# of the block size — 0 right after a restart). Write `num_tokens_to_load(prompt, num_local_tokens, verified,
# block_size, fingerprint)` → how many **more** prompt tokens come from the tier; the engine computes the rest.
# `verified` is the set of keys whose records are stored *and* pass every check (a corrupt record counts as
# absent — block 20 in the live cell above). The rules:
#
# 1. use the tier's keys, `block_keys(prompt, block_size, fingerprint)`: chain hashes with the model fingerprint,
#    so another model's records never match (and notebook 05's local-cache keys are not tier keys);
# 2. walk from the first block and stop at the first block that is not verified: a chain cannot skip a block;
# 3. never load the prompt's last token: at most `(len(prompt) − 1) // block_size` blocks (the engine must compute
#    something to get logits to sample from);
# 4. count only the tokens beyond the local hit: the verified run, in tokens, minus `num_local_tokens`;
# 5. and a local hit longer than the tier's run loads nothing — never a negative count.
#
# `check_num_tokens_to_load` tries one case per rule, then 200 random prompts; the test suite shows that the same
# rule is what the real engine loads after a record is corrupted.

# %%
from minienv.exercises.persistent_kv import check_num_tokens_to_load


def num_tokens_to_load(prompt, num_local_tokens, verified, block_size, fingerprint):
    """Prompt tokens to load from the tier beyond the local prefix-cache hit."""
    raise NotImplementedError("your code here")


# %%
check_num_tokens_to_load(num_tokens_to_load)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `block_keys(prompt, block_size, fingerprint, max_blocks=(len(prompt) - 1) // block_size)` gives exactly the keys
# that may be loaded (rules 1 and 3); it is imported above from `minienv.kv_tier`.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Count the keys in order while they are in `verified`, and `break` at the first one that is not — do not keep
# counting after a gap.
# </details>
#
# <details><summary>Hint 3</summary>
#
# The run is in blocks: multiply by `block_size`, subtract `num_local_tokens`, and take `max(0, …)`.
# </details>
#
# The reference solutions are in `solutions/11_persistent_kv.py` — try them yourself first.

# %% [markdown]
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if the tier's keys left out the model fingerprint? Describe the first wrong thing a user would see after
#   upgrading the model behind a warm tier.
#
# ## Where this lives in vLLM / LMCache / SGLang
#
# > **vLLM** (v0.11.0)
# > * [`vllm/distributed/kv_transfer/kv_connector/v1/base.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/distributed/kv_transfer/kv_connector/v1/base.py) — `KVConnectorBase_V1`. Scheduler side:
# >   `get_num_new_matched_tokens(request, num_computed_tokens)` (how many more tokens the external store has; it
# >   must not change state), `update_state_after_alloc` (the blocks allocated for them), `build_connector_meta`.
# >   Worker side: `start_load_kv` / `wait_for_layer_load` (into the allocated blocks, before the forward pass),
# >   `save_kv_layer` / `wait_for_save`, `request_finished`. Ours is the same seam without the process boundary.
# > * [`vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py) — the adapter that plugs LMCache in.
# >
# > **LMCache** (v0.3.8)
# > * [`lmcache/v1/storage_backend/local_disk_backend.py`](https://github.com/LMCache/LMCache/blob/v0.3.8/lmcache/v1/storage_backend/local_disk_backend.py) — the local disk tier; `connector/redis_connector.py` —
# >   Redis as a remote tier; chunk keys are chained hashes of token chunks.
# >
# > **SGLang** (v0.5.3)
# > * [`python/sglang/srt/mem_cache/hiradix_cache.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/hiradix_cache.py) — HiCache: the radix tree of notebook 06 extended with host
# >   memory and storage tiers; [`python/sglang/srt/mem_cache/hicache_storage.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/hicache_storage.py) — the storage backend interface
# >   (`get`, `set`, `exists` by page hash).

# %% [markdown]
# ## Summary
#
# * The tier sits **under** the KV pool: asked after the local prefix lookup (without side effects), loaded into
#   freshly allocated blocks before the prefill, written after the commit with full blocks only.
# * Keys are **chain hashes over canonical bytes** with the model fingerprint mixed in: the same in every process,
#   different for every model, block size and layout.
# * A record **cannot lie**: header, token ids, payload and checksum are all checked; any mismatch is a miss and a
#   counted error, and the block is recomputed — never an error for the request.
# * Full stores evict **chain tails** first and never keep a block without its parent.
# * The embedded SQLite store survives restarts with no server; Redis shares one cache between instances; either
#   way the outputs are exactly the outputs without a tier.

# %%
import shutil

shutil.rmtree(workdir, ignore_errors=True)  # the notebook's temporary tiers (a real tier would keep its directory)

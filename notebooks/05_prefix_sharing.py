# %% [markdown]
# # 05 · Prefix sharing: the block-hash chain, refcounts, and copy-on-write
#
# Notebook 04 gave every request its own blocks. But requests often *start the same way*: the same system
# prompt, the same few-shot examples, the same conversation so far; and one request may ask for several samples of
# one prompt. Their K/V for those shared tokens are identical, so an engine can compute them once, keep them in
# one set of blocks, and let every request's block table point there — counting holders with a **refcount**.
#
# **Learning goals.** After this notebook you can
# 1. compute a block's **chain hash** from its parent's hash and its own tokens, and say why a hash of the block's
#    tokens alone, or of the *whole prompt*, is wrong;
# 2. find the longest cached prefix of a prompt — full blocks only, and **never the last prompt token**;
# 3. keep refcounts exact while requests arrive, finish, and **fork** (parallel sampling, beam search), and say
#    exactly when **copy-on-write** copies a block;
# 4. reproduce, in our units, the vLLM paper's sharing results (Kwon et al., SOSP 2023, §6.3–6.4) and explain the
#    differences;
# 5. prove that the cache changes how much is computed and never what is generated, and name the bugs real engines
#    shipped here.

# %% [markdown]
# ## The problem, with a number
#
# Six requests to the bundled model share one system prompt, then Hamlet asks Horatio a different question in
# each. Without sharing,
# each request computes and stores the system prompt's K/V again:

# %%
# NBVAL_CHECK_OUTPUT
import numpy as np

from minienv.kv.block_table import cdiv
from minienv.lab.serving import load_demo_model

demo = load_demo_model()
SYSTEM = ("You are the prompter of the Globe Theatre. Answer each question in the voice of Shakespeare, "
          "in plain words and in one short sentence, and never break character.\n\n")
QUESTIONS = ["Who is the king?", "Where is Romeo?", "What is the hour?", "Why weep you so?",
             "Who knocks at the gate?", "What news from Rome?"]
prompts = {f"r{i}": demo.encode(SYSTEM + f"HAMLET.\n{q}\n\nHORATIO.\n") for i, q in enumerate(QUESTIONS)}
B = 4  # a small block size, so the pictures stay readable (vLLM's default is 16)


def common_prefix_len(seqs):
    seqs = list(seqs)
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


shared = common_prefix_len(prompts.values())
total = sum(len(p) for p in prompts.values())
print(f"model: {demo.name}")
print(f"{len(prompts)} prompts, {total} prompt tokens; the first {shared} tokens of every prompt are the same")
print(f"without sharing: {total} tokens prefilled, {sum(cdiv(len(p), B) for p in prompts.values())} blocks of {B}")
shared_blocks = shared // B
saved = (len(prompts) - 1) * shared_blocks
print(f"sharing the {shared_blocks} full blocks of the common prefix: {total - saved * B} tokens prefilled, "
      f"{sum(cdiv(len(p), B) for p in prompts.values()) - saved} blocks "
      f"({saved * B / total:.0%} of the prefill and of the prompt KV memory saved)")

# %% [markdown]
# Only **full** blocks can be shared: the block that holds the end of the system prompt also holds the start of a
# question, and its contents differ per request. So the unit of sharing is the block, and the question is: how do
# we recognise that block `j` of a new prompt holds exactly what a cached block holds?
#
# ## Build it small: a hash chain in ten lines
#
# A block's K/V depend on **every token before it** (attention mixed them in), not only on its own tokens. So the
# key of block `j` must name the whole prefix `tokens[0 : (j+1)·B]`. Hashing that prefix from scratch costs
# O(j·B) per block; a **chain** costs O(B): hash the parent's hash together with the block's own tokens.

# %%
import hashlib


def chain(tokens, block_size):
    """Chain hash of every full block: h_j = sha256(h_{j-1} | tokens of block j)."""
    parent, out = b"root", []
    for j in range(len(tokens) // block_size):
        block = np.asarray(tokens[j * block_size:(j + 1) * block_size], dtype="<i8").tobytes()
        parent = hashlib.sha256(parent + block).digest()
        out.append(parent)
    return out


toy_index = {}  # hash -> "block" (here just the name of the request that computed it)


def toy_lookup(tokens, block_size):
    """Longest cached run of full blocks, leaving at least the last token to compute."""
    hits = 0
    for h in chain(tokens, block_size)[: (len(tokens) - 1) // block_size]:
        if h not in toy_index:
            break
        hits += 1
    return hits * block_size


for name, p in prompts.items():
    cached = toy_lookup(p, B)
    for h in chain(p, B):
        toy_index.setdefault(h, name)
    print(f"{name}: {len(p)} tokens, {cached:>2} cached, {len(p) - cached:>2} to compute")

# %% [markdown]
# The first request computes everything; each later one finds the common prefix's full blocks and computes only the
# rest. Two details carry the correctness:
#
# * `chain(...)[: (len - 1) // B]` — a lookup never covers the **whole** prompt: the last prompt token must run
#   through the model, or there are no logits to sample the first output token from (nano-vllm #144 crashed here).
# * the loop **stops at the first miss**: block `j + 1` is only usable if block `j` is, because its K/V were
#   computed attending to block `j`.
#
# ## The chain, drawn
#
# One row per prompt, one column per logical block. A block whose hash several prompts share is drawn once,
# spanning them; where a group splits, the prompts diverge — and from there on the two groups never share a hash
# again, even where later tokens agree, because each hash carries its parent's. (Questions that start with the same
# word — "Who …", "What …" — share one more block in pairs.) The dashed box is the trailing partial block, which
# has no hash yet.

# %%
from IPython.display import display

from minienv.viz.kv_views import chain_hashes, hash_chain_svg, hash_chain_view

chain_picture = hash_chain_svg(prompts, B, title=f"block-hash chains of the six prompts (B = {B})", cell_w=66)
hash_chain_view(prompts, B, title=f"block-hash chains of the six prompts (B = {B})", cell_w=66)

# %%
chains = {n: chain_hashes(p, B) for n, p in prompts.items()}
first_split = min(j for j in range(max(map(len, chains.values())))
                  if len({c[j] if j < len(c) else None for c in chains.values()}) > 1)
assert first_split == shared // B  # the chains agree exactly on the full blocks of the common prefix
assert chain_picture.count(f"×{len(prompts)}") == shared // B  # drawn once each, shared by all six
for x, y in [(x, y) for x in prompts for y in prompts if x < y]:  # equal hash <=> equal tokens up to that block
    for j in range(min(len(chains[x]), len(chains[y]))):
        assert (chains[x][j] == chains[y][j]) == (prompts[x][:(j + 1) * B] == prompts[y][:(j + 1) * B])

# %% [markdown]
# ## The naive design: one hash for the whole prompt
#
# The naive design's `PrefixAwareRefcounter` (as it circulates in tutorials) keys its prefix block by
# `hash(tuple(prompt))` — the **whole** prompt. Two prompts that share a system prompt and differ in the question
# hash differently, so it shares nothing unless a prompt repeats exactly. `minienv.lab.naive_design` reproduces it;
# here it is beside ours on the same six prompts:

# %%
# NBVAL_CHECK_OUTPUT
from minienv.lab.naive_design import demo_whole_prompt_hashing

naive_demo = demo_whole_prompt_hashing(list(prompts.values()), system_prompt_tokens=shared, block_size=B)
print(f"blocks the six prompts need without sharing: {naive_demo.blocks_without_sharing}")
print(f"naive (whole-prompt hash): {naive_demo.naive_shared_blocks} blocks shared")
print(f"minienv (block-hash chain): {naive_demo.ours_shared_blocks} blocks shared, "
      f"{naive_demo.ours_blocks_in_use} in use, {naive_demo.ours_hit_tokens} prompt tokens served from cache")

# %%
assert naive_demo.naive_shared_blocks == 0
assert naive_demo.ours_shared_blocks >= (len(prompts) - 1) * (shared // B)
assert naive_demo.ours_hit_tokens >= (len(prompts) - 1) * (shared // B) * B

# %% [markdown]
# ## minienv's version: `KVCacheManager`
#
# `minienv/kv/kv_cache_manager.py` is the toy above made exact:
#
# * **hash**: `minienv.kv.hashing.hash_block_tokens(parent, tokens, extra_key)` — sha256 over a fixed byte
#   encoding, with a real 32-byte root and an *extra key* (model id, dtype, a user's cache salt) mixed in, so two
#   models or two tenants never share K/V;
# * **index**: hash → the one block holding that prefix; a hit also compares the stored tokens and parent hash,
#   so even a hash collision costs a miss, never wrong K/V;
# * **refcounts**: a hit on a block in use is refcount + 1; `free` is refcount − 1, last block first; a block
#   reaching 0 keeps its K/V and hash (**cached-free**) and stays findable until it is evicted (notebook 06);
# * a block enters the index at `commit`, after the model step that wrote its K/V — never at allocation, or a
#   request in the same step could "hit" K/V that do not exist yet;
# * stats in **tokens**, like vLLM's `prefix_cache_queries` / `prefix_cache_hits`.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.kv.kv_cache_manager import KVCacheManager, UnknownRequestError

mgr = KVCacheManager(num_blocks=64, block_size=B)
a0 = mgr.allocate("r0", prompts["r0"])
mgr.commit("r0")  # (the model step that writes r0's K/V happens between allocate and commit)
a1 = mgr.allocate("r1", prompts["r1"])
mgr.commit("r1")
print(f"r0: {a0.num_cached_tokens} cached, computes {a0.num_new_tokens} tokens; blocks {mgr.block_ids('r0')}")
print(f"r1: {a1.num_cached_tokens} cached, computes {a1.num_new_tokens} tokens; blocks {mgr.block_ids('r1')}")
common = [b for b in mgr.block_ids("r0") if b in mgr.block_ids("r1")]
print("shared blocks and their refcounts:", {b: mgr.ref_cnt(b) for b in common})
again = mgr.lookup(prompts["r0"])  # the same prompt again: everything is cached, but the last token is not taken
print(f"lookup of r0's prompt again: {again.num_cached_tokens} of {len(prompts['r0'])} tokens")
mgr.free("r0")
print("after r0 finishes:", {b: mgr.ref_cnt(b) for b in common}, "| r0's own blocks are now",
      sorted({mgr.block_state(b).value for b in a0.new_block_ids if b not in common}))
s = mgr.stats()
print(f"stats: {s.prefix_queries_tokens} prompt tokens queried, {s.prefix_hits_tokens} hit "
      f"({s.prefix_hit_rate:.1%}); blocks in use {s.num_in_use}, cached-free {s.num_cached_free}")
mgr.check_invariants()

# %%
expected_hit = min(common_prefix_len([prompts["r0"], prompts["r1"]]), len(prompts["r1"]) - 1) // B * B
assert a1.num_cached_tokens == expected_hit >= (shared // B) * B and len(common) == expected_hit // B
assert again.num_cached_tokens < len(prompts["r0"])  # nano-vllm #144: never the whole prompt
assert all(mgr.ref_cnt(b) == 1 for b in common)  # r1 still holds them; r0 let go of exactly one reference

# %% [markdown]
# ## Live: requests arriving and finishing
#
# The six requests arrive one at a time, decode a few tokens, and finish at different times (bookkeeping only —
# the model runs in the proof cells below). Each cell reads `block ·rcN` and who holds it; dark cells are shared.
# Watch the system prompt's blocks: the refcount rises with every arrival, falls with every finish, and when the
# last holder finishes they turn **cached-free** (pale blue, hash kept) — so `r5`, arriving after everyone left,
# still hits them. The free queue below is drawn in LRU order, head first. The view is
# `minienv.viz.kv_views.ManagerView`, reused by notebooks 06–08.

# %%
from minienv.viz import Stepper, panel
from minienv.viz.kv_views import ManagerView

LIVE_BLOCKS = 48
# (step caption, action): "+r" admits r (prefill), "d" = every running request decodes one token, "-r" finishes r
SCRIPT = [("+r0",), ("+r1",), ("d", "+r2"), ("d",), ("-r0", "+r3"), ("d",), ("-r1", "-r2"), ("d", "+r4"),
          ("-r3",), ("-r4",), ("+r5",), ("d",), ("-r5",)]
live_mgr = KVCacheManager(LIVE_BLOCKS, B)
view = ManagerView(live_mgr, title=f"KV pool: {LIVE_BLOCKS} blocks of {B} slots", columns=16, cell_px=56)
live_log = []  # (step, {block: refcount} of the system prompt's blocks, hits of admitted requests)


def live_reset():
    global live_mgr
    live_mgr = KVCacheManager(LIVE_BLOCKS, B)
    view.attach(live_mgr, caption="empty pool")
    live_log.clear()


def live_step(i):
    notes, hits = [], {}
    for action in SCRIPT[i]:
        if action == "d":
            for rid in live_mgr.request_ids():
                live_mgr.append_slots(rid, [1000 + i])
                live_mgr.commit(rid)
            notes.append("all decode 1 token")
        elif action[0] == "+":
            rid = action[1:]
            alloc = live_mgr.allocate(rid, prompts[rid])
            live_mgr.commit(rid)
            hits[rid] = alloc.num_cached_tokens
            notes.append(f"{rid} arrives ({alloc.num_cached_tokens} of {len(prompts[rid])} tokens cached)")
        else:
            live_mgr.free(action[1:])
            notes.append(f"{action[1:]} finishes")
    live_mgr.check_invariants()
    system_blocks = live_mgr.lookup(prompts["r0"]).block_ids[: shared // B]
    live_log.append((i, {b: live_mgr.ref_cnt(b) for b in system_blocks}, hits))
    caption = f"step {i + 1}: " + "; ".join(notes)
    view.update(caption=caption)
    return caption


live_stepper = Stepper(live_step, live_reset, n_steps=len(SCRIPT), interval_ms=900)
live_stepper.reset()
panel(live_stepper, view)

# %% [markdown]
# Press **Step** or ▶. Then the code takes over: it steps through the script and checks that the refcount of every
# system-prompt block always equals the number of running requests, and that the grid draws exactly that.

# %%
live_stepper.go_to(5)  # r0 finished, r1..r3 run
running = live_mgr.request_ids()
sys_blocks = live_mgr.lookup(prompts["r1"]).block_ids[: shared // B]
assert running == ["r1", "r2", "r3"] and all(live_mgr.ref_cnt(b) == 3 for b in sys_blocks)
assert all(view.grid.cells[b].text()[0] == f"{b} ·rc3" and view.grid.cells[b].shared for b in sys_blocks)
live_stepper.run()
assert live_stepper.done and live_mgr.request_ids() == []
for step, refs, hits in live_log:
    n_running = sum(1 for a in SCRIPT[: step + 1] for x in a if x.startswith("+")) - \
        sum(1 for a in SCRIPT[: step + 1] for x in a if x.startswith("-"))
    assert all(rc == n_running for rc in refs.values()), (step, refs, n_running)
    assert all((h == 0) if r == "r0" else (h >= (shared // B) * B) for r, h in hits.items()), (step, hits)
assert all(view.grid.cells[b].state == "cached" for b in sys_blocks)  # everyone left: cached-free, still findable
print("refcounts of the system-prompt blocks after each step:", [next(iter(r.values()), 0) for _, r, _ in live_log])

# %% [markdown]
# `r5` arrived after every other request had finished (step 11) and still got the whole system prompt from cache:
# the blocks were cached-free, not gone. For readers without a kernel, the pool just before `r5` leaves:

# %%
live_stepper.go_to(len(SCRIPT) - 1)
view.static()

# %%
assert live_mgr.request_ids() == ["r5"] and "rc1" in view.to_html()
assert sum(c.state == "cached" for c in view.grid.cells) > 0

# %% [markdown]
# ## Fork and copy-on-write, at the moment of the copy
#
# **Parallel sampling** asks for `n` completions of one prompt. After the prompt's prefill the request **forks**:
# each child's table names the parent's blocks, every refcount goes up by exactly the number of children, and
# nothing is copied. The prompt's last block is usually *partly* filled — and each child is about to write a
# *different* token into it. So the first write into a shared, not-full block must first **copy** it
# (copy-on-write); a shared block that is **full** is never written again and is never copied (vLLM #417 got this
# condition wrong and generated wrong text).
#
# Step through it: a 10-token prompt (two full blocks + 2 of 4 slots of the third), forked into three samples.

# %%
FORK_PROMPT = prompts["r0"][:10]
fork_mgr = KVCacheManager(16, B)
fork_view = ManagerView(fork_mgr, title="fork: P and two children S1, S2", columns=16, cell_px=56)
FORK_SCRIPT = ["prefill P", "fork P -> S1, S2", "S1 writes its first token", "S2 writes its first token",
               "P writes its first token", "each writes one more (fills its block)",
               "each writes two more (a new block each)", "each writes one more"]
fork_log = []


def fork_reset():
    global fork_mgr
    fork_mgr = KVCacheManager(16, B)
    fork_view.attach(fork_mgr, caption="empty pool")
    fork_log.clear()


def fork_step(i):
    if i == 0:
        fork_mgr.allocate("P", FORK_PROMPT)
    elif i == 1:
        fork_mgr.fork("P", ["S1", "S2"])
    elif i in (2, 3, 4):
        rid = {2: "S1", 3: "S2", 4: "P"}[i]
        fork_mgr.append_slots(rid, [500 + i])
    else:
        for rid in ("P", "S1", "S2"):
            fork_mgr.append_slots(rid, [600 + i] * (2 if i == 6 else 1))
    for rid in fork_mgr.request_ids():
        fork_mgr.commit(rid)
    fork_mgr.check_invariants()
    fork_view.update(caption=f"step {i + 1}: {FORK_SCRIPT[i]}")
    fork_log.append((fork_view.last_copies, {r: fork_mgr.block_ids(r) for r in fork_mgr.request_ids()},
                     [fork_mgr.ref_cnt(b) for b in range(16)]))
    copies = fork_view.last_copies
    return f"step {i + 1}: {FORK_SCRIPT[i]}" + (f" → copy-on-write {copies}" if copies else "")


fork_stepper = Stepper(fork_step, fork_reset, n_steps=len(FORK_SCRIPT), interval_ms=1200)
fork_stepper.reset()
panel(fork_stepper, fork_view)

# %%
# NBVAL_CHECK_OUTPUT
fork_stepper.run()
for i, (copies, tables, refs) in enumerate(fork_log):
    print(f"step {i + 1} {FORK_SCRIPT[i]:<40} copies {str(list(copies)):<10} tables {tables}")
(c0, t0, r0), (c1, t1, r1), (c2, t2, r2), (c3, t3, r3), (c4, t4, r4) = fork_log[:5]
assert t1["S1"] == t1["S2"] == t1["P"] == [0, 1, 2] and r1[:3] == [3, 3, 3]  # fork: +2 per block, no copy
assert c2 == ((2, 3),) and r2[:4] == [3, 3, 2, 1]  # S1's write: block 2 copied to 3, one reference moved
assert c3 == ((2, 4),) and r3[:5] == [3, 3, 1, 1, 1]  # S2's write: copied again; P is now block 2's only holder
assert c4 == () and t4["P"] == [0, 1, 2]  # P writes in place: refcount 1 means nobody else can see it
assert all(c == () for c, _, _ in fork_log[5:])  # full shared blocks 0 and 1 are never copied (vLLM #417)
assert fork_mgr.stats().cow_copies == 2 and fork_log[-1][2][:2] == [3, 3]
print("copy-on-write copies:", fork_mgr.stats().cow_copies, "| memory saved by sharing now:",
      f"{fork_mgr.sharing().saved_fraction:.0%}")

# %% [markdown]
# Exactly `n − 1` copies for `n` samples: the last holder of the shared partial block writes in place. The two
# full prompt blocks stay shared (refcount 3) for the samples' whole lives — that is the memory parallel sampling
# saves. The test suite also runs this through the model: each child's continuation equals what the dense model
# computes on that child's own sequence (`tests/unit/test_prefix_differential.py`).

# %%
fork_view.static()

# %%
assert fork_view.grid.cells[0].text()[0] == "0 ·rc3" and fork_view.grid.cells[0].shared

# %% [markdown]
# ## The paper's sharing results, in our units
#
# The vLLM paper measures sharing in two places (Kwon et al., SOSP 2023):
#
# * **§6.3, Fig. 15** — OPT-13B on the Alpaca trace: "the number of blocks we saved by sharing divided by the number
#   of total blocks without sharing": **6.1 %–9.8 %** for parallel sampling and **37.6 %–55.2 %** for beam search
#   (2, 4 and 6 sequences / beams).
# * **§6.4, Fig. 16** — LLaMA-13B translating WMT16 English→German with a shared few-shot prefix: 1 example
#   (80 tokens) or 5 examples (341 tokens). vLLM serves **1.67×** and **3.58×** the request rate of
#   Orca (Oracle) at the same latency.
#
# We recompute them with the real manager in `minienv.lab.sharing_experiments` (block size 16, as in the paper):
# parallel sampling forks each Alpaca-like prompt into `n` samples with their own Alpaca-like output lengths; beam
# search keeps the `width` best (beam, token) pairs per step under a seeded random scorer, forking beams chosen
# several times and freeing beams chosen none, as vLLM's block manager did; the shared-prefix workload counts the
# prompt tokens the model must run and the KV blocks a batch holds, cache off vs on.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.lab.sharing_experiments import format_paper_table, paper_sharing_results

# the same numbers from a shell: .venv/bin/python -m minienv.lab.sharing_experiments
par, beam, shots = paper_sharing_results(parallel_requests=100, beam_requests=40)
print(format_paper_table(par, beam, shots))

# %%
assert all(a.saved_fraction < b.saved_fraction for a, b in zip(par, par[1:]))  # more samples, more sharing
assert all(a.saved_fraction < b.saved_fraction for a, b in zip(beam, beam[1:]))
assert 0.03 < par[0].saved_fraction and par[-1].saved_fraction < 0.15  # same ballpark as 6.1–9.8 %
assert 0.3 < beam[0].saved_fraction and beam[-1].saved_fraction < 0.7  # same ballpark as 37.6–55.2 %
assert beam[0].saved_fraction > par[-1].saved_fraction  # beams share far more than samples
assert 1 < shots[0].work_ratio < shots[0].prefill_ratio and shots[1].prefill_ratio > shots[0].prefill_ratio > 2
assert all(r.memory_ratio > 1 for r in shots)

# %% [markdown]
# **Why ours differ from theirs.**
#
# * *Parallel sampling* is close: only the prompt's **full** blocks are shared (the partial last block is copied
#   on the first write), and Alpaca prompts are short (~19 tokens ≈ one full block of 16) next to ~58 output
#   tokens per sample, so the saving is small and grows with `n`. Our lengths are log-normal draws with Alpaca's
#   means, not the trace itself, and we count blocks at every decode step of one request at a time, where the paper
#   averages over a served trace with requests at different stages.
# * *Beam search* shares much more because beams also share most of their **generated** history: beam candidates
#   descend from a few recent ancestors. How much depends on how peaked the model's next-token distribution is —
#   our scorer is a seeded random one (logits ~ N(0, 3²) over 64 tokens), not OPT-13B, so the agreement in range
#   is partly luck of that choice; the ordering (beam ≫ parallel, growing with width) is not.
# * *Shared prefix*: the paper's 1.67× / 3.58× are **serving throughput against Orca (Oracle)** on an A100, which
#   mixes two effects we separate: the prefix's prefill is computed once (our prefill ratio), and the prefix's KV is
#   stored once, so more requests fit in a batch (our KV-block ratio). Decode tokens are not saved at all, which is
#   why the all-tokens ratio is much smaller than the prefill ratio; and on a GPU a decode token costs more time
#   than a prefill token, pulling the real speed-up further down. Our sentence lengths (mean 30 tokens) are an
#   assumption; the paper gives only the prefix lengths. `benchmarks/bench_prefix_cache.py` measures wall time on
#   the model for a 5-shot workload.
#
# ## Proof: the cache changes how much is computed, never what is generated
#
# Six prompts sharing the system prompt are served greedily by the engine (`minienv.lab.serving.serve_greedy` submits
# them to `InferenceEngine`: batched steps through the paged attention backend, blocks from the manager) with the
# prefix cache **on** and **off**. The text must be identical. (With the cache off, this path is token-for-token the dense model — notebook 04
# proved it; `tests/unit/test_prefix_differential.py` also checks on == off == dense on many prompts, with budgets
# small enough to evict between requests.)
#
# A prefix hit *skips* running the hit tokens through the model, so attention must read their **cached** K/V from
# the shared blocks. MinivLLM #98 shipped a prefix cache that shared the blocks but never fed their K/V to
# attention: outputs silently changed. The second check catches that class of bug: poison the cached blocks' K/V
# before a request that hits them is admitted — if attention really reads them, its output must change.
#
# (Two requests run at a time, so `r0` and `r1` prefill in the *same* step: `r1` finds nothing cached, because a
# block becomes findable only after the step that writes its K/V. At `commit`, `r1` switches to `r0`'s identical
# blocks and frees its duplicates — one block per hash. From `r2` on, every request hits.)

# %%
from minienv.lab.serving import serve_greedy

NEW = 8
plist = list(prompts.values())
on = serve_greedy(demo.model, plist, NEW, block_size=B, caching=True, max_running=2)
off = serve_greedy(demo.model, plist, NEW, block_size=B, caching=False, max_running=2)
for q, out in zip(QUESTIONS, on.outputs):
    print(f"{q!r:>28} -> {demo.decode(out)!r}")
print(f"prompt tokens computed: cache off {off.prefill_tokens_computed}, on {on.prefill_tokens_computed} "
      f"(of {on.prompt_tokens}); cached per request: {on.cached_tokens_per_request}")
print(f"the prefix cache skipped {off.prefill_tokens_computed - on.prefill_tokens_computed} prompt tokens; "
      f"outputs identical with the cache on and off: {on.outputs == off.outputs}")


def poison(mgr, kv_pool, i):
    if i == 2:  # r2 will hit the system prompt's blocks, cached by r0 and r1
        for bid in mgr.lookup(plist[2]).block_ids:
            kv_pool.kv_cache[:, :, bid] = 3.0


poisoned = serve_greedy(demo.model, plist[:3], NEW, block_size=B, caching=True, max_running=2, before_admit=poison)
print("poisoned cached K/V changed r2's output:", poisoned.outputs[2] != off.outputs[2])

# %%
assert on.outputs == off.outputs  # identical text, cache on or off
assert on.prefill_tokens_computed < off.prefill_tokens_computed == on.prompt_tokens
assert on.cached_tokens_per_request[:2] == [0, 0] and min(on.cached_tokens_per_request[2:]) > 0
assert poisoned.cached_tokens_per_request[2] > 0 and poisoned.outputs[2] != off.outputs[2]  # attention reads it
assert poisoned.outputs[:2] == off.outputs[:2]

# %% [markdown]
# ## Break it yourself
#
# `minienv.lab.break_it` is minienv's manager with one switch per classic bug. Set `BUG` to one of this chapter's
# (`index_at_allocation`, `hash_own_tokens`, `no_copy_on_write`), predict which proof fails, and run the cell: it runs the series' proofs on
# the **real engine** (the manager goes in through `InferenceEngine(kv_cache_manager_factory=...)`) and on the
# manager, and prints which still hold.

# %%
from minienv.lab import break_it

BUG = None  # try "index_at_allocation" or "hash_own_tokens" or "no_copy_on_write"
for result in break_it.run_proofs(BUG).values():
    print(f"{'✓' if result.holds else '✗'} {result.name:<14} {result.detail}")

# %% [markdown]
# <details><summary>Which proof each bug breaks, and why (after you tried)</summary>
#
# * `index_at_allocation` — the outputs still match: a same-step hit reads K/V the same forward pass writes first.
#   But interrupt a step (the stop button) and roll it back: the reserved blocks stay findable though their K/V
#   were never written, and the resumed request "hits" its own empty blocks (`failed_step`).
# * `hash_own_tokens` — equal tokens after a different prefix get the same key, so a request reuses K/V that
#   attended to someone else's beginning (`outputs`).
# * `no_copy_on_write` — after a fork, the child's first token lands in the half-full block it shares with the
#   parent and overwrites the parent's K/V (`copy_on_write`). Full shared blocks are never written, so only the
#   last one needs the copy.
# </details>

# %%
# NBVAL_CHECK_OUTPUT
broken = {bug: sorted(n for n, r in break_it.run_proofs(bug).items() if not r.holds) for bug in ("index_at_allocation", "hash_own_tokens", "no_copy_on_write",)}
for bug, names in broken.items():
    print(f"{bug:<20} breaks: {', '.join(names)}")
assert broken == {'index_at_allocation': ['failed_step'], 'hash_own_tokens': ['outputs'], 'no_copy_on_write': ['copy_on_write']}

# %% [markdown]
# ## The traps of this layer
#
# Each of these shipped in a real engine (or in the naive design). Each has a regression test in
# `tests/unit/test_kv_cache_manager.py` / `test_naive_design.py`; the cell below re-checks each in one line.
#
# | trap | what went wrong | the lesson, in one sentence |
# |---|---|---|
# | naive design: whole-prompt hash | one key for the whole prompt | Hash **per block, chained**, so prompts share exactly their common full blocks. |
# | naive design: refcount set to 1 | `acquire` set the refcount instead of incrementing it | A refcount is only ever **+1 / −1**, once per table that takes or drops the block. |
# | vLLM #12621 | `hash(None)` became a constant in Python 3.12 → forced collisions across users | Use a **stable content hash** (sha256) with a real root, and check the stored key on every hit. |
# | vLLM PR #3347 / #1556 | double free; fork over-incremented refcounts | Fork adds exactly **one reference per child**; freeing an unknown request is an error that changes nothing. |
# | vLLM #417 | wrong copy-on-write condition → wrong text | Copy only when writing into a block that is **shared and not full**. |
# | nano-vllm #144 | a fully cached prompt left zero tokens to run → crash | A lookup **always leaves the last prompt token** to compute. |
# | MinivLLM #98 | hits shared blocks but attention never read them | Test the cache **through the model**: outputs equal with it on and off, and poisoned cached K/V must change them. |
# | SGLang #35270 | shared pages counted once per holder → a false "leak" | Count **physical** blocks once, however many tables hold them. |

# %%
# NBVAL_CHECK_OUTPUT
import subprocess
import sys

from minienv.kv.hashing import hash_block_tokens, ROOT_HASH
from minienv.lab.naive_design import demo_refcount_set

checks = {}
rc = demo_refcount_set()
checks["naive refcount set"] = (rc.naive_refcount_after_share, rc.ours_refcount_after_share) == (1, 2)
code = "from minienv.kv.hashing import *; print(hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]).hex())"
other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
checks["#12621 stable hash"] = other_process.strip() == hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]).hex()
t = KVCacheManager(16, B)
t.allocate("p", list(range(9)))
t.commit("p")
before = t.snapshot()
t.fork("p", ["c1", "c2"])
checks["#1556 fork +1 per child"] = [t.ref_cnt(b) for b in t.block_ids("p")] == [3, 3, 3]
t.free("c2")
try:
    t.free("c2")
except UnknownRequestError:
    checks["#3347 double free refused"] = [t.ref_cnt(b) for b in t.block_ids("p")] == [2, 2, 2]
t.append_slots("c1", [7, 7, 7])  # 9 -> 12 tokens: writes into the shared partial block 2 -> one copy
t.append_slots("c1", [8])  # 12 -> 13: block 2 of c1 is now full and private; new token goes to a new block
checks["#417 copy only shared partial"] = t.stats().cow_copies == 1
checks["#144 never the whole prompt"] = t.lookup(list(range(8))).num_cached_tokens == 4
checks["#35270 physical blocks once"] = t.stats().num_in_use == t.sharing().physical_blocks < t.sharing().logical_blocks
t.check_invariants()
checks["#98 hits read cached K/V"] = poisoned.outputs[2] != off.outputs[2]
for name, ok in checks.items():
    print(f"{name:<32} {'ok' if ok else 'FAILED'}")

# %%
assert all(checks.values()) and len(checks) == 8

# %% [markdown]
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/05_prefix_sharing.py` — is explained in notebook 00.)
#
# ### Exercise 1: the hash chain
#
# Write `chain_hashes(tokens, block_size)`: the key of every **full** block of `tokens`, in order, with
# `hash_block_tokens(parent, block_tokens)` (imported above) starting from `ROOT_HASH`. Rules: (1) the first
# block's parent is `ROOT_HASH`; (2) only full blocks get a hash; (3) each block's hash takes its parent's hash,
# so the same tokens after a different prefix get a different key. The check compares you with minienv's own
# `hash_block_chain`.

# %%
from minienv.exercises.prefix_sharing import check_cached_tokens, check_chain_hashes


def chain_hashes(tokens, block_size):
    """Chain hashes of the full blocks of ``tokens``, in logical order."""
    raise NotImplementedError("your code here")


# %%
check_chain_hashes(chain_hashes)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# There are `len(tokens) // block_size` full blocks; block `j` is `tokens[j * block_size:(j + 1) * block_size]`.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Keep a `parent` variable: start it at `ROOT_HASH`, and after hashing a block, the block's hash becomes the
# next block's parent.
# </details>
#
# ### Exercise 2: the longest cached prefix
#
# Write `my_cached_tokens(prompt, cached_hashes, block_size)`: given the set of block hashes currently in the
# index, return how many prompt tokens a request can take from the cache. Rules: (1) walk the chain from
# `ROOT_HASH`; (2) **stop at the first miss** — a block after a missing one cannot be used, its K/V depend on
# the missing block; (3) **never cover the last prompt token**.

# %%
def my_cached_tokens(prompt, cached_hashes, block_size):
    """Prompt tokens served by the prefix cache: whole blocks, from the start, never the last token."""
    raise NotImplementedError("your code here")


# %%
check_cached_tokens(my_cached_tokens)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# It is Exercise 1's loop, with a membership test and a `break`.
# </details>
#
# <details><summary>Hint 2</summary>
#
# How many blocks may a lookup cover at most, if the last token must stay? `(len(prompt) - 1) // block_size`.
# </details>
#
# A tempting wrong answer counts every cached block it sees, without stopping at the first miss. After an
# eviction leaves a hole in a chain it claims blocks whose K/V were computed after a different block:

# %%
from minienv.exercises import ExerciseFailed


def wrong_cached_tokens(prompt, cached_hashes, block_size):
    parent, hits = ROOT_HASH, 0
    for j in range((len(prompt) - 1) // block_size):
        parent = hash_block_tokens(parent, prompt[j * block_size:(j + 1) * block_size])
        hits += parent in cached_hashes  # no break at a miss
    return hits * block_size


try:
    check_cached_tokens(wrong_cached_tokens)
    raise RuntimeError("the check should have rejected wrong_cached_tokens")
except ExerciseFailed as err:
    print("rejected:", str(err).splitlines()[0])

# %% [markdown]
# ## Where this lives in vLLM / SGLang
#
# > **vLLM (v1)**
# > * `vllm/v1/core/kv_cache_utils.py` — `hash_block_tokens(hash_function, parent_block_hash,
# >   curr_block_token_ids, extra_keys)`: the chain hash, with a configurable hash function
# >   (`--prefix-caching-hash-algo`, sha256 among them — the way out of #12621); `NONE_HASH` is the chain's root,
# >   random per process unless `PYTHONHASHSEED` is set; `generate_block_hash_extra_keys` (LoRA, multimodal
# >   inputs, `cache_salt`); `KVCacheBlock` with `ref_cnt` and `block_hash`.
# > * `vllm/v1/core/block_pool.py` — `BlockPool`: `cached_block_hash_to_block` (the prefix index),
# >   `get_cached_block`, `cache_full_blocks` (index blocks once their K/V are computed), `touch` (a hit: out of the
# >   free queue, `ref_cnt += 1`), `free_blocks`.
# > * `vllm/v1/core/kv_cache_manager.py` — `get_computed_blocks` (the longest cached prefix; it caps the hit at
# >   `num_tokens - 1` so the last token is recomputed), `allocate_slots`, `free`; prefix-cache stats
# >   (`PrefixCacheStats`: queries and hits in tokens).
# > * Copy-on-write and fork were in vLLM v0's `vllm/core/block_manager.py` (`fork`, `cow`); v1 implements
# >   parallel sampling as separate requests that share the prompt through the prefix cache.
# >
# > **SGLang**
# > * `python/sglang/srt/mem_cache/radix_cache.py` — `RadixCache`: a radix tree over token ids instead of a hash
# >   chain; `match_prefix` walks it, `inc_lock_ref` / `dec_lock_ref` are the refcounts (a locked node is in use),
# >   `insert` adds a finished request's tokens, `evict` drops unlocked leaves. The tree *is* the chain: a node's
# >   key is its tokens, its parent is the prefix.

# %% [markdown]
# ## Summary
#
# * A block's K/V depend on every token before it, so its key is a **chain hash**: `H(parent hash, block tokens,
#   extra key)`. Prompts then share exactly their common **full** blocks; the naive whole-prompt hash shared
#   nothing.
# * A lookup walks the chain from the root, **stops at the first miss**, and **never covers the last prompt token**.
# * **Refcounts** count the tables that hold a block: +1 per hit or per forked child, −1 per free. At 0 a block
#   becomes **cached-free** — still findable, evictable (notebook 06).
# * **Fork** shares every block; the first write into a **shared, not-full** block copies it — `n − 1` copies for
#   `n` samples.
# * In our units: parallel sampling saves 5–11 % of KV memory (n = 2 to 6; paper 6.1–9.8 %), beam search 39–63 %
#   (width 2 to 6; paper 37.6–55.2 %) — the paper's ballpark, a little above it at the widest — and a shared few-shot prefix cuts prefill work ~3× (1-shot) to ~9× (5-shot), though not decode.
# * The cache changes how much is computed, never what is generated: the text is identical with it on and off, and
#   poisoning cached K/V proves attention reads them.
# * Next: the budget is finite — which cached-free block goes first? Notebook 06: the token-budget LRU evictor.

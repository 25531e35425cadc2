# %% [markdown]
# # 04 · PagedAttention: block tables, the free queue, and attention over scattered blocks
#
# Notebook 03 measured where KV memory goes when every request reserves one contiguous chunk. This notebook builds
# the fix the vLLM paper proposed (Kwon et al., *Efficient Memory Management for Large Language Model Serving with
# PagedAttention*, SOSP 2023): cut the KV cache into fixed-size **blocks**, give each request a **block table**
# that maps its logical blocks to physical ones, and make attention read K/V *through* the table.
#
# **Learning goals.** After this notebook you can
# 1. compute a token's **slot** from its position and its request's block table: `table[t // B] * B + t % B`;
# 2. explain why a request takes a new block exactly when a token crosses a block boundary, and what that bounds
#    (at most `B − 1` wasted slots per request);
# 3. say what the **free queue** must support in O(1) — pop the head, append at the tail, remove from the middle —
#    and why the naive design's `free_list.pop(0)` does not;
# 4. show that attention over scattered blocks equals attention over contiguous K/V — for one layer and for the
#    whole model's generated text;
# 5. find the same pieces in vLLM and SGLang.

# %% [markdown]
# ## The problem, with a number
#
# In [notebook 03](03_kv_memory.ipynb), on a ShareGPT-like workload in the paper's 15.7 K token slots, reserving
# the maximum length per request left **21.1 %<!--out:03-->** of the KV memory holding real token states (paper:
# 20.4 %); even an oracle that knew every output length reached only 38.9 %<!--out:03--> (paper: 38.2 %), while
# paging reached **97.0 %<!--out:03-->** (paper: 96.3 %). Here is the same effect on four requests and the bundled model's 1024-token context:

# %%
# NBVAL_CHECK_OUTPUT
import numpy as np

MAX_LEN, B = 1024, 16
lengths = [37, 120, 9, 300]  # tokens each request holds right now
contiguous_slots = MAX_LEN * len(lengths)  # each request reserved max_len up front
paged_slots = sum(-(-n // B) * B for n in lengths)  # ceil(n / B) blocks each
print(f"tokens held:            {sum(lengths)}")
print(f"contiguous reservation: {len(lengths)} x {MAX_LEN} = {contiguous_slots} slots -> "
      f"{sum(lengths) / contiguous_slots:.1%} hold token states")
print(f"paged, block size {B}:  {paged_slots} slots -> {sum(lengths) / paged_slots:.1%} hold token states")
print(f"worst case per request in the last block: {B - 1} wasted slots")

# %% [markdown]
# Reserving 1024<!--out--> slots each, 11.4 %<!--out--> of the slots hold token states; with blocks of 16<!--out-->,
# 94.0 %<!--out-->.
# The contiguous scheme does not know how long a request will get, so it must reserve for the worst case; the
# paged scheme takes one block at a time, as the request grows. The price is that a request's K/V is no longer
# contiguous: attention must find token `t`'s K and V wherever its block landed.
#
# ## Build it small: a block table by hand
#
# Eight physical blocks of `B = 4` slots. A free queue hands out blocks from its head. A request's block table is
# the list of physical blocks it holds, in *logical* order. Let's give request A ten tokens while another request
# (X) also takes blocks, so A's blocks are not adjacent.

# %%
# NBVAL_CHECK_OUTPUT
from collections import deque

TOY_B = 4
free = deque(range(8))  # a deque: popleft and append are O(1) (a list's pop(0) shifts every element)
tables = {"A": [], "X": []}
lengths_toy = {"A": 0, "X": 0}


def append_token(req):
    """Give `req` one more token slot: a new block only when its last block is full."""
    if lengths_toy[req] % TOY_B == 0:  # crossing a block boundary (or the very first token)
        tables[req].append(free.popleft())
    lengths_toy[req] += 1


for step in range(10):
    append_token("A")
    if step % 3 == 0:
        append_token("X")
print("A's block table:", tables["A"], "  X's:", tables["X"], "  free queue:", list(free))

t = np.arange(lengths_toy["A"])
table_a = np.array(tables["A"])
slots = table_a[t // TOY_B] * TOY_B + t % TOY_B  # the slot mapping, vectorized
print("A's slots:", slots.tolist())

# %% [markdown]
# Token 5 of A is in logical block `5 // 4 = 1`, at offset `5 % 4 = 1`; logical block 1 is physical block
# `table[1]`, here block 2<!--out-->, whose slots start at `table[1] * 4` = 8<!--out-->: token 5 is slot 9<!--out-->,
# the sixth of A's slots above. Now put K vectors into a toy pool through those slots, and read
# them back through the same table: one `np.take` of **whole blocks**, in logical order, gives back the
# contiguous K — which is all attention needs.

# %%
rng = np.random.default_rng(0)
toy_pool = np.zeros((8, TOY_B, 2), dtype=np.float32)  # [blocks, slots per block, head_dim]
k_contiguous = rng.standard_normal((lengths_toy["A"], 2), dtype=np.float32)  # what a contiguous cache would hold
toy_pool.reshape(8 * TOY_B, 2)[slots] = k_contiguous  # write through the slot mapping
gathered = np.take(toy_pool, table_a, axis=0).reshape(-1, 2)[: lengths_toy["A"]]  # gather whole blocks
assert np.array_equal(gathered, k_contiguous)
print("gathered == contiguous:", np.array_equal(gathered, k_contiguous))

# %% [markdown]
# ## minienv's version
#
# `minienv.kv` splits the same idea into the pieces an engine needs (each module is one box of the engine map):
#
# | piece | module | what it keeps |
# |---|---|---|
# | `BlockPool` | `kv/block_pool.py` | one `KVCacheBlock(block_id, ref_cnt, block_hash)` per block and the **free queue**; knows nothing of requests |
# | `BlockTable` | `kv/block_table.py` | one sequence's physical blocks in logical order + its token count; `append_tokens`, `slot_mapping` |
# | `KVPool` | `kv/kv_pool.py` | the preallocated arrays: per layer `[num_blocks, block_size, kv_heads, head_dim]` for K and for V, as you index them; in memory each head's blocks sit together (`KVPool.storage`), so a run of blocks is one contiguous slab per head, as in a dense cache |
# | `PagedAttentionBackend` | `kv/paged_attention.py` | writes new K/V through the slot mapping, reads them back through the block tables, computes attention |
#
# The free queue is an `OrderedDict` (a C-implemented doubly linked list with a hash index): take the head,
# append at the tail, and remove from anywhere are all O(1). Notebook 05 needs the last one: a prefix-cache hit on
# a freed-but-cached block pulls it out of the *middle* of the queue.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.kv import BlockPool, BlockTable, DoubleFreeError, KVPool, OutOfBlocksError

pool = BlockPool(6)
a, b = BlockTable(block_size=4), BlockTable(block_size=4)
print("A takes", a.append_tokens(5, pool), "for 5 tokens; B takes", b.append_tokens(8, pool), "for 8 tokens")
print("A takes", a.append_tokens(3, pool), "for 3 more (its last block had room)")
print("free queue, head first:", pool.free_block_ids(), "| refcounts:", [blk.ref_cnt for blk in pool.blocks])

before = pool.snapshot()
try:
    b.append_tokens(9, pool)  # needs 3 blocks, only 2 are free
except OutOfBlocksError as err:
    print("OutOfBlocksError:", err)
assert pool.snapshot() == before and b.num_tokens == 8  # all or nothing: nothing was allocated

freed = a.free(pool)  # blocks go back tail first, to the tail of the free queue
print("A freed", freed, "-> free queue:", pool.free_block_ids())
try:
    pool.free(freed[:1])
except DoubleFreeError as err:
    print("DoubleFreeError:", err)
assert pool.snapshot() != before and pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
pool.check_invariants()

# %% [markdown]
# Every error is typed and raised *before* anything changes — the scheduler (notebook 07) catches
# `OutOfBlocksError` and preempts a request; a double free is a bug and must not corrupt refcounts (refcount bugs
# do ship: in vLLM #1556, forking a sequence under sliding-window attention over-incremented block refcounts; PR
# #3347 fixed it). The unit tests check each of these with snapshots before and after, plus a hypothesis state
# machine that runs random allocate / append / truncate / free sequences and checks after every step that free + in use =
# total, no block is both free and used, and every used block is in exactly one table.
#
# ## Live: requests growing token by token
#
# Three requests are admitted with their prompts (step 1), then each decodes one token per step until it
# reaches its length; C finishes early and returns its blocks. Watch three things:
#
# * a request takes a **new block exactly when a token crosses a block boundary** (token index `t % B == 0`);
# * the **free queue shrinks** from its head, and C's freed blocks join its **tail** (so they are reused last);
# * the labels `A[j] n/4` say "logical block j of A, n of 4 slots filled" — the only waste is the unfilled tail
#   of each request's last block.

# %%
from IPython.display import display

from minienv.viz import BlockCell, BlockGrid, QueueView, Stepper, panel

DEMO_B, DEMO_BLOCKS = 4, 12
PROMPTS = {"A": 5, "B": 2, "C": 7}  # prompt lengths
FINAL = {"A": 17, "B": 14, "C": 10}  # lengths at which each request finishes


def demo_snapshot(tables):
    """The pool as plain BlockCell records, labelled request[logical block] and fill."""
    cells = []
    for req, table in tables.items():
        for j, blk in enumerate(table.block_ids):
            fill = min(DEMO_B, table.num_tokens - j * DEMO_B)
            cells.append(BlockCell(blk, owner=req, refcount=demo_pool.ref_cnt(blk), label=f"{req}[{j}] {fill}/{DEMO_B}"))
    return cells


grid = BlockGrid(DEMO_BLOCKS, columns=DEMO_BLOCKS, title=f"KV pool: {DEMO_BLOCKS} blocks of {DEMO_B} slots")
queue = QueueView(title="free queue", head_label="head → allocated next")
events = []  # (step, request, token index, new block id or None)


def on_reset():
    global demo_pool, demo_tables
    demo_pool = BlockPool(DEMO_BLOCKS)
    demo_tables = {}
    events.clear()
    grid.reset(caption="empty pool")
    queue.reset(demo_pool.free_block_ids())


def on_step(i):
    notes = []
    if i == 0:  # admit: prefill each prompt
        for req, n in PROMPTS.items():
            demo_tables[req] = BlockTable(DEMO_B)
            new = demo_tables[req].append_tokens(n, demo_pool)
            notes.append(f"{req} prefills {n} tokens → blocks {new}")
    else:  # decode: every running request appends one token
        for req in list(demo_tables):
            table = demo_tables[req]
            t = table.num_tokens  # index of the token being added
            new = table.append_tokens(1, demo_pool)
            events.append((i + 1, req, t, new[0] if new else None))
            if new:
                notes.append(f"{req} token {t} → new block {new[0]}")
            if table.num_tokens == FINAL[req]:
                freed = table.free(demo_pool)
                del demo_tables[req]
                notes.append(f"{req} finished, frees {freed}")
    caption = "; ".join(notes) or "no new blocks"
    grid.update(demo_snapshot(demo_tables), caption=f"step {i + 1}: {caption}")
    queue.update(demo_pool.free_block_ids(), caption=f"step {i + 1}")
    return caption


N_STEPS = 1 + max(FINAL[r] - PROMPTS[r] for r in PROMPTS)
stepper = Stepper(on_step, on_reset, n_steps=N_STEPS, interval_ms=700, description="step")
stepper.reset()
demo = panel(stepper, grid, queue)
demo

# %% [markdown]
# Press **Step** or ▶. Then the code takes over: step to the end and check, from the recorded events, that a new
# block was taken at every block boundary and nowhere else, and that the views show the pool's state.

# %%
# NBVAL_CHECK_OUTPUT
stepper.go_to(4)  # admit + 3 decode steps; C finished in the last one
assert {r: t.block_ids for r, t in demo_tables.items()} == {"A": [0, 1], "B": [2, 6]}
assert queue.items == tuple(demo_pool.free_block_ids()) == (7, 8, 9, 10, 11, 5, 4, 3)
print(f"after step 4, C finished: A holds {demo_tables['A'].block_ids}, B {demo_tables['B'].block_ids}; "
      f"free queue, head first: {list(queue.items)}")
stepper.run()
assert stepper.done and demo_tables == {} and demo_pool.num_free_blocks == DEMO_BLOCKS
for step, req, t, new_block in events:
    assert (new_block is not None) == (t % DEMO_B == 0), (step, req, t, new_block)
boundary = [(step, req, t, blk) for step, req, t, blk in events if blk is not None]
print("new blocks during decode (step, request, token index, block):")
for e in boundary:
    print("  ", e)
print("tokens decoded:", len(events), "| new blocks taken:", len(boundary), "| all at t % 4 == 0")
print("free queue at the end, head first:", list(queue.items))

# %% [markdown]
# The 27<!--out--> decoded tokens took 7<!--out--> new blocks, each at a block boundary and nowhere else. C finished at
# step 4<!--out--> and its blocks went to the **tail** of the free queue, last block first (`5, 4, 3`), so A's and
# B's next blocks (`7, 8, 9, 10, 11`) came from the head — the freed blocks are reused last. That order is
# what notebook 06 turns into an LRU cache. For readers without a kernel, the state after step 8 as static
# pictures:

# %%
stepper.go_to(8)
display(grid.static(), queue.static())

# %%
# The pictures show the pool: A's cells are A's table, in logical order; the queue is the pool's free list.
assert {c.label.split()[0]: c.block_id for c in grid.cells if c.owners == ("A",)} == {
    f"A[{j}]": block for j, block in enumerate(demo_tables["A"].block_ids)}
assert queue.items == tuple(demo_pool.free_block_ids())

# %% [markdown]
# ## The slot-mapping arithmetic, worked through
#
# At step 8 A holds 12<!--out--> tokens in the blocks drawn above. Every new K/V vector the model computes is written
# at its token's slot: token 9, say, is offset `9 % 4 = 1` of logical block `9 // 4 = 2`, which is physical block
# 7<!--out-->, so its slot is `7 * 4 + 1` = 29<!--out-->. The backend computes all slots of a step in one vectorized
# expression.

# %%
# NBVAL_CHECK_OUTPUT
table_a = demo_tables["A"]
ids = table_a.as_array()
print(f"A: {table_a.num_tokens} tokens, block table {ids.tolist()}, block size {DEMO_B}")
print(f"{'t':>3} {'t // B':>7} {'t % B':>6} {'table[t//B]':>12} {'slot':>5}")
for t in range(table_a.num_tokens):
    print(f"{t:>3} {t // DEMO_B:>7} {t % DEMO_B:>6} {ids[t // DEMO_B]:>12} {ids[t // DEMO_B] * DEMO_B + t % DEMO_B:>5}")
assert table_a.slot_mapping().tolist() == [int(ids[t // DEMO_B] * DEMO_B + t % DEMO_B) for t in range(table_a.num_tokens)]

# %% [markdown]
# ## Attention over scattered blocks
#
# For a batch, the backend receives the step's metadata — like vLLM's attention metadata — and the model's Q, K, V
# for the new tokens:
#
# * `block_tables [seqs, max_blocks]`, `context_lens` (tokens cached before this step), `query_lens` (new tokens:
#   a prefill chunk, possibly starting mid-sequence, or 1 for a decode), and the `slot_mapping` of the new tokens.
#
# It writes the new K/V through the slot mapping, then reads them back through the block tables with one of two
# kernels:
#
# * **numpy** (the reference) — gather each sequence's blocks in logical order with one `np.take` on the block
#   axis, then ordinary batched causal attention, exactly as over contiguous caches. Every step: prefill chunks,
#   decodes, blocks shared between sequences. The copy costs about as much as the attention itself.
# * **numba** (the fused block walk, `minienv/kv/block_walk.py`, when numba is installed) — attention is a *sum
#   over keys*, so it can be computed block by block wherever the blocks lie, in three passes: for every block of
#   every sequence, score its keys; per query, the **softmax** of its row of scores; for every block again, add
#   each key's weight times its V row. No K/V copy — the shape of the paper's CUDA kernel (which keeps a sequence's
#   scores in the GPU's shared memory the same way). The walk visits blocks in *physical* order, front to back
#   through the pool, which keeps the CPU's prefetchers busy.
#
# `kernel="auto"` is the block walk when numba imports, else the numpy kernel: the choice depends on what is
# installed, never on the step. Both are held to dense attention, and to each other, by property tests (random
# batches, block sizes 1/2/16/64, GQA ratios, shared blocks).
#
# **Proof 1: one layer, a random batch.** Four sequences with different cached lengths; two prefill chunks that
# start mid-sequence and two decodes in the same step; blocks handed out interleaved. Each kernel installed here,
# named (not `"auto"`), is compared with the model's dense attention (`minienv.model.attention.causal_attention`)
# on each sequence's contiguous K/V.

# %%
from minienv.kv import PagedAttentionMetadata, paged_attention
from minienv.kv.paged_attention import NUMBA_MISSING
from minienv.model.attention import causal_attention

KERNELS = ["numpy"] + ([] if NUMBA_MISSING else ["numba"])  # numba: the `lab` extra installs it

rng = np.random.default_rng(4)
P_B, HKV, GROUP, D = 16, 2, 2, 32
context, new_tokens = [40, 3, 77, 16], [5, 1, 1, 9]
p_pool = BlockPool(40)
p_kv = KVPool(num_layers=1, num_blocks=40, block_size=P_B, num_kv_heads=HKV, head_dim=D)
p_tables = [BlockTable(P_B) for _ in context]
dense_k = [rng.standard_normal((c + q, HKV, D), dtype=np.float32) for c, q in zip(context, new_tokens)]
dense_v = [rng.standard_normal((c + q, HKV, D), dtype=np.float32) for c, q in zip(context, new_tokens)]
for start in range(0, max(context), 8):  # the cached part, written 8 tokens at a time, sequences interleaved
    for s, table in enumerate(p_tables):
        n = max(0, min(8, context[s] - start))
        if n:
            table.append_tokens(n, p_pool)
            p_kv.write(0, table.slot_mapping(start, start + n), dense_k[s][start:start + n], dense_v[s][start:start + n])
for s, table in enumerate(p_tables):  # this step's new tokens
    table.append_tokens(new_tokens[s], p_pool)
meta = PagedAttentionMetadata.from_block_tables(p_tables, new_tokens)
q = rng.standard_normal((meta.num_tokens, HKV * GROUP, D), dtype=np.float32)
p_kv.write(0, meta.slot_mapping, np.concatenate([k[c:] for k, c in zip(dense_k, context)]),
           np.concatenate([v[c:] for v, c in zip(dense_v, context)]))
paged_outs = {k: paged_attention(q, p_kv.kv_cache[0], meta, k) for k in KERNELS}  # mixed prefill + decode
dense_out = np.concatenate([
    causal_attention(q[meta.query_start_loc[s]:meta.query_start_loc[s + 1]], dense_k[s], dense_v[s],
                     np.arange(context[s], context[s] + new_tokens[s]))
    for s in range(len(context))
])
print("block tables:", [t.block_ids for t in p_tables])
print("positions of the step's tokens:", meta.positions.tolist())
for k, paged_out in paged_outs.items():
    print(f"kernel={k!r}: max |paged - dense| = {np.abs(paged_out - dense_out).max():.1e}")

# %%
for paged_out in paged_outs.values():
    assert np.abs(paged_out - dense_out).max() < 1e-5
assert not any(np.all(np.diff(t.block_ids) == 1) for t in p_tables if t.num_blocks > 2)  # really scattered

# %% [markdown]
# **Proof 2: the whole model.** The bundled model generates greedily for four prompts *batched together*
# through the paged backend — chunked prefills (4 tokens per step) and decodes share steps — with each kernel
# installed here.
# The reference is the dense `model.forward`, which recomputes the whole sequence with no cache at all. One dense
# pass over `prompt + generated tokens` is enough: the model is causal, so its logits at position
# `len(prompt) + i - 1` are exactly what dense greedy decoding sees when it picks token `i`. If every generated
# token is the argmax of those logits, dense greedy decoding produces the very same tokens.
#
# %%
from minienv.kv import PagedAttentionBackend
from minienv.model import load_model
from minienv.tokenizer import load_tokenizer

model, tokenizer = load_model(), load_tokenizer()  # the bundled target model, trained on Shakespeare
prompts = [tokenizer.encode(s) for s in ["To be, or not to be", "ROMEO:", "The king is dead", "O"]]
MODEL_NAME = "the bundled target model"
NEW_TOKENS, CHUNK, MODEL_B = 8, 4, 16


def generate_paged(model, prompts, max_new_tokens, block_size, chunk, kernel="auto"):
    """Greedy generation for all prompts in one batch over a paged KV cache; one model call per step."""
    kv = KVPool.for_model(model.config, sum(len(p) + max_new_tokens + block_size for p in prompts), block_size)
    pool, backend = BlockPool(kv.num_blocks), PagedAttentionBackend(kv, kernel=kernel)
    tables = [BlockTable(block_size) for _ in prompts]
    fed, out, logits = [0] * len(prompts), [[] for _ in prompts], [[] for _ in prompts]
    while any(len(o) < max_new_tokens for o in out):
        live = [i for i in range(len(prompts)) if len(out[i]) < max_new_tokens]
        tokens, qlens, sample = [], [], []
        for i in live:  # per sequence, once per step: which tokens it feeds
            if fed[i] < len(prompts[i]):  # (the rest of) its prompt, a chunk at a time
                toks = prompts[i][fed[i]:fed[i] + chunk]
                fed[i] += len(toks)
            else:  # its last generated token
                toks = [out[i][-1]]
            tokens += toks
            qlens.append(len(toks))
            sample.append(fed[i] == len(prompts[i]))
            tables[i].append_tokens(len(toks), pool)
        meta = PagedAttentionMetadata.from_block_tables([tables[i] for i in live], qlens)
        backend.set_metadata(meta)
        rows = model.forward_step(tokens, meta.positions, backend, logits_indices=meta.query_start_loc[1:] - 1)
        for row, i, ok in zip(rows, live, sample):
            if ok:
                logits[i].append(row)
                out[i].append(int(np.argmax(row)))
    for t in tables:
        t.free(pool)
    return out, [np.stack(x) for x in logits]


def dense_logits(model, prompt, generated):
    """Dense logits at the positions that chose each generated token: one causal pass, no cache."""
    return model.forward(list(prompt) + list(generated[:-1]))[len(prompt) - 1:]


runs = {k: generate_paged(model, prompts, NEW_TOKENS, MODEL_B, CHUNK, kernel=k) for k in KERNELS}
paged_ids = runs["numpy"][0]
dense = [dense_logits(model, p, ids_) for p, ids_ in zip(prompts, paged_ids)]
dense_choice = [np.argmax(d, axis=-1).tolist() for d in dense]
print(f"model: {MODEL_NAME}")
for p, ids_, choice in zip(prompts, paged_ids, dense_choice):
    shown = repr(tokenizer.decode(p) + "|" + tokenizer.decode(ids_)) if tokenizer else f"{p} | {ids_}"
    print(f"  {shown}   dense greedy picks the same: {ids_ == choice}")
max_logit_err = max(np.abs(pl - dl).max() for _, pls in runs.values() for pl, dl in zip(pls, dense))
logit_scale = max(np.abs(dl).max() for dl in dense)
print(f"max |paged - dense| over all logits, kernels {' and '.join(KERNELS)}: {max_logit_err:.1e} "
      f"(logits up to {logit_scale:.1f}: {max_logit_err / logit_scale:.0e} relative, float32 rounding)")

# %%
assert paged_ids == dense_choice, "paged generation must be token-for-token dense greedy generation"
assert all(ids_ == paged_ids for ids_, _ in runs.values()), "every kernel generates the same text"
for _, pls in runs.values():  # 1e-5 absolute + 1e-6 relative: float32 at logits of ~17
    for pl, dl in zip(pls, dense):
        np.testing.assert_allclose(pl, dl, atol=1e-5, rtol=1e-6)

# %% [markdown]
# ### What paging costs in numpy
#
# Reaching K/V through a table is extra work for the numpy kernel: it copies the blocks, and in numpy a copy costs
# about as much as the attention matmul reading them, so it cannot get much below 2× the best dense kernel where
# everything sits in cache. The block walk copies nothing; it reads each block once, in pool order.
# `benchmarks/bench_paged.py` times a decode step (attention only) at batch {1, 8, 32} × context
# {128, 512, 2048} against the fastest of four dense numpy variants over contiguous slabs, and reports every path
# against the machine's *read* bandwidth (a large `np.sum`: the floor for anything that reads all of K and V once).
# One point, timed here for each kernel **by name** — `kernel="numpy"` (the gather this section is about), then
# `kernel="numba"` (the block walk, which is what `kernel="auto"` picks when numba is installed) — against the best
# dense variant (timings are not checked: they depend on the machine and its load):
# %%
import time

from minienv.kv import batched_attention

S, T = 8, 512
b_pool, b_kv = BlockPool(S * T // 16 + 4), KVPool(1, S * T // 16 + 4, 16, 2, 64)
b_tables = [BlockTable(16) for _ in range(S)]
for _ in range(T // 16):
    for tb in b_tables:
        tb.append_tokens(16, b_pool)
b_kv.kv_cache[...] = np.random.default_rng(0).standard_normal(b_kv.kv_cache.shape, dtype=np.float32)
b_meta = PagedAttentionMetadata.from_block_tables(b_tables, [1] * S)
k_slab = b_kv.k_cache[0][b_meta.block_tables].reshape(S, T, 2, 64).copy()
v_slab = b_kv.v_cache[0][b_meta.block_tables].reshape(S, T, 2, 64).copy()
qd = np.random.default_rng(1).standard_normal((S, 4, 64), dtype=np.float32)


def best_of(fn, n=30):
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


t_dense = best_of(lambda: batched_attention(qd[:, None], k_slab, v_slab))
for k in KERNELS:
    t_paged = best_of(lambda: paged_attention(qd, b_kv.kv_cache[0], b_meta, k))
    print(f"batch {S}, context {T}: paged ({k}) {t_paged * 1e6:.0f} us, dense {t_dense * 1e6:.0f} us, "
          f"ratio {t_paged / t_dense:.2f}")

# %%
for k in KERNELS:
    assert np.allclose(paged_attention(qd, b_kv.kv_cache[0], b_meta, k),
                       batched_attention(qd[:, None], k_slab, v_slab).reshape(S, 4, 64), atol=1e-5)

# %% [markdown]
# The numpy line is the gather's price: the copy of every block before the attention. The numba line is the walk's:
# no copy, but loops over 16-key blocks instead of one large matmul — so at 512 keys it still trails the dense
# kernel (`bench_paged.py`, batch 8 and 32: 1.2–1.5× the strongest dense numpy variant). It pays off with longer
# contexts: at batch 8 and 32 × 2048 keys the walk measured 0.90–1.10×, while the gather measured 2.5–5.7× over
# 512 and 2048 keys (`docs/BENCHMARKS.md`, the three-pass walk's runs).
#
# On a GPU the paper's kernel reads the blocks in place (no copy) and was 20–26 % slower than FasterTransformer's
# contiguous kernel; the memory it saves lets the batch grow 2–4×, which is where the throughput comes from.
#
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/04_paged_attention.py` — is explained in notebook 00.)
#
# ### Exercise 1: gather a token range
#
# The build-it-small above gathered a *whole* sequence. Attention often needs only part of it: a sliding-window
# layer reads the last `W` tokens, a chunk of a long prompt attends to a range, a cached prefix is copied out from a
# given token. Write `my_gather(k_layer, block_table, start, stop)` that returns the K of tokens `start … stop − 1`
# of a sequence as a contiguous `[stop − start, kv_heads, head_dim]` array, from `k_layer [num_blocks, block_size,
# kv_heads, head_dim]` and the sequence's block table. Rules: (1) token `t` is slot `t % block_size` of block
# `block_table[t // block_size]` — the blocks in the table's (logical) order; (2) read only the blocks the range
# touches, `start // block_size` … `(stop − 1) // block_size` (the check points the table's other entries past the
# pool); (3) the range starts `start % block_size` slots into its first block, includes its partial last block, and
# ends at `stop`; (4) the result has shape `[stop − start, kv_heads, head_dim]` (an empty range gives 0 rows);
# (5) no Python loop over tokens — read whole blocks (the check counts how often your code indexes the pool).

# %%
from minienv.exercises.paged_attention import check_gather, check_new_blocks_needed


def my_gather(k_layer, block_table, start, stop):
    """The K of tokens start … stop - 1 of a sequence, contiguous, read through its block table."""
    raise NotImplementedError("your code here")


# %%
check_gather(my_gather)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Which logical blocks hold tokens `start` and `stop − 1`? Take only that slice of the block table, in order,
# with one `np.take(..., axis=0)`.
# </details>
#
# <details><summary>Hint 2</summary>
#
# After merging the first two axes (`reshape(-1, H, D)`), row `r` is token `first_block * B + r`: skip
# `start − first_block * B` rows and keep `stop − start`.
# </details>

# %% [markdown]
# ### Exercise 2: when does a request take a block?
#
# Write `new_blocks_needed(num_tokens, num_new, block_size)`: how many blocks a request holding `num_tokens`
# tokens (in `ceil(num_tokens / block_size)` blocks) must take to add `num_new` tokens — what
# `BlockTable.append_tokens` asks the pool for. Rules: (1) a new request needs `ceil(tokens / block_size)`
# blocks; (2) tokens that fit in the last block's free slots take no block; (3) a token that crosses a block
# boundary takes one — including when the last block is exactly full.

# %%
def new_blocks_needed(num_tokens, num_new, block_size):
    """Blocks to take so that num_tokens + num_new tokens fit."""
    raise NotImplementedError("your code here")


# %%
check_new_blocks_needed(new_blocks_needed)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Count the blocks the request needs after the append and the blocks it holds before.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Both are ceilings: `-(-n // b)`. Floors (`n // b`) are wrong exactly at the boundaries rule 3 is about.
# </details>

# %% [markdown]
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if blocks were one token each? The slot arithmetic still works — where does the cost move (table size,
#   gather, per-block work)? Notebook 13 measures it.
#
# ## Where this lives in vLLM / SGLang
#
# > **vLLM** (v1 engine, v0.11.0)
# > * [`vllm/v1/core/kv_cache_utils.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/kv_cache_utils.py) — `KVCacheBlock` (block id, `ref_cnt`, block hash) and
# >   `FreeKVCacheBlockQueue`, a hand-written doubly linked list with O(1) `popleft`, `append` and `remove`;
# >   minienv's `KVCacheBlock` and `FreeBlockQueue`.
# > * [`vllm/v1/core/block_pool.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/block_pool.py) — `BlockPool`: `get_new_blocks`, `free_blocks` (refcount −1, to the free
# >   queue at 0), `get_num_free_blocks`; minienv's `BlockPool`.
# > * [`vllm/v1/core/kv_cache_manager.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/kv_cache_manager.py) — per-request block lists and allocation of the slots a step needs
# >   (minienv: `BlockTable.append_tokens`; the full manager is notebook 05).
# > * [`vllm/v1/worker/block_table.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/worker/block_table.py) — the worker-side `BlockTable` array and `compute_slot_mapping`:
# >   `block_table[req, pos // block_size] * block_size + pos % block_size`; minienv's `batch_slot_mapping`.
# > * [`vllm/v1/attention/backends/flash_attn.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/attention/backends/flash_attn.py) — `FlashAttentionMetadata` (`query_start_loc`, `seq_lens`,
# >   `block_table`, `slot_mapping`); K/V live in a `[2, num_blocks, block_size, kv_heads, head_dim]` tensor per
# >   layer, the order in which minienv's `KVPool.kv_cache[layer]` is indexed (its memory keeps heads outermost
# >   instead: numpy reads a head's keys fastest as one contiguous slab). [`vllm/v1/attention/backends/cpu_attn.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/attention/backends/cpu_attn.py) is the CPU backend.
# > * [`csrc/attention/paged_attention_v1.cu`](https://github.com/vllm-project/vllm/blob/v0.11.0/csrc/attention/paged_attention_v1.cu) / [`csrc/attention/paged_attention_v2.cu`](https://github.com/vllm-project/vllm/blob/v0.11.0/csrc/attention/paged_attention_v2.cu) — the original PagedAttention CUDA kernels
# >   from the paper, which read blocks in place instead of gathering them; minienv's `kv/block_walk.py` is v1's
# >   walk (per sequence and head: every key's score, their softmax, the weighted V rows) on a CPU, block by block
# >   in physical-block order.
# >
# > **SGLang** (v0.5.3)
# > * [`python/sglang/srt/mem_cache/memory_pool.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/memory_pool.py) — `ReqToTokenPool` (per request, position → KV slot: a block
# >   table at token granularity) and `MHATokenToKVPool` (the K/V buffers per layer, written by slot).
# > * [`python/sglang/srt/mem_cache/allocator.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/allocator.py) — `TokenToKVPoolAllocator` and `PagedTokenToKVPoolAllocator`
# >   (free slots / pages; newer versions split this into an `allocator/` package).

# %% [markdown]
# ## Summary
#
# * A **block table** maps a request's logical blocks to physical blocks; token `t` lives in slot
#   `table[t // B] * B + t % B`. A new block is taken exactly when a token crosses a block boundary, so a request
#   wastes at most `B − 1` slots — notebook 03's 97.0 %<!--out:03--> utilisation against 21.1 %<!--out:03-->–38.9 %<!--out:03-->
#   for contiguous reservation.
# * The **block pool** keeps a refcount per block and a **free queue** with O(1) pop-head, append-tail and
#   remove-from-middle; allocation is all-or-nothing and every error leaves the pool exactly as it was.
# * **Paged attention** writes new K/V through the slot mapping and reads them back through the block tables —
#   by gathering whole blocks in logical order (numpy), or block by block where they lie (the numba block walk),
#   as the paper's CUDA kernel does. Either way the result is dense attention (checked for one layer and for the model's generated
#   text); the cost is the indirection, which the benchmark measures against contiguous slabs.
# * Next: blocks that hold the same prefix can be **shared** between requests (refcounts > 1) and kept after a
#   request finishes (cached-free) — notebook 05.

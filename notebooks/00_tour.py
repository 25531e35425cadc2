# %% [markdown]
# # 00 · A tour of minienv: the map, the series, and the live views
#
# minienv is a small LLM inference engine written in numpy, built one layer per notebook. Its subject is the
# part of a real engine (vLLM, SGLang) that decides where every token's keys and values live: the **KV cache**
# — paged into fixed-size blocks, shared between requests by refcount, evicted least recently used first, and
# scheduled so that many requests run together.
#
# **Learning goals.** After this notebook you can
# 1. name the five parts of the engine, in the order a prompt flows through them, and say what state each keeps;
# 2. say which notebook builds which part;
# 3. read the live views used throughout the series — the *block grid* (who owns each physical block, with
#    which refcount, what just changed) and the *queue view* (the free queue, head first);
# 4. drive a view with the *stepper* (step / play / reset) by hand and from code, and check what it shows with
#    `assert`s — on a toy allocator you will write in ten lines.

# %% [markdown]
# ## The map
#
# This is the architecture of the naive design as it circulates in tutorials, with each box made correct
# (`minienv/lab/naive_design.py` reproduces what the naive design gets wrong). A prompt flows top to bottom; the numbers on the right
# are the notebooks that build each box.

# %%
from minienv.viz import Stage, flow_diagram, flow_svg

ENGINE_MAP = [
    Stage("Tokenizer", ("byte-level BPE: text ⇄ token ids",), "01"),
    Stage(
        "Scheduler",
        ("waiting / running queues, a token budget per step:", "admit · chunk long prefills · preempt"),
        "07 · 08",
    ),
    Stage(
        "PagedAttention manager",
        ("fixed-size blocks of token slots in one preallocated pool",),
        "03 · 04",
        children=(
            Stage("block table", "per request: logical block → physical block", "04"),
            Stage("free list", "the free queue: allocate from the head, free to the tail", "04"),
        ),
    ),
    Stage(
        "KV cache manager",
        ("which blocks can be shared, kept, or dropped",),
        "05 · 06",
        children=(
            Stage("prefix-aware refcounter", "hash chain of full blocks → share them, refcount each", "05"),
            Stage("token-budget LRU evictor", "cached-free blocks evicted least recently used first", "06"),
        ),
    ),
    Stage("Model core", ("numpy Llama: reads and writes K/V through block tables", "→ logits → sampler"), "02"),
]
engine_svg = flow_svg(ENGINE_MAP, title="minienv: the engine, as a prompt flows through it", start="prompt",
                      end="next token (streamed back; the loop repeats until the request finishes)")
flow_diagram(ENGINE_MAP, title="minienv: the engine, as a prompt flows through it", start="prompt",
             end="next token (streamed back; the loop repeats until the request finishes)")

# %%
for stage in ENGINE_MAP:
    assert stage.name in engine_svg
    for child in stage.children:
        assert child.name in engine_svg
assert [s.name for s in ENGINE_MAP] == [
    "Tokenizer", "Scheduler", "PagedAttention manager", "KV cache manager", "Model core"]

# %% [markdown]
# The same map as text, with the minienv module behind each box (dependencies point one way: the model never
# imports the scheduler, and the block pool knows nothing of requests):
#
# ```
# prompt
#   │
#   ▼
# Tokenizer               byte-level BPE: text ⇄ token ids             minienv/tokenizer.py
#   │
#   ▼
# Scheduler               waiting / running queues, token budget       minienv/scheduler.py, engine/
#   │                     admit · chunk · preempt
#   ▼
# PagedAttention manager  block table per request, free list           minienv/kv/block_pool.py, block_table.py,
#   │                     (the pool of K/V blocks)                     kv_pool.py, paged_attention.py
#   ▼
# KV cache manager        prefix-aware refcounter,                     minienv/kv/prefix_cache.py, hashing.py,
#   │                     token-budget LRU evictor                     kv_cache_manager.py
#   ▼
# Model core              numpy Llama reading K/V through block tables minienv/model/, sampling.py
#   │
#   ▼
# next token
# ```

# %%
from pathlib import Path

import minienv

MODULES = {
    "Tokenizer": ["tokenizer.py"],
    "Scheduler": ["scheduler.py", "engine/core.py"],
    "PagedAttention manager": ["kv/block_pool.py", "kv/block_table.py", "kv/kv_pool.py", "kv/paged_attention.py"],
    "KV cache manager": ["kv/prefix_cache.py", "kv/hashing.py", "kv/kv_cache_manager.py"],
    "Model core": ["model/llama.py", "sampling.py"],
}
package = Path(minienv.__file__).parent
missing = [m for mods in MODULES.values() for m in mods if not (package / m).is_file()]
assert not missing, f"the map names modules that do not exist: {missing}"
assert list(MODULES) == [s.name for s in ENGINE_MAP]

# %% [markdown]
# ## How the series is organized
#
# Each notebook builds one box, first small and inline so you see the idea, then minienv's version, then a live
# view and cells that *prove* what the view shows.
#
# | notebook | you build | you see |
# |---|---|---|
# | **00 tour** (this one) | a ten-line block allocator | the map; the block grid, queue view and stepper |
# | **01 tokenizer** | byte-level BPE, trained on Shakespeare | merges forming words; encode ⇄ decode round trips |
# | **02 model and KV cache** | a numpy Llama and a contiguous KV cache | cached decoding giving the same logits as the dense pass |
# | **03 KV memory waste** | four ways to place KV memory | the vLLM paper's Figure 2: how little of a contiguous cache holds tokens |
# | **04 paged attention** | the block pool, block tables, paged attention | requests growing block by block; paged == dense |
# | **05 prefix sharing** | hash chains, refcounts, copy-on-write forks | shared blocks with refcount > 1; the moment of a copy |
# | **06 LRU eviction** | the token-budget LRU evictor | the free queue in LRU order; hit rate vs budget |
# | **07 scheduling** | continuous batching, chunked prefill, preemption | static vs continuous timelines; throughput and latency |
# | **08 engine** | `InferenceEngine` | the whole engine in one dashboard, text streaming in |
# | **09 metrics** | Prometheus metrics in vLLM's names | running / waiting, KV usage, hit rate, the TTFT histogram, live |
# | **10 serving** | the engine behind gRPC; two instances behind a balancer | a stream, a cancel giving blocks back, `RESOURCE_EXHAUSTED`; round robin vs prefix-aware hit rates |
# | **11 persistent KV** | a KV tier on disk (SQLite) or shared (Redis) | a restart whose prefix comes back from disk; a corrupt record refused |
# | **12 speculative decoding** | draft-model and n-gram proposals, exact verification | drafts kept and rejected, their KV slots given back |
# | **13 block size** | a sweep from 1 to 256, a dynamic scheme, a tuner | fragmentation, hits and time as the block size changes |
# | **14 capstone** | your own KV cache manager | it runs the real engine and is graded by the series' proofs |
# | **15 real model** | SmolLM2-135M-Instruct read from its GGUF file, its tokenizer and chat template | a real instruct model chatting through minienv's own engine and paged KV cache |
# | **16 at scale** | minienv's scheduler and KV manager on a simulated GPU clock (a roofline per step) | latency–throughput curves; the shape of the vLLM paper's result (paged vs reservation vs static batching) |
#
# ## How to use the live views
#
# These views appear from notebook 04 on, all from `minienv.viz`:
#
# - **Block grid** — one cell per *physical* block of the KV pool. The colour is the owner (a request); dark
#   slate means several requests share the block; light grey is *free*; pale blue is *cached-free* (refcount 0,
#   contents kept, can be evicted or reused). Each cell reads `id ·rcN` (N = refcount) over its owner or label.
#   Cells that changed in the last step have a **thick dark outline**. Hover a cell for its details.
# - **Block tables** — one row per request: its blocks in logical order (`[0]`, `[1]`, …), each cell naming the
#   physical block (`p5`) and its refcount; a cell outlined dark is new or changed.
# - **Queue view** — an ordered queue, head first, like the free queue: `▼ head` is the block the next
#   allocation takes. Green outlines mark items that just joined, dark ones items that moved; items that just
#   left are drawn dashed below, marked *taken* or *evicted*.
# - **Stepper** — ▶ plays (pause with the same button, ■ goes back to the start), **Step** takes one step,
#   **Reset** starts over; the slider shows where you are. Everything a button does, code can do too:
#   `stepper.step()`, `stepper.run()`, `stepper.go_to(k)`, `stepper.reset()` — that is how the proof cells
#   below drive the views before they check them.
#
# Live widgets need a running kernel. **Reading on GitHub or nbviewer?** Widget state is not saved in the
# notebooks, so under each live view you will find a *static* picture of the same state (`view.static()`).
#
# ## Before you start
#
# **Prerequisites.** Python and numpy (arrays, `@`, slicing). From machine learning, two ideas — here is all the
# series uses of them:
#
# - **softmax** turns scores into weights that are positive and sum to 1: `w = exp(s - s.max()); w /= w.sum()`
#   (subtracting the max changes nothing but keeps `exp` from overflowing);
# - **attention**: each token's *query* vector is compared with every earlier token's *key* (a dot product, divided
#   by √(head dim)); the softmax of those scores weights the earlier tokens' *value* vectors, and their weighted
#   sum is the token's output. A token sees itself and the tokens before it, never after (*causal*). Those keys and
#   values are the **KV cache**: computed once per token, read by every later token.
#
# **Time.** About 30 min for this notebook; 45–60 min for each of 01–08 (an hour for 02, 04, 05 and 07), exercises
# included. Run All takes under 20 s for each.
#
# **How to use the series.** Open the notebooks in order (each builds on the last) and run them top to bottom; then
# change things and re-run. Each ends with **exercises**: a stub to replace, a check that says *not implemented yet*
# until you do and names the rule a wrong answer breaks, hints folded under it, and solutions in `solutions/`
# (details at the end of this notebook). Live views need a running kernel; if one gets into a strange state,
# *Kernel → Restart Kernel and Run All Cells* starts clean. On GitHub every view and figure has a static picture.
#
# **The naive design.** The series starts from a design that circulates in tutorials. It draws the right boxes —
# the map above — and fills them with code that is wrong in instructive ways: **one block per whole prompt** (a hash
# of the entire prompt, so two prompts with the same system prompt share nothing), a reused block's **refcount set
# to 1** instead of incremented, an LRU **evictor that ignores refcounts** (it evicts blocks running requests still
# read), and a **free list that is a Python list** popped from the front (O(n) per allocation).
# `minienv/lab/naive_design.py` reproduces each flaw so notebooks 05 (hashing, refcounts) and 06 (eviction, the
# free list) can show it fail on real requests, then show minienv's version pass the same test.
#
# **Glossary** (each term is explained where it first matters; this is the list to come back to):
#
# | term | meaning |
# |---|---|
# | token | the unit the model reads and writes: an id from the tokenizer (01); every count in the engine is in tokens |
# | prefill / decode | computing a prompt's tokens (many per step) / generating one new token per step |
# | KV cache | the keys and values of every token computed so far, kept so later tokens need not recompute them (02) |
# | GQA | grouped-query attention: several query heads share one key/value head, so the cache stores fewer heads (02) |
# | RoPE | rotary position embedding: queries and keys are rotated by an angle set by their position, so attention scores depend on relative position (02) |
# | slot | room for one token's K and V in the preallocated pool (03, 04) |
# | block | a fixed number of consecutive slots, the unit of allocation (04) |
# | block table | a request's blocks in logical order: token `t` is in block `table[t // B]` (04) |
# | free queue | the free blocks, head first: allocation takes the head, a freed block joins the tail (00, 04, 06) |
# | refcount | how many requests hold a block; it is free only at 0 (00, 05) |
# | prefix cache | full blocks indexed by a hash of their whole prefix, so a new prompt reuses computed K/V (05) |
# | cached-free | a block with refcount 0 whose K/V are kept for prefix hits until it is evicted (05, 06) |
# | copy-on-write | a block shared after a fork is copied the first time one holder writes into it (05) |
# | LRU eviction | reusing the least recently freed cached block first — the head of the free queue (06) |
# | token budget | the most tokens one step computes (`max_num_batched_tokens`), or the KV memory in tokens (06, 07) |
# | continuous batching | choosing who runs at every step, instead of running a fixed batch to the end (07) |
# | chunked prefill | splitting a long prompt over several steps so decodes keep running beside it (07) |
# | preemption | taking a running request's blocks when memory runs out; it is recomputed later, and loses nothing (07) |
# | TTFT | time to first token: from arrival to the first generated token (07, 08) |
# | TPOT | time per output token after the first (07, 08) |
# | e2e latency | arrival to the last token (08) |
# | parallel sampling / beam search | `n` completions of one prompt / keeping the `k` most likely partial outputs at every step and extending each; both fork a request, so their copies share the prompt's blocks (05) |
# | cache salt | an extra key mixed into every block hash (vLLM's `cache_salt`), so tenants with the same prompt never share K/V (05) |
# | FasterTransformer | NVIDIA's inference library; the vLLM paper's contiguous-KV baseline for attention speed (04) |
# | nano-vllm | a ~1,200-line re-implementation of vLLM's core; this series compares its allocator and eviction (05, 06, 13) |
#
# ## Build it small: a ten-line block allocator
#
# Here is the whole idea of a paged KV cache in miniature. The pool has 8 physical blocks (say 4 token slots
# each). A request holds a **block table**, the list of its blocks in logical order. Free blocks wait in a
# **free queue**: allocation takes from the head, and a freed block goes to the tail — so the block taken next
# is the one that has been free the longest. Blocks carry a **refcount**, so two requests can hold the same
# block (here: C starts with the same 4-token system prompt as A, so it shares A's first block instead of
# computing and storing it again). The free queue is an `OrderedDict`, so taking the head and appending to the
# tail are O(1) — never `list.pop(0)`.

# %%
from collections import OrderedDict

from minienv.exercises.tour import reference_release  # exercise 2 below: write it yourself


class ToyPool:
    """A tiny block allocator: a free queue (head = next out), refcounts, one block table per request."""

    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free = OrderedDict.fromkeys(range(num_blocks))  # free queue, head first
        self.refcount = [0] * num_blocks
        self.tables = {}  # request id -> its physical blocks, in logical order

    def allocate(self, req, n):
        if n > len(self.free):
            raise MemoryError(f"{req} needs {n} blocks, only {len(self.free)} free")
        table = self.tables.setdefault(req, [])
        for _ in range(n):
            block, _ = self.free.popitem(last=False)  # the head of the free queue
            self.refcount[block] = 1
            table.append(block)

    def share(self, req, other, n):
        """``req`` starts with the first ``n`` blocks of ``other`` (a common prefix): refcount + 1 each."""
        shared = self.tables[other][:n]
        for block in shared:
            self.refcount[block] += 1
        self.tables.setdefault(req, []).extend(shared)

    def release(self, req):
        """Give ``req``'s blocks back: one reference each, the table's last block first; a block nobody holds any
        more joins the tail of the free queue. Exercise 2 asks you to write it — until then, minienv's runs."""
        reference_release(self, req)

    def holders(self, block):
        return tuple(r for r, table in self.tables.items() if block in table)


# %% [markdown]
# The demo: three requests arrive, grow, share and finish. Each action is one step.

# %%
# NBVAL_CHECK_OUTPUT
ACTIONS = [
    ("arrive", "A", 3),  # A's prompt needs 3 blocks
    ("arrive", "B", 2),
    ("share", "C", "A", 1),  # C has A's system prompt: it shares A's first block ...
    ("grow", "C", 1),  # ... and needs one block of its own
    ("grow", "A", 1),  # A's output fills a block: it needs one more
    ("finish", "B"),
    ("grow", "C", 2),  # C takes the two blocks B just freed
    ("finish", "A"),  # A's blocks go back to the queue, except the one C still shares
    ("finish", "C"),
]


def apply(pool, action):
    kind, req, *args = action
    if kind in ("arrive", "grow"):
        pool.allocate(req, args[0])
        return f"{req} takes {args[0]} block(s)"
    if kind == "share":
        pool.share(req, args[0], args[1])
        return f"{req} shares the first {args[1]} block(s) of {args[0]}"
    pool.release(req)
    return f"{req} finishes"


pool = ToyPool(8)
peak_in_use, final_size = 0, {}
for i, action in enumerate(ACTIONS):
    what = apply(pool, action)
    table_text = " ".join(f"{r}:{t}" for r, t in pool.tables.items())
    print(f"{i}: {what:<36} tables {table_text:<34} free queue {list(pool.free)}")
    peak_in_use = max(peak_in_use, pool.num_blocks - len(pool.free))
    final_size.update({r: len(t) for r, t in pool.tables.items()})

# %% [markdown]
# Read the free queue in the last lines: blocks come back in the order their owners finished, each table
# tail first, and block 0<!--out--> — shared by A and C — comes back only when C, its last holder, finishes.
#
# **Why bother, in one number.** An engine without paging reserves, when a request arrives, one contiguous
# region big enough for the request's final length. Even if it knew those lengths in advance, it would need:

# %%
# NBVAL_CHECK_OUTPUT
reserve_up_front = sum(final_size.values())
print(f"final table sizes: {final_size}")
print(f"reserved up front (contiguous, even with perfect foresight): {reserve_up_front} blocks "
      f"> {pool.num_blocks} in the pool, so C would have to wait")
print(f"paged + shared, as above: at most {peak_in_use} of {pool.num_blocks} blocks in use, all three run together")
assert (reserve_up_front, peak_in_use) == (10, 7)

# %% [markdown]
# Reserving up front would need 10<!--out--> blocks of a pool of 8<!--out-->; paged and shared, the demo never held more
# than 7<!--out-->. Paging (take a block only when a request crosses a block boundary) and sharing (C reuses A's
# first block) are the two savings; notebook 03 measures the first on a realistic workload, notebook 05 the second.
#
# ## The live view
#
# Now the same sequence, drawn. The stepper calls `on_step(i)`, which applies action `i` to a fresh pool and
# updates the block grid, the block tables and the queue view **in place** (the same widgets, new values). In
# the grid, labels are `request[logical index]`: `C[0]` on block 0 means "C's first block lives in physical
# block 0".
#
# Press **Step** a few times, or ▶ (the cells below drive the same widgets from code, so after Run All the views
# show the last step: press **Reset** to start over).

# %%
from IPython.display import display

from minienv.viz import BlockCell, BlockGrid, BlockTableView, QueueView, Stepper, panel


def snapshot(pool):
    """The pool as plain BlockCell records: what the grid draws (any allocator can produce these)."""
    cells = []
    for block in range(pool.num_blocks):
        holders = pool.holders(block)
        if not holders:
            continue
        label = "+".join(f"{r}[{pool.tables[r].index(block)}]" for r in holders)
        cells.append(BlockCell(block, owner=holders, refcount=pool.refcount[block], label=label))
    return cells


grid = BlockGrid(8, columns=8, cell_px=66, title="KV pool (8 blocks)")
tables = BlockTableView(title="block tables", num_blocks=8, colors_from=grid, cell_px=66)
queue = QueueView(title="free queue", head_label="head → allocated next")


def used_refcounts(pool):
    return {b: rc for b, rc in enumerate(pool.refcount) if rc > 0}


def on_reset():
    global live_pool
    live_pool = ToyPool(8)
    grid.reset(caption="empty")
    tables.reset()
    queue.reset(list(live_pool.free))


def on_step(i):
    caption = apply(live_pool, ACTIONS[i])
    grid.update(snapshot(live_pool), caption=f"step {i + 1}: {caption}")
    tables.update(live_pool.tables, refcounts=used_refcounts(live_pool), caption=f"step {i + 1}")
    queue.update(list(live_pool.free), caption=f"step {i + 1}")
    return caption


stepper = Stepper(on_step, on_reset, n_steps=len(ACTIONS), interval_ms=900)
stepper.reset()
demo = panel(stepper, grid, tables, queue)
demo

# %%
# code takes over: step to where C has just shared A's block, and check the views against the allocator
stepper.go_to(4)  # arrive A, arrive B, C shares A's block, C grows
assert live_pool.tables == {"A": [0, 1, 2], "B": [3, 4], "C": [0, 5]}
assert live_pool.refcount[0] == 2 and list(live_pool.free) == [6, 7]  # block 0 is held twice; 6 is taken next
# every view shows exactly the allocator's state
assert [c.refcount for c in grid.cells] == live_pool.refcount
assert grid.cells[0].owners == ("A", "C") and grid.changed == {5}  # the last step (C grows) touched block 5 only
assert tables.tables == {"A": (0, 1, 2), "B": (3, 4), "C": (0, 5)} and tables.changed == {("C", 1)}
assert queue.items == (6, 7) and queue.head == 6 and queue.removed == (5,)  # block 5 just left the queue
print("step 4 checks passed")

# %% [markdown]
# For readers without a kernel, here is the same state as a static picture:

# %%
display(grid.static(), tables.static(), queue.static())

# %% [markdown]
# Now to the end of the sequence. Every block must be free again, the free queue must hold all eight blocks in
# the order they were freed, and the grid must agree with the allocator block for block.

# %%
# NBVAL_CHECK_OUTPUT
taken = stepper.run()
assert stepper.done and stepper.position == len(ACTIONS) and taken == len(ACTIONS) - 4
assert live_pool.tables == {} and live_pool.refcount == [0] * 8
assert list(live_pool.free) == [3, 6, 2, 1, 4, 7, 5, 0]
assert all(c.state == "free" for c in grid.cells) and tables.tables == {}
assert grid.changed == {0, 4, 5, 7}  # C's four blocks came back in the last step
assert queue.items == tuple(live_pool.free) and queue.added == (4, 7, 5, 0)
print("free queue after the demo, head first:", list(queue.items))
print("blocks that changed in the last step:", sorted(grid.changed))

# %%
display(grid.static(), queue.static())

# %% [markdown]
# Two things to notice, both of which come back later in the series:
#
# - **The queue order is the eviction order.** Blocks return to the tail, so the head is the block that has
#   been free longest. In notebook 06 freed blocks keep their contents (*cached-free*), and the head of this
#   same queue is the block evicted next: that is LRU eviction for free.
# - **A refcount decides when a block is free, not its first owner.** Block 0<!--out:above--> stayed in use after A
#   finished, because C held it too. Getting this wrong — freeing a block someone still reads — is the bug the naive
#   design ships (notebook 05).
#
# ## Exercises
#
# Every notebook ends with exercises that work the same way:
#
# - the exercise cell holds a **stub** that raises `NotImplementedError`: replace its body with your code;
# - the **check** cell below it runs your function on many cases. Until you write it, it prints *not implemented
#   yet* (so Run All never fails on an unsolved exercise); a wrong answer stops with `ExerciseFailed: ✗ <the rule
#   it broke>` and the case that shows it; a right one prints `✓`;
# - **hints** are folded under the check, weakest first: open one at a time;
# - **solutions** are in `solutions/00_tour.py` (one file per notebook), outside the notebook on purpose.
#
# The checks are `minienv/exercises/` — the test suite runs each one against its solution, against typical wrong
# answers and against the stub you see here. If the kernel is in a strange state (a pool you changed by hand,
# say), *Kernel → Restart and Run All* starts clean.
#
# ### Exercise 1: which blocks does the next request get?
#
# Write `next_blocks(pool, n)`: the block ids the next `pool.allocate(req, n)` will take, in order. Rules:
# (1) allocation takes the **head** of the free queue first, in queue order; (2) it only predicts: the pool must
# not change.

# %%
from minienv.exercises.tour import check_next_blocks, check_release


def next_blocks(pool, n):
    """The ids ``pool.allocate(req, n)`` would take, in order, without changing ``pool``."""
    raise NotImplementedError("your code here")


# %%
check_next_blocks(next_blocks)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `pool.free` is an `OrderedDict` whose keys are the free blocks, head first. What does `allocate` do with it?
# </details>
#
# <details><summary>Hint 2</summary>
#
# `allocate` calls `popitem(last=False)` — that changes the pool. Read the keys instead: `list(pool.free)` is a
# copy, head first.
# </details>
#
# ### Exercise 2: give a request's blocks back
#
# Write `release(pool, req)`, the toy pool's `release` — the one method the demo borrowed from minienv — from the
# rules: (1) the request's block table is removed; (2) each of its blocks loses exactly one reference; (3) a block
# goes back to the free queue only when its refcount reaches 0 — another request may still read it; (4) freed
# blocks join the **tail** of the queue, the table's **last** block first. The check replays the demo (and a longer sequence where three
# requests share blocks) with your `release` and compares the whole pool after every step.

# %%
def release(pool, req):
    """Give back ``req``'s blocks: refcount -1 each, last block first; at refcount 0 to the free queue's tail."""
    raise NotImplementedError("your code here")


# %%
check_release(release)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `pool.tables.pop(req)` removes the table and gives you its blocks in logical order.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Walk `reversed(...)` of that list. Appending a key to an `OrderedDict` (`pool.free[block] = None`) puts it at
# the tail.
# </details>
#
# <details><summary>Hint 3</summary>
#
# Why last block first? When a cached chain of blocks is evicted from the head of the queue later (notebook 06),
# its tail goes first and its first block — the one other prompts are most likely to share — stays longest.
# </details>

# %% [markdown]
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if the free queue were a stack — freed blocks pushed on the head? Which block would the next request get,
#   and what would that do to the chance that a finished request's blocks are still there when the same prompt comes
#   back (notebook 06 measures it)?
#
# ## Where this lives in vLLM / SGLang
#
# The toy above is the skeleton of real code. Open these files next to notebooks 04–08:
#
# | idea | vLLM v0.11.0 (v1 engine) | SGLang v0.5.3 |
# |---|---|---|
# | pool of blocks, free queue, allocate / free, refcounts | [`vllm/v1/core/block_pool.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/block_pool.py) (`BlockPool.get_new_blocks`, `free_blocks`, `touch`) | [`python/sglang/srt/mem_cache/allocator.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/allocator.py) (token / page allocators) |
# | the free queue as a doubly linked list (O(1) removal from the middle) | [`vllm/v1/core/kv_cache_utils.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/kv_cache_utils.py) (`FreeKVCacheBlockQueue`, `KVCacheBlock.ref_cnt`) | — |
# | block tables per request, prefix-cache hits, allocation for a step | [`vllm/v1/core/kv_cache_manager.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/kv_cache_manager.py) (`KVCacheManager.allocate_slots`) | [`python/sglang/srt/mem_cache/memory_pool.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/memory_pool.py) (`ReqToTokenPool`) |
# | prefix sharing and eviction | block hashes + the free queue (`block_pool.py`, `kv_cache_utils.py`) | [`python/sglang/srt/mem_cache/radix_cache.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/radix_cache.py) (`RadixCache.match_prefix`, `evict`, lock refs) |
# | the scheduler that calls all of this every step | [`vllm/v1/core/sched/scheduler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/sched/scheduler.py) (`Scheduler.schedule`) | [`python/sglang/srt/managers/scheduler.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/scheduler.py) |
#
# vLLM's queue is the same idea as `ToyPool.free`: allocate from the head, free to the tail, a refcount per
# block. SGLang organises the shared prefixes as a radix tree of token sequences instead of a chain of block
# hashes; both evict least recently used first, and neither evicts what a running request still uses.
#
# ## Summary
#
# - The engine is five boxes: tokenizer → scheduler → PagedAttention manager (block tables, free list) → KV
#   cache manager (prefix-aware refcounter, token-budget LRU evictor) → model core. Notebooks 01–08 build them
#   in that spirit, one box at a time.
# - A paged KV cache is a pool of fixed-size blocks, a block table per request, a refcount per block and a free
#   queue whose head is taken next. Ten lines of Python hold the whole idea; the rest of the series makes it
#   fast, shared, evictable and scheduled — and proves it correct.
# - The live views (`BlockGrid`, `QueueView`, `Stepper` in `minienv.viz`) draw plain snapshots of any
#   allocator, update in place, outline what changed, and have a static picture for GitHub readers. Every view
#   is followed by `assert`s that check it against the state it draws.

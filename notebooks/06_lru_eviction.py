# %% [markdown]
# # 06 · The token-budget LRU evictor: which cached block goes first
#
# Notebook 05 kept a finished request's blocks **cached-free**: refcount 0, K/V and hash kept, findable by the next
# request with the same prefix. But memory is finite. The KV budget (in tokens) bounds *everything resident* —
# blocks in use **and** cached-free blocks — so when a new block is needed and no free-empty block is left, some
# cached block's contents must go. Which one, and how do we make sure it is never a block someone is still using?
#
# **Learning goals.** After this notebook you can
# 1. explain why eviction **is** allocation: a cached-free block's hash leaves the prefix index in the same step it
#    is handed out, so it can never be found again while holding someone else's K/V;
# 2. read the **free queue** as the LRU order — head = evicted next, tail = most recently freed — and predict which
#    block is evicted next;
# 3. say why a block with refcount > 0 is **never** evicted, and show the naive design's evictor corrupting a running
#    request's text by doing exactly that;
# 4. explain why a request's blocks are freed **last block first** (a chain's tail is evicted before its parent);
# 5. measure the prefix-cache hit rate as a function of the budget for LRU, nano-vllm's free deque, and no cache.

# %% [markdown]
# ## The problem, with a number
#
# A seeded stream of 150 requests: half use one popular 96-token system prompt, the rest one of 60 other system
# prompts with a long tail (prompt `k` chosen with probability ∝ 1/k), each followed by its own question. Up to
# four requests run at a time, as many as the budget can hold. How many prompt tokens can be served from cache depends on how much KV memory may hold
# cached blocks:

# %%
# NBVAL_CHECK_OUTPUT
import numpy as np

from minienv.lab.eviction_experiments import hit_rate_sweep, popular_prefix_workload, simulate_cache

stream = popular_prefix_workload(150, seed=0)
BUDGETS = [256, 384, 512, 768, 1024, 2048, 4096, 8192]
sweep = hit_rate_sweep(stream, BUDGETS)  # every policy at every budget; the curves are drawn further down
unbounded = simulate_cache(stream, sum(len(r.prompt) + r.output_len + 16 for r in stream), "minienv LRU")
for run in (sweep["minienv LRU"][0], sweep["minienv LRU"][4], unbounded):
    print(f"KV budget {run.kv_budget_tokens:>6} tokens: prefix-cache hit rate {run.hit_rate:.1%}, "
          f"{run.prefill_tokens_computed} prompt tokens computed, {run.evicted_blocks} blocks evicted")
none = sweep["no caching"][4]
print(f"no prefix cache at all: hit rate {none.hit_rate:.1%}, {none.prefill_tokens_computed} prompt tokens computed")

# %% [markdown]
# A budget of 256 tokens (16 blocks of 16) holds one or two running requests, so little beyond what they hold can be
# hit; 1024 tokens keep a useful set of finished requests' blocks too. The order in which
# cached blocks are dropped decides which prefixes survive. The answer real engines converged on: drop the block
# that was **freed longest ago** — least recently used.
#
# ## Build it small: an LRU free queue in fifteen lines
#
# An `OrderedDict` is a hash map threaded on a doubly linked list: pop the head, append at the tail, and delete
# from the middle are all O(1). Three operations are all the evictor needs:

# %%
from collections import OrderedDict

free_q = OrderedDict((b, None) for b in range(6))  # block id -> None, head first; all free-empty at start
toy_hash = {}  # block -> hash of what it caches (a cached-free block keeps it)
toy_index = {}  # hash -> block (the prefix index)


def toy_allocate():
    """Take the head; if it caches something, that is the eviction: drop it from the index *now*."""
    block, _ = free_q.popitem(last=False)
    if block in toy_hash:
        del toy_index[toy_hash.pop(block)]
    return block


def toy_free(block, h):
    """Refcount reached 0: to the tail, still indexed (cached-free)."""
    toy_hash[block] = h
    toy_index[h] = block
    free_q[block] = None


def toy_hit(h):
    """A hit on a cached-free block takes it out of the middle of the queue."""
    block = toy_index[h]
    del free_q[block]
    return block


for name in "abcd":  # four "requests", one block each, freed in order a, b, c, d
    toy_free(toy_allocate(), name)
print("queue, head first:", list(free_q), "| cached:", {toy_hash[b]: b for b in free_q if b in toy_hash})
print("hit on 'a' takes block", toy_hit("a"), "from the middle ->", list(free_q))
taken = [toy_allocate() for _ in range(3)]
print("three allocations take", taken, "-> evicted:", sorted(set("abcd") - set(toy_index)),
      "| still indexed:", sorted(toy_index))
assert taken == [4, 5, 1] and sorted(toy_index) == ["a", "c", "d"]

# %% [markdown]
# The two free-empty blocks (4, 5) went first, then the least recently freed cached block (`b`); `a` was saved
# by its hit, `c` and `d` by being freed later. Dropping the index entry inside `toy_allocate` is the whole trick:
# there is no moment when a block is both reused and still findable.
#
# ## minienv's version
#
# `KVCacheManager` keeps exactly this in its `BlockPool` (`minienv/kv/block_pool.py`: the free queue is an
# `OrderedDict`), with three rules:
#
# * **only refcount-0 blocks are in the free queue**, so the evictor *cannot* pick a block in use — there is no
#   check to forget;
# * **allocation is eviction**: `_take_free_blocks` pops the head and, if it carries a hash, removes it from the
#   index in the same call (an `evict` event, counted in blocks and tokens);
# * **free goes last block first**: a chain's tail joins the queue ahead of its parent, so it is evicted first.
#
# When nothing is free or cached-free, allocation returns `None` and changes nothing — an expected outcome, not
# an error: the scheduler (notebook 07) then preempts a request or waits.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.kv import OutOfBlocksError  # the exercise's toy evictor raises it (misuse of a pool)
from minienv.kv.kv_cache_manager import KVCacheManager

B = 4
m = KVCacheManager(num_blocks=8, block_size=B)
m.allocate("A", list(range(13)))  # 13 tokens: 3 full blocks + 1
m.commit("A")
m.allocate("X", [90, 91, 92, 93, 94])  # 5 tokens: 1 full block + 1
m.commit("X")
print("A holds", m.block_ids("A"), "| X holds", m.block_ids("X"))
m.free("A")
print("A finished; free queue head first (block, cached?):", m.free_queue())
before = m.snapshot()
no_room = m.allocate("Y", list(range(200, 230)))  # 30 tokens = 8 blocks; X holds 2 of the 8
print("30 tokens need 8 blocks, X holds 2 -> allocate returned", no_room)
assert no_room is None and m.snapshot() == before  # all or nothing
y = m.allocate("Y", list(range(200, 222)))  # 22 tokens = 6 blocks: 2 free-empty, A's partial block, 3 evictions
m.commit("Y")
s = m.stats()
print("Y took", m.block_ids("Y"), f"-> evicted {s.evicted_blocks} blocks ({s.evicted_tokens} tokens)")
print("A's prompt now hits", m.lookup(list(range(13))).num_cached_tokens, "tokens; free queue:", m.free_queue())
m.check_invariants()

# %%
assert s.evicted_blocks == 3 and m.lookup(list(range(13))).num_cached_tokens == 0
assert not set(m.block_ids("X")) & set(m.block_ids("Y"))  # X's blocks (in use) were never candidates

# %% [markdown]
# A's four blocks went to the queue's tail as `3, 2, 1, 0` — last block first. Y took the two free-empty blocks at
# the head, then A's blocks in queue order: the partial block 3 (no hash, nothing to evict), then 2, 1, 0 — the
# tail of A's chain before its parent. X's blocks were never in the queue at all.
#
# ## Live: a budget slider and a request stream
#
# Twelve requests run two at a time. Each starts with a two-block system prompt — four different ones: one shared
# by `r0`, `r7`, `r8`, `r11`, one by `r1`, `r4`, `r5`, `r6`, `r9` — then its own question. Pick a KV budget
# with the slider, then **Step** or ▶: the grid shows who holds each block (`·rcN` = refcount), the queue below it
# is the free queue in LRU order with its **head** marked; each step's evictions are drawn leaving the queue in
# red. Small budgets evict cached system prompts before they are used again; larger ones keep them.

# %%
import ipywidgets as widgets

from minienv.lab.eviction_experiments import CacheStream
from minienv.viz import Stepper
from minienv.viz.kv_views import ManagerView

live_requests = popular_prefix_workload(12, popular_share=0.3, prefix_len=8, num_tail_prefixes=3,
                                        question_mean=4, output_mean=3, vocab=50, seed=3)
budget_slider = widgets.IntSlider(value=64, min=48, max=128, step=16, description="KV budget (tokens)",
                                  style={"description_width": "initial"}, continuous_update=False)
live = {}  # the current manager, stream and view


def live_reset():
    budget = budget_slider.value
    mgr = KVCacheManager.from_budget(budget, B)
    if "view" not in live or live["view"].grid.num_blocks != mgr.num_blocks:
        live["view"] = ManagerView(mgr, title=f"KV pool: {budget} tokens = {mgr.num_blocks} blocks of {B}",
                                   columns=16, cell_px=56)
        live_box.children = [budget_slider, live_stepper.widget, live["view"].widget]
    else:
        live["view"].attach(mgr)
    if "stream" in live:
        live["stream"].close()
    live["mgr"], live["stream"] = mgr, CacheStream(live_requests, mgr, max_running=2)
    live["log"] = []


def live_step(i):
    stream, view = live["stream"], live["view"]
    queue_before = [b for b, _ in live["mgr"].free_queue()]
    caption = stream.step()
    if caption is None:
        return False
    live["mgr"].check_invariants()
    view.update(caption=caption)
    live["log"].append((queue_before, view.last_evicted, view.queue.evicted, [b for b, _ in live["mgr"].free_queue()]))
    return caption


live_box = widgets.VBox()
live_stepper = Stepper(live_step, live_reset, n_steps=None, interval_ms=900, description="engine step")
budget_slider.observe(lambda change: live_stepper.reset(), names="value")
live_stepper.reset()
live_box

# %% [markdown]
# Then the code takes over: for every budget on the slider, run the stream to the end and check what the views
# showed — every eviction came from the head side of the queue (each block ahead of it was taken too), the queue
# view highlighted exactly the evicted blocks, and no block a running request held was ever evicted.

# %%
# NBVAL_CHECK_OUTPUT
assert [r.prefix_id for r in live_requests] == [0, 1, 2, 3, 1, 1, 1, 0, 0, 1, 2, 0]  # as described above
results = {}
for budget in (48, 64, 96, 128):
    budget_slider.value = budget  # the observer resets the stepper with a new manager
    live_stepper.run()
    st = live["stream"]
    assert live_stepper.done and st.done and st.evicted_in_use == []
    for queue_before, evicted, highlighted, queue_after in live["log"]:
        assert set(highlighted) <= set(evicted)  # the queue view drew exactly evicted blocks as evictions
        for b in evicted:  # LRU: every block ahead of an evicted one left the queue in the same step
            ahead = queue_before[: queue_before.index(b)] if b in queue_before else queue_before
            assert not set(ahead) & set(queue_after), (budget, b, queue_before, queue_after)
    results[budget] = (len(st.evictions), sum(st.hits.values()), st.mgr.stats().prefix_hit_rate)
    print(f"budget {budget:>3} tokens: {results[budget][0]:>2} blocks evicted, {results[budget][1]:>2} prompt tokens "
          f"hit ({results[budget][2]:.0%})")
budget_slider.value = 64

# %%
evictions = [results[b][0] for b in sorted(results)]
hits = [results[b][1] for b in sorted(results)]
assert evictions == sorted(evictions, reverse=True) and evictions[0] > evictions[-1]  # more budget, fewer evictions
assert hits == sorted(hits) and hits[-1] > hits[0]  # ... and more hits
assert live["view"].queue.head == live["mgr"].free_queue()[0][0]  # the marked head is the queue's head

# %% [markdown]
# For readers without a kernel, the pool at the 64-token budget, at the step with the most evictions:

# %%
live_stepper.reset()
live_stepper.run()
busiest = max(range(len(live["log"])), key=lambda i: (len(live["log"][i][1]), -i))
live_stepper.go_to(busiest + 1)
live["view"].static()

# %%
assert live["view"].last_evicted and set(live["view"].queue.evicted) <= set(live["view"].last_evicted)
assert "head" in live["view"].queue.to_svg()

# %% [markdown]
# ## The naive evictor: a running request's text, corrupted
#
# The naive design's `TokenBudgetLRUEvictor` (as it circulates in tutorials) keeps used tokens under the budget by
# evicting the least recently used block — **any** block. Request A is decoding when request B arrives under a
# budget that holds one of them: the naive evictor takes A's oldest blocks *while A is running*, hands them to B,
# B's prefill overwrites their K/V, and A keeps decoding over B's K/V.
# `minienv.lab.naive_design.demo_evictor_damage` runs the naive classes (`PagedAttentionManager` +
# `TokenBudgetLRUEvictor`) and our manager on the model, and measures A's logits at every step against the dense
# model's logits **for the same tokens** — so the damage shows even on prompts where no greedy token happens to flip
# (a small model often shrugs off a few corrupted blocks for a token or two).

# %%
from minienv.lab.naive_design import demo_evictor_damage
from minienv.lab.serving import load_demo_model

demo = load_demo_model()
prompt_a = demo.encode("JULIET.\nO Romeo, Romeo,")
prompt_b = demo.encode("FIRST CITIZEN.\nBefore we proceed any further, hear me speak.")
ev = demo_evictor_damage(demo.model, prompt_a, prompt_b, block_size=B, max_new_tokens=8, b_arrives_after=3)
print(f"model: {demo.name}; budget {ev.kv_budget_tokens} tokens; B arrives after A's token {ev.b_arrives_after}")
print(f"naive: evicted A's in-use blocks {list(ev.naive_evicted_in_use)}; B's table now names A's blocks "
      f"{list(ev.naive_overwritten)}")
print(f"A, alone (reference): {demo.decode(list(ev.reference_ids))!r}")
print(f"A, naive design:      {demo.decode(list(ev.naive_ids))!r}   text changed: {ev.naive_ids != ev.reference_ids}")
print(f"A, minienv:           {demo.decode(list(ev.ours_ids))!r}   B refused while A ran: {ev.ours_b_refused}")

# %%
import plotly.graph_objects as go

from minienv.viz.static import show  # every figure: live, with a PNG of it for readers without a kernel

steps = list(range(1, len(ev.naive_logit_error) + 1))
damage = go.Figure([go.Bar(x=steps, y=ev.naive_logit_error, name="naive evictor"),
                    go.Bar(x=steps, y=ev.ours_logit_error, name="minienv")])
damage.add_vline(x=ev.b_arrives_after + 0.5, line_dash="dash", annotation_text="B arrives")
damage.update_layout(title="request A: max |served logits − dense logits of the same tokens|", barmode="group",
                     xaxis_title="A's output token", yaxis={"title": "max logit error", "type": "log"}, height=330,
                     margin={"t": 50, "b": 40})
show(damage)

# %%
k = ev.b_arrives_after
assert ev.naive_evicted_in_use and ev.naive_overwritten  # the naive evictor handed a running request's blocks to B
assert max(ev.naive_logit_error[:k]) < 1e-4 < 1e-2 < min(ev.naive_logit_error[k:])  # fine until B's prefill, then wrong
assert ev.naive_ids != ev.reference_ids  # ... and on this pair of prompts the text changes, too
assert max(ev.ours_logit_error) < 1e-4 and ev.ours_ids == ev.reference_ids and ev.ours_b_refused
assert [t.name for t in damage.data] == ["naive evictor", "minienv"]

# %% [markdown]
# The fix is structural, not a check: a block enters the free queue only when its refcount reaches 0, and the
# evictor only ever looks at the free queue. There is no code path by which a block in use can be evicted.
#
# ## Hit rate vs budget: LRU, nano-vllm's free deque, no cache
#
# **nano-vllm** (`nanovllm/engine/block_manager.py`) keeps `free_block_ids`, a `collections.deque`. It allocates
# `free_block_ids[0]` (the left end) and, when a request finishes, walks its block table **in reverse** and
# `append`s each block whose refcount reaches 0 to the right — keeping its hash and token ids. Its
# `hash_to_block_id` dict is never cleaned on reuse; a hit additionally requires the block's own token ids to match,
# so a reused block just stops matching. A hit on a freed block takes it out of the middle with `deque.remove` —
# O(n). So the deque is ordered by **when blocks were freed** ("FIFO of frees"), and a freed block that is hit and
# freed again moves to the back. `minienv.lab.eviction_experiments.NanoVLLMBlockManager` reproduces that policy; we run
# it, our LRU, and no caching on the 150-request stream from the top, at budgets from 256 tokens up (the sweep
# was computed in the first cell of this notebook).

# %%
# NBVAL_CHECK_OUTPUT
from minienv.lab.eviction_experiments import format_hit_rate_table

ceiling = unbounded.hit_rate
print(format_hit_rate_table(sweep))
print(f"{'unbounded':>18} {ceiling:>24.1%}   (every block ever computed stays cached)")

# %%
fig = go.Figure()
for policy, dash in zip(sweep, ("solid", "dot", "dash")):
    fig.add_trace(go.Scatter(x=BUDGETS, y=[100 * s.hit_rate for s in sweep[policy]], name=policy,
                             mode="lines+markers", line={"dash": dash}))
fig.add_hline(y=100 * ceiling, line_dash="dot", line_color="grey", annotation_text="unbounded budget")
fig.update_layout(title="prefix-cache hit rate vs KV budget (150 requests, popular system prompt + long tail)",
                  xaxis={"title": "KV budget (tokens)", "type": "log"}, yaxis={"title": "hit rate (% of prompt tokens)"},
                  height=380, margin={"t": 50, "b": 40})
show(fig)

# %%
lru_rates = [s.hit_rate for s in sweep["minienv LRU"]]
nano_rates = [s.hit_rate for s in sweep["nano-vllm FIFO-of-frees"]]
assert [t.name for t in fig.data] == list(sweep) and len(fig.data[0].x) == len(BUDGETS)
assert all(s.hit_rate == 0 for s in sweep["no caching"])
assert lru_rates == sorted(lru_rates) and lru_rates[-1] > lru_rates[0] + 0.2  # budget buys hits
assert max(abs(a - b) for a, b in zip(lru_rates, nano_rates)) < 0.01  # same eviction order
assert lru_rates[-1] <= ceiling + 1e-9 and ceiling - lru_rates[-1] < 0.05

# %% [markdown]
# **The two caching curves coincide**, and that is the lesson: nano-vllm's deque *is* an LRU-by-release queue.
# Allocate from the left, append frees on the right in reverse table order, pull a hit block out of the middle —
# that is exactly vLLM v1's `FreeKVCacheBlockQueue`, and ours. What differs is not the policy but the engineering:
# `deque.remove` on a hit is O(n) in the number of free blocks (ours, an `OrderedDict`, is O(1)); stale entries
# linger in `hash_to_block_id`; and a prompt whose every block is cached is hit *in full* (nano-vllm #144), while
# ours recomputes the last token. Even the smallest budget hits the popular prompt often — half the requests use
# it, so it is usually held by a running request or was freed a moment ago — and the budget buys the **tail**: the
# rarer system prompts survive between their uses only if enough cached-free blocks are kept. Without a prefix cache, every prompt
# token is computed.
#
# ## A chain's tail is evicted before its parent (LMCache #443)
#
# A cached prefix is only usable from its first block on: block `j` can be hit only if blocks `0 … j−1` are hit.
# If eviction removes a *middle* block, every block after it still takes memory but can never be found again.
# Freeing a request's blocks **last block first** puts the tail at the head of the queue, so eviction eats a
# cached chain from its end.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.lab.eviction_experiments import usable_prefix_after_evictions

chain_prompt = list(range(300, 321))  # 21 tokens: 5 full blocks + 1
c = KVCacheManager(6, B)
c.allocate("R", chain_prompt)
c.commit("R")
logical = {b: j for j, b in enumerate(c.block_ids("R"))}
c.free("R")
print("R's blocks in logical order:", list(logical), "-> free queue after free:", [b for b, _ in c.free_queue()])
c.evict(2)
print(f"evict 2 (minienv, tail first): lookup of R's prompt still hits {c.lookup(chain_prompt).num_cached_tokens} "
      f"tokens = {c.lookup(chain_prompt).num_cached_tokens // B} blocks")
for tail_first in (True, False):
    gone, usable, stranded = usable_prefix_after_evictions(5, 2, tail_first=tail_first)
    print(f"  free {'last block first ' if tail_first else 'first block first'}: evicts logical blocks {gone}, "
          f"{usable} blocks still usable, {stranded} stranded (in memory, unreachable)")
c.check_invariants()

# %%
assert c.lookup(chain_prompt).num_cached_tokens == 3 * B
assert usable_prefix_after_evictions(5, 2, tail_first=True)[1:] == (3, 0)
assert usable_prefix_after_evictions(5, 2, tail_first=False)[1:] == (0, 3)

# %% [markdown]
# ## Break it yourself
#
# `minienv.lab.break_it` is minienv's manager with one switch per classic bug. Set `BUG` to one of this chapter's
# (`free_head_first`, `evict_in_use`), predict which proof fails, and run the cell: it runs the series' proofs on
# the **real engine** (the manager goes in through `InferenceEngine(kv_cache_manager_factory=...)`) and on the
# manager, and prints which still hold.

# %%
from minienv.lab import break_it

BUG = None  # try "free_head_first" or "evict_in_use"
for result in break_it.run_proofs(BUG).values():
    print(f"{'✓' if result.holds else '✗'} {result.name:<14} {result.detail}")

# %% [markdown]
# <details><summary>Which proof each bug breaks, and why (after you tried)</summary>
#
# * `free_head_first` — outputs stay right, but a freed chain now sits in the queue head-first, so eviction
#   takes its *first* block and strands the rest: cached blocks no lookup can reach (`invariants`: "parent block
#   would be evicted before its child").
# * `evict_in_use` — a prefix hit on a cached-free block leaves it in the free queue; the next allocation takes
#   it from under the request using it (`invariants`: refcount 1 but in the free queue), and the engine ends up
#   freeing a block twice (`outputs`: the crash is the proof failing).
# </details>

# %%
# NBVAL_CHECK_OUTPUT
broken = {bug: sorted(n for n, r in break_it.run_proofs(bug).items() if not r.holds) for bug in ("free_head_first", "evict_in_use",)}
for bug, names in broken.items():
    print(f"{bug:<20} breaks: {', '.join(names)}")
assert broken == {'free_head_first': ['invariants'], 'evict_in_use': ['invariants', 'outputs']}

# %% [markdown]
# ## The traps of this layer
#
# | trap | what went wrong | the lesson, in one sentence |
# |---|---|---|
# | naive design: evictor ignores refcounts | evicted a block a running request still used → its text changed | Evict only from the free queue, which holds **only refcount-0 blocks**. |
# | naive design: `free_list.pop(0)` | a list used as a queue: O(n) per allocation | The free queue needs O(1) pop-head, append-tail **and remove-from-middle** (a hit). |
# | vLLM PR #4761 | a block popped for reuse stayed in the cached-block index → "hit" while holding new K/V | Drop the hash from the index **in the same step** the block is handed out. |
# | LMCache #443 | evicting a middle block strands its descendants | Free **last block first**, so a chain is evicted from its tail. |
# | SGLang #35270 | evictable size counted shared pages once per holder → a false "leak" | Count each **physical** block once; resident = in use + cached-free ≤ budget. |
# | vLLM PR #3347 | a double free put a block in the free queue twice | Freeing an unknown request is a typed error that **changes nothing**. |
# | (by design) | nothing evictable | Allocation returns `None`, all or nothing, and the scheduler preempts. |

# %%
from minienv.kv.kv_cache_manager import UnknownRequestError
from minienv.lab.naive_design import demo_pop0_timing

trap = {}
pop0 = demo_pop0_timing(sizes=(1_000, 100_000), ops=1_000, repeats=2)  # timings: printed, never checked by nbval
print("ns per allocate+free at", pop0.sizes, "blocks: naive list", [f"{x:.0f}" for x in pop0.naive_ns_per_op],
      "| minienv", [f"{x:.0f}" for x in pop0.ours_ns_per_op])
trap["pop(0) grows with the pool, ours flat"] = pop0.naive_growth > 5 and pop0.ours_growth < pop0.naive_growth / 3
t = KVCacheManager(4, B)
t.allocate("P", list(range(8)))
t.commit("P")
t.free("P")  # 2 cached-free blocks
t.allocate("Q", list(range(50, 62)))  # 3 blocks: 2 free-empty + evicts 1 cached
trap["#4761 evicted hash left the index"] = t.lookup(list(range(9))).num_cached_tokens == 4 and len(t.index) == 1
t.check_invariants()
t2 = KVCacheManager(6, B)
for r in ("a", "b"):
    t2.allocate(r, list(range(9)))
    t2.commit(r)
    t2.free(r)
st = t2.stats()
trap["#35270 shared blocks counted once"] = (st.num_cached_free, st.num_in_use, st.num_free_empty) == (2, 0, 4)
before = t2.snapshot()
try:
    t2.free("a")
except UnknownRequestError:
    trap["#3347 double free changes nothing"] = t2.snapshot() == before
t3 = KVCacheManager(3, B)
t3.allocate("big", list(range(10)))
before = t3.snapshot()
trap["nothing evictable: None, no change"] = (t3.allocate("more", list(range(100, 105))) is None
                                              and t3.snapshot() == before)
trap["naive evictor corrupted A, ours never"] = (min(ev.naive_logit_error[k:]) > 1e-2
                                               and max(ev.ours_logit_error) < 1e-4)
trap["#443 tail evicted before parent"] = c.lookup(chain_prompt).num_cached_tokens == 3 * B
for name, ok in trap.items():
    print(f"{name:<44} {'ok' if ok else 'FAILED'}")

# %%
assert all(trap.values()) and len(trap) == 7

# %% [markdown]
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/06_lru_eviction.py` — is explained in notebook 00.)
#
# ### Exercise 1: predict the next evictions
#
# Given the free queue head first, as `KVCacheManager.free_queue()` returns it (`(block id, is_cached)` pairs),
# write `my_evictions(free_queue, n)`: the block ids whose cached contents are evicted when a request allocates `n`
# new blocks. Rules: (1) an allocation of `n` blocks takes the first `n` blocks of the queue, head first;
# (2) a free-empty block holds nothing, so taking it evicts nothing; (3) every cached block among those taken is
# evicted, in queue order. The check builds random managers, asks you, then lets the real manager allocate and
# compares with the `evict` events it emits.

# %%
from minienv.exercises.lru_eviction import check_evictions, check_safe_victims


def my_evictions(free_queue, n):
    """Ids of the cached blocks evicted by allocating n blocks, in eviction order."""
    raise NotImplementedError("your code here")


# %%
check_evictions(my_evictions)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Which blocks does the allocation take? Slice the list.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Of those, keep the ids whose `is_cached` flag is true — a list comprehension with a condition.
# </details>
#
# A common wrong answer evicts the *most recently* freed blocks (the tail) — the check names the rule:

# %%
from minienv.exercises import ExerciseFailed


def wrong_evictions(free_queue, n):
    return [block for block, cached in free_queue[::-1][:n] if cached]


try:
    check_evictions(wrong_evictions)
    raise RuntimeError("the check should have rejected wrong_evictions")
except ExerciseFailed as err:
    print("rejected:", str(err).splitlines()[0])

# %% [markdown]
# ### Exercise 2: fix the naive evictor
#
# The naive `TokenBudgetLRUEvictor` kept an LRU order of *all* blocks and popped victims from its front whatever
# their refcount. Write `safe_victims(lru_order, refcount, n)`: the first `n` blocks of `lru_order` (least recently
# used first) that **no request holds**. Rules: (1) never a block with refcount > 0; (2) victims in LRU order;
# (3) if fewer than `n` blocks are free, raise `OutOfBlocksError(n, free, total)` (imported above) instead of
# returning fewer — and refuse only then; (4) change nothing: the evictor only chooses.

# %%
def safe_victims(lru_order, refcount, n):
    """The n least recently used blocks nobody holds; OutOfBlocksError if there are fewer."""
    raise NotImplementedError("your code here")


# %%
check_safe_victims(safe_victims)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Filter first (refcount 0), then take `n`: filtering keeps the LRU order of what remains.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Build a new list instead of removing from `lru_order`; count before you return, and raise if short.
# </details>
#
# <details><summary>Hint 3</summary>
#
# minienv never needs this function: a block in use is never in its free queue at all, so "evict the head" is
# already safe. That is the design choice that removes the bug instead of guarding against it.
# </details>

# %% [markdown]
# ## Where this lives in vLLM / SGLang
#
# > **vLLM (v1)**
# > * `vllm/v1/core/kv_cache_utils.py` — `FreeKVCacheBlockQueue`: a hand-written doubly linked list of
# >   `KVCacheBlock`s with O(1) `popleft`, `append` and `remove` (the docstring states the order: least recently
# >   used first, and among blocks freed together the chain's tail first).
# > * `vllm/v1/core/block_pool.py` — `BlockPool.get_new_blocks` pops the head and calls `_maybe_evict_cached_block`,
# >   which drops the block's hash from `cached_block_hash_to_block` in the same call (the PR #4761 lesson);
# >   `touch` takes hit blocks out of the queue; `free_blocks` appends refcount-0 blocks to the tail;
# >   `reset_prefix_cache`.
# > * `vllm/v1/core/single_type_kv_cache_manager.py` — `free`: "Free blocks in reverse order so that the tail
# >   blocks are freed first" (`reversed(req_blocks)`).
# > * `vllm/v1/core/kv_cache_manager.py` — `allocate_slots` returns `None` when the blocks do not fit; the
# >   scheduler (`vllm/v1/core/sched/scheduler.py`) then preempts.
# >
# > **SGLang**
# > * `python/sglang/srt/mem_cache/radix_cache.py` — `RadixCache.evict(num_tokens)`: a heap of evictable
# >   **leaves** (nodes with `lock_ref == 0`), ordered by the eviction strategy; when a leaf goes, its parent may
# >   become a leaf — the tree form of "tail before parent"; `evictable_size_` counts unlocked tokens once.
# > * `python/sglang/srt/mem_cache/evict_policy.py` — `LRUStrategy` (`last_access_time`), `LFUStrategy`,
# >   `FIFOStrategy`, …: the priority the heap uses.
# >
# > **nano-vllm**: `nanovllm/engine/block_manager.py` — `BlockManager` with `free_block_ids: deque`, described above.

# %% [markdown]
# ## Summary
#
# * The token budget bounds **in-use + cached-free** blocks. Cached-free blocks are the cache; they are evicted
#   from the **head of the free queue**: least recently freed first.
# * **Eviction is allocation**: the head block's hash leaves the index in the same step it is handed out, so no
#   request can ever hit a block that now holds someone else's K/V.
# * A block in use is **never** in the free queue, so it can never be evicted — the naive evictor, which could,
#   corrupted a running request's text.
# * Blocks are freed **last block first**, so a cached chain is evicted from its tail and never stranded.
# * On a popular-prefix workload the hit rate grows with the budget from ~30 % to the unbounded ceiling; nano-vllm's
#   free deque gives the same curve (same order, O(n) hits); no caching gives 0.
# * When nothing is evictable, allocation fails with a typed error and changes nothing: notebook 07's scheduler
#   turns that into preemption.

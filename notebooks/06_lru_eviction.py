# %% [markdown]
# # 06 · The token-budget LRU evictor: which cached block goes first
#
# Notebook 05 kept finished requests' blocks **cached-free** (refcount 0, K/V and hash kept). The KV budget bounds
# blocks in use **and** cached-free ones, so when no free-empty block is left some cached block must go. Which one —
# and how is it never a block someone is still using?
#
# **Learning goals.** After this notebook you can
# 1. explain why eviction **is** allocation: the hash leaves the prefix index in the step the block is handed out;
# 2. read the **free queue** as the LRU order (head = evicted next) and predict the next evictions;
# 3. say why a block with refcount > 0 is **never** evicted, and show the naive evictor corrupting text by doing it;
# 4. explain why a request's blocks are freed **last block first** (a chain's tail goes before its parent);
# 5. measure the prefix-cache hit rate against the budget for LRU, nano-vllm's free deque, and no cache.

# %% [markdown]
# ## The problem, with a number
#
# 150 seeded requests: half use one popular 96-token system prompt, the rest one of 60 others (prompt `k` with
# probability ∝ 1/k), each with its own question; up to four run at a time. The hit rate depends on the budget.
#
# Serving the stream is a short loop (bookkeeping only, no model): each step every running request decodes one
# token or finishes — its blocks become cached-free, and the policy decides which go first — then waiting requests
# start, first come first served, while their whole life fits (`admits`, the only bookkeeping left to `lab`):

# %%
# NBVAL_CHECK_OUTPUT
from collections import deque

import numpy as np

from minienv.lab.eviction_experiments import (POLICIES, CacheRunStats, admits, popular_prefix_workload,
                                              simulate_cache)


def serve(stream, budget, policy, max_running=4, B=16):
    """Serve the stream under one eviction policy and KV budget (tokens); count the prefix-cache hits."""
    pol, waiting, running, computed = POLICIES[policy](budget // B, B), deque(range(len(stream))), {}, 0
    while waiting or running:
        for rid, n in list(running.items()):  # one step: every running request decodes a token, or finishes
            if n == stream[rid].output_len:
                pol.free(rid)  # its blocks turn cached-free, findable until the policy evicts them
                del running[rid]
            else:
                pol.append(rid, 1_000_000 + rid * 1000 + n)  # a token no other request has
                running[rid] = n + 1
        while waiting and len(running) < max_running and admits(pol, stream, waiting[0], running, B):
            rid = waiting.popleft()  # first come, first served
            computed += len(stream[rid].prompt) - pol.allocate(rid, stream[rid].prompt)  # a hit is not computed
            running[rid] = 0
    return CacheRunStats(policy, budget // B * B, pol.queries, pol.hits, pol.evicted_blocks, computed)


stream = popular_prefix_workload(150, seed=0)
BUDGETS = [256, 384, 512, 768, 1024, 2048, 4096, 8192]
sweep = {policy: [serve(stream, budget, policy) for budget in BUDGETS] for policy in POLICIES}  # drawn below
unbounded = serve(stream, sum(len(r.prompt) + r.output_len + 16 for r in stream), "minienv LRU")
assert all(sweep[p][i] == simulate_cache(stream, BUDGETS[i], p) for p in POLICIES for i in (0, 4))  # = the lab's
for run in (sweep["minienv LRU"][0], sweep["minienv LRU"][4], unbounded):
    print(f"KV budget {run.kv_budget_tokens:>6} tokens: prefix-cache hit rate {run.hit_rate:.1%}, "
          f"{run.prefill_tokens_computed} prompt tokens computed, {run.evicted_blocks} blocks evicted")
print(f"no prefix cache at all: {sweep['no caching'][4].prefill_tokens_computed} prompt tokens computed")

# %% [markdown]
# 256 tokens hold little beyond the running requests (a 31.4 %<!--out--> hit rate); 1024 keep many finished
# prefixes too (52.9 %<!--out-->), close to the 63.1 %<!--out--> of an unbounded cache. Which cached block goes
# first decides which prefixes survive; real engines drop the one **freed longest ago** — least recently used.
#
# ## Build it small: an LRU free queue in fifteen lines
#
# An `OrderedDict` pops the head, appends at the tail and deletes from the middle in O(1) — all the evictor needs:

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
# Free-empty blocks (4, 5) go first, then the least recently freed cached block (`b`); `a` was saved by its hit.
# Dropping the index entry inside `toy_allocate` is the trick: a block is never both reused and findable.
#
# ## minienv's version
#
# `KVCacheManager`'s `BlockPool` (`minienv/kv/block_pool.py`) keeps this `OrderedDict` with three rules: **only
# refcount-0 blocks are in the free queue** (the evictor *cannot* pick a block in use); **allocation is eviction**
# (`_take_free_blocks` drops the head's hash from the index in the same call, an `evict` event); **free goes last
# block first**. When nothing is free or cached-free, allocation returns `None` and changes nothing; the scheduler
# (notebook 07) then preempts or waits.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.kv import OutOfBlocksError  # the exercise's toy evictor raises it (misuse of a pool)
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import KVCacheManager


def admit(m, rid, tokens):
    """A request arrives: the manager reads its tokens (the request is ours), takes its hit, reserves the rest."""
    req = KVRequest(rid, tokens)
    alloc = m.allocate(req)
    if alloc is not None:
        req.num_computed_tokens = req.num_tokens  # (the model step writes the K/V here)
        m.commit(req)  # its full blocks become findable
    return alloc


B = 4
m = KVCacheManager(num_blocks=8, block_size=B)
admit(m, "A", list(range(13)))  # 13 tokens: 3 full blocks + 1
admit(m, "X", [90, 91, 92, 93, 94])  # 5 tokens: 1 full block + 1
a_blocks = m.block_ids("A")
print("A holds", a_blocks, "| X holds", m.block_ids("X"))
m.free("A")
print("A finished; free queue head first (block, cached?):", m.free_queue())
assert [b for b, _ in m.free_queue()][-len(a_blocks):] == a_blocks[::-1]  # freed last block first
before = m.snapshot()
no_room = admit(m, "Y", list(range(200, 230)))  # 30 tokens = 8 blocks; X holds 2 of the 8
print("30 tokens need 8 blocks, X holds 2 -> allocate returned", no_room)
assert no_room is None and m.snapshot() == before  # all or nothing
y = admit(m, "Y", list(range(200, 222)))  # 22 tokens = 6 blocks: 2 free-empty, A's partial block, 3 evictions
s = m.stats()
print("Y took", m.block_ids("Y"), f"-> evicted {s.evicted_blocks} blocks ({s.evicted_tokens} tokens)")
print("A's prompt now hits", m.lookup(list(range(13))).num_cached_tokens, "tokens; free queue:", m.free_queue())
m.check_invariants()
assert s.evicted_blocks == 3 and m.lookup(list(range(13))).num_cached_tokens == 0
assert not set(m.block_ids("X")) & set(m.block_ids("Y"))  # X's blocks (in use) were never candidates

# %% [markdown]
# A's blocks joined the tail as `3, 2, 1, 0` — last block first; Y took the two free-empty blocks, then A's partial
# block 3 (nothing to evict), then 2, 1, 0: the chain's tail before its parent. X's blocks were never in the queue.
#
# ## Live: a budget slider and a request stream
#
# Twelve requests run two at a time, each a two-block system prompt (`r0`, `r7`, `r8`, `r11` share one; `r1`, `r4`,
# `r5`, `r6`, `r9` another) plus a question. Pick a budget, then **Step** or ▶: below the pool, the free queue in LRU
# order, **head** marked, evictions in red. Small budgets evict system prompts before their next use.

# %%
import ipywidgets as widgets

from minienv.lab.eviction_experiments import CacheStream
from minienv.viz import Stepper
from minienv.viz.kv_views import ManagerView

live_requests = popular_prefix_workload(12, popular_share=0.3, prefix_len=8, num_tail_prefixes=3,
                                        question_mean=4, output_mean=3, vocab=50, seed=3)
budget_slider = widgets.IntSlider(value=64, min=48, max=128, step=16, description="KV budget (tokens)",
                                  style={"description_width": "initial"}, continuous_update=False)
live = {}  # the current view and stream

def live_reset():
    budget = budget_slider.value
    mgr = KVCacheManager.from_budget(budget, B)
    if "view" in live and live["view"].grid.num_blocks == mgr.num_blocks:
        live["view"].attach(mgr)
    else:  # another pool size needs another grid
        title = f"KV pool: {budget} tokens = {mgr.num_blocks} blocks of {B}"
        live["view"] = ManagerView(mgr, title=title, columns=16, cell_px=56)
        live_box.children = [budget_slider, live_stepper.widget, live["view"].widget]
    if "stream" in live:
        live["stream"].close()
    live["stream"] = CacheStream(live_requests, mgr, max_running=2)  # the requests' lives, step by step

def live_step(i):
    caption = live["stream"].step()  # None when every request has finished
    if caption is None:
        return False
    live["stream"].mgr.check_invariants()
    live["view"].update(caption=caption)
    return caption

live_box = widgets.VBox()
live_stepper = Stepper(live_step, live_reset, n_steps=None, interval_ms=900, description="engine step")
budget_slider.observe(lambda change: live_stepper.reset(), names="value")
live_stepper.reset()
live_box

# %% [markdown]
# The code runs the stream at every budget on the slider (`tests/unit/test_notebook_views.py` checks that the views
# drew exactly the evictions, from the queue's head side):

# %%
# NBVAL_CHECK_OUTPUT
assert [r.prefix_id for r in live_requests] == [0, 1, 2, 3, 1, 1, 1, 0, 0, 1, 2, 0]  # as described above
results = {}
for budget in (48, 64, 96, 128):
    budget_slider.value = budget  # the observer resets the stepper with a new manager
    live_stepper.run()
    st = live["stream"]
    assert live_stepper.done and st.done and st.evicted_in_use == []  # no block in use was ever evicted
    results[budget] = (len(st.evictions), sum(st.hits.values()), st.mgr.stats().prefix_hit_rate)
    print(f"budget {budget:>3} tokens: {results[budget][0]:>2} blocks evicted, {results[budget][1]:>2} prompt tokens "
          f"hit ({results[budget][2]:.0%})")
budget_slider.value = 64
evictions, hits = ([results[b][i] for b in sorted(results)] for i in (0, 1))
assert evictions == sorted(evictions, reverse=True) and evictions[0] > evictions[-1]  # more budget, fewer evictions
assert hits == sorted(hits) and hits[-1] > hits[0]  # ... and more hits

# %% [markdown]
# Without a kernel: the 64-token pool at the (first) step with the most evictions:

# %%
from collections import Counter

live_stepper.reset()
live_stepper.run()
per_step = Counter(step for step, _ in live["stream"].evictions)
live_stepper.go_to(min(per_step, key=lambda step: (-per_step[step], step)) + 1)
live["view"].static()

# %% [markdown]
# ## The naive evictor: a running request's text, corrupted
#
# The naive design's evictor (notebook 00) takes the least recently used block — **any** block. A is decoding when
# B arrives under a budget that holds one of them: B gets A's oldest blocks and overwrites them. Here is the whole
# run on the naive design — its manager, its evictor and one paged model step per call:

# %%
import numpy as np

from minienv.kv import KVPool, PagedAttentionBackend
from minienv.kv.block_table import cdiv
from minienv.lab.naive_design import PagedAttentionManager, TokenBudgetLRUEvictor, demo_evictor_damage, paged_step
from minienv.lab.serving import load_demo_model

demo = load_demo_model()
prompt_a = demo.encode("JULIET.\nO Romeo, Romeo,")
prompt_b = demo.encode("FIRST CITIZEN.\nBefore we proceed any further, hear me speak.")
budget = cdiv(max(len(prompt_a), len(prompt_b)) + 8, B) * B  # holds A or B alone, not both
backend = PagedAttentionBackend(KVPool.for_model(demo.model.config, budget, B))
naive_mgr, naive_evictor = PagedAttentionManager(budget // B, B), TokenBudgetLRUEvictor(budget, B)


def feed(rid, tokens):  # make room the naive way (any LRU block, in use or not), then run one model step
    naive_evictor.evict_if_needed(naive_mgr, len(tokens))
    naive_evictor.touch(naive_mgr.append_tokens(rid, len(tokens)))
    naive_evictor.touch(naive_mgr.block_tables[rid])  # the request's whole table is now the most recently used
    return paged_step(demo.model, backend, naive_mgr.block_tables[rid], tokens, naive_mgr.seq_lens[rid])


logits, a_out = feed("A", prompt_a), []
while len(a_out) < 8:
    a_out.append(int(np.argmax(logits)))  # greedy
    if len(a_out) == 3:
        feed("B", prompt_b)  # B arrives while A decodes: the evictor hands it A's oldest blocks
    if len(a_out) < 8:
        logits = feed("A", [a_out[-1]])
print(f"A on the naive design: {demo.decode(a_out)!r}")

# %% [markdown]
# `demo_evictor_damage` runs that same loop and minienv's, and compares A's logits with the dense model's **for the
# same tokens** (damage shows even where no token flips):

# %%
ev = demo_evictor_damage(demo.model, prompt_a, prompt_b, block_size=B, max_new_tokens=8, b_arrives_after=3)
assert list(ev.naive_ids) == a_out  # the loop above, exactly
print(f"model: {demo.name}; budget {ev.kv_budget_tokens} tokens; B arrives after A's token {ev.b_arrives_after}")
print(f"naive: evicted A's in-use blocks {list(ev.naive_evicted_in_use)}; B's table now names A's blocks "
      f"{list(ev.naive_overwritten)}")
print(f"A, alone (reference): {demo.decode(list(ev.reference_ids))!r}")
print(f"A, naive design:      {demo.decode(list(ev.naive_ids))!r}   text changed: {ev.naive_ids != ev.reference_ids}")
print(f"A, minienv:           {demo.decode(list(ev.ours_ids))!r}   B refused while A ran: {ev.ours_b_refused}")
k = ev.b_arrives_after
assert ev.naive_evicted_in_use and ev.naive_overwritten  # the naive evictor handed a running request's blocks to B
assert max(ev.naive_logit_error[:k]) < 1e-4 < 1e-2 < min(ev.naive_logit_error[k:])  # fine until B's prefill, then wrong
assert ev.naive_ids != ev.reference_ids  # ... and on this pair of prompts the text changes, too
assert max(ev.ours_logit_error) < 1e-4 and ev.ours_ids == ev.reference_ids and ev.ours_b_refused

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

# %% [markdown]
# The fix is structural: the evictor only looks at the free queue, which holds only refcount-0 blocks.
#
# ## Hit rate vs budget: LRU, nano-vllm's free deque, no cache
#
# **nano-vllm** (`nanovllm/engine/block_manager.py`) allocates from the left of a `deque` of free ids, appends a
# finished request's blocks to the right **in reverse** (hash kept), and pulls a hit block out with `deque.remove`
# — O(n). `NanoVLLMBlockManager` (`minienv.lab.eviction_experiments`) reproduces it; the first cell's sweep ran it:

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
                  xaxis={"title": "KV budget (tokens)", "type": "log"}, height=380, margin={"t": 50, "b": 40},
                  yaxis={"title": "hit rate (% of prompt tokens)"})
show(fig)
lru_rates = [s.hit_rate for s in sweep["minienv LRU"]]
nano_rates = [s.hit_rate for s in sweep["nano-vllm FIFO-of-frees"]]
assert all(s.hit_rate == 0 for s in sweep["no caching"])
assert lru_rates == sorted(lru_rates) and lru_rates[-1] > lru_rates[0] + 0.2  # budget buys hits
assert max(abs(a - b) for a, b in zip(lru_rates, nano_rates)) < 0.01  # same eviction order
assert lru_rates[-1] <= ceiling + 1e-9 and ceiling - lru_rates[-1] < 0.05

# %% [markdown]
# **The two caching curves coincide**: nano-vllm's deque *is* an LRU-by-release queue, like vLLM v1's and ours;
# only the engineering differs (O(n) `deque.remove` on a hit, ours O(1)). Even the smallest budget hits the popular
# prompt (31.4 %<!--out:above-->); more budget buys the **tail** of rarer prompts.
#
# ## Why a chain's tail must go before its parent (LMCache #184)
#
# Block `j` can be hit only if blocks `0 … j−1` are, so evicting a *middle* block strands every block after it:
# cached, in memory, unreachable. Freeing **last block first** (as `A` was above) queues a chain's last block ahead
# of its parents, so eviction eats a chain from its end. A 5-block chain freed together, then two evictions:

# %%
# NBVAL_CHECK_OUTPUT
from minienv.lab.eviction_experiments import usable_prefix_after_evictions

for tail_first in (True, False):
    gone, usable, stranded = usable_prefix_after_evictions(5, 2, tail_first=tail_first)
    print(f"free {'last block first ' if tail_first else 'first block first'}: evicts logical blocks {gone}, "
          f"{usable} blocks still usable, {stranded} stranded (in memory, unreachable)")
assert usable_prefix_after_evictions(5, 2, tail_first=True)[1:] == (3, 0)
assert usable_prefix_after_evictions(5, 2, tail_first=False)[1:] == (0, 3)

# %% [markdown]
# ## Break it yourself
#
# As in notebook 05: set `BUG` to one of this chapter's switches, predict which proof fails, and run the series'
# proofs on the **real engine**.

# %%
from minienv.lab import break_it

BUG = None  # try "free_head_first" or "evict_in_use"
for result in break_it.run_proofs(BUG).values():
    print(f"{'✓' if result.holds else '✗'} {result.name:<14} {result.detail}")

# %% [markdown]
# <details><summary>Which proof each bug breaks, and why (after you tried)</summary>
#
# * `free_head_first` — outputs stay right, but eviction takes a freed chain's *first* block and strands the rest
#   (`invariants`: "parent block would be evicted before its child").
# * `evict_in_use` — a hit leaves the block in the free queue; the next allocation takes it from under its user
#   (`invariants`: refcount 1 but in the free queue) and the engine frees it twice (`outputs`: the crash).
# </details>

# %%
# NBVAL_CHECK_OUTPUT
broken = {bug: sorted(n for n, r in break_it.run_proofs(bug).items() if not r.holds)
          for bug in ("free_head_first", "evict_in_use")}
for bug, names in broken.items():
    print(f"{bug:<20} breaks: {', '.join(names)}")
assert broken == {'free_head_first': ['invariants'], 'evict_in_use': ['invariants', 'outputs']}

# %% [markdown]
# ## The traps of this layer
#
# Sharing's traps (hashing, refcounts, fork, counting shared blocks) are notebook 05's; these are eviction's.
#
# | trap | what went wrong | the lesson, in one sentence |
# |---|---|---|
# | naive design: evictor ignores refcounts | evicted a block a running request still used → its text changed | Evict only from the free queue, which holds **only refcount-0 blocks**. |
# | naive design: `free_list.pop(0)` | a list used as a queue: O(n) per allocation | The free queue needs O(1) pop-head, append-tail **and remove-from-middle** (a hit). |
# | vLLM #4764 (the merged fix; #4761 and #4762 were closed unmerged) | block manager v2: a block popped from the evictor for reuse stayed in the cached-block index → found as "cached" while holding new K/V | Drop the hash from the index **in the same step** the block is handed out. |
# | [LMCache #184](https://github.com/LMCache/LMCache/issues/184) ("Evictor should consider relations between chunks") | its evictor updated a request's chunks first to last, so the **first** chunk was evicted first, leaving every later chunk cached but unusable | Free **last block first**, so a chain is evicted from its tail. |
# | (by design) | nothing evictable | Allocation returns `None`, all or nothing, and the scheduler preempts. |

# %%
from minienv.lab.naive_design import demo_pop0_timing

trap = {}
pop0 = demo_pop0_timing(sizes=(1_000, 100_000), ops=1_000, repeats=2)  # timings: printed, never checked by nbval
print("ns per allocate+free at", pop0.sizes, "blocks: naive list", [f"{x:.0f}" for x in pop0.naive_ns_per_op],
      "| minienv", [f"{x:.0f}" for x in pop0.ours_ns_per_op])
trap["pop(0) grows with the pool, ours flat"] = pop0.naive_growth > 5 and pop0.ours_growth < pop0.naive_growth / 3
t = KVCacheManager(4, B)
admit(t, "P", list(range(8)))
t.free("P")  # 2 cached-free blocks
t.allocate(KVRequest("Q", list(range(50, 62))))  # (not yet computed) 3 blocks: 2 free-empty + evicts 1 cached
trap["#4764 evicted hash left the index"] = t.lookup(list(range(9))).num_cached_tokens == 4 and len(t.index) == 1
t.check_invariants()
for name, ok in trap.items():  # the naive evictor, LMCache #184 and "nothing evictable" are proved above
    print(f"{name:<40} {'ok' if ok else 'FAILED'}")
assert all(trap.values()) and len(trap) == 2

# %% [markdown]
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/06_lru_eviction.py` — is explained in notebook 00.)
#
# ### Exercise 1: predict the next evictions
#
# Given `KVCacheManager.free_queue()` (head first, `(block id, is_cached)` pairs), write `my_evictions(free_queue,
# n)`: the ids whose cached contents an allocation of `n` blocks evicts. Rules: (1) it takes the first `n` blocks,
# head first; (2) taking a free-empty block evicts nothing; (3) every cached block taken is evicted, in queue order.
# The check compares with the real manager's `evict` events on random managers.

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

# %% [markdown]
# ### Exercise 2: fix the naive evictor
#
# The naive evictor popped victims from an LRU order of *all* blocks, whatever their refcount. Write
# `safe_victims(lru_order, refcount, n)`: the first `n` blocks of `lru_order` (least recently used first) that **no
# request holds**. Rules: (1) never a block with refcount > 0; (2) victims in LRU order; (3) if fewer than `n` are
# free, raise `OutOfBlocksError(n, free, total)` (imported above) — and refuse only then; (4) change nothing.

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
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if eviction were least *frequently* used instead (SGLang's `--radix-eviction-policy lfu`)? Describe a
#   workload where it beats LRU, and one where it loses.
#
# ## Where this lives in vLLM / SGLang
#
# | engine (release) | file | what to look at |
# |---|---|---|
# | vLLM v0.11.0 | [`vllm/v1/core/kv_cache_utils.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/kv_cache_utils.py) | `FreeKVCacheBlockQueue`: a doubly linked list with O(1) `popleft` / `append` / `remove`; least recently freed first |
# | vLLM v0.11.0 | [`vllm/v1/core/block_pool.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/block_pool.py) | `BlockPool.get_new_blocks` pops the head and `_maybe_evict_cached_block` drops its hash in the same call; `touch` takes hit blocks out of the queue; `free_blocks` appends to the tail |
# | vLLM v0.11.0 | [`vllm/v1/core/single_type_kv_cache_manager.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/single_type_kv_cache_manager.py) | `SingleTypeKVCacheManager.free`: `reversed(req_blocks)`, so a request's tail blocks are freed (and evicted) first |
# | vLLM v0.11.0 | [`vllm/v1/core/kv_cache_manager.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/kv_cache_manager.py) | `KVCacheManager.allocate_slots` returns `None` when the blocks do not fit; the scheduler preempts |
# | SGLang v0.5.3 | [`python/sglang/srt/mem_cache/radix_cache.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/radix_cache.py) | `RadixCache.evict`: a heap of unlocked **leaves** (`lock_ref == 0`); a parent becomes a leaf after its children — tail before parent, as a tree |
# | SGLang v0.5.3 | [`python/sglang/srt/mem_cache/evict_policy.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/evict_policy.py) | `LRUStrategy`, `LFUStrategy`: the heap's priority (`--radix-eviction-policy`) |
# | nano-vllm | [`nanovllm/engine/block_manager.py`](https://github.com/GeeeekExplorer/nano-vllm/blob/bb823b3/nanovllm/engine/block_manager.py) | `BlockManager.free_block_ids`, a `deque` (described above) |

# %% [markdown]
# ## Summary
#
# * The budget bounds **in-use + cached-free** blocks; cached-free ones are evicted from the **head of the free
#   queue** (least recently freed first), and **eviction is allocation**: the hash leaves the index in that step.
# * A block in use is **never** in the free queue, so never evicted; the naive evictor could, and corrupted text.
# * Freeing **last block first** evicts a cached chain from its tail, never stranding blocks.
# * The hit rate grows with the budget up to the unbounded ceiling (63.1 %<!--out:above--> here); nano-vllm's
#   deque gives the same curve (O(n) hits); no caching gives 0. When nothing is evictable, allocation returns `None` and changes nothing: notebook
#   07's scheduler turns that into preemption.

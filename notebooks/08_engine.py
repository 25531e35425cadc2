# %% [markdown]
# # 08 · The engine: every part at once, one step at a time
#
# Notebooks 01–07 built the parts: a tokenizer, a model, paged KV blocks, prefix sharing with refcounts, an LRU of
# cached blocks, a scheduler. `minienv.InferenceEngine` joins them, and this notebook watches it run the bundled
# model behind **one dashboard**: the queues, every block with its refcount, the free queue in LRU order, the budget,
# the stats, and each request's text streaming in — step by step.
#
# **Learning goals.** After this notebook you can
# 1. name what one **engine step** does — schedule, one batched model call, sample, stream, finish — and which part
#    of minienv does each;
# 2. read the engine's state at any step: who waits, who runs, which physical blocks each request's table points
#    to, which blocks are shared (refcount > 1), cached-free, or next to be evicted;
# 3. use the engine like vLLM's `LLM`: `generate(prompts, SamplingParams(...))` → `RequestOutput`s with metrics;
#    `add_request` / `step` / `abort`; streaming;
# 4. map every minienv part to the file that does the same job in **vLLM** and in **SGLang**.

# %%
import os

# Tiny matrices: one BLAS thread is faster, and spinning BLAS threads on a busy 2-core machine can make every
# matmul far slower (measured in benchmarks/). Set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from minienv.engine import InferenceEngine
from minienv.model import load_model
from minienv.sampling import SamplingParams
from minienv.tokenizer import load_tokenizer

tokenizer = load_tokenizer()
model = load_model()  # assets/target: the bundled model, trained on Shakespeare
SOURCE = "the bundled model (assets/target)"
print(SOURCE)
print(model.config)

PROMPTS = [  # the play-script format the model was trained on: "NAME." on its own line, then the speech
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "JULIET.\nO Romeo, Romeo, wherefore art thou",
    "HAMLET.\nTo be, or not to be, that is the question:",
    "ROMEO.\nBut soft, what light",  # shares its first block of tokens with prompt 0
    "MACBETH.\nIs this a dagger which I see before me,",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0)
ENGINE = dict(kv_budget_tokens=96, block_size=8, max_num_seqs=3, max_num_batched_tokens=32)
print([len(tokenizer.encode(p)) for p in PROMPTS], "prompt tokens;", ENGINE)

# %% [markdown]
# ## The problem, with a number
#
# Five people send a prompt at the same moment. Served one after another, every generated token is one model call
# for one request (five people × 16 tokens), and the fifth person waits for everybody else. An engine runs **one
# batched call per step** for everyone scheduled in it.
#
# ## Build it small: the engine step, from the parts of 04–07
#
# One step is five moves, each a part you built: the **scheduler** (07) decides who runs and how many tokens each
# computes, within the token budget and the KV blocks the **manager** (05–06) can give; the **inputs** are the
# scheduled tokens with their positions, slots and block tables (04); the **model** runs once over all of them
# through the paged K/V; each request whose prompt is done **samples** a token from its own row of logits; the
# step is **committed** (computed tokens counted, full blocks indexed) and a request that hit its limit finishes,
# its blocks going back to the pool. The parts:

# %%
from minienv.engine.inputs import build_step_inputs
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.kv.kv_pool import KVPool
from minienv.kv.paged_attention import PagedAttentionBackend
from minienv.request import Request, RequestMetrics
from minienv.scheduler import make_scheduler

B, NUM_BLOCKS = ENGINE["block_size"], ENGINE["kv_budget_tokens"] // ENGINE["block_size"]
kv = KVCacheManager(NUM_BLOCKS, B)  # 05-06: block tables, refcounts, prefix cache, LRU of cached-free blocks
pool = KVPool.for_model(model.config, NUM_BLOCKS * B, B)  # 04: the K/V tensors, one row per slot
backend = PagedAttentionBackend(pool)  # 04: attention that reads K/V through the block tables
sched = make_scheduler(kv, max_num_seqs=ENGINE["max_num_seqs"],  # 07: who runs, within the token budget
                       max_num_batched_tokens=ENGINE["max_num_batched_tokens"])
small = {str(i): Request(str(i), tokenizer.encode(p), GREEDY, RequestMetrics(0.0, 0)) for i, p in enumerate(PROMPTS)}
for req in small.values():
    sched.add_request(req)

# %% [markdown]
# And the loop — the whole engine, without streaming, metrics, stop strings or error handling:

# %%
# NBVAL_CHECK_OUTPUT
small_steps = 0
while sched.has_unfinished_requests():
    plan = sched.schedule()  # schedule: who runs, and how many tokens each computes
    inputs = build_step_inputs(plan, kv, pool)  # inputs: token ids, positions, slots, padded block tables
    backend.set_metadata(inputs.metadata)
    logits = model.forward_step(inputs.token_ids, inputs.metadata.positions, backend,  # model: ONE call
                                logits_indices=inputs.logits_indices)  # (one row per request that samples)
    sched.update_from_output(plan)  # commit: the tokens are computed; newly full blocks are indexed
    for i, row in zip(inputs.sampling, logits):  # sample: greedy, from each request's own row
        req = small[plan.scheduled[i].request_id]
        token = int(np.argmax(row[:tokenizer.vocab_size]))
        if token != tokenizer.eos_token_id:
            req.append_output_token(token)
        if token == tokenizer.eos_token_id or req.num_output_tokens == GREEDY.max_tokens:
            sched.finish_request(req.request_id, "eos" if token == tokenizer.eos_token_id else "length")  # outputs
    small_steps += 1
calls_one_by_one = sum(r.num_output_tokens + (r.finish_reason == "eos") for r in small.values())
print(f"one request at a time: {calls_one_by_one} model calls; the small engine: {small_steps} steps "
      f"({calls_one_by_one / small_steps:.1f}x fewer), with a KV budget of only {NUM_BLOCKS * B} tokens")
print(small["0"].output_token_ids[:8], "->", repr(tokenizer.decode(small["0"].output_token_ids)))

# %% [markdown]
# 33<!--out--> batched steps instead of 80<!--out--> calls. `InferenceEngine` is this loop with everything a server
# needs around it (validation, streaming, stop strings, seeded sampling, metrics, a step rolled back on an
# exception). Its tokens must be the small loop's, step for step:

# %%
# NBVAL_CHECK_OUTPUT
import time

engine = InferenceEngine(model, tokenizer, **ENGINE)
t0 = time.perf_counter()
outs = engine.generate(PROMPTS, GREEDY)
wall = time.perf_counter() - t0
print(f"InferenceEngine: {engine.stats.num_steps} steps; tokens equal to the small loop's: "
      f"{[list(o.token_ids) for o in outs] == [r.output_token_ids for r in small.values()]}")
assert [list(o.token_ids) for o in outs] == [r.output_token_ids for r in small.values()]
assert engine.stats.num_steps == small_steps < calls_one_by_one and all(o.finished for o in outs)

# %%
print(f"wall time {wall * 1e3:.0f} ms for {engine.stats.num_generated_tokens} tokens (not checked: machine-dependent)")

# %% [markdown]
# ## minienv's version: the same loop behind `add_request` / `step` / `abort`
#
# `generate` is a loop around `step()` — the same loop vLLM's `LLMEngine` runs (`add_request`, then `step()` until
# `has_unfinished_requests()` is false). Each `step()` returns a `RequestOutput` per request that got a token:

# %%
by_hand = InferenceEngine(model, tokenizer, **ENGINE)
ids = [by_hand.add_request(p, SamplingParams(max_tokens=6, temperature=0)) for p in PROMPTS[:3]]
doomed = by_hand.add_request(PROMPTS[3], SamplingParams(max_tokens=6, temperature=0))
by_hand.abort(doomed)  # a request can leave at any time; its blocks are freed, the others carry on
while by_hand.has_unfinished_requests():
    step_outputs = by_hand.step()
    plan = by_hand.history[-1].scheduler_output
    news = ", ".join(f"{o.request_id}+{o.delta_text!r}" + (" (done)" if o.finished else "") for o in step_outputs)
    print(f"step {plan.step + 1}: {plan.num_scheduled_tokens:>2} tokens ({plan.num_prefill_tokens} prefill, "
          f"{plan.num_decode_tokens} decode) -> {news}")
print("aborted:", by_hand.output(doomed).finish_reason)

# %%
assert by_hand.output(doomed).finish_reason == "abort" and not by_hand.output(doomed).token_ids
assert all(by_hand.output(rid).finished for rid in ids)
by_hand.check_invariants()

# %% [markdown]
# Each line is one engine step: prefill chunks and decodes together, within 32 tokens, in one model call;
# `delta_text` is what each request's text grew by in that step.
#
# ## minienv's version: `generate` with `SamplingParams`, `RequestOutput` with metrics
#
# The API has vLLM's shape. Each `RequestOutput` carries the text, the token ids, why it finished, and its metrics:
# TTFT, TPOT and end-to-end latency in seconds *and* in engine steps, prompt tokens served from the prefix cache,
# preemptions. Mixed sampling in one batch: greedy for some requests, seeded temperature / top-p for others.

# %%
mixed = [GREEDY, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1),
         SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=7), GREEDY,
         SamplingParams(max_tokens=16, stop=["\n\n"], temperature=0)]
gen_engine = InferenceEngine(model, tokenizer, **ENGINE)
results = gen_engine.generate(PROMPTS, mixed)
print(f"{'id':>3} {'finish':>7} {'tok':>4} {'TTFT':>11} {'TPOT':>11} {'e2e':>11} {'cached':>6} {'preempt':>7}  text")
for r in results:
    m = r.metrics
    print(f"{r.request_id:>3} {r.finish_reason:>7} {len(r.token_ids):>4} {m.ttft_steps:>3} st {r.ttft * 1e3:4.0f}ms "
          f"{m.tpot_steps:>4.2f} {r.tpot * 1e3:4.1f}ms {m.e2e_steps:>3} st {r.e2e_latency * 1e3:4.0f}ms "
          f"{r.num_cached_tokens:>6} {r.num_preemptions:>7}  {r.text[:40]!r}")
s = gen_engine.stats
print(f"engine: {s.num_steps} steps, prefix cache {s.prefix_cache_hits_tokens}/{s.prefix_cache_queries_tokens} "
      f"tokens hit, {s.evicted_blocks} blocks evicted, {s.num_preemptions} preemptions, KV usage now {s.kv_usage:.0%}")

# %%
again = InferenceEngine(model, tokenizer, **ENGINE).generate(PROMPTS[1:3], mixed[1:3])
assert [r.token_ids for r in again] == [r.token_ids for r in results[1:3]]  # seeded sampling: the same text again
assert [r.request_id for r in results] == ["0", "1", "2", "3", "4"] and all(r.finished for r in results)
assert results[3].num_cached_tokens >= 8  # prompt 3 starts like prompt 0: its first block is a prefix-cache hit
assert all(r.metrics.ttft_steps >= 1 and r.metrics.e2e_steps >= r.metrics.ttft_steps for r in results)

# %% [markdown]
# ## Live: the engine dashboard
#
# `EngineDashboard` (`minienv/viz/dashboard.py`) builds a fresh engine, queues the five prompts as `r0` … `r4`, and
# draws everything after every step. Press **Step** (or ▶ to play):
#
# * the caption says what the step did: who decoded, which prefill chunks ran (and how many tokens came from the
#   cache), who was admitted, preempted, finished;
# * the **KV pool**: each physical block coloured by its holder, `·rcN` its refcount (dark = shared: when `r3`
#   arrives, it shares `r0`'s first block), pale blue = cached-free; below it the **free queue**, head = evicted
#   next;
# * **stats** with budget bars, the **running** list (the last is preempted first) and the **waiting** queue;
# * every running request's **block table** (logical → physical, refcount, fill), the **text** streaming in, and
#   the **request timeline**.

# %%
from minienv.viz.dashboard import EngineDashboard

REQUESTS = [(p, SamplingParams(max_tokens=28 if i == 0 else 16, temperature=0)) for i, p in enumerate(PROMPTS)]
dash = EngineDashboard(lambda: InferenceEngine(model, tokenizer, **ENGINE), REQUESTS,
                       title="minienv engine — 5 requests, 96-token KV budget", columns=8, interval_ms=900)
dash

# %% [markdown]
# Now the notebook drives the same widget: a few steps, then check that every view shows exactly the engine's
# state — the grid's refcounts are the manager's, the free-queue view is the free queue in LRU order, the tables are
# the block tables, the texts are the requests' texts.

# %%
def check_dashboard(dash):
    """Every view of the dashboard agrees with the engine's current state."""
    eng, snap = dash.engine, dash.snapshot
    mgr = eng.kv_cache_manager
    assert [c.refcount for c in dash.grid.cells] == [b.ref_cnt for b in mgr.pool.blocks]
    for c in dash.grid.cells:
        holders = {rid for rid in mgr.request_ids() if c.block_id in mgr.block_ids(rid)}
        assert set(c.owners) == holders, (c, holders)
        assert c.state == {"free-empty": "free", "cached-free": "cached"}.get(mgr.block_state(c.block_id).value,
                                                                               "used")
    assert list(dash.free_queue.items) == [b for b, _ in mgr.free_queue()]
    assert list(dash.running_view.items) == [r.request_id for r in eng.scheduler.running]
    assert list(dash.waiting_view.items) == [r.request_id for r in eng.scheduler.waiting]
    assert dash.tables.tables == {v.request_id: v.block_ids for v in snap.running}
    assert dash.texts == {rid: eng.output(rid).text for rid in dash.request_ids}
    assert dash.stats_view.values["KV blocks in use"] == f"{mgr.stats().num_in_use} / {mgr.num_blocks}"


for _ in range(3):
    dash.step()
    check_dashboard(dash)
print(dash.captions[-1])
print("running:", dash.running_view.items, "| waiting:", dash.waiting_view.items,
      "| block tables:", dash.tables.tables)

# %%
assert dash.stepper.position == 3 and dash.snapshot.step == 3
assert len(dash.running_view.items) == 3 and list(dash.waiting_view.items) == ["r3", "r4"]  # max_num_seqs = 3

# %% [markdown]
# Run to the end, checking every step on the way; then compare the finished texts with `engine.generate` on a
# separate engine — the dashboard drives the same engine, it does not change what it does.

# %%
# NBVAL_CHECK_OUTPUT
steps, shared_seen = 3, {}
while dash.step():
    steps += 1
    check_dashboard(dash)
    for c in dash.grid.cells:
        if c.refcount > 1:
            shared_seen.setdefault(c.block_id, (steps, c.owners))
separate = InferenceEngine(model, tokenizer, **ENGINE).generate(PROMPTS, [sp for _, sp in REQUESTS])
r3 = dash.engine.output("r3")
print(f"the dashboard ran {steps} steps; {dash.engine.stats.num_preemptions} preemptions, "
      f"{dash.engine.stats.evicted_blocks} evicted blocks")
print(f"r3 took {r3.num_cached_tokens} prompt tokens from the prefix cache; blocks seen shared (block: (step, holders)):",
      shared_seen)
print("finished texts equal generate() on a separate engine:",
      [dash.texts[f"r{i}"] for i in range(5)] == [o.text for o in separate])

# %%
assert dash.done and steps == dash.engine.stats.num_steps
assert [dash.texts[f"r{i}"] for i in range(5)] == [o.text for o in separate]
assert r3.num_cached_tokens >= 8  # r0's first block served r3's prompt
assert all(set(owners) == {"r0", "r3"} for _, owners in shared_seen.values())  # the only sharing: that prefix
assert dash.timeline.count("preempted") == dash.engine.stats.num_preemptions
dash.engine.check_invariants()

# %% [markdown]
# For readers without a kernel, the dashboard at its busiest step (the most blocks in use) as static pictures:

# %%
busiest = max(range(len(dash.engine.history)),
              key=lambda i: (dash.engine.history[i].stats.num_blocks_in_use, -i))
peak = dash.engine.history[busiest].stats.num_blocks_in_use
dash.reset()
dash.run(busiest + 1)
dash.static()

# %%
check_dashboard(dash)
assert dash.snapshot.stats.num_blocks_in_use == peak and dash.snapshot.step == busiest + 1  # a replay: same peak

# %% [markdown]
# ## Streaming
#
# `engine.stream(prompts, params)` yields each request's new text as it is produced — what a chat UI shows. The
# deltas of a request add up to its final text:

# %%
pieces = {}
for out in InferenceEngine(model, tokenizer, **ENGINE).stream(PROMPTS[:3], GREEDY):
    pieces.setdefault(out.request_id, []).append(out.delta_text)
print({rid: len(p) for rid, p in pieces.items()}, "deltas per request")

# %%
assert ["".join(pieces[str(i)]) for i in range(3)] == [o.text for o in outs[:3]]  # = generate(), greedy

# %% [markdown]
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/08_engine.py` — is explained in notebook 00.) Both checks run
# a small engine (a tiny random model, token-id prompts) so they take well under a second.
#
# ### Exercise 1: latency in steps, from what `step()` returns
#
# The dashboard reported each request's TTFT and end-to-end latency **in steps**. Recompute them yourself from
# nothing but what `step()` returned. Write `latency_in_steps(arrivals, step_outputs)`: `step_outputs` holds one
# list per `step()` call, in order — the `RequestOutput`s that step returned; `arrivals` maps each request id to
# the number of steps the engine had run when the request was added. Return `{request_id: (ttft_steps,
# e2e_steps)}`. Rules: (1) steps are numbered from 1 — the first `step()` call is step 1; (2) a step returns an
# output only for the requests that got a token in it, so a step that ran just a chunk of a prompt returns nothing
# for it: the first token is the request's first *output*; (3) both latencies count from the arrival; (4) e2e ends
# at the step whose output has `finished` set — counting steps, not outputs (a preempted request can spend steps
# without one). The check runs hand-made cases (one per rule), then a real engine with staggered arrivals, chunked
# prefill and preemption, against the metrics the engine records itself.

# %%
from minienv.exercises.engine import check_latency_in_steps, check_run_to_completion


def latency_in_steps(arrivals, step_outputs):
    """{request_id: (ttft_steps, e2e_steps)} from what each step() returned."""
    raise NotImplementedError("your code here")


# %%
check_latency_in_steps(latency_in_steps)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `for step, outputs in enumerate(step_outputs, start=1)` numbers the steps as the engine does. Remember the first
# step each request id shows up in, and the step its output says `finished`.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Subtract the arrival from both. A request added after 2 steps whose first token comes out of step 5 waited
# 3 steps for it.
# </details>
#
# A classic slip — counting steps from 0 — is caught on the smallest case, a one-token request:

# %%
from minienv.exercises import ExerciseFailed


def zero_based(arrivals, step_outputs):
    first, done = {}, {}
    for step, outputs in enumerate(step_outputs):  # starts at 0
        for out in outputs:
            first.setdefault(out.request_id, step)
            if out.finished:
                done[out.request_id] = step
    return {rid: (first[rid] - a, done[rid] - a) for rid, a in arrivals.items()}


try:
    check_latency_in_steps(zero_based)
    raise RuntimeError("the check should have rejected it")
except ExerciseFailed as err:
    print("rejected:", str(err).splitlines()[0])

# %% [markdown]
# ### Exercise 2: the engine loop, by hand
#
# Write `run_to_completion(engine, prompts, params)` with `add_request`, `step` and `has_unfinished_requests`
# only — the loop `generate` runs — and return `{request_id: text}`. Rules: (1) key the texts by the ids
# `add_request` returns; (2) step until `has_unfinished_requests()` is false; (3) each output's `delta_text` is
# only what is new: a request's text is all its deltas joined, in order. The check compares you with
# `generate()` on a separate engine, and hands your function an engine that allows only those three calls
# (`generate` or `output` fail the exercise's process rule).

# %%
def run_to_completion(engine, prompts, params):
    """Serve ``prompts`` to completion through add_request / step; {request_id: text}."""
    raise NotImplementedError("your code here")


# %%
check_run_to_completion(run_to_completion)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# The `add_request` / `step` loop in "minienv's version" steps the engine; what is left is each request's text.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Start every request's text at `""`; `step()` returns the outputs of the requests that ran in that step — add
# each one's `delta_text` to its request's text.
# </details>

# %% [markdown]
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if `step()` also returned an output (with no new token) for a request that only ran a prefill chunk? Which
#   of your exercise 1 rules would change, and which metric could silently break in a client that counts outputs?
#
# ## The map: every minienv part and its counterpart
#
# | minienv | what it does | vLLM v0.11.0 (v1 engine) | SGLang v0.5.3 |
# |---|---|---|---|
# | `minienv/engine/` — `InferenceEngine` (`core.py`), outputs routed per consumer (`outputs.py`) | the loop: add / step / abort, generate, stream, stats; a failed step rolled back | [`vllm/v1/engine/llm_engine.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/engine/llm_engine.py) (`LLMEngine`), [`vllm/v1/engine/core.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/engine/core.py) (`EngineCore.step`), [`vllm/entrypoints/llm.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/entrypoints/llm.py) (`LLM.generate`) | [`python/sglang/srt/managers/scheduler.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/scheduler.py) (event loop), [`python/sglang/srt/entrypoints/engine.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/entrypoints/engine.py) |
# | `minienv/scheduler.py` — `Scheduler`, `SchedulerOutput` | waiting / running, token budget, chunked prefill, preemption | [`vllm/v1/core/sched/scheduler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/sched/scheduler.py), [`vllm/v1/core/sched/output.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/sched/output.py) | [`python/sglang/srt/managers/scheduler.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/scheduler.py), `schedule_policy.py` (`PrefillAdder`), `schedule_batch.py` (`retract_decode`) |
# | `minienv/request.py` — `Request`, `RequestMetrics` | one request's tokens, `num_computed_tokens`, status | [`vllm/v1/request.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/request.py) | [`python/sglang/srt/managers/schedule_batch.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/schedule_batch.py) (`Req`) |
# | `minienv/kv/interface.py` — `KVManager` | the contract the scheduler calls (lookup, allocate, append, commit, free, undo) | the methods [`vllm/v1/core/sched/scheduler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/sched/scheduler.py) calls on `KVCacheManager` | the calls [`python/sglang/srt/managers/schedule_policy.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/schedule_policy.py) makes on the tree cache (`BasePrefixCache`, [`python/sglang/srt/mem_cache/base_prefix_cache.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/base_prefix_cache.py)) |
# | `minienv/kv/kv_cache_manager.py` — `KVCacheManager` | block tables, prefix lookup, allocate / free, stats | [`vllm/v1/core/kv_cache_manager.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/kv_cache_manager.py) | [`python/sglang/srt/mem_cache/radix_cache.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/radix_cache.py) (`match_prefix`, `cache_finished_req`) |
# | `minienv/kv/block_pool.py` — `BlockPool` | blocks, refcounts, the LRU free queue, eviction | [`vllm/v1/core/block_pool.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/block_pool.py), [`vllm/v1/core/kv_cache_utils.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/kv_cache_utils.py) (`FreeKVCacheBlockQueue`) | [`python/sglang/srt/mem_cache/radix_cache.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/radix_cache.py) (`evict`), `evict_policy.py` |
# | `minienv/kv/hashing.py` | chain hash of a full block | [`vllm/v1/core/kv_cache_utils.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/kv_cache_utils.py) (`hash_block_tokens`) | the radix tree's token-keyed nodes (`radix_cache.py`) |
# | `minienv/kv/kv_pool.py` — `KVPool` | the preallocated K/V arrays | [`vllm/v1/worker/gpu_model_runner.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/worker/gpu_model_runner.py) (`kv_caches`) | [`python/sglang/srt/mem_cache/memory_pool.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/mem_cache/memory_pool.py) (`ReqToTokenPool`, `MHATokenToKVPool`) |
# | `minienv/kv/paged_attention.py`, `kv/block_walk.py` | attention through block tables / slot mappings (numpy reference; numba block walk) | [`vllm/v1/attention/backends/flash_attn.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/attention/backends/flash_attn.py) | [`python/sglang/srt/layers/attention/`](https://github.com/sgl-project/sglang/tree/v0.5.3/python/sglang/srt/layers/attention) (FlashInfer, Triton backends) |
# | `minienv/model/llama.py` | the Llama forward | [`vllm/model_executor/models/llama.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/model_executor/models/llama.py) | [`python/sglang/srt/models/llama.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/models/llama.py) |
# | `minienv/sampling.py` — `SamplingParams`, `Sampler` | greedy / temperature / top-k / top-p, seeded | [`vllm/sampling_params.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/sampling_params.py), [`vllm/v1/sample/sampler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/sample/sampler.py) | [`python/sglang/srt/sampling/sampling_params.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/sampling/sampling_params.py), [`python/sglang/srt/layers/sampler.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/layers/sampler.py) |
# | `minienv/tokenizer.py`, `IncrementalDetokenizer` | text ↔ ids, streaming text | [`vllm/v1/engine/detokenizer.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/engine/detokenizer.py) | [`python/sglang/srt/managers/tokenizer_manager.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/tokenizer_manager.py), `detokenizer_manager.py` |
# | `EngineStats`, `RequestOutput` | KV usage, cache hits, preemptions; per-request metrics | [`vllm/v1/metrics/stats.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/metrics/stats.py), [`vllm/outputs.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/outputs.py) | [`python/sglang/srt/managers/scheduler_metrics_mixin.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/scheduler_metrics_mixin.py), `io_struct.py` |
#
# The biggest structural difference: vLLM keeps **blocks + a hash index** (what minienv does); SGLang keeps a
# **radix tree** over token ids whose nodes own KV slots, and evicts unlocked leaves — the same LRU-with-refcounts
# idea in tree form. Both preempt by recompute and both chunk long prefills.

# %%
# NBVAL_CHECK_OUTPUT
import importlib

modules = ["minienv.engine.core", "minienv.engine.outputs", "minienv.scheduler", "minienv.request",
           "minienv.kv.kv_cache_manager", "minienv.kv.block_pool", "minienv.kv.hashing", "minienv.kv.kv_pool",
           "minienv.kv.paged_attention", "minienv.model.llama", "minienv.sampling", "minienv.tokenizer"]
for name in modules:
    importlib.import_module(name)  # every minienv part in the table exists
print(f"{len(modules)} minienv modules in the map, all importable")

# %%
import pkgutil

import minienv

package = {m.name for m in pkgutil.walk_packages(minienv.__path__, "minienv.")}
assert len(set(modules)) == len(modules) and set(modules) <= package  # every row names a real, distinct module
assert not any(m.startswith(("minienv.lab", "minienv.viz")) for m in modules)  # the map is the engine path

# %% [markdown]
# ## Summary
#
# * One engine step = **schedule** (who runs, how many tokens; admit, chunk, preempt) → **one batched model call**
#   through the paged KV cache → **sample** per request → **stream** the new text → **finish** and free blocks.
# * The dashboard shows the whole state and the notebook checked it against the engine at every step: refcounts,
#   the LRU free queue, queues, block tables, texts. Driving it does not change what the engine generates.
# * The API is vLLM's: `generate(prompts, SamplingParams)` → `RequestOutput` with TTFT / TPOT / e2e (seconds and
#   steps), cached prompt tokens, preemptions; `add_request` / `step` / `abort`; `stream`.
# * Every minienv module has a counterpart in vLLM (`vllm/v1/core/sched/scheduler.py`, `kv_cache_manager.py`,
#   `block_pool.py`, `llm_engine.py`, …) and in SGLang (`scheduler.py`, `schedule_policy.py`, `radix_cache.py`, …):
#   you can now read them.

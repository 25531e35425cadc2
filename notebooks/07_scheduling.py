# %% [markdown]
# # 07 · Scheduling: continuous batching, chunked prefill, and preemption that loses nothing
#
# Notebooks 04–06 built the memory. The **scheduler** decides every step who runs, how many tokens each computes
# and, when memory runs out, whom to push back: throughput and latency depend on it; what is generated must not.
#
# **Learning goals.** After this notebook you can
# 1. explain why **static batching** wastes steps on mixed lengths and how **continuous batching** refills a slot;
# 2. read a **request timeline** and its latency metrics: **TTFT**, **TPOT**, end-to-end;
# 3. say how **chunked prefill** keeps every running request decoding while a long prompt arrives;
# 4. follow a **preemption by recompute**, and say when its resume finds blocks in the prefix cache and when not;
# 5. prove that preemption **loses nothing**: under a tight budget every output equals the request run alone.
#
# Scheduling depends only on token *counts*, so a tiny seeded random model drives the engine (the nothing-lost
# proof is repeated on the bundled model). Checked numbers count **steps and tokens**; wall times are unchecked.

# %% [markdown]
# ## The problem, with a number
#
# Sixteen requests (prompts ~24 tokens; outputs long-tailed: most short, a few long), at most four running at once;
# only the batching policy differs:

# %%
# NBVAL_CHECK_OUTPUT
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: one BLAS thread per process
import numpy as np

from minienv.engine import InferenceEngine
from minienv.lab.scheduling_demos import mixed_workload, step_budget_rows, tiny_model
from minienv.sampling import SamplingParams

model, tok = tiny_model(seed=0)  # a random two-layer Llama; its "tokenizer" takes token ids
rng = np.random.default_rng(0)  # every prompt below is drawn from it
lens, prompts, params = mixed_workload(16, seed=0, rng=rng)
ENGINE = dict(kv_budget_tokens=4096, block_size=8, max_num_seqs=4, max_num_batched_tokens=256)

def run(scheduling, **kw):
    engine = InferenceEngine(model, tok, scheduling=scheduling, **(ENGINE | kw))
    return engine, engine.generate(prompts, params)

runs = {mode: run(mode) for mode in ("static", "continuous")}
print("output lengths:", lens, f"(mean {np.mean(lens):.2f}, median {np.median(lens):.1f}, max {max(lens)})")
for mode, (engine, outs) in runs.items():
    s, n = engine.stats, engine.stats.num_generated_tokens
    print(f"{mode:>10}: {s.num_steps:>3} steps for {n} tokens = {n / s.num_steps:.2f} tokens/step | mean TTFT "
          f"{np.mean([o.metrics.ttft_steps for o in outs]):5.2f} steps, mean e2e "
          f"{np.mean([o.metrics.e2e_steps for o in outs]):5.2f} steps")
speedup = runs["static"][0].stats.num_steps / runs["continuous"][0].stats.num_steps
print(f"continuous batching: {speedup:.2f}x fewer steps, same {runs['continuous'][0].stats.num_generated_tokens} tokens")
assert [o.token_ids for o in runs["static"][1]] == [o.token_ids for o in runs["continuous"][1]]  # same outputs
assert speedup > 1.5

# %% [markdown]
# The outputs average 12.25<!--out--> tokens, the median is 8.5<!--out--> and the longest is 38<!--out-->: that
# tail is what static batching waits for. It runs a batch of four until its **longest** member is done; the other slots idle (a padded batch
# even computes thrown-away tokens for them, see below) and the next requests wait. Continuous batching — Orca's
# "iteration-level scheduling" (notebook 03 met Orca) — decides who runs **every step**: a freed slot refills at once.
#
# ## Build it small: both policies in a dozen lines
#
# Ignoring memory and the token budget, a request admitted at step `a` samples its first token in step `a` and one
# more per step, so it is done after step `a + output_len`:

# %%
import heapq

def toy_finish_steps(output_lens, slots, continuous):
    """Step count at which each request is done, with unlimited memory and token budget."""
    finish = []
    if continuous:  # each request takes the slot that frees first
        free_at = [0] * slots
        for n in output_lens:
            finish.append(heapq.heappop(free_at) + n)
            heapq.heappush(free_at, finish[-1])
    else:  # a batch of `slots` starts when the previous one's longest member is done
        for i in range(0, len(output_lens), slots):
            start = max(finish[i - slots:i], default=0)
            finish += [start + n for n in output_lens[i:i + slots]]
    return finish

for mode, continuous in (("static", False), ("continuous", True)):
    toy = toy_finish_steps(lens, 4, continuous)
    engine_finish = [o.metrics.finished_step for o in runs[mode][1]]
    print(f"{mode:>10}: toy says done after {max(toy)} steps, the engine took {runs[mode][0].stats.num_steps}; "
          f"finish steps equal: {toy == engine_finish}")
    assert toy == engine_finish

# %% [markdown]
# With ample memory and budget only the policy matters; `minienv/scheduler.py` (vLLM v1's design) adds the rest.
#
# ## minienv's version: the timeline
#
# The engine records each step's plan (`engine.history`) and per-request states (`engine.timeline()`); one row per
# request, one column per step: **grey** waiting, **orange** prefill, **blue** decoding, **red** preempted; a black
# bar marks the finishing step.

# %%
from IPython.display import display

from minienv.viz.timeline import RequestTimeline

timelines = {}
for mode, (engine, _) in runs.items():
    timelines[mode] = RequestTimeline(title=f"{mode} batching — {engine.stats.num_steps} steps", live="html",
                                      step_px=10)
    timelines[mode].update(engine.timeline(), num_steps=engine.stats.num_steps)
    display(timelines[mode].static())
waiting = {mode: sum(e.state == "waiting" for e in engine.timeline()) for mode, (engine, _) in runs.items()}
assert waiting["static"] > 1.5 * waiting["continuous"]  # far more request-steps spent waiting (the grey cells)

# %% [markdown]
# Static: the next four rows start only after the longest of a batch ends (white gaps: idle slots). Continuous: none.
#
# ## Throughput and latency
#
# **Throughput** is generated tokens per step. **TTFT** (time to first token) = queueing + prefill — what
# continuous batching improves most. **TPOT** (time per output token) = (finish − first token) / (output − 1):
# 1.0 in steps under both policies (every running request decodes every step); in seconds it grows with the batch.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.lab.scheduling_demos import latency_table  # means and p90s of the per-request metrics, in steps

metrics = {}
print(f"{'':>10} {'tok/step':>9} {'TTFT mean':>10} {'TTFT p90':>9} {'TPOT':>6} {'e2e mean':>9} {'e2e p90':>8}   (steps)")
for mode, (engine, outs) in runs.items():
    m = metrics[mode] = latency_table(outs) | dict(tps=engine.stats.num_generated_tokens / engine.stats.num_steps)
    print(f"{mode:>10} {m['tps']:>9.2f} {m['ttft_mean']:>10.2f} {m['ttft_p90']:>9.1f} {m['tpot_mean']:>6.2f} "
          f"{m['e2e_mean']:>9.2f} {m['e2e_p90']:>8.1f}")

# %%
import plotly.graph_objects as go

from minienv.viz.static import show

keys = {"tokens / step": "tps", "TTFT mean": "ttft_mean", "TTFT p90": "ttft_p90", "TPOT": "tpot_mean"}
fig = go.Figure([go.Bar(x=list(keys), y=[metrics[mode][k] for k in keys.values()], name=mode, marker_color=color)
                 for mode, color in (("static", "#9c755f"), ("continuous", "#4e79a7"))])
fig.update_layout(height=320, barmode="group", margin=dict(t=50, b=30), yaxis_title="steps (or tokens / step)",
                  title_text="static vs continuous batching")
show(fig)  # live, with a PNG of it for readers without a kernel
assert metrics["continuous"]["tps"] > 1.5 * metrics["static"]["tps"]
assert metrics["continuous"]["ttft_mean"] < metrics["static"]["ttft_mean"] / 2
assert metrics["static"]["tpot_mean"] == metrics["continuous"]["tpot_mean"] == 1.0

# %% [markdown]
# ### What a static step computes: padding
#
# On this CPU a step's cost grows with its tokens (on a GPU a decode step reads the weights once for the whole
# batch, so it barely grows: notebook 16's roofline clock gives 6.63 ms<!--out:16--> for one Llama-3-8B stream
# on an H100 and 8.21 ms<!--out:16--> for 64), so count tokens *computed*. A padded static batch (`transformers.generate`;
# minienv's default `static_padding=True`) computes a thrown-away token for each finished member until the longest
# ends (`stats.num_padding_tokens`); the *charitable* `static_padding=False` stops finished members at once:

# %%
# NBVAL_CHECK_OUTPUT
runs["static, charitable"] = run("static", static_padding=False)
for mode in ("static", "static, charitable", "continuous"):
    s = runs[mode][0].stats
    print(f"{mode:>18}: {s.num_steps:>3} steps, {s.num_computed_tokens:>4} tokens computed = "
          f"{s.num_computed_tokens - s.num_padding_tokens:>4} useful + {s.num_padding_tokens:>3} padding "
          f"({s.num_computed_tokens / s.num_steps:5.2f} per step)")
static_stats, charitable_stats, cont_stats = (runs[m][0].stats for m in ("static", "static, charitable", "continuous"))
assert [o.token_ids for o in runs["static, charitable"][1]] == [o.token_ids for o in runs["continuous"][1]]
assert static_stats.num_steps == charitable_stats.num_steps
assert charitable_stats.num_computed_tokens == cont_stats.num_computed_tokens  # the same useful work ...
assert static_stats.num_computed_tokens == cont_stats.num_computed_tokens + static_stats.num_padding_tokens
batches = [lens[i:i + 4] for i in range(0, len(lens), 4)]
assert static_stats.num_padding_tokens == sum(max(b) - n for b in batches for n in b)

# %%
from minienv.lab.scheduling_demos import time_runs  # seconds, unchecked: a tiny model's fixed step cost hides padding

variants = [("static", "static", {}), ("static, charitable", "static", dict(static_padding=False)),
            ("continuous", "continuous", {})]
for label, wall, engine, outs in time_runs(run, variants):  # benchmarks/bench_engine.py measures it properly
    print(f"{label:>18}: {wall * 1e3:6.0f} ms, {engine.stats.num_generated_tokens / wall:7.0f} tokens/s, mean TTFT "
          f"{np.mean([o.ttft for o in outs]) * 1e3:5.1f} ms, mean TPOT {np.mean([o.tpot for o in outs]) * 1e3:5.2f} ms")

# %% [markdown]
# ## Live: step through either policy
#
# Pick a policy and press **Step** or ▶: each step adds a column. Under continuous batching a grey row turns orange
# the step a slot frees; under static batching it stays grey until the whole batch is done.

# %%
import ipywidgets as widgets

from minienv.lab.scheduling_demos import EngineScene
from minienv.viz import Stepper

policy = widgets.ToggleButtons(options=["continuous", "static"], value="continuous", description="batching")
live_tl = RequestTimeline(title="request timeline", step_px=10)
scene = EngineScene(model, tok, prompts, params, **ENGINE)  # a fresh engine with the 16 requests at each reset

def live_reset():
    scene.reset(policy.value)
    live_tl.reset(caption=policy.value)

def live_step(i):
    caption = scene.step()  # one engine step; None once every request has finished
    if caption is None:
        return False
    live_tl.update(scene.engine.timeline(), num_steps=scene.engine.stats.num_steps, caption=caption)
    return caption

live_stepper = Stepper(live_step, live_reset, n_steps=None, interval_ms=300, description="engine step")
policy.observe(lambda change: live_stepper.reset(), names="value")
live_stepper.reset()
widgets.VBox([policy, live_stepper.widget, live_tl.widget])

# %% [markdown]
# The code drives the widget to the end of each policy (`tests/unit/test_notebook_views.py` checks every cell):

# %%
# NBVAL_CHECK_OUTPUT
for mode in ("static", "continuous"):
    policy.value = mode  # the observer resets the stepper with a fresh engine
    taken = live_stepper.run()
    print(f"{mode:>10}: the stepper took {taken} steps; the timeline shows {live_tl.num_steps} steps, "
          f"{live_tl.count('decode')} decode cells, {live_tl.count('waiting')} waiting cells")

# %% [markdown]
# ## Chunked prefill keeps decodes flowing
#
# Three requests are decoding when a 120-token prompt arrives. **Without chunking** (vLLM v0's default) a prompt is
# prefilled whole in a step of its own, so the step budget must hold the longest prompt (v0 required
# `max_num_batched_tokens ≥ max_model_len`) and the decoders **stall** for that step. **Chunked prefill** (vLLM v1,
# SGLang) keeps a small budget — here 32 tokens: each running request gets its decode token first, the rest goes
# to the next chunk of the prompt:

# %%
# NBVAL_CHECK_OUTPUT
def toy_steps(num_decoding, prompt_len, budget, chunked):
    """(decode tokens, prefill tokens) of each step until the long prompt is fully prefilled."""
    steps, left = [], prompt_len
    while left:  # unchunked: the whole prompt in one step (the budget must allow it), nobody decodes in it
        chunk = min(left, budget - num_decoding) if chunked else left
        steps.append((num_decoding if chunked else 0, chunk))
        left -= chunk
    return steps

for chunked in (False, True):
    plan = toy_steps(3, 120, 32, chunked)
    print(f"{'chunked' if chunked else 'no chunking':>12}: (decodes, prefill tokens) per step {plan}")

# %% [markdown]
# Unchunked, one 120-token step in which nobody decodes; chunked, every step stays ≤ 32 and all three decode.
# minienv's scheduler chunks (`step_budget_rows` steps the engine and reads each step's plan):

# %%
# NBVAL_CHECK_OUTPUT
chunk_engine = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=8, max_num_seqs=4,
                               max_num_batched_tokens=32)
short_ids = [chunk_engine.add_request(rng.integers(0, 128, 6).tolist(), SamplingParams(max_tokens=14, temperature=0))
             for _ in range(3)]
chunk_engine.run(max_steps=2)  # the three are decoding now
long_id = chunk_engine.add_request(rng.integers(0, 128, 120).tolist(), SamplingParams(max_tokens=3, temperature=0))
rows = step_budget_rows(chunk_engine, long_id)  # until the long prompt samples its first token
for r in rows:
    print(f"step {r.step + 1}: {r.decode_tokens} decodes + prefill chunk of {r.chunk:>3} tokens = {r.total} tokens")
chunk_engine.run()  # steps to the end (the timeline below shows it all)
assert all(r.decode_tokens == 3 for r in rows)  # every running request decoded in every step
assert [r.chunk for r in rows] == [c for _, c in toy_steps(3, 120, 32, True)]  # the toy's chunks exactly
assert all(r.total <= 32 for r in rows) and sum(r.chunk for r in rows) == 120

# %%
chunk_tl = RequestTimeline(title="chunked prefill: the 120-token prompt arrives after step 2", live="html", step_px=18)
chunk_tl.update(chunk_engine.timeline(), num_steps=chunk_engine.stats.num_steps)
chunk_tl.static()

# %% [markdown]
# The long prompt runs as orange chunks (29, 29, 29, 29, 4) while the three short rows stay blue: nobody stalls.
#
# ## Preemption under a tight budget
#
# Five requests (24 prompt + 24 output tokens, blocks of 8) need 30 blocks; the budget is 16. When a running request
# needs a block that is not there, the scheduler **preempts** the most recently admitted request (vLLM's rule):
# frees its blocks — full ones stay cached-free, in notebook 06's LRU — and puts it at the front of the waiting
# queue with its generated tokens. On readmission the prefix lookup finds whatever the LRU has not yet handed to
# someone else; the rest is recomputed.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.engine import required_kv_tokens
from minienv.lab.scheduling_demos import preemptions_and_resumes

tight_prompts = [rng.integers(0, 128, 24).tolist() for _ in range(5)]
tight_params = SamplingParams(max_tokens=24, temperature=0)
need = required_kv_tokens([24] * 5, 24, 8)
tight = InferenceEngine(model, tok, kv_budget_tokens=128, block_size=8, max_num_seqs=5, max_num_batched_tokens=64)
tight_outs, ts = tight.generate(tight_prompts, tight_params), tight.stats
print(f"all at once the requests need {need} KV tokens; the budget is {tight.kv_budget_tokens} "
      f"({tight.kv_budget_tokens / need:.0%})")
print(f"{ts.num_steps} steps, {ts.num_preemptions} preemptions, {ts.num_computed_tokens} tokens computed for "
      f"{5 * 24} prompt + {ts.num_generated_tokens} generated tokens")
events = preemptions_and_resumes(tight)
for e in events:
    if e.kind == "preempted":
        print(f"step {e.step + 1:>2}: request {e.request_id} preempted (the most recently admitted; still running: "
              f"{list(e.running_after)})")
    else:
        print(f"step {e.step + 1:>2}: request {e.request_id} resumes: {e.cached:>2} of its {e.cached + e.recomputed} "
              f"tokens from the prefix cache, {e.recomputed} recomputed")
print(f"prefix cache over the run: {ts.prefix_cache_hits_tokens} of {ts.prefix_cache_queries_tokens} queried tokens "
      f"hit; {ts.evicted_blocks} cached blocks evicted")
resumes = [e for e in events if e.kind == "resumed"]
assert ts.num_preemptions == len(resumes) > 0 and all(o.finished for o in tight_outs)
assert any(e.cached >= 24 and e.recomputed < e.cached for e in resumes)  # a cheap resume: most blocks still cached
assert any(e.cached == 0 for e in resumes)  # ... and one whose blocks the LRU had already handed to others

# %%
pre_tl = RequestTimeline(title=f"a 128-token budget: {ts.num_preemptions} preemptions", live="html", step_px=12)
pre_tl.update(tight.timeline(), num_steps=ts.num_steps)
pre_tl.static()

# %% [markdown]
# Red cells are preemptions; the orange cell after the grey gap is the resume. One victim came back while its full
# blocks were still in the free queue — a short chunk; the other waited longer, the LRU handed its blocks to the
# growing requests, and it recomputed everything. Slower, never wrong.
#
# ## The proof: nothing lost
#
# A preempted request keeps its generated tokens and its sampler, and the recompute feeds exactly the tokens it had.
# Compare with each request generated **alone** (no cache, no batching, no preemption):

# %%
# NBVAL_CHECK_OUTPUT
from minienv.generate import generate_ids

alone = [list(generate_ids(model, p, tight_params)) for p in tight_prompts]
same = [list(o.token_ids) == a for o, a in zip(tight_outs, alone)]
print(f"{sum(same)} of {len(same)} outputs equal the request run alone; "
      f"{sum(o.num_preemptions for o in tight_outs)} preemptions among them "
      f"(per request: {[o.num_preemptions for o in tight_outs]})")
print(f"distinct tokens in the outputs: {len({t for a in alone for t in a})} (the outputs are not trivial)")
assert all(same) and sum(o.num_preemptions for o in tight_outs) == ts.num_preemptions > 0
tight.check_invariants()

# %% [markdown]
# The same on the bundled model: six speeches, greedy and seeded sampling mixed, under a 48-token KV budget
# (`tests/unit/test_nothing_lost.py` checks more budgets, block sizes and random workloads).

# %%
# NBVAL_CHECK_OUTPUT
from minienv.model import load_model
from minienv.tokenizer import load_tokenizer

real_model, real_tok = load_model(), load_tokenizer()  # the bundled target model
speeches = ["ROMEO.\nBut soft, what light", "JULIET.\nO Romeo, Romeo", "HAMLET.\nTo be, or not to be",
            "MACBETH.\nIs this a dagger", "KING LEAR.\nBlow, winds", "PORTIA.\nThe quality of mercy"]
speech_params = [SamplingParams(max_tokens=24, temperature=0) if i % 2 == 0 else
                 SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=i) for i in range(len(speeches))]
speech_ids = [real_tok.encode(t) for t in speeches]
need_real = required_kv_tokens([len(i) for i in speech_ids], 24, 4)
small = InferenceEngine(real_model, real_tok, kv_budget_tokens=48, block_size=4,
                        max_num_seqs=6, max_num_batched_tokens=32)
served = small.generate(speeches, speech_params)
alone_real = [list(generate_ids(real_model, i, sp, eos_token_id=real_tok.eos_token_id))
              for i, sp in zip(speech_ids, speech_params)]
print(f"budget {small.kv_budget_tokens} of the {need_real} KV tokens needed at once; {small.stats.num_preemptions} "
      f"preemptions; {sum(list(o.token_ids) == a for o, a in zip(served, alone_real))} of {len(served)} outputs equal "
      "the request run alone")
for o in served[:3]:
    print(f"  {o.prompt!r} -> {o.text!r}")
assert all(list(o.token_ids) == a for o, a in zip(served, alone_real)) and small.stats.num_preemptions > 0

# %% [markdown]
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/07_scheduling.py` — is explained in notebook 00.)
#
# ### Exercise 1: a victim policy of your own
#
# Preempt the request with the **least work to redo** instead. `InferenceEngine(..., victim_policy=fn)` calls
# `fn(candidates)` with the requests not yet scheduled this step, oldest first (`candidates[0]` needs the block);
# each has `num_computed_tokens` and `request_id`. Write `fewest_computed(candidates)`. Rules: (1) the fewest
# computed tokens; (2) among equals, the latest in the list; (3) return the request object itself.

# %%
from minienv.exercises.scheduling import check_plan_step, check_victim_policy

def fewest_computed(candidates):
    """The victim: fewest num_computed_tokens; among equals the latest in the list."""
    raise NotImplementedError("your code here")

# %%
check_victim_policy(fewest_computed)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `min(candidates, key=lambda c: c.num_computed_tokens)` is almost it. Which of several equals does `min` return?
# </details>
#
# <details><summary>Hint 2</summary>
#
# `min` keeps the *first* of equals. Give it the list newest first: `reversed(candidates)`.
# </details>
#
# Whatever the policy nothing is lost; it changes only *how much is recomputed* and *who waits*.
#
# ### Exercise 2: split one step's budget
#
# Write `plan_step(needs, budget)` — the scheduler's rule without memory: `needs[i]` is what running request `i`
# still has to compute (`1` when decoding), in running order; return how many each computes this step. Rules: (1)
# one number per request, in order; (2) at most `budget` in total; (3) nobody more than it needs; (4) every decode
# gets its token, even after a long prefill; (5) prefill chunks take the rest in running order, earlier first.
# (Notebook 14 hands your `plan_step` to the engine, where it sizes the prefill chunks of real steps.)

# %%
def plan_step(needs, budget):
    """Tokens each running request computes in one step: decodes first, then prefill chunks in order."""
    raise NotImplementedError("your code here")

# %%
check_plan_step(plan_step)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Before walking the list, count the decodes: their tokens are reserved out of the budget.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Walk in order, keeping `decodes_left` (decodes not yet given their token). A decode gets 1; a prefill gets
# `max(0, min(need, budget - decodes_left))`. Subtract what you give from `budget`.
# </details>

# %% [markdown]
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if the victim policy preempted the request with the *most* computed tokens? Which moves — total
#   recomputation or the tail latency of long requests — and in which direction?
#
# ## Where this lives in vLLM / SGLang
#
# | engine (release) | file | what to look at |
# |---|---|---|
# | vLLM v0.11.0 | [`vllm/v1/core/sched/scheduler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/sched/scheduler.py) | `Scheduler.schedule()`: one token budget per step, running requests first (each gets `num_tokens - num_computed_tokens`, capped: chunked prefill falls out), then `waiting`; when `kv_cache_manager.allocate_slots` returns `None`, FCFS preempts `self.running.pop()`, frees its blocks, sets `num_computed_tokens = 0` and `waiting.prepend_request`s it |
# | vLLM v0.11.0 | [`vllm/v1/core/sched/output.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/sched/output.py), [`vllm/v1/core/sched/request_queue.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/sched/request_queue.py) | `SchedulerOutput` (minienv's mirrors it); the FCFS and priority queues |
# | SGLang v0.5.3 | [`python/sglang/srt/managers/scheduler.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/scheduler.py) | `Scheduler.get_next_batch_to_run`: a prefill batch when there is room, else the decode batch; `update_running_batch` retracts requests when decode memory is short |
# | SGLang v0.5.3 | [`python/sglang/srt/managers/schedule_policy.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/schedule_policy.py) | `SchedulePolicy` (FCFS or cache-aware LPM), `PrefillAdder` (chunks a long prompt within the step's budgets) |
# | SGLang v0.5.3 | [`python/sglang/srt/managers/schedule_batch.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/schedule_batch.py) | `ScheduleBatch.retract_decode`: the preemption; retracted requests are recomputed, reusing what the radix cache kept |

# %% [markdown]
# ## Summary
#
# * **Continuous batching** schedules every step: about half the steps of static batching for the same tokens, and
#   less than half the mean TTFT; TPOT in steps stays 1.0. A padded static batch also computes thrown-away tokens.
# * **Chunked prefill** gives decodes their token first and chunks a long prompt into the rest of the step budget.
# * Under memory pressure the scheduler **preempts by recompute** (the most recently admitted, by default). The
#   victim's full blocks stay cached-free, but the LRU may hand them to others before it returns: above, one resume
#   took 32 of 40 tokens from the cache, the other none (32 of 192 queried tokens hit over the whole run).
# * **Nothing is lost**: every output under a tight budget equals the request run alone, for any victim policy and
#   on the bundled model. Notebook 08 puts the whole engine behind one dashboard.

# %% [markdown]
# # 07 · Scheduling: continuous batching, chunked prefill, and preemption that loses nothing
#
# Notebooks 04–06 built the memory: paged blocks, shared prefixes, an LRU of cached blocks. This notebook puts a
# **scheduler** on top. Every engine step it decides which requests run, how many tokens each computes, and — when
# memory runs out — whom to push back into the queue. Those decisions set the throughput and the latency a user
# feels; they must never change what a request generates.
#
# **Learning goals.** After this notebook you can
# 1. explain why **static batching** (a fixed batch that waits for its longest member) wastes steps on a
#    mixed-length workload, and how **continuous batching** refills a slot the step it frees;
# 2. read a **request timeline** (waiting, prefill chunks, decode, preempted) and the latency metrics behind it:
#    time to first token (**TTFT**), time per output token (**TPOT**), end-to-end latency;
# 3. say how **chunked prefill** keeps every running request decoding while a long prompt arrives;
# 4. follow a **preemption by recompute**: the victim's blocks are freed but its full blocks stay cached (notebook
#    06's LRU), so its resume takes from the prefix cache whatever the LRU has not evicted by then;
# 5. prove that preemption **loses nothing**: under a tight budget every output equals the request run alone.
#
# Scheduling depends only on token *counts*, so this notebook drives the engine with a tiny seeded random model
# (a step costs about a millisecond) — the nothing-lost proof is repeated on the bundled model, and notebook 08 runs
# the whole engine on it. Every number printed
# here counts **engine steps and tokens** — deterministic on any machine; wall times appear only in cells that
# are not checked.

# %% [markdown]
# ## The problem, with a number
#
# Sixteen requests with mixed lengths (prompts ~24 tokens, outputs long-tailed around 16: most short, a few long),
# at most four running at once. The same engine, the same budgets; only the batching policy differs:

# %%
# NBVAL_CHECK_OUTPUT
import os

# Tiny matrices: one BLAS thread is faster, and spinning BLAS threads on a busy 2-core machine can make every
# matmul far slower (measured in benchmarks/). Set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from minienv.engine import InferenceEngine
from minienv.model import LlamaConfig, LlamaModel, random_weights
from minienv.sampling import SamplingParams
from minienv.lab.workload import LengthDistribution, WorkloadConfig, generate_workload


class TokenIds:
    """A tokenizer stand-in: prompts are token ids, text is the ids (this notebook counts tokens)."""

    eos_token_id = None  # no end-of-text: every request generates exactly max_tokens
    vocab_size = 128

    def encode(self, text):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


CFG = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
model, tok = LlamaModel(CFG, random_weights(CFG, seed=0, scale=0.3)), TokenIds()

MIXED = WorkloadConfig("mixed", LengthDistribution(24.0, 0.5), LengthDistribution(16.0, 1.0))
specs = generate_workload(16, MIXED, max_len=160, seed=0)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 128, s.prompt_len).tolist() for s in specs]
params = [SamplingParams(max_tokens=s.output_len, temperature=0) for s in specs]
ENGINE = dict(kv_budget_tokens=4096, block_size=8, max_num_seqs=4, max_num_batched_tokens=256)


def run(scheduling, **kw):
    engine = InferenceEngine(model, tok, scheduling=scheduling, **(ENGINE | kw))
    return engine, engine.generate(prompts, params)


runs = {mode: run(mode) for mode in ("static", "continuous")}
print("output lengths:", [s.output_len for s in specs])
for mode, (engine, outs) in runs.items():
    s = engine.stats
    print(f"{mode:>10}: {s.num_steps:>3} steps for {s.num_generated_tokens} tokens = "
          f"{s.num_generated_tokens / s.num_steps:.2f} tokens/step | mean TTFT "
          f"{np.mean([o.metrics.ttft_steps for o in outs]):5.2f} steps, mean e2e "
          f"{np.mean([o.metrics.e2e_steps for o in outs]):5.2f} steps")
speedup = runs["static"][0].stats.num_steps / runs["continuous"][0].stats.num_steps
print(f"continuous batching: {speedup:.2f}x fewer steps, same {runs['continuous'][0].stats.num_generated_tokens} tokens")

# %%
assert [o.token_ids for o in runs["static"][1]] == [o.token_ids for o in runs["continuous"][1]]  # same outputs
assert speedup > 1.5

# %% [markdown]
# Same tokens, far fewer steps. In static batching, a batch of four runs until its **longest** member is done: the
# other three slots do no useful work for the rest of the batch, and the next requests wait outside. (They are
# not even free: a padded batch — `transformers.generate`, FasterTransformer — keeps computing a finished row's
# token and throws it away; minienv's static baseline does the same by default, more on that cost below.)
# Continuous batching (Orca, OSDI 2022: "iteration-level scheduling") decides who runs **every step**, so a freed
# slot is refilled at the next step.
#
# ## Build it small: both policies in a dozen lines
#
# Ignore memory and the token budget for a moment. A request admitted at step `a` computes its prompt and samples
# its first token in step `a`, then decodes one token per step: its last token comes out of step
# `a + output_len - 1`, so it "finishes at" `a + output_len` — the step count after which it is done. Static
# batching admits four at a time and waits for the slowest; continuous batching gives each freed slot to the next
# request in line:

# %%
import heapq


def toy_finish_steps(output_lens, slots, continuous):
    """Step count at which each request is done, with unlimited memory and token budget."""
    finish = []
    if continuous:
        free_at = [0] * slots  # when each slot frees up
        for n in output_lens:
            start = heapq.heappop(free_at)
            finish.append(start + n)
            heapq.heappush(free_at, start + n)
    else:
        start = 0
        for i in range(0, len(output_lens), slots):
            batch = output_lens[i:i + slots]
            finish += [start + n for n in batch]
            start += max(batch)  # the whole batch waits for its longest member
    return finish


lens = [s.output_len for s in specs]
for mode, continuous in (("static", False), ("continuous", True)):
    toy = toy_finish_steps(lens, 4, continuous)
    engine_finish = [o.metrics.finished_step for o in runs[mode][1]]
    print(f"{mode:>10}: toy says done after {max(toy)} steps, the engine took {runs[mode][0].stats.num_steps}; "
          f"finish steps equal: {toy == engine_finish}")

# %%
assert toy_finish_steps(lens, 4, False) == [o.metrics.finished_step for o in runs["static"][1]]
assert toy_finish_steps(lens, 4, True) == [o.metrics.finished_step for o in runs["continuous"][1]]

# %% [markdown]
# The toy predicts every request's finish step exactly: with a 256-token step budget and ample memory, the only
# thing that matters is the policy. The rest of the notebook adds what the toy leaves out — a token budget per step
# and a memory budget — and what the real scheduler (`minienv/scheduler.py`, vLLM v1's design) does about them.
#
# ## minienv's version: the timeline
#
# `InferenceEngine(..., scheduling="static" | "continuous")` records every step's plan (`engine.history`: a
# `SchedulerOutput` per step) and turns it into per-request states (`engine.timeline()`). `RequestTimeline`
# (`minienv/viz/timeline.py`) draws them: one row per request, one column per step — **grey** waiting (no KV held),
# **orange** a prefill chunk (with its token count), **blue** decoding, **red** preempted; the black bar marks the
# step whose token finished the request.

# %%
from IPython.display import display

from minienv.viz.timeline import RequestTimeline

timelines = {}
for mode, (engine, _) in runs.items():
    timelines[mode] = RequestTimeline(title=f"{mode} batching — {engine.stats.num_steps} steps", live="html",
                                      step_px=10)
    timelines[mode].update(engine.timeline(), num_steps=engine.stats.num_steps)
    display(timelines[mode].static())

# %%
st, ct = timelines["static"], timelines["continuous"]
assert st.rows == ct.rows == [o.request_id for o in runs["static"][1]]
assert st.count("decode") == ct.count("decode")  # the same tokens decoded ...
assert st.count("waiting") > 1.5 * ct.count("waiting")  # ... but far more waiting under static batching
for mode, tl in timelines.items():  # every finish mark sits where the engine says the request finished
    assert all(tl.finish_step(o.request_id) + 1 == o.metrics.finished_step for o in runs[mode][1])
# static: admissions only when the whole previous batch has finished
first = {r: next(s for s in range(st.num_steps) if st.state_at(r, s) == "prefill") for r in st.rows}
batches = [st.rows[i:i + 4] for i in range(0, len(st.rows), 4)]
starts = [0] + [max(st.finish_step(r) + 1 for r in b) for b in batches[:-1]]
assert all(first[r] == starts[k] for k, b in enumerate(batches) for r in b)

# %% [markdown]
# Read the static picture by batches: four rows start together, and the next four start only after the longest of
# them ends — the white gaps after short requests are slots doing no useful work (the timeline shows each request's
# own work; the padding a finished row still computes is not drawn). The continuous picture has no gaps: each time a
# row ends, a waiting row starts in the next step.
#
# ## Throughput and latency
#
# * **Throughput**: generated tokens per step (each step is one batched model call).
# * **TTFT** (time to first token) = queueing + prefill. It is what continuous batching improves most: a request
#   no longer waits for a whole batch to drain.
# * **TPOT** (time per output token) = (finish − first token) / (output tokens − 1): the decode pace once a
#   request runs. Every running request decodes one token per step under both policies, so in steps it is 1.0;
#   in seconds it grows with how much else shares each step.

# %%
# NBVAL_CHECK_OUTPUT
def latency_table(outs):
    ttft = np.array([o.metrics.ttft_steps for o in outs])
    tpot = np.array([o.metrics.tpot_steps for o in outs])
    e2e = np.array([o.metrics.e2e_steps for o in outs])
    return dict(ttft_mean=ttft.mean(), ttft_p90=np.percentile(ttft, 90), tpot_mean=tpot.mean(),
                e2e_mean=e2e.mean(), e2e_p90=np.percentile(e2e, 90))


metrics = {}
print(f"{'':>10} {'tok/step':>9} {'TTFT mean':>10} {'TTFT p90':>9} {'TPOT':>6} {'e2e mean':>9} {'e2e p90':>8}   (steps)")
for mode, (engine, outs) in runs.items():
    m = metrics[mode] = latency_table(outs) | dict(tps=engine.stats.num_generated_tokens / engine.stats.num_steps)
    print(f"{mode:>10} {m['tps']:>9.2f} {m['ttft_mean']:>10.2f} {m['ttft_p90']:>9.1f} {m['tpot_mean']:>6.2f} "
          f"{m['e2e_mean']:>9.2f} {m['e2e_p90']:>8.1f}")

# %%
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from minienv.viz.static import show

fig = make_subplots(rows=1, cols=3, subplot_titles=("throughput (tokens / step)", "TTFT (steps)",
                                                    "TPOT (steps / token)"))
for mode, color in (("static", "#9c755f"), ("continuous", "#4e79a7")):
    m = metrics[mode]
    fig.add_trace(go.Bar(x=[mode], y=[m["tps"]], marker_color=color, name=mode), 1, 1)
    fig.add_trace(go.Bar(x=["mean", "p90"], y=[m["ttft_mean"], m["ttft_p90"]], marker_color=color, name=mode,
                         showlegend=False), 1, 2)
    fig.add_trace(go.Bar(x=["mean"], y=[m["tpot_mean"]], marker_color=color, name=mode, showlegend=False), 1, 3)
fig.update_layout(height=320, barmode="group", margin=dict(t=50, b=30), title_text="static vs continuous batching")
show(fig)  # live, with a PNG of it for readers without a kernel

# %%
assert len(fig.data) == 6 and fig.data[0].y[0] == metrics["static"]["tps"]
assert metrics["continuous"]["tps"] > 1.5 * metrics["static"]["tps"]
assert metrics["continuous"]["ttft_mean"] < metrics["static"]["ttft_mean"] / 2
assert metrics["static"]["tpot_mean"] == metrics["continuous"]["tpot_mean"] == 1.0

# %% [markdown]
# ### What a static step computes: padding
#
# Steps are not free on a CPU: a step's cost grows with the tokens in it. So count tokens *computed*, not only
# steps. Classic static batching runs the batch as one padded tensor: a finished member keeps its row and computes
# a token every step, thrown away, until the longest member ends. `scheduling="static"` does exactly that
# (`static_padding=True`, the default: the finished request's output is final, but it keeps its KV blocks and feeds
# its last token at its next position in the same batched model call — `engine.stats.num_padding_tokens` counts
# them). `static_padding=False` is a *charitable* baseline whose finished members stop at once: only the idle-slot
# loss remains. Same steps, same outputs, different work:

# %%
# NBVAL_CHECK_OUTPUT
runs["static, charitable"] = run("static", static_padding=False)
for mode in ("static", "static, charitable", "continuous"):
    s = runs[mode][0].stats
    print(f"{mode:>18}: {s.num_steps:>3} steps, {s.num_computed_tokens:>4} tokens computed = "
          f"{s.num_computed_tokens - s.num_padding_tokens:>4} useful + {s.num_padding_tokens:>3} padding "
          f"({s.num_computed_tokens / s.num_steps:5.2f} per step)")

# %%
static_stats, charitable_stats, cont_stats = (runs[m][0].stats for m in ("static", "static, charitable", "continuous"))
assert [o.token_ids for o in runs["static, charitable"][1]] == [o.token_ids for o in runs["continuous"][1]]
assert static_stats.num_steps == charitable_stats.num_steps
assert charitable_stats.num_computed_tokens == cont_stats.num_computed_tokens  # the same useful work ...
assert static_stats.num_computed_tokens == cont_stats.num_computed_tokens + static_stats.num_padding_tokens
# ... and padding by hand: each batch lasts as long as its longest member; every other member pads the difference
batches = [lens[i:i + 4] for i in range(0, len(lens), 4)]
assert static_stats.num_padding_tokens == sum(max(b) - n for b in batches for n in b)

# %% [markdown]
# In seconds (not checked: it depends on the machine and its load). Continuous steps carry more tokens each, so a
# step costs more, but there are far fewer of them. Padding makes each static step carry more tokens than the
# charitable baseline's; with this tiny model a step's fixed overhead dominates, so the padding costs little here —
# `benchmarks/bench_engine.py` measures both baselines on the bundled model, where a step's cost grows with its
# tokens:

# %%
import time

for mode, kw in (("static", {}), ("static, charitable", dict(static_padding=False)), ("continuous", {})):
    t0 = time.perf_counter()
    engine, outs = run(mode.split(",")[0], **kw)
    wall = time.perf_counter() - t0
    print(f"{mode:>18}: {wall * 1e3:6.0f} ms, {engine.stats.num_generated_tokens / wall:7.0f} tokens/s, mean TTFT "
          f"{np.mean([o.ttft for o in outs]) * 1e3:5.1f} ms, mean TPOT {np.mean([o.tpot for o in outs]) * 1e3:5.2f} ms")

# %% [markdown]
# ## Live: step through either policy
#
# Pick a policy and press **Step** or ▶: each engine step adds one column to the timeline. Watch a slot free up:
# under continuous batching a grey row turns orange in the very next step; under static batching it stays grey
# until the whole batch is done.

# %%
import ipywidgets as widgets

from minienv.viz import Stepper

policy = widgets.ToggleButtons(options=["continuous", "static"], value="continuous", description="batching")
live_tl = RequestTimeline(title="request timeline", step_px=10)
live = {}


def live_reset():
    engine = InferenceEngine(model, tok, scheduling=policy.value, **ENGINE)
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    live["engine"] = engine
    live_tl.reset(caption=policy.value)


def live_step(i):
    engine = live["engine"]
    if not engine.has_unfinished_requests():
        return False
    engine.step()
    s = engine.stats
    caption = f"{policy.value}, step {s.num_steps}: {s.num_running} running, {s.num_waiting} waiting"
    live_tl.update(engine.timeline(), num_steps=s.num_steps, caption=caption)
    return caption


live_stepper = Stepper(live_step, live_reset, n_steps=None, interval_ms=300, description="engine step")
policy.observe(lambda change: live_stepper.reset(), names="value")
live_stepper.reset()
widgets.VBox([policy, live_stepper.widget, live_tl.widget])

# %% [markdown]
# The code drives the same widget: run each policy to the end and check that the live timeline shows exactly what
# the engine recorded.

# %%
# NBVAL_CHECK_OUTPUT
for mode in ("static", "continuous"):
    policy.value = mode  # the observer resets the stepper with a fresh engine
    taken = live_stepper.run()
    engine = live["engine"]
    for rec in engine.history:  # every decode the engine ran is a blue cell in the live picture
        for s in rec.scheduler_output.scheduled:
            if s.kind == "padding":  # a finished static member's thrown-away token: its row has ended, nothing drawn
                assert live_tl.state_at(s.request_id, rec.step) is None and mode == "static"
                continue
            assert live_tl.state_at(s.request_id, rec.step) in (s.kind, "decode" if s.num_new_tokens == 1 else "prefill")
    print(f"{mode:>10}: the stepper took {taken} steps; the timeline shows {live_tl.num_steps} steps, "
          f"{live_tl.count('decode')} decode cells, {live_tl.count('waiting')} waiting cells")

# %%
assert live_stepper.done and live_tl.num_steps == runs["continuous"][0].stats.num_steps
assert live_tl.count("waiting") == timelines["continuous"].count("waiting")
assert len(live_tl.fig.data) == 6 and sum(len(t.x or ()) for t in live_tl.fig.data[:5]) == len(live_tl.segments)

# %% [markdown]
# ## Chunked prefill keeps decodes flowing
#
# Three requests are decoding when a 120-token prompt arrives. The step budget is 32 tokens. Two ways to fit it in:
#
# * **no chunking** (vLLM v0's default scheduler): a waiting prompt is prefilled whole, in a step of its own; the
#   running requests get no token in that step — they **stall**, and that one step is as long as 120 tokens;
# * **chunked prefill** (vLLM v1, SGLang): every step first gives each running request its decode token, then
#   spends what is left of the budget on the next chunk of the prompt.
#
# In miniature, counting tokens per step:

# %%
# NBVAL_CHECK_OUTPUT
def toy_steps(num_decoding, prompt_len, budget, chunked):
    """(decode tokens, prefill tokens) of each step until the long prompt is fully prefilled."""
    steps, left = [], prompt_len
    while left:
        if chunked:
            chunk = min(left, budget - num_decoding)
            steps.append((num_decoding, chunk))
        else:  # the whole prompt in a step of its own; nobody decodes in it
            chunk = left
            steps.append((0, chunk))
        left -= chunk
    return steps


for chunked in (False, True):
    plan = toy_steps(3, 120, 32, chunked)
    print(f"{'chunked' if chunked else 'no chunking':>12}: (decodes, prefill tokens) per step {plan}")

# %% [markdown]
# Without chunking, the three decoders lose a step and that step computes 120 tokens (far over the 32 budget);
# with chunking every step computes at most 32 tokens and all three decode in every one of them. minienv's
# scheduler chunks: it reserves one token per decode still to be scheduled before it sizes a prefill chunk.

# %%
# NBVAL_CHECK_OUTPUT
chunk_engine = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=8, max_num_seqs=4,
                               max_num_batched_tokens=32)
short_ids = [chunk_engine.add_request(rng.integers(0, 128, 6).tolist(), SamplingParams(max_tokens=14, temperature=0))
             for _ in range(3)]
chunk_engine.run(max_steps=2)  # the three are decoding now
long_id = chunk_engine.add_request(rng.integers(0, 128, 120).tolist(), SamplingParams(max_tokens=3, temperature=0))
rows = []
while chunk_engine.output(long_id).num_preemptions == 0 and not chunk_engine.output(long_id).token_ids:
    chunk_engine.step()
    plan = chunk_engine.history[-1].scheduler_output
    by = plan.by_id()
    rows.append((plan.step, plan.num_decode_tokens, by[long_id].num_new_tokens if long_id in by else 0,
                 plan.num_scheduled_tokens))
for step, dec, chunk, total in rows:
    print(f"step {step}: {dec} decodes + prefill chunk of {chunk:>3} tokens = {total} tokens")
_ = chunk_engine.run()  # steps to the end; the views below show the result

# %%
assert all(dec == 3 for _, dec, _, _ in rows)  # every running request decoded in every step
assert [c for _, _, c, _ in rows] == [c for _, c in toy_steps(3, 120, 32, True)]  # the toy's chunks exactly
assert all(total <= 32 for *_, total in rows) and sum(c for _, _, c, _ in rows) == 120
chunk_tl = RequestTimeline(title="chunked prefill: the 120-token prompt arrives at step 2", live="html", step_px=18)
chunk_tl.update(chunk_engine.timeline(), num_steps=chunk_engine.stats.num_steps)
assert all(chunk_tl.state_at(r, s) == "decode" for r in short_ids for s in range(1, 2 + len(rows)))
chunk_tl.static()

# %%
assert [s.num_tokens for s in chunk_tl.segments if s.request_id == long_id and s.state == "prefill"][:len(rows)] \
    == [c for _, _, c, _ in rows]

# %% [markdown]
# The timeline shows the long prompt as a run of orange chunks (29, 29, 29, 29, 4 tokens) while the three short
# rows stay blue throughout: nobody stalls, and no step is longer than 32 tokens.
#
# ## Preemption under a tight budget
#
# Now memory is the limit. Five requests, 24-token prompts, 24 output tokens each, blocks of 8 tokens: together
# they need 5 × 6 = 30 blocks; the budget is 16 blocks (128 tokens). The scheduler admits what fits; as decodes
# grow the tables, a running request asks for a block that is not there. Then it **preempts** the most recently
# admitted request (vLLM's rule): frees its blocks — full ones stay **cached-free** in the LRU, keeping their hash —
# and puts it back at the front of the waiting queue with its generated tokens. When it is readmitted, the prefix
# lookup finds whatever of those blocks is still cached: only the rest is recomputed.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.engine import required_kv_tokens

tight_prompts = [rng.integers(0, 128, 24).tolist() for _ in range(5)]
tight_params = SamplingParams(max_tokens=24, temperature=0)
need = required_kv_tokens([24] * 5, 24, 8)
tight = InferenceEngine(model, tok, kv_budget_tokens=128, block_size=8, max_num_seqs=5, max_num_batched_tokens=64)
tight_outs = tight.generate(tight_prompts, tight_params)
ts = tight.stats
print(f"all at once the requests need {need} KV tokens; the budget is {tight.kv_budget_tokens} "
      f"({tight.kv_budget_tokens / need:.0%})")
print(f"{ts.num_steps} steps, {ts.num_preemptions} preemptions, {ts.num_computed_tokens} tokens computed for "
      f"{5 * 24} prompt + {ts.num_generated_tokens} generated tokens")
preempted_at = {}
resumes = []
for rec in tight.history:
    plan = rec.scheduler_output
    for rid in plan.preempted:
        preempted_at[rid] = rec.step
        print(f"step {rec.step:>2}: request {rid} preempted (the most recently admitted; still running: {plan.running})")
    for s in plan.scheduled:
        if s.is_resume:
            resumes.append((rec.step, s))
            print(f"step {rec.step:>2}: request {s.request_id} resumes: {s.num_cached_tokens:>2} of its "
                  f"{s.num_cached_tokens + s.num_new_tokens} tokens from the prefix cache, {s.num_new_tokens} recomputed")
print(f"prefix cache over the run: {ts.prefix_cache_hits_tokens} of {ts.prefix_cache_queries_tokens} queried tokens "
      f"hit; {ts.evicted_blocks} cached blocks evicted")

# %%
assert ts.num_preemptions == len(resumes) > 0 and all(o.finished for o in tight_outs)
cheap = [(step, s) for step, s in resumes if s.num_cached_tokens >= 24 and s.num_new_tokens < s.num_cached_tokens]
assert cheap  # at least one resume was mostly prefix hits
victim, (resume_step, resume_s) = cheap[0][1].request_id, cheap[0]
pre_tl = RequestTimeline(title=f"a 128-token budget: {ts.num_preemptions} preemptions", live="html", step_px=12)
pre_tl.update(tight.timeline(), num_steps=ts.num_steps)
assert pre_tl.state_at(victim, preempted_at[victim]) == "preempted" and pre_tl.count("preempted") == ts.num_preemptions
pre_tl.static()

# %%
assert pre_tl.state_at(victim, resume_step) == "prefill" and "preempted" in pre_tl.to_svg()
assert [s.num_tokens for s in pre_tl.segments if s.request_id == victim and s.state == "prefill"][-1] \
    == resume_s.num_new_tokens

# %% [markdown]
# Each red cell is a preemption; the orange cell after the grey gap is the resume. The two resumes differ, and the
# LRU of notebook 06 says why: one victim came back while its full blocks were still in the free queue — a short
# chunk; the other waited longer, the running requests' growth took the free queue's blocks from the head, its
# cached blocks were evicted, and it recomputed everything. Slower, never wrong.
#
# ## The proof: nothing lost
#
# Preemption throws K/V away and recomputes it. The request keeps its generated tokens and its own sampler, and
# the recomputation feeds exactly the tokens it had, so its continuation is the same. Check it against each
# request generated **alone**, with no cache, no batching, no preemption:

# %%
# NBVAL_CHECK_OUTPUT
from minienv.generate import generate_ids

alone = [list(generate_ids(model, p, tight_params)) for p in tight_prompts]
same = [list(o.token_ids) == a for o, a in zip(tight_outs, alone)]
print(f"{sum(same)} of {len(same)} outputs equal the request run alone; "
      f"{sum(o.num_preemptions for o in tight_outs)} preemptions among them "
      f"(per request: {[o.num_preemptions for o in tight_outs]})")
print(f"distinct tokens in the outputs: {len({t for a in alone for t in a})} (the outputs are not trivial)")

# %%
assert all(same) and sum(o.num_preemptions for o in tight_outs) == ts.num_preemptions > 0
tight.check_invariants()

# %% [markdown]
# The same on the bundled model, with real text: six speeches under a KV budget of 48 tokens — less than a quarter
# of what they need at once, barely more than one request alone — greedy and seeded sampling mixed, compared with
# each request generated alone.

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
print(f"budget {small.kv_budget_tokens} of the {need_real} KV tokens needed at once; "
      f"{small.stats.num_preemptions} preemptions")
print(f"{sum(list(o.token_ids) == a for o, a in zip(served, alone_real))} of {len(served)} outputs equal the "
      "request run alone")
for o in served[:3]:
    print(f"  {o.prompt!r} -> {o.text!r}")

# %%
assert all(list(o.token_ids) == a for o, a in zip(served, alone_real)) and small.stats.num_preemptions > 0

# %% [markdown]
# The test suite checks the same at two budgets and two block sizes, with sampling and with random workloads
# (`tests/unit/test_nothing_lost.py`).
#
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/07_scheduling.py` — is explained in notebook 00.)
#
# ### Exercise 1: a victim policy of your own
#
# The engine's rule preempts the most recently admitted request. Another reasonable rule: preempt the one with
# the **least work to redo** — the fewest computed tokens. `InferenceEngine(..., victim_policy=fn)` takes your rule:
# `fn(candidates)` gets the requests not yet scheduled in this step, oldest first (`candidates[0]` is the one that
# needs the block), and returns one of them. Each candidate has `num_computed_tokens` and `request_id`.
#
# Write `fewest_computed(candidates)`. Rules: (1) return the candidate with the fewest computed tokens; (2) among
# equals, the most recently admitted (the latest in the list); (3) return the request object itself. The check
# tries hand-made candidate lists first (ties included), then runs tight workloads on a real engine with your
# policy, checks every choice, checks that no output changed, and compares the recomputation with the default.

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
# `min(candidates, key=lambda c: c.num_computed_tokens)` is almost it. Which of several equal candidates does
# `min` return?
# </details>
#
# <details><summary>Hint 2</summary>
#
# `min` keeps the *first* of equals. Give it the list newest first: `reversed(candidates)`.
# </details>
#
# A tempting wrong answer — "the request that needs the block gives way" (`candidates[0]`, usually the one with the
# *most* computed tokens) — is caught by the first rule:

# %%
from minienv.exercises import ExerciseFailed

try:
    check_victim_policy(lambda cands: cands[0])
    raise RuntimeError("the check should have rejected it")
except ExerciseFailed as err:
    print("rejected:", str(err).splitlines()[0])

# %% [markdown]
# Whatever the policy, nothing is lost — the check compares every output with the request alone. What a policy
# changes is only *how much is recomputed* and *who waits*.
#
# ### Exercise 2: split one step's budget
#
# Write `plan_step(needs, budget)`: `needs[i]` is how many tokens running request `i` still has to compute (`1`
# for a request that is decoding; more for one still in prefill), in running order; return how many each computes
# this step. This is the rule of minienv's scheduler (and vLLM's), without memory. Rules: (1) one number per
# request, in order; (2) the step never computes more than `budget` tokens; (3) no request computes more than it
# needs; (4) every decode gets its token, even after a long prefill — decodes never stall; (5) prefill chunks
# take what the decodes leave, in running order: an earlier request first, as much as it needs.

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
# ## Where this lives in vLLM / SGLang
#
# > **vLLM (v1)**
# > * `vllm/v1/core/sched/scheduler.py` — `Scheduler.schedule()`: one token budget (`max_num_batched_tokens`) per
# >   step; running requests first (each gets `num_tokens - num_computed_tokens`, capped by the budget: chunked
# >   prefill falls out of that one rule), then the waiting queue. When `kv_cache_manager.allocate_slots` returns
# >   `None`, the FCFS policy does `preempted_req = self.running.pop()` (the most recently admitted) and
# >   `_preempt_request` frees its blocks, sets `num_computed_tokens = 0` and puts it back at the front of
# >   `waiting`. `update_from_output` appends sampled tokens and checks stop conditions.
# > * `vllm/v1/core/sched/output.py` — `SchedulerOutput` (what minienv's `SchedulerOutput` mirrors);
# >   `vllm/v1/core/sched/request_queue.py` — FCFS and priority waiting queues.
# > * `vllm/core/scheduler.py` (v0) — the older design: prefills and decodes in separate steps unless
# >   chunked prefill is enabled (`_schedule_chunked_prefill`), and `PreemptionMode.SWAP` / `RECOMPUTE`.
# >
# > **SGLang**
# > * `python/sglang/srt/managers/scheduler.py` — `Scheduler.get_next_batch_to_run`: a new prefill batch when
# >   there is room, else the running decode batch; `update_running_batch` retracts requests when memory is short.
# > * `python/sglang/srt/managers/schedule_policy.py` — `SchedulePolicy` orders the waiting queue (FCFS, or
# >   cache-aware longest-prefix-match, LPM); `PrefillAdder` fills a prefill batch within the token budgets and
# >   chunks a long prompt.
# > * `python/sglang/srt/managers/schedule_batch.py` — `ScheduleBatch.retract_decode`: SGLang's preemption, with its
# >   own victim order (by output and input length), recomputed later from the radix cache.

# %% [markdown]
# ## Summary
#
# * **Continuous batching** schedules every step: on a mixed-length workload it took about half the steps of
#   static batching for the same tokens, and cut the mean TTFT by more than half; TPOT in steps stays 1.0 (every
#   running request decodes every step).
# * A **request timeline** (`RequestTimeline`) shows the schedule at a glance: static batches leave idle slots,
#   continuous batching none. And a static slot is not even idle: a padded batch computes a thrown-away token for
#   every finished member until the longest ends (`static_padding`, minienv's default for `"static"`).
# * **Chunked prefill** gives each running request its decode token first and spends the rest of the step budget on
#   the next chunk of a long prompt: decodes never stall and no step exceeds the budget.
# * Under memory pressure the scheduler **preempts by recompute** — the most recently admitted request, by default.
#   Its full blocks stay cached-free in the LRU, so a resume recomputes only what was evicted meanwhile: above, one
#   resume took 32 of its 40 tokens from the cache, the other (whose blocks the LRU had reused) none.
# * **Nothing is lost**: every output under a 128-token budget, with preemptions, equals the request run alone — for
#   any victim policy, and on the bundled model under a 48-token budget with sampling. Notebook 08 puts the whole engine, on the bundled model, behind one dashboard.

# %% [markdown]
# # 09 · Metrics: what to watch when the engine runs, in vLLM's names
#
# Notebook 08 watched one engine through a dashboard of its insides. In production nobody sees the insides: a
# monitoring server (Prometheus) *scrapes* a few dozen numbers from every engine every few seconds, stores them as
# time series, and dashboards and alerts are queries over those series. This notebook gives minienv's engine the
# metrics vLLM exports — the same names, types, units and buckets — and teaches how to read them.
#
# **Learning goals.** After this notebook you can
# 1. say what each standard serving metric measures — gauges (requests running / waiting, KV usage), counters
#    (tokens, prefix-cache queries and hits, preemptions), histograms (time to first token, inter-token latency,
#    end-to-end latency and its queue / prefill / decode parts) — and which part of the engine moves it;
# 2. tell a healthy engine from a thrashing one by its metrics alone, and name the metrics that move when the KV
#    budget shrinks or when prompts share a prefix;
# 3. compute rates and quantiles the way PromQL does (`rate`, `histogram_quantile`), and know how far a quantile
#    read from buckets can be from the true one;
# 4. serve `/metrics` to a real Prometheus without the trap that renames every `vllm:` series;
# 5. find the same metrics in vLLM and in SGLang.

# %%
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matrices: one BLAS thread (set before numpy loads)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import math

import numpy as np

from minienv.engine import InferenceEngine
from minienv.model import load_model
from minienv.sampling import SamplingParams
from minienv.tokenizer import load_tokenizer

tokenizer = load_tokenizer()
model = load_model()  # the bundled model (assets/target)

SCENE = "ACT I. SCENE I. Verona. A public place.\n\n"  # a shared prefix, like a system prompt
SPEAKERS = ["ROMEO", "JULIET", "MERCUTIO", "BENVOLIO", "TYBALT", "NURSE", "CAPULET", "PARIS"]
LINES = ["But soft, what light", "O gentle friend", "What news, my lord?", "Good morrow to you all",
         "I pray thee, tell me", "Come hither, man"]


def prompts(n, shared_prefix=True):
    """n play-script prompts; with `shared_prefix` they all start with the same scene heading."""
    head = SCENE if shared_prefix else ""
    return [f"{head}{SPEAKERS[i % 8]}.\n{LINES[(i * 5) % 6]}" for i in range(n)]


ENGINE = dict(block_size=8, max_num_seqs=8, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=24, temperature=0)


def traffic(engine, texts, per_step=2):
    """Requests arrive `per_step` at a time, one engine step between arrivals (live traffic, not one batch);
    yields after every step, so a caller can read the metrics in between."""
    queue = list(texts)
    while queue or engine.has_unfinished_requests():
        for _ in range(per_step):
            if queue:
                engine.add_request(queue.pop(0), PARAMS)
        engine.step()
        yield engine.stats.num_steps


def serve_traffic(engine, texts, panel=None):
    """All of `traffic`, taking one metrics sample per step when a panel is given."""
    for _ in traffic(engine, texts):
        if panel is not None:
            panel.update()


print([len(tokenizer.encode(p)) for p in prompts(3)], "prompt tokens;", ENGINE, PARAMS)

# %% [markdown]
# ## The problem, with a number
#
# `engine.stats` tells you totals at one moment, and each `RequestOutput` carries its own timings. A service needs
# more: *distributions over time*, in a format every monitoring tool reads. An average alone hides what users
# feel. Twenty-four requests arrive two per step at an engine whose KV budget holds only a few of them at once —
# time to first token, counted in engine steps (deterministic on any machine):

# %%
# NBVAL_CHECK_OUTPUT
from minienv.metrics import metrics_of, serve_metrics

eng = InferenceEngine(model, tokenizer, kv_budget_tokens=160, **ENGINE)
m = metrics_of(eng)  # the engine's Prometheus metrics (explained below), attached before the traffic
serve_traffic(eng, prompts(24))
ttft_steps = sorted(eng.output(str(i)).metrics.ttft_steps for i in range(24))
p90_steps = ttft_steps[math.ceil(0.9 * 24) - 1]
print(f"TTFT in steps: mean {np.mean(ttft_steps):.1f}, median {ttft_steps[11]}, p90 {p90_steps}, "
      f"max {ttft_steps[-1]}; preemptions {eng.stats.num_preemptions}")

# %%
assert p90_steps > 2 * np.mean(ttft_steps)  # the tail is far above the mean
assert eng.stats.num_preemptions > 0

# %% [markdown]
# One user in ten waited more than twice the mean: a p90 of 107<!--out:above--> steps against a mean of
# 50.5<!--out:above-->. A p90 over the last five minutes, per engine, for a fleet: that is what **histograms**
# scraped by Prometheus give, and why vLLM, SGLang and every serving stack export them in one text format.
#
# ## Build it small: a histogram and its text
#
# Prometheus has three kinds of number that matter here. A **counter** only goes up (tokens generated so far); a
# **gauge** goes up and down (requests running now); a **histogram** counts observations into fixed buckets,
# *cumulatively*: the bucket `le="0.1"` counts every observation ≤ 0.1 s, so the `+Inf` bucket counts them all.
# The exposition format is one line per sample: `name{labels} value`.

# %%
class TinyHistogram:
    """Cumulative buckets, a sum and a count: all a Prometheus histogram stores."""

    def __init__(self, bounds):
        self.bounds = list(bounds) + [math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value):
        self.sum += value
        for i, le in enumerate(self.bounds):
            if value <= le:
                self.counts[i] += 1  # cumulative: every bucket at or above the value

    def lines(self, name):
        def le_text(le):
            return "+Inf" if le == math.inf else repr(float(le))
        out = [f'{name}_bucket{{le="{le_text(le)}"}} {float(c)}' for le, c in zip(self.bounds, self.counts)]
        return out + [f"{name}_count {float(self.counts[-1])}", f"{name}_sum {self.sum}"]


tiny = TinyHistogram([0.01, 0.05, 0.1])
for v in (0.004, 0.02, 0.03, 0.07, 0.5):
    tiny.observe(v)
print("\n".join(tiny.lines("ttft_seconds")))

# %% [markdown]
# prometheus-client, the library vLLM uses, writes the same lines for the same observations:

# %%
import prometheus_client

registry = prometheus_client.CollectorRegistry()  # a registry of our own, never the process-wide default
lib = prometheus_client.Histogram("ttft_seconds", "demo", registry=registry, buckets=[0.01, 0.05, 0.1])
for v in (0.004, 0.02, 0.03, 0.07, 0.5):
    lib.observe(v)
text = prometheus_client.generate_latest(registry).decode()
ours = tiny.lines("ttft_seconds")
assert all(line in text.splitlines() for line in ours[:-1])  # every bucket and the count, line for line
assert math.isclose(registry.get_sample_value("ttft_seconds_sum"), tiny.sum)  # the same sum
print(f"{len(ours)} lines identical to prometheus-client's")

# %% [markdown]
# ## minienv's version: `metrics_of(engine)`
#
# `metrics_of(engine)` (`minienv/metrics.py`) is a registry per engine with vLLM's series. Gauges and counters are read
# from the engine's own stats after each step — nothing extra is counted, so they *equal* `engine.stats`.
# Histograms are fed once per token (inter-token latency), once per first token (TTFT), and once per finished
# request (the rest). Where minienv teaches something vLLM does not export, the name says `minienv:`.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.metrics import SERIES, VLLM_RELEASE

print(f"{'series (as Prometheus stores it)':<52} {'type':<9} labels: model_name, engine (+)  — vLLM {VLLM_RELEASE}")
for s in SERIES:
    stored = s.stored_names[0] if len(s.stored_names) == 1 else s.name + "_{bucket,sum,count}"
    extra = ("+ " + ", ".join(s.extra_labels) + " " if s.extra_labels else "") + (
        {"spec_decode": "(with speculative decoding)", "kv_tier": "(with a KV tier)"}.get(s.feature, ""))
    print(f"{stored:<52} {s.type:<9} {extra}")

# %%
s = eng.stats  # the engine of the first cell, whose metrics were attached before its traffic
for name, value in [("vllm:generation_tokens_total", s.num_generated_tokens),
                    ("vllm:prompt_tokens_total", s.num_prompt_tokens),
                    ("vllm:num_preemptions_total", s.num_preemptions),
                    ("vllm:prefix_cache_hits_total", s.prefix_cache_hits_tokens),
                    ("minienv:kv_cache_evicted_blocks_total", s.evicted_blocks)]:
    assert m.value(name) == value, name
assert m.value("vllm:time_to_first_token_seconds_count") == 24  # one TTFT per request that produced a token
parts = sum(m.value(f"vllm:request_{p}_seconds_sum") for p in ("queue_time", "prefill_time", "decode_time"))
assert abs(parts - m.value("vllm:e2e_request_latency_seconds_sum")) < 1e-9  # e2e = queue + prefill + decode
print("\n".join(line for line in m.exposition().splitlines()
                if line.startswith(("vllm:generation_tokens_total", "vllm:num_requests_running",
                                    "vllm:request_success_total{", "vllm:time_to_first_token_seconds_count"))))

# %% [markdown]
# Every request's end-to-end latency splits into **queue** (arrival → first scheduled), **prefill** (→ first
# token) and **decode** (→ finished), from one monotonic clock; the cell above checked that the three sums add up
# to the end-to-end sum. `vllm:request_success_total{finished_reason=...}` counts aborted requests too (vLLM 0.13
# did not: vllm-project/vllm#31503).
#
# ## Live: one scrape at a time
#
# Prometheus never sees the engine: it sees one scrape, then the next — every sample's value at that moment. Step
# the engine and watch two views of the same registry. `ScrapeView` (`minienv/viz/scrape_view.py`) is one scrape:
# each gauge and counter as Prometheus stores it, the ones that changed since the previous scrape highlighted with
# their change, and the TTFT histogram as stored — *cumulative* buckets, with what this scrape added drawn on top:
# a request's first token raises its own bucket and every bucket above it, so `+Inf` always equals `_count`. Its
# caption says what the engine did in that step, read off the counters alone. `MetricsPanel`
# (`minienv/viz/metrics_panel.py`) is the same registry over time, what a Grafana dashboard draws from the
# scrapes: requests running / waiting, KV usage in blocks and in token slots, the prefix hit rate over the last 8
# steps (PromQL's `rate(hits[w]) / rate(queries[w])`), preemptions and evicted blocks, and the TTFT histogram.
#
# Pick a KV budget and whether the prompts share their scene heading, then press **Step** (or ▶): two requests
# arrive, the engine runs one step, and both views take one scrape. Run All stopped at the first step, after a
# preemption, in which a request got its first token (the pictures below); **Step** and ▶ go on from there,
# **Reset** starts again.

# %%
import ipywidgets as widgets

from minienv.viz import Stepper
from minienv.viz.metrics_panel import MetricsPanel
from minienv.viz.scrape_view import ScrapeView
from minienv.viz.static import show  # every figure: live, with a PNG of it for readers without a kernel

budget_choice = widgets.ToggleButtons(options=[("160 tokens (tight)", 160), ("1024 tokens (roomy)", 1024)],
                                      value=160, description="KV budget")
shared_choice = widgets.Checkbox(value=True, description="prompts share a scene heading")
live = {}  # the engine and its traffic since the last reset, and the two views that scrape it


def live_reset():
    engine = InferenceEngine(model, tokenizer, kv_budget_tokens=budget_choice.value, **ENGINE)
    shared = shared_choice.value
    title = (f"KV budget {budget_choice.value} tokens, {'shared' if shared else 'distinct'} prompts, "
             f"2 arrivals per step")
    live.update(engine=engine, steps=traffic(engine, prompts(24, shared_prefix=shared)))
    if "panel" in live:  # the same views, emptied, now watching the new engine (attached before its traffic)
        live["panel"].attach(metrics_of(engine), title=title)
        live["scrape"].attach(metrics_of(engine))
    else:
        live["panel"] = MetricsPanel(metrics_of(engine), title=title)
        live["scrape"] = ScrapeView(metrics_of(engine))


def live_step(i):
    if next(live["steps"], None) is None:  # every request has finished
        return False
    live["panel"].update()
    return live["scrape"].update()  # one scrape; the caption: what changed since the previous one


live_stepper = Stepper(live_step, live_reset, n_steps=None, interval_ms=400, description="engine step")
for choice in (budget_choice, shared_choice):
    choice.observe(lambda change: live_stepper.reset(), names="value")
live_stepper.reset()
live_box = widgets.VBox([widgets.HBox([budget_choice, shared_choice]), live_stepper.widget, live["scrape"].widget,
                         live["panel"].widget])
scrape = live["scrape"]
with live["panel"].batch():  # driven from code: the charts are drawn once at the end (a click draws every step)
    while not (scrape.now["vllm:num_preemptions_total"] and scrape.delta("vllm:time_to_first_token_seconds_count")):
        live_stepper.step()
show(live["panel"].widget, live=live_box)
scrape.static()

# %% [markdown]
# The same scrape in numbers (the TTFT buckets are wall time, so they are drawn but not printed):

# %%
# NBVAL_CHECK_OUTPUT
print(f"engine step {live_stepper.position}; changed since the previous scrape:")
for sample, (before, after) in scrape.changes.items():
    if "_seconds" not in sample:  # the histograms' times are wall time
        print(f"  {sample:<42} {before:>7.4g} -> {after:<7.4g} ({after - before:+.4g})")
print(f"  vllm:time_to_first_token_seconds_count     {scrape.before['vllm:time_to_first_token_seconds_count']:>7.4g}"
      f" -> {scrape.now['vllm:time_to_first_token_seconds_count']:<7.4g}")

# %% [markdown]
# Read it as Prometheus does, one scrape against the previous one. In engine step 26<!--out--> the gauges jumped:
# `num_requests_running` from 1<!--out--> to 5<!--out-->, `num_requests_waiting` from 20<!--out--> to
# 16<!--out--> — four requests admitted at once. To hold them the pool evicted cached-free blocks
# (`minienv:kv_cache_cached_free_blocks` fell from 11<!--out--> to 2<!--out-->, the eviction counter rose by
# +9<!--out-->), and KV usage went from 0.35<!--out--> to 0.9<!--out-->. Only one request produced its first token
# in this step: the TTFT histogram's `_count` went from 6<!--out--> to 7<!--out-->, and that single observation is
# the orange cap on its own bucket *and on every bucket above it*. `vllm:num_preemptions_total` is not in the list:
# a scrape shows a counter's total, and this step added nothing to it. Press **Step** a few times and watch which
# rows light up: generation tokens on almost every step, preemptions and evictions in bursts, the histogram only
# when a request gets its first token.

# %%
panel, live_engine = live["panel"], live["engine"]
assert len(panel.samples) == live_engine.stats.num_steps == live_stepper.position  # one scrape per engine step
assert scrape.now["vllm:num_preemptions_total"] == live_engine.stats.num_preemptions > 0  # the scrape is the engine
for sample, (before, after) in scrape.changes.items():  # a counter, and every part of a histogram, only goes up
    if sample.endswith(("_total", "_count", "_sum")) or "_bucket{" in sample:
        assert after > before, sample
cumulative = scrape.buckets()  # [(le, count before, count now), ...], +Inf last
added = [now - before for _, before, now in cumulative]
assert all(a <= b for a, b in zip(added, added[1:])), "an observation raises its bucket and every bucket above it"
assert added[-1] == scrape.delta("vllm:time_to_first_token_seconds_count") >= 1
assert cumulative[-1][2] == scrape.now["vllm:time_to_first_token_seconds_count"]  # +Inf is the count
assert max(s.kv_tokens for s in panel.samples) < max(s.kv_blocks for s in panel.samples)  # blocks overstate

# %% [markdown]
# ## What moves when: healthy vs thrashing, shared vs distinct prompts
#
# Same traffic, the widget's four settings: a KV budget that holds everybody (healthy) or only a few requests
# (thrashing), and prompts that share their scene heading or not — each on a fresh engine with a panel that only
# records (no live charts to redraw). Only counters and step counts are printed — they are the same on every
# machine.

# %%
# NBVAL_CHECK_OUTPUT
runs = {}
for budget, label in ((1024, "healthy"), (160, "thrashing")):
    for shared in (True, False):
        e = InferenceEngine(model, tokenizer, kv_budget_tokens=budget, **ENGINE)
        p = MetricsPanel(metrics_of(e), live=False, title=f"{label}: {budget}-token KV budget, "  # attached now
                         f"{'shared' if shared else 'distinct'} prompts")
        serve_traffic(e, prompts(24, shared_prefix=shared), panel=p)
        runs[label, shared] = (e, p)
        v = metrics_of(e).value
        hit = v("vllm:prefix_cache_hits_total") / v("vllm:prefix_cache_queries_total")
        print(f"{label:>9}, {'shared' if shared else 'distinct'} prompts: {e.stats.num_steps:3d} steps, "
              f"peak running {max(s.running for s in p.samples):.0f}, peak waiting "
              f"{max(s.waiting for s in p.samples):2.0f}, preemptions {v('vllm:num_preemptions_total'):3.0f}, "
              f"evicted blocks {v('minienv:kv_cache_evicted_blocks_total'):3.0f}, prefix hit rate {hit:.0%}")

# %%
(healthy, hp), (thrash, tp) = runs["healthy", True], runs["thrashing", True]
hv, tv = metrics_of(healthy).value, metrics_of(thrash).value
assert hv("vllm:num_preemptions_total") == 0 < tv("vllm:num_preemptions_total")  # too little KV: preemption
assert max(s.waiting for s in tp.samples) > max(s.waiting for s in hp.samples)  # ...and a queue
assert thrash.stats.num_steps > healthy.stats.num_steps  # recomputation costs steps
distinct = metrics_of(runs["healthy", False][0]).value
hit_rate = lambda v: v("vllm:prefix_cache_hits_total") / v("vllm:prefix_cache_queries_total")  # noqa: E731
assert hit_rate(hv) > 5 * hit_rate(distinct)  # the shared scene heading is computed once, then hit
assert tv("minienv:kv_cache_evicted_blocks_total") > 0  # the tight pool reuses cached-free blocks
assert [s.preemptions for s in tp.samples[:len(panel.samples)]] == [s.preemptions for s in panel.samples]  # replayed

# %% [markdown]
# Read it as an operator would:
#
# * **Healthy**: the queue is the burst of arrivals waiting for one of the `max_num_seqs = 8` batch slots (a peak of
#   16<!--out:above--> waiting), and it drains steadily; no preemptions, no evictions; KV usage rises and falls with
#   the traffic; 75<!--out:above--> steps.
# * **Thrashing**: `vllm:num_requests_waiting` keeps a queue, `vllm:num_preemptions_total` climbs steadily
#   (17<!--out:above--> preemptions with shared prompts, 23<!--out:above--> with distinct ones; each throws K/V away
#   and recomputes it later), KV usage sits near 1, evictions climb, and TTFT's tail stretches: the same traffic
#   takes 144<!--out:above--> steps instead of 75<!--out:above-->. The fix is capacity (more KV, or fewer
#   `max_num_seqs`), not a faster model.
# * **Shared prefix**: `vllm:prefix_cache_hits_total` grows with `queries` — the scene heading is computed once: a
#   60 %<!--out:above--> hit rate against 6 %<!--out:above--> for distinct prompts. Under thrashing the hit rate can
#   still be high (53 %<!--out:above-->): a preempted request's resume finds its own blocks cached.
#
# The widget's picture stopped partway through the thrashing run; here are the healthy run's charts (shared prompts)
# from start to end — no preemptions, no evictions, a shorter run (or set the widget's budget to 1024 and press ▶):

# %%
hp.static()

# %%
assert hp.samples[-1].preemptions == hp.samples[-1].evicted_blocks == 0 < tp.samples[-1].preemptions
assert len(hp.samples) < len(tp.samples)
svg = hp.to_svg()
assert svg.startswith("<svg") and svg.count("<polyline") >= 6 and "time to first token" in svg

# %% [markdown]
# ## PromQL, worked through
#
# Prometheus stores each series as (time, value) samples; dashboards query them with PromQL.
#
# **`rate(c[w])`** — how fast a counter grows: `(value now − value w ago) / w`, per second (with care for counter
# resets). `rate(vllm:generation_tokens_total[1m])` is tokens/s. The same, by hand, from two reads of the registry
# around a burst of steps:

# %%
import time

rate_engine = InferenceEngine(model, tokenizer, kv_budget_tokens=1024, **ENGINE)
for text in prompts(8):
    rate_engine.add_request(text, SamplingParams(max_tokens=40, temperature=0))
while any(rate_engine.output(str(i)).metrics.first_token_time is None for i in range(8)):
    rate_engine.step()  # until all 8 prompts are prefilled and decoding
read = metrics_of(rate_engine).value
t1, v1 = time.perf_counter(), read("vllm:generation_tokens_total")
for _ in range(20):
    rate_engine.step()
t2, v2 = time.perf_counter(), read("vllm:generation_tokens_total")
print(f"rate = ({v2:.0f} - {v1:.0f}) / {t2 - t1:.3f} s = {(v2 - v1) / (t2 - t1):.0f} tokens/s; "
      f"per step: {(v2 - v1) / 20:.0f} tokens (8 requests decoding)")

# %%
assert v2 - v1 == 20 * 8  # 8 requests, one token each per step

# %% [markdown]
# **`histogram_quantile(φ, rate(h_bucket[w]))`** — a quantile from buckets. Prometheus does not have the raw values,
# only cumulative bucket counts, so it (1) finds the *rank* φ × total, (2) finds the first bucket whose cumulative
# count reaches the rank, and (3) interpolates linearly inside that bucket, assuming its observations are spread
# evenly between the bucket's lower and upper bounds. Worked example: buckets `le=0.01 → 5`, `le=0.02 → 9`,
# `le=0.04 → 10`, `+Inf → 10`, φ = 0.9. Rank = 9; the first bucket reaching 9 is `le=0.02`; it holds 9 − 5 = 4
# observations between 0.01 and 0.02, and the rank is the 4th of them: 0.01 + 0.01 × 4/4 = **0.02 s**.
#
# The answer can only be as fine as the buckets. vLLM's buckets are made for large models on GPUs; minienv's tiny
# model decodes a token in a couple of milliseconds, so on an unloaded machine nearly every inter-token latency
# falls into vLLM's first bucket (≤ 10 ms), and the quantile can only say "somewhere in 0–10 ms" (the count below
# is wall time, so it varies from run to run and is not asserted):

# %%
itl = m.histogram_buckets("vllm:inter_token_latency_seconds")
total = itl[-1][1]
print(f"{itl[0][1]:.0f} of {total:.0f} inter-token latencies are in the first bucket (le={itl[0][0]} s); "
      f"if most are there, histogram_quantile(0.5) says a point inside 0–10 ms, whatever the truth is")

# %% [markdown]
# ## Serving `/metrics`, and the trap that renames every series
#
# `serve_metrics(engine, port)` serves the registry over HTTP (prometheus-client's own threaded server, on
# 127.0.0.1; port 0 picks a free one). A Prometheus 2.42 asks for the OpenMetrics format first. prometheus-client
# 0.26 answers it with sample names escaped as if they were *label* names, and `:` is not allowed in a label
# name — so Prometheus stores `vllm_generation_tokens_total`, and every `vllm:` query of a vLLM dashboard finds
# nothing. minienv's server always answers in the classic text format, where `:` is legal:

# %%
import urllib.request

from prometheus_client.exposition import choose_encoder

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # what Prometheus 2.42 sends
with serve_metrics(eng, 0) as server:
    request = urllib.request.Request(server.url, headers={"Accept": PROMETHEUS_ACCEPT})
    with urllib.request.urlopen(request, timeout=5) as response:
        served, content_type = response.read().decode(), response.headers["Content-Type"]
stock = choose_encoder(PROMETHEUS_ACCEPT)[0](metrics_of(eng).registry).decode()  # what the library would answer
pick = lambda body: [ln.split("{")[0] for ln in body.splitlines() if "generation_tokens_total{" in ln]  # noqa: E731
print("minienv serves:          ", content_type, pick(served))
print("prometheus-client stock: ", pick(stock))

# %%
assert pick(served) == ["vllm:generation_tokens_total"] and pick(stock) == ["vllm_generation_tokens_total"]
assert not server.running

# %% [markdown]
# The test suite checks this against a **real** Prometheus (the `prometheus` tier, `tests/prometheus/`): it starts
# Debian's Prometheus 2.42, scrapes an engine every 250 ms, runs traffic, and asks Prometheus' HTTP API which
# series it stored and what values they hold — which must equal `engine.stats`. A Grafana dashboard for these
# series ships in `assets/grafana/minienv.json` (`docs/SERVING.md`: how to import it); every query in it is run against the
# real server too.
#
# ## Exercise 1: p90 TTFT from the buckets
#
# (How exercises work — stubs, checks, hints, solutions — is explained in notebook 00.)
#
# Write `quantile_from_buckets(q, buckets)`: PromQL's `histogram_quantile` on one histogram. `buckets` is
# `[(le, cumulative_count), ...]` sorted by `le`, `float("inf")` last — what `m.histogram_buckets(name)` returns.
# Rules: (1) the counts are cumulative; (2) find the bucket that holds rank `q * total` — the first whose count is
# `>= rank`, even when empty buckets follow it (and even when `q = 1`); (3) interpolate linearly inside it, from its
# lower bound — the previous bucket's `le`, even when that bucket is empty — to its own `le`; (4) the first
# bucket's lower bound is 0; (5) a rank in the `+Inf` bucket gives the largest finite bound, even when that bucket
# is empty; (6) no observations → NaN. The check runs a case per rule and per edge, then the live TTFT histogram of
# the thrashing run, where your p90 must land in the bucket that holds the exact p90 of the raw TTFTs.

# %%
from minienv.exercises.metrics import check_increase, check_quantile_from_buckets


def quantile_from_buckets(q, buckets):
    """PromQL's histogram_quantile(q, ...) on cumulative buckets [(le, count), ...], +Inf last."""
    raise NotImplementedError("your code here")


# %%
thrash_ttft = [thrash.output(str(i)).metrics.ttft for i in range(24)]
check_quantile_from_buckets(quantile_from_buckets, metrics_of(thrash).histogram_buckets(
    "vllm:time_to_first_token_seconds"), thrash_ttft)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# The rank is `q * total`, and `total` is the `+Inf` bucket's count.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Walk the buckets keeping the previous bound and the previous cumulative count: the bucket you stop in holds
# `count - previous_count` observations between `previous_le` and `le`.
# </details>
#
# <details><summary>Hint 3</summary>
#
# If you stop in the `+Inf` bucket there is no upper bound to interpolate to: answer the previous bound.
# </details>

# %% [markdown]
# ## Exercise 2: a counter across a restart
#
# Counters only go up — until the process restarts and they start again from 0. That is why nobody plots a
# counter's raw value, and why PromQL's `increase()` and `rate()` treat **any decrease as a reset**: the value after
# the drop counted from 0, so all of it is increase. Write `increase(samples)` for `[(seconds, value), ...]`
# (oldest first), without PromQL's extrapolation to the window's edges. Rules: (1) without a reset, last minus
# first — two samples are enough; (2) an equal value is not a reset; (3) a lower value is a reset: the new value
# is all increase — also between the first two samples, and when the new value is 0; (4) every reset counts, two in a
# row too; (5) fewer than two samples → `None`. The check runs a case per rule and per edge, then live samples
# of `vllm:generation_tokens_total` read after every step of one engine and then of its replacement.

# %%
def increase(samples):
    """How much a counter grew over [(seconds, value), ...], counter resets included; None with < 2 samples."""
    raise NotImplementedError("your code here")


# %%
counter_samples, servers = [], []
for restart in range(2):  # an engine, then a new one in its place: its counters start again from 0
    server_engine = InferenceEngine(model, tokenizer, kv_budget_tokens=1024, **ENGINE)
    servers.append(server_engine)
    for text in prompts(6):
        server_engine.add_request(text, PARAMS)
    while server_engine.has_unfinished_requests():
        server_engine.step()
        counter_samples.append((time.perf_counter(), metrics_of(server_engine).value("vllm:generation_tokens_total")))
true_increase = (servers[0].stats.num_generated_tokens - counter_samples[0][1]) + servers[1].stats.num_generated_tokens
check_increase(increase, counter_samples, true_increase)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Walk consecutive pairs of samples; each pair contributes its own increase.
# </details>
#
# <details><summary>Hint 2</summary>
#
# If `after < before`, the counter restarted in between: the pair contributes `after` (counted from 0), not
# `after - before`. If `after == before`, nothing happened.
# </details>

# %%
assert any(b[1] < a[1] for a, b in zip(counter_samples, counter_samples[1:]))  # the restart shows as a drop
assert counter_samples[-1][1] - counter_samples[0][1] < true_increase  # last − first undercounts across it

# %% [markdown]
# (Solutions: `solutions/09_metrics.py`.)
#
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if the TTFT histogram's buckets were ten times coarser? How far could a bucket-estimated p90 drift from the
#   true one, and where would you add a bucket first?
#
# ## Where it lives in vLLM and SGLang
#
# | minienv (`minienv/metrics.py`) | vLLM v0.11.0 ([`vllm/v1/metrics/loggers.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/metrics/loggers.py), [`vllm/v1/metrics/stats.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/metrics/stats.py)) | SGLang v0.5.3 ([`python/sglang/srt/metrics/collector.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/metrics/collector.py)) |
# |---|---|---|
# | where the numbers are made: the engine's stats after each step, read into the registry | `Scheduler.make_stats()` in [`vllm/v1/core/sched/scheduler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/sched/scheduler.py) → `SchedulerStats` → `PrometheusStatLogger` (`loggers.py`) | the scheduler's `SchedulerMetricsMixin` ([`python/sglang/srt/managers/scheduler_metrics_mixin.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/scheduler_metrics_mixin.py)) → `SchedulerMetricsCollector` |
# | `vllm:num_requests_running` / `_waiting` | the same (`SchedulerStats.num_running_reqs`, `num_waiting_reqs`) | `sglang:num_running_reqs`, `sglang:num_queue_reqs` |
# | `vllm:kv_cache_usage_perc` (blocks) · `minienv:kv_cache_token_usage_perc` | `vllm:kv_cache_usage_perc` (blocks only) | `sglang:token_usage` (SGLang's pool is per token) |
# | `vllm:prefix_cache_queries` / `_hits` (tokens) | the same (`PrefixCacheStats`) | `sglang:cache_hit_rate` (a gauge ratio) |
# | `vllm:num_preemptions` | the same | `sglang:num_retracted_reqs` (SGLang calls preemption *retraction*) |
# | `vllm:prompt_tokens`, `vllm:generation_tokens` | the same | `sglang:prompt_tokens_total`, `sglang:generation_tokens_total` |
# | `vllm:request_success{finished_reason}` | the same (its `abort` series stays 0: vLLM #31503, reported on v0.13.0) | — |
# | TTFT, ITL, e2e histograms | `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds` | `sglang:time_to_first_token_seconds`, `sglang:inter_token_latency_seconds`, `sglang:e2e_request_latency_seconds` |
# | queue / prefill / decode time | `vllm:request_queue_time_seconds`, `_prefill_time_`, `_decode_time_` | `sglang:queue_time_seconds` |
# | `minienv:kv_cache_evicted_blocks` / `_tokens`, `minienv:kv_cache_cached_free_blocks` | — (KV events, not metrics) | — |
# | `vllm:spec_decode_num_drafts` / `_draft_tokens` / `_accepted_tokens` / `_accepted_tokens_per_pos` (notebook 12) | the same ([`vllm/v1/spec_decode/metrics.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/spec_decode/metrics.py)) | `sglang:spec_accept_length` |
# | `vllm:external_prefix_cache_queries` / `_hits`, `minienv:kv_tier_*` (notebook 11) | — (v0.11.0 has no connector hit counters; the `vllm:external_prefix_cache_*` names minienv uses come from later releases) | HiCache storage counters: `sglang:prefetched_tokens_total`, `sglang:backuped_tokens_total` (`StorageMetricsCollector`) |
#
# Two traps worth knowing. vLLM registers into prometheus-client's process-wide registry and unregisters its own
# metrics first (`unregister_vllm_metrics()` in [`vllm/v1/metrics/loggers.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/metrics/loggers.py)), because a second engine in the same process would
# otherwise crash on duplicate names; minienv gives every engine its own registry (the second engine below
# registers cleanly). And renamed metrics break dashboards silently: vLLM's `time_per_output_token_seconds` became
# `inter_token_latency_seconds`, `gpu_cache_usage_perc` became `kv_cache_usage_perc`.

# %%
# NBVAL_CHECK_OUTPUT
again = InferenceEngine(model, tokenizer, kv_budget_tokens=160, **ENGINE)
again.generate(prompts(2), PARAMS)
successes = sum(metrics_of(again).value("vllm:request_success_total", finished_reason=r) for r in ("length", "stop"))
print(f"a second engine, its own registry: {metrics_of(again).registry is not metrics_of(eng).registry}; metrics attached "
      f"after generate(): generation tokens {metrics_of(again).value('vllm:generation_tokens_total'):.0f} (totals, from "
      f"its stats), request_success {successes:.0f} (events, counted from the attach on)")

# %%
assert metrics_of(again).value("vllm:generation_tokens_total") == again.stats.num_generated_tokens

# %% [markdown]
# ## Summary
#
# * **Gauges** say how the engine is now (running, waiting, KV usage); **counters** only grow and are read as
#   rates (tokens/s, hits/queries, preemptions/s); **histograms** keep cumulative bucket counts from which
#   quantiles are estimated — as fine as the buckets, no finer.
# * A healthy engine drains its queue and rarely preempts; a thrashing one keeps a queue, preempts and evicts
#   steadily, and its TTFT tail stretches. A shared prefix shows up as prefix-cache hits.
# * Block-based KV usage overstates what the K/V occupies (a half-filled block counts as full); minienv also
#   exports usage in token slots.
# * minienv exports vLLM's names, types, units and buckets, so a vLLM dashboard reads it unchanged — provided the
#   scrape keeps the `:` in the names, which minienv's `/metrics` guarantees and a real Prometheus test checks.

# %% [markdown]
# # 10 · Serving: the engine behind a gRPC API, and several engines behind a balancer
#
# Until now the engine lived inside this notebook's Python process. A real engine is a **server**: other programs
# reach it over the network, many at once; they stream tokens, give up half way, set deadlines, and arrive faster
# than it can serve them. And one server is rarely enough: several instances run side by side behind a load
# balancer — where a second lesson waits for the prefix cache of notebooks 05–06.
#
# **Learning goals.** After this notebook you can
# 1. start `python -m minienv serve` as a separate process, check its health, and stop it cleanly;
# 2. stream a request over gRPC and read its chunks and its final message (finish reason, cached tokens, TTFT);
# 3. say what happens to a request's KV blocks when its client cancels or its deadline passes — and watch them
#    come back;
# 4. explain **back-pressure**: why a full waiting queue answers `RESOURCE_EXHAUSTED` instead of queueing without
#    bound, and how a client retries with exponential backoff;
# 5. explain why **round-robin** balancing lowers the prefix-cache hit rate of N instances, and how
#    **prefix-aware routing** (SGLang's router, llm-d) wins it back;
# 6. find the same parts in vLLM and SGLang.

# %%
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matrices: one BLAS thread (set before numpy loads)
# This process will start server processes *after* it has opened gRPC channels. gRPC's fork support would run
# handlers around each fork; our children exec a fresh Python at once, so switch it off before grpc loads.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"

import numpy as np

from minienv.engine import InferenceEngine
from minienv.model import load_model
from minienv.sampling import SamplingParams
from minienv.tokenizer import load_tokenizer

tokenizer = load_tokenizer()
model = load_model()  # the bundled model (assets/target), the same one every server below loads

BLOCK = 16  # the servers' block size (vLLM's default)
SCENES = [  # four "system prompts": every request starts with one of them
    "ACT I. SCENE I. Verona. A public place.\n\nEnter SAMPSON and GREGORY, of the house of Capulet, with swords "
    "and bucklers.\n\n",
    "ACT II. SCENE II. Capulet's orchard.\n\nEnter ROMEO, who hath climbed the wall, and JULIET above at a "
    "window.\n\n",
    "ACT III. SCENE I. A room of state in the castle of Elsinore.\n\nEnter KING, QUEEN, POLONIUS, OPHELIA, and "
    "lords.\n\n",
    "ACT I. SCENE III. A heath near Forres.\n\nThunder. Enter the three WITCHES, and after them MACBETH and "
    "BANQUO.\n\n",
]
SPEAKERS = ["ROMEO", "JULIET", "HAMLET", "MACBETH", "NURSE", "KING", "FIRST WITCH", "BANQUO"]
LINES = ["What news?", "I pray thee, speak", "Good morrow", "O, woe the day", "Come hither", "Peace, I say"]
rng = np.random.default_rng(0)
TRAFFIC = [f"{SCENES[s]}{SPEAKERS[(3 * q + s) % 8]}.\n{LINES[(q + s) % 6]}" for s in range(4) for q in range(8)]
TRAFFIC = [TRAFFIC[i] for i in rng.permutation(len(TRAFFIC))]  # 32 requests, the scenes interleaved
SHORT = SamplingParams(max_tokens=4, temperature=0)
print(f"{len(TRAFFIC)} requests; scene prompts of {[len(tokenizer.encode(s)) for s in SCENES]} tokens "
      f"= {[len(tokenizer.encode(s)) // BLOCK for s in SCENES]} full blocks of {BLOCK}")

# %% [markdown]
# ## The problem, with a number
#
# The 32 requests above share four scene headings — four system prompts. Served by **one** engine, each heading
# is computed once and then served from the prefix cache. Now add instances to serve more traffic, and put a
# **round-robin** balancer in front: request *i* goes to instance *i* mod N. Here it is in this process, with N
# engines side by side, each with the same ample KV budget (nothing is ever evicted):

# %%
# NBVAL_CHECK_OUTPUT
def round_robin_hit_rate(n_instances, prompts=TRAFFIC):
    """Prefix-cache hit rate (cached prompt tokens / prompt tokens) with requests dealt round robin."""
    engines = [InferenceEngine(model, tokenizer, kv_budget_tokens=1024, block_size=BLOCK, max_num_seqs=4)
               for _ in range(n_instances)]
    hits = total = 0
    for i, prompt in enumerate(prompts):
        out = engines[i % n_instances].generate([prompt], SHORT)[0]
        hits, total = hits + out.num_cached_tokens, total + len(out.prompt_token_ids)
    return hits / total


in_process = {n: round_robin_hit_rate(n) for n in (1, 2, 4)}
for n, rate in in_process.items():
    print(f"{n} instance{'s' if n > 1 else ' '} behind round robin: prefix-cache hit rate {rate:.1%}")

# %%
assert in_process[1] > in_process[2] > in_process[4]  # more instances, fewer hits: each cache sees a slice

# %% [markdown]
# Four times the engines, and the cache hits fell from 65 % to 40 %: behind round robin, **every** instance sees
# every scene heading, so each computes each heading itself. The more instances, the more often the same prefix
# is prefilled. By the end of this notebook, a router that sends each scene to *one* instance gets the single
# engine's hit rate back with any number of instances. First, the server.
#
# ## Build it small: a server in a subprocess
#
# `python -m minienv serve` (`minienv/serving/server.py`) loads the model, then serves the engine over gRPC on
# 127.0.0.1. One thread steps the engine; each call's handler hands its request in and receives only its own
# outputs. `--port 0` lets it pick a free port, which it prints once it is serving. Starting one by hand takes a
# few lines — and one promise: **the process is stopped when we are done, even if a cell fails** (here:
# `atexit`, which runs when the kernel stops).

# %%
import atexit
import subprocess
import sys


def start_server(*flags):
    """Start `python -m minienv serve --port 0 FLAGS` and return (process, address) once it is serving."""
    proc = subprocess.Popen([sys.executable, "-m", "minienv", "serve", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    atexit.register(stop_servers, proc)  # stopped when the kernel exits, whatever happens in between
    banner = proc.stdout.readline()  # "minienv serve: serving minienv.v1.MinienvEngine on 127.0.0.1:PORT ..."
    if " on " not in banner:
        stop_servers(proc)
        raise RuntimeError(f"the server did not start: {banner}{proc.stdout.read()}")
    return proc, banner.split(" on ")[1].split()[0]


def stop_servers(*procs, timeout=10):
    """SIGTERM each (a server drains: in-flight requests get --grace seconds), then wait; SIGKILL one that is
    still alive after `timeout`. One SIGTERM only: a second one could hit a server that is already exiting,
    after Python has put back the default handler, and kill it mid-exit. Returns the exit statuses."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]


# Small on purpose: at most 2 requests running and 2 waiting, so the flood below overflows it.
server, address = start_server("--kv-budget-tokens", "512", "--block-size", str(BLOCK), "--max-num-seqs", "2",
                               "--max-waiting", "2", "--grace", "1")
print("serving at", address, "pid", server.pid)

# %% [markdown]
# Is it up? Every gRPC server can carry the standard **health service** (`grpc.health.v1`): load balancers and
# Kubernetes probes ask it. minienv's says `NOT_SERVING` while the model loads and while it drains.

# %%
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minienv.serving import minienv_pb2 as pb
from minienv.serving import minienv_pb2_grpc as pb_grpc

channel = grpc.insecure_channel(address)
stub = pb_grpc.MinienvEngineStub(channel)
health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="minienv.v1.MinienvEngine"),
                                                   timeout=5)
info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
print("health:", health_pb2.HealthCheckResponse.ServingStatus.Name(health.status))
print(f"KV: {info.num_blocks} blocks of {info.block_size} tokens, {info.num_blocks_in_use} in use; "
      f"max_waiting {info.max_waiting}")

# %%
assert health.status == health_pb2.HealthCheckResponse.SERVING and server.poll() is None
assert (info.num_blocks, info.block_size, info.num_blocks_in_use, info.max_waiting) == (512 // BLOCK, BLOCK, 0, 2)

# %% [markdown]
# ## Streaming from a client
#
# `Generate` is a *server-streaming* call (`proto/minienv/v1/minienv.proto`): one request in, a stream of
# messages out — zero or more `chunk`s (new token ids and their text), then exactly one `complete` (all ids, the
# finish reason, how many prompt tokens came from the prefix cache, the time to first token). The text appears as
# it is generated, as in a chat UI:

# %%
PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?"
request = pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=24, temperature=0))
chunks, final = [], None
for message in stub.Generate(request, timeout=30):  # a chat UI would print each chunk as it arrives
    if message.WhichOneof("response") == "chunk":
        chunks.append(message.chunk)
    else:
        final = message.complete
print("|".join(c.text for c in chunks))  # | marks where one message ended and the next began
print(f"[{final.finish_reason}] {len(chunks)} chunks, {len(final.output_ids)} tokens, "
      f"{final.cached_tokens} cached prompt tokens, TTFT {final.ttft_s * 1e3:.0f} ms (not checked: timing)")

# %%
local = InferenceEngine(model, tokenizer, kv_budget_tokens=512, block_size=BLOCK).generate(
    [PROMPT], SamplingParams(max_tokens=24, temperature=0))[0]
assert [t for c in chunks for t in c.token_ids] == list(final.output_ids)  # the chunks add up to the whole
assert "".join(c.text for c in chunks) == final.text
assert list(final.output_ids) == list(local.token_ids) and final.text == local.text  # served == in-process, greedy
assert final.finish_reason == "length" and final.ttft_s > 0

# %% [markdown]
# The served text is token for token what the in-process engine generates: the server adds a transport, not a
# different engine.
#
# ## Cancel a request, and watch its blocks come back
#
# A client that stops listening must not keep KV blocks. When a call is cancelled — or its deadline passes — the
# handler's call ends, and a callback asks the engine thread to abort the request: its blocks are freed before
# the next step. `GetServerInfo` shows the blocks in use while a long request runs, then after the cancel:

# %%
import time


def blocks_in_use():
    return stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).num_blocks_in_use


long_request = pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=400, temperature=0))
call = stub.Generate(long_request, timeout=60)
seen = [next(call).chunk.text for _ in range(8)]  # read 8 chunks: the request is running
during = blocks_in_use()
call.cancel()  # the client gives up
after, t0 = [], time.perf_counter()
while not after or (after[-1] > 0 and time.perf_counter() - t0 < 5):
    after.append(blocks_in_use())
    time.sleep(0.01)
print(f"after {len(seen)} chunks: {during} blocks in use; cancelled -> {after[-1]} in use "
      f"(polled {len(after)} times); the call says {call.code().name}")

# %%
assert during >= 2 and after[-1] == 0  # the prompt and its first tokens held blocks; all of them came back
assert call.code() == grpc.StatusCode.CANCELLED

# %% [markdown]
# A **deadline** is the same end, decided by the clock: the client sends "answer within 50 ms" with the call; when
# it passes, both sides end the call with `DEADLINE_EXCEEDED` and the server aborts the request.

# %%
try:
    for _ in stub.Generate(long_request, timeout=0.05):
        pass
    deadline_code = None
except grpc.RpcError as err:
    deadline_code = err.code()
t0 = time.perf_counter()
while blocks_in_use() and time.perf_counter() - t0 < 5:
    time.sleep(0.01)
print(deadline_code.name, "-> blocks in use:", blocks_in_use())

# %%
assert deadline_code == grpc.StatusCode.DEADLINE_EXCEEDED and blocks_in_use() == 0

# %% [markdown]
# ## Back-pressure: `RESOURCE_EXHAUSTED` under a flood
#
# This server runs at most 2 requests (`--max-num-seqs 2`) and lets at most 2 more wait (`--max-waiting 2`). What
# should request number 12 of a sudden burst get? Queueing everything means unbounded memory and latency that
# grows without limit — every client times out, and the server keeps working for clients that are gone. A bounded
# queue answers at once with a status the client can act on: `RESOURCE_EXHAUSTED`, "retry later". Twelve
# requests at the same moment (each gRPC call starts when it is made; we read them afterwards):

# %%
flood = [stub.Generate(pb.GenerateRequest(text=t, sampling_params=pb.SamplingParams(max_tokens=8, temperature=0)),
                       timeout=30) for t in TRAFFIC[:12]]
outcomes = []
for call in flood:
    try:
        done = [m.complete for m in call if m.WhichOneof("response") == "complete"]
        outcomes.append(done[0].finish_reason)
    except grpc.RpcError as err:
        outcomes.append(err.code().name)
print(outcomes)
refusal = next(call for call in flood if call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED).details()
print("the server says:", refusal)

# %%
assert len(outcomes) == 12 and set(outcomes) <= {"length", "RESOURCE_EXHAUSTED"}  # nothing lost, nothing else
assert outcomes.count("RESOURCE_EXHAUSTED") >= 1 and outcomes.count("length") >= 2  # at least max_waiting got in
assert blocks_in_use() == 0

# %% [markdown]
# Every request ended — with its tokens or with a clear refusal — and the refused ones cost the server nothing.
# (How many are refused depends on timing: a request that is admitted frees its waiting slot. Not checked.)
#
# A refused client should **retry, later**. gRPC can do it by itself: a channel's *service config* carries a
# retry policy — which status codes to retry, how many attempts, and an **exponential backoff** with jitter: retry
# *n* waits a random time between 0 and `min(initialBackoff × multiplier^(n−1), maxBackoff)`. Spreading the retries
# out is the point: a burst that retried in lockstep would be the same burst again. A call is retried only before
# the server sent anything, so no client ever sees a token twice. The same flood through such a channel:

# %%
import json

retry_config = {"methodConfig": [{
    "name": [{"service": "minienv.v1.MinienvEngine"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "1s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]}
patient = grpc.insecure_channel(address, options=[("grpc.service_config", json.dumps(retry_config)),
                                                  ("grpc.enable_retries", 1)])
patient_stub = pb_grpc.MinienvEngineStub(patient)
flood = [patient_stub.Generate(pb.GenerateRequest(
    text=t, sampling_params=pb.SamplingParams(max_tokens=8, temperature=0)), timeout=30) for t in TRAFFIC[:12]]
retried = []
for call in flood:
    try:
        retried.append([m.complete for m in call if m.WhichOneof("response") == "complete"][0].finish_reason)
    except grpc.RpcError as err:
        retried.append(err.code().name)
print(retried)

# %%
assert len(retried) == 12 and retried.count("length") > outcomes.count("length")  # retries got more of them in
assert set(retried) <= {"length", "RESOURCE_EXHAUSTED"} and blocks_in_use() == 0

# %% [markdown]
# ### Exercise 1: the backoff ceilings
#
# Write `retry_ceilings(max_attempts, initial_backoff, multiplier, max_backoff)`: the list of ceilings gRPC's retry
# policy draws each wait under. Rules: (1) the first retry waits up to `initial_backoff`; (2) each ceiling is
# `multiplier` × the previous one; (3) no ceiling exceeds `max_backoff`; (4) `max_attempts` counts the first call
# too: `max_attempts − 1` retries, one ceiling each. With your function, `sum(retry_ceilings(5, 0.05, 2, 1))` is
# the longest the channel above can spend waiting before it gives up.

# %%
from minienv.exercises.serving import check_pick_instance, check_retry_ceilings


def retry_ceilings(max_attempts, initial_backoff, multiplier, max_backoff):
    """The ceilings of gRPC's randomized backoff: one per retry."""
    raise NotImplementedError("your code here")


# %%
check_retry_ceilings(retry_ceilings)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Number the retries n = 1, 2, …, `max_attempts − 1`. Retry n's ceiling is `initial_backoff × multiplier^(n−1)`.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Cap each ceiling with `min(..., max_backoff)`; `max_attempts = 1` means no retries at all: an empty list.
# </details>

# %% [markdown]
# This first server has done its job: stop it — SIGTERM, the server drains (health `NOT_SERVING`, new requests
# `UNAVAILABLE`, in-flight ones get `--grace` seconds) and exits 0.

# %%
channel.close()
patient.close()
print("exit status", stop_servers(server)[0])

# %%
assert server.returncode == 0

# %% [markdown]
# ## Two instances: round robin vs prefix-aware routing
#
# Two servers, each with a **metrics** port (notebook 09's `/metrics`, in vLLM's names), so we can read each
# instance's own prefix-cache counters. First the balancer everybody has: gRPC's own **`round_robin`** policy. One
# channel over both addresses (the `ipv4:` target lists them); the channel keeps a connection to each and deals
# the calls out in turn — no proxy in between.

# %%
import urllib.request


def start_instances(n):
    """n servers with a /metrics port each, started together; [(process, address, metrics url)]."""
    procs = [subprocess.Popen([sys.executable, "-m", "minienv", "serve", "--port", "0", "--metrics-port", "0",
                               "--kv-budget-tokens", "1024", "--block-size", str(BLOCK), "--grace", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for _ in range(n)]
    atexit.register(stop_servers, *procs)
    started = []
    for proc in procs:
        banner = proc.stdout.readline()
        if "metrics at " not in banner:
            stop_servers(*procs)
            raise RuntimeError(f"a server did not start: {banner}{proc.stdout.read()}")
        started.append((proc, banner.split(" on ")[1].split()[0], banner.split("metrics at ")[1].split()[0]))
    return started


def prefix_counters(metrics_url):
    """(hits, queries) in tokens, from the instance's /metrics (what Prometheus would scrape)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    value = lambda name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()  # noqa: E731
                             if line.startswith(name + "{"))
    return value("vllm:prefix_cache_hits_total"), value("vllm:prefix_cache_queries_total")


def run_traffic(send):
    """Send TRAFFIC one request after another through `send(prompt) -> complete`; per-request hit fractions."""
    return [(c.cached_tokens, c.prompt_tokens) for c in map(send, TRAFFIC)]


def complete_of(responses):
    return [m.complete for m in responses if m.WhichOneof("response") == "complete"][0]


params = pb.SamplingParams(max_tokens=4, temperature=0)
rr_instances, pa_instances = start_instances(2), start_instances(2)  # fresh caches for each policy
rr_channel = grpc.insecure_channel("ipv4:" + ",".join(a for _, a, _ in rr_instances),
                                   options=[("grpc.lb_policy_name", "round_robin")])
rr_stub = pb_grpc.MinienvEngineStub(rr_channel)
rr = run_traffic(lambda text: complete_of(rr_stub.Generate(pb.GenerateRequest(text=text, sampling_params=params),
                                                             timeout=30)))
rr_counters = [prefix_counters(m) for _, _, m in rr_instances]
print("round robin, per instance (hits / queries, tokens):", rr_counters)

# %%
assert sum(q for _, q in rr_counters) == sum(p for _, p in rr)  # the instances saw every prompt token, once
assert all(q > 0 for _, q in rr_counters)  # both instances got traffic

# %% [markdown]
# Now **prefix-aware** routing, built small: hash the prompt's first full block — the same sha256 chain hash the
# prefix cache keys blocks by (notebook 05) — and let it pick the instance. Every request of a scene then meets
# the one cache that holds that scene. One channel per instance; the routing is ours:

# %%
from minienv.kv.hashing import ROOT_HASH, hash_block_tokens


def home_instance(text, n):
    ids = tokenizer.encode(text)
    return int.from_bytes(hash_block_tokens(ROOT_HASH, ids[:BLOCK])[:8], "big") % n


pa_channels = [grpc.insecure_channel(a) for _, a, _ in pa_instances]
pa_stubs = [pb_grpc.MinienvEngineStub(c) for c in pa_channels]
pa = run_traffic(lambda text: complete_of(pa_stubs[home_instance(text, 2)].Generate(
    pb.GenerateRequest(text=text, sampling_params=params), timeout=30)))
pa_counters = [prefix_counters(m) for _, _, m in pa_instances]
print("prefix-aware, per instance (hits / queries, tokens):", pa_counters)
print("scenes' home instances:", [home_instance(s, 2) for s in SCENES])

# %% [markdown]
# The hit rate after each request, for both policies (and one engine, for reference):

# %%
import plotly.graph_objects as go
import plotly.io as pio

from minienv.viz.static import show

pio.renderers.default = "plotly_mimetype"  # drawn by JupyterLab itself: no CDN, no network


def running_rate(pairs):
    hits, total = np.cumsum([h for h, _ in pairs]), np.cumsum([t for _, t in pairs])
    return hits / total


fig = go.Figure()
for name, pairs, color in (("round robin (gRPC's policy), 2 instances", rr, "#e15759"),
                           ("prefix-aware, 2 instances", pa, "#4e79a7")):
    fig.add_scatter(x=list(range(1, len(pairs) + 1)), y=100 * running_rate(pairs), mode="lines+markers",
                    name=name, line_color=color)
fig.add_hline(y=100 * in_process[1], line_dash="dot", line_color="#999",
              annotation_text=f"one engine: {in_process[1]:.0%}", annotation_position="bottom right")
fig.update_layout(width=820, height=380, title="Prefix-cache hit rate of the fleet after each request",
                  xaxis_title="requests served", yaxis_title="hit rate so far (%)", yaxis_range=[0, 100],
                  legend=dict(x=0.02, y=0.98))
show(fig)

# %%
rate = lambda pairs: sum(h for h, _ in pairs) / sum(t for _, t in pairs)  # noqa: E731
assert rate(pa) > rate(rr)  # routing by prefix beats dealing round robin
assert abs(rate(pa) - in_process[1]) < 1e-9  # ... and equals one engine that sees everything
assert abs(rate(rr) - in_process[2]) < 0.05  # round robin ≈ the in-process round robin of the first cell
print(f"hit rate: round robin {rate(rr):.1%}, prefix-aware {rate(pa):.1%}, one engine {in_process[1]:.1%}")

# %% [markdown]
# Prefix-aware routing gets the single engine's hit rate back: each scene heading is computed once in the whole
# fleet. The price is balance: the hash put three of the four scenes on one instance, which served three
# quarters of the traffic. A real router therefore gives way under load — the next exercise.
#
# ### Exercise 2: a prefix router with a fallback
#
# Write `pick_instance(prompt_ids, loads, block_size, max_load)` → the index of the instance a request goes to.
# `loads[i]` is the number of requests in flight on instance `i`. Rules: (1) the **home** instance is
# `int.from_bytes(hash_block_tokens(ROOT_HASH, prompt_ids[:block_size])[:8], "big") % len(loads)` — only the first
# full block decides; (2) a home instance with `max_load` or more requests in flight is **overloaded**: the
# request goes to the least-loaded instance instead (the lowest index among equals); (3) a prompt shorter than one
# block has no full block to share: the least-loaded instance. The check runs one case per rule, then a trace of
# shared system prompts.

# %%
def pick_instance(prompt_ids, loads, block_size, max_load):
    """The instance for this request: its prefix's home, unless that one is overloaded."""
    raise NotImplementedError("your code here")


# %%
check_pick_instance(pick_instance)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Compute the least-loaded instance first: `min(range(len(loads)), key=lambda i: (loads[i], i))` — the tuple
# breaks ties by index. Rules 2 and 3 both answer it.
# </details>
#
# <details><summary>Hint 2</summary>
#
# `hash_block_tokens(ROOT_HASH, prompt_ids[:block_size])` is 32 bytes; read the first 8 as one big integer and
# take it modulo the number of instances. Check `len(prompt_ids) < block_size` before you hash.
# </details>
#
# <details><summary>Hint 3</summary>
#
# "Overloaded" is `loads[home] >= max_load` — at the limit counts.
# </details>

# %% [markdown]
# ## Stopping everything
#
# Every server this notebook started is stopped here (and by `atexit` if a cell failed on the way):

# %%
for ch in [rr_channel, *pa_channels]:
    ch.close()
codes = stop_servers(*[proc for proc, _, _ in rr_instances + pa_instances])  # all drain at once
print("exit statuses:", codes)

# %%
assert codes == [0, 0, 0, 0], codes  # each drained and exited cleanly
assert all(proc.poll() is not None for proc, _, _ in rr_instances + pa_instances), [p.poll() for p, _, _ in rr_instances + pa_instances]

# %% [markdown]
# ## Where it lives in vLLM and SGLang
#
# | minienv | what it does | vLLM v0.11.0 | SGLang v0.5.3 |
# |---|---|---|---|
# | `python -m minienv serve` (`minienv/cli.py`), `minienv/serving/server.py` | a server process around one engine; one thread steps it | `vllm/entrypoints/openai/api_server.py` (`vllm serve`); the engine loop in its own process: `vllm/v1/engine/core.py` (`EngineCoreProc`) | `python/sglang/launch_server.py`, `python/sglang/srt/entrypoints/http_server.py`; the loop: `python/sglang/srt/managers/scheduler.py` |
# | handlers hand requests to the engine thread; each receives only its own outputs | per-request output queues | `vllm/v1/engine/async_llm.py` (`AsyncLLM.generate`), `vllm/v1/engine/output_processor.py` (`RequestOutputCollector`) | `python/sglang/srt/managers/tokenizer_manager.py` (per-request state and event) |
# | `proto/minienv/v1/minienv.proto`: `Generate` (a stream of `chunk`s, then `complete`), `Abort`, info calls; `grpc.health.v1` | the gRPC API | none in this release: HTTP only (a gRPC entrypoint came later, vllm-project/vllm#30190) | `python/sglang/srt/grpc/sglang_scheduler.proto`, `python/sglang/srt/entrypoints/grpc_server.py`, `grpc_request_manager.py`; health is its own `HealthCheck` RPC (`grpc.health.v1` came later, sgl-project/sglang#11955) |
# | a cancelled call or a passed deadline aborts the request; its blocks are freed | a client that is gone costs nothing | `vllm/entrypoints/utils.py` (`with_cancellation`: a disconnect cancels the handler), `AsyncLLM.abort` | `tokenizer_manager.py` (`abort_request`); `grpc_server.py` aborts when `context.cancelled()` |
# | `--max-waiting` → `RESOURCE_EXHAUSTED` | back-pressure | none: the waiting queue is unbounded (a bound is proposed in vllm-project/vllm#27064) | `--max-queued-requests` (`python/sglang/srt/server_args.py`, checked at admission in `scheduler.py`) |
# | gRPC's `round_robin` over N servers; prefix-aware routing | balancing, with cache affinity | data-parallel engines balanced by load: `vllm/v1/engine/coordinator.py`, `vllm/v1/engine/core_client.py` | `sgl-router/` (Rust): `src/policies/round_robin.rs`, `src/policies/cache_aware.rs` |
#
# SGLang's `cache_aware` policy keeps, per worker, an approximate radix tree of the *text* it was sent, routes to
# the worker with the longest match (above a threshold), and switches to the shortest queue when the loads differ
# by more than an absolute and a relative threshold — exercise 2's fallback, with finer affinity than our first
# block. The price is state in the router; a first-block hash needs none, so any number of routers agree without
# talking to each other.

# %% [markdown]
# ## Summary
#
# * A server is a process: start it, ask its **health** service, stop it with SIGTERM (it drains) — and make sure
#   it is stopped even when something fails.
# * `Generate` streams **chunks** and ends with one **complete** message; the served text equals the in-process
#   engine's.
# * A cancelled call or a passed **deadline** aborts the request: its KV blocks came back at once.
# * A bounded waiting queue answers a flood with **`RESOURCE_EXHAUSTED`**; clients retry with exponential
#   backoff and jitter (gRPC's retry policy does it for you).
# * Behind **round robin**, every instance computes every shared prefix: the fleet's hit rate falls as instances
#   are added. **Prefix-aware routing** sends each prefix to one home instance and gets one engine's hit rate
#   back — at the price of balance, which a fallback under load restores.

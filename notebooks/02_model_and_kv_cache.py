# %% [markdown]
# # 02 · The model and its KV cache
#
# **Learning goals** — after this notebook you can
# 1. trace one token through a Llama-style decoder (embedding → *L* × [RMSNorm, attention, SwiGLU] → LM head) and
#    point at the line of numpy that does each step — and say why RoPE makes attention see *relative* positions;
# 2. explain why generating *without* a cache redoes ~quadratic work, and count it;
# 3. compute the KV-cache bytes per token of any model from four numbers in its `config.json`;
# 4. say what a contiguous per-request cache costs when every request reserves `max_len` — the problem notebook 03
#    measures and notebook 04 solves.

# %%
import os

# This model's matrices are tiny (hidden size 192, printed below): handing them to several BLAS threads costs more than it saves, and on a
# busy 2-core machine spinning BLAS threads can make every matmul 100x slower. One thread; set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import time

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from IPython.display import SVG, display

from minienv.generate import generate_ids
from minienv.model import ContiguousKVCache, causal_attention, load_model
from minienv.model.cost import generation_cost
from minienv.paths import REPO_ROOT
from minienv.sampling import SamplingParams
from minienv.tokenizer import load_tokenizer

# The bundled model: a 2M-parameter Llama trained on Shakespeare (see the README and assets/MODELS.md).
model = load_model()          # assets/target: HF config.json + model.safetensors
tokenizer = load_tokenizer()  # assets/tokenizer.json: byte-level BPE from notebook 01
encode, decode = tokenizer.encode, tokenizer.decode
source = "bundled assets/target"
cfg = model.config
pio.renderers.default = "plotly_mimetype"  # drawn by JupyterLab itself: no CDN, no network
from minienv.viz.static import show  # every figure: live, with a PNG of it for readers without a kernel
print(source)
print(model)

# %% [markdown]
# ## The problem, with a number
#
# A decoder produces one token per forward pass, and each new token must attend to **every** token before it.
# The naive loop therefore feeds the whole sequence back in at every step. For a 19-token prompt and 256 new tokens:

# %%
# NBVAL_CHECK_OUTPUT
P, N = 19, 256
naive = sum(P + s for s in range(N))
cached = P + (N - 1)
print(f"token rows pushed through the layers, no cache : {naive:,}")
print(f"token rows pushed through the layers, KV cache : {cached:,}")
print(f"ratio                                          : {naive / cached:.1f}x")

# %% [markdown]
# The cached loop computes each token's keys and values **once**, keeps them, and from then on runs only the newest
# token through the model. The rest of this notebook builds that up and measures it.
#
# ## The forward pass, as a picture

# %%
from minienv.viz.diagram import forward_pass_svg  # boxes and arrows, labelled with the config's shapes

diagram = forward_pass_svg(cfg)
display(SVG(diagram))

# %%
assert "KV cache" in diagram and f"× {cfg.num_hidden_layers} layers" in diagram
assert diagram.count("<rect") == 9

# %% [markdown]
# Only one box talks to the cache: attention. Everything else — projections, RoPE, the MLP, the LM head — works on
# each token independently. That is why minienv's model hands attention to a **backend** object and never needs to
# know whether keys live in a contiguous array (this notebook) or in scattered blocks (notebook 04).
#
# ## Build it small: causal attention in a few lines of numpy
#
# One head, five tokens. Each query may look at its own key and those before it (the causal mask).

# %%
rng = np.random.default_rng(0)
T, D = 5, 8
q, k, v = (rng.standard_normal((T, D)).astype(np.float32) for _ in range(3))

scores = q @ k.T / np.sqrt(D)                        # [T, T]: how much token i attends to token j
scores[np.triu_indices(T, k=1)] = -np.inf            # no peeking at the future
weights = np.exp(scores - scores.max(axis=1, keepdims=True))
weights /= weights.sum(axis=1, keepdims=True)
tiny_out = weights @ v                               # [T, D]
print(np.round(weights, 2))

# %% [markdown]
# The upper triangle is zero: row *i* is a distribution over tokens 0..i. minienv's kernel does the same for all heads
# at once (and for grouped-query attention, where several query heads share one K/V head):

# %%
same = causal_attention(q[:, None, :], k[:, None, :], v[:, None, :], q_positions=np.arange(T))[:, 0]
assert np.allclose(same, tiny_out, atol=1e-6)
assert np.allclose(np.triu(weights, 1), 0)

# %% [markdown]
# Now look at row 2 of `weights`: it only involves `k[:3]` and `v[:3]`. **Appending token 5 changes nothing about
# tokens 0–4** — their keys and values, and even their outputs, stay the same. So they can be stored instead of
# recomputed. That observation is the whole KV cache.

# %% [markdown]
# ## Build it small: the whole forward pass, box by box
#
# The picture above, in numpy, on the bundled model's own weights (read from its safetensors file by their Hugging
# Face names). This model has 4 layers, a hidden size of 192, and **grouped-query attention**: 4 query heads share 2
# key/value heads, so each K/V head serves two query heads — and the cache stores half as many heads. Every line
# below is one box of the diagram.

# %%
from minienv.model.checkpoint import load_weights
from minienv.paths import assets_dir

W = load_weights(assets_dir() / "target", cfg)  # {"model.layers.0.self_attn.q_proj.weight": array, ...}
L, Hq, Hkv, Dh = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim


def rmsnorm(x, w):  # each token's vector scaled to unit root-mean-square, then by a learned weight per dim
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)


def rope(x, pos):  # rotate dims (i, i + Dh/2) of every head by the angle pos * theta_i (explained below)
    theta = cfg.rope_theta ** (-np.arange(0, Dh, 2) / Dh)  # [Dh/2]: one frequency per pair of dims
    angle = pos[:, None] * theta[None, :]  # [N, Dh/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # the same for every head
    x1, x2 = x[..., : Dh // 2], x[..., Dh // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def attention(q, k, v):  # q [N, Hq, Dh], k and v [N, Hkv, Dh]: causal, grouped-query
    k, v = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)  # KV head j serves query heads 2j, 2j+1
    s = np.einsum("nhd,mhd->hnm", q, k) / np.sqrt(Dh)  # [Hq, N, N]
    s = np.where(np.tril(np.ones((len(q), len(q)), dtype=bool)), s, -np.inf)  # no peeking at the future
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hnm,mhd->nhd", w / w.sum(axis=-1, keepdims=True), v)


def silu(x):  # x * sigmoid(x), written with tanh so it never overflows
    return x * (0.5 + 0.5 * np.tanh(x / 2))


def my_forward(ids):
    pos = np.arange(len(ids))
    x = W["model.embed_tokens.weight"][ids]  # embedding: one row of the table per token, [N, 192]
    for layer in range(L):
        p = f"model.layers.{layer}."
        h = rmsnorm(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(-1, Hq, Dh)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(-1, Hkv, Dh)  # these two are what a KV cache keeps
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(-1, Hkv, Dh)
        a = attention(rope(q, pos), rope(k, pos), v)
        x = x + a.reshape(len(ids), -1) @ W[p + "self_attn.o_proj.weight"].T  # o_proj, + residual
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"])
        gate, up = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
        x = x + (silu(gate) * up) @ W[p + "mlp.down_proj.weight"].T  # SwiGLU MLP, + residual
    head = W["model.embed_tokens.weight"] if cfg.tie_word_embeddings else W["lm_head.weight"]  # tied here
    return rmsnorm(x, W["model.norm.weight"]) @ head.T  # LM head: one score per vocabulary id, [N, 2048]


mine = my_forward(encode("To be, or not to be"))
print(f"logits {mine.shape}; next token: {decode([int(mine[-1].argmax())])!r}")

# %% [markdown]
# ### RoPE: position as a rotation
#
# Attention by itself does not know where a token is: shuffle the keys and the scores shuffle with them. **Rotary
# position embedding** (RoPE) writes the position into q and k by *rotating* them: the head's `Dh` dims are taken as
# `Dh/2` pairs, and pair `i` of a token at position `p` is turned by the angle `p · θ_i`, with `θ_i = 10000^(−2i/Dh)`
# — fast turns for the first pairs, slow ones for the last, like the hands of a clock. Below, one pair of a query
# vector at positions 0 to 11, for the fastest and a slower frequency.
#
# Why it works: a dot product between two rotated vectors depends only on the **difference** of their angles. The
# score of a query at position `m` against a key at `n` is the score of the unrotated pair turned by `(m − n) · θ_i`
# — so attention sees **relative** positions, and a token's key, once rotated at its position, never changes. That
# is what makes it cacheable, and why every later notebook passes each token's `positions` to the model.

# %%
SLOW = 4  # pair 4 turns 10000^(-8/48) ≈ 0.22 rad per position
vec = np.zeros((12, 1, Dh))
vec[:, 0, [0, Dh // 2]] = [1.0, 0.0]  # pair 0 (the fastest) starts at (1, 0)
vec[:, 0, [SLOW, SLOW + Dh // 2]] = [0.6, 0.0]  # pair 4 starts at (0.6, 0): drawn on an inner circle
turned = rope(vec, np.arange(12))
rot_fig = go.Figure()
for i in (0, SLOW):
    theta_i = cfg.rope_theta ** (-2 * i / Dh)
    rot_fig.add_trace(go.Scatter(x=turned[:, 0, i], y=turned[:, 0, i + Dh // 2], mode="markers+text",
                                 text=[str(p) for p in range(12)], textposition="top center",
                                 hovertemplate="position %{text}: (%{x:.2f}, %{y:.2f})<extra>pair " + str(i) + "</extra>",
                                 name=f"pair {i}: θ = {theta_i:.2f} rad per position"))
rot_fig.update_layout(title="RoPE turns each pair of dims by position × θ (labels: position)", height=440, width=640,
                      xaxis=dict(range=[-1.3, 1.3]), yaxis=dict(range=[-1.3, 1.3], scaleanchor="x"))
show(rot_fig)

# %%
# NBVAL_CHECK_OUTPUT
rot_rng = np.random.default_rng(7)
q1, k1 = rot_rng.standard_normal((2, 1, 1, Dh))


def score(m, n):  # the attention score of a query at position m against a key at position n
    return float((rope(q1, np.array([m])) * rope(k1, np.array([n]))).sum())


for m, n in [(5, 2), (105, 102), (1005, 1002), (2, 5), (102, 105)]:
    print(f"query at {m:>4}, key at {n:>4} (m − n = {m - n:+d}): score {score(m, n):+.4f}")

# %%
assert np.isclose(score(5, 2), score(105, 102)) and np.isclose(score(5, 2), score(1005, 1002))  # only m − n counts
assert not np.isclose(score(5, 2), score(2, 5))  # ... and its sign: before and after are different
assert np.allclose(np.linalg.norm(turned, axis=-1), np.linalg.norm(vec, axis=-1))  # a rotation: lengths unchanged

# %% [markdown]
# ## minienv's model
#
# `model.forward(ids)` is the dense reference: the whole sequence, causal, no cache — the forward pass above, with
# Q/K/V and gate/up fused into single matmuls and attention handed to a backend. The reference tests check it against
# `transformers`' `LlamaForCausalLM` to 1e-4 on random configs; here it equals `my_forward`.

# %%
prompt = "To be, or not to be"
ids = encode(prompt)
logits = model.forward(ids)
print(f"{len(ids)} prompt tokens → logits {logits.shape}; next token: {decode([int(logits[-1].argmax())])!r}")

# %%
assert np.allclose(my_forward(ids), logits, atol=1e-4)  # the numpy above IS this model, to float32 rounding
longer = model.forward(ids + [int(logits[-1].argmax())])
assert logits.shape == (len(ids), cfg.vocab_size)
assert np.allclose(longer[: len(ids)], logits, atol=1e-5)  # causality: the past does not change

# %% [markdown]
# ## The contiguous KV cache
#
# `ContiguousKVCache` preallocates K and V as `[layers, max_len, kv_heads, head_dim]` arrays plus a length counter.
# A *prefill* step writes the prompt's K/V into rows `0..P-1`; each *decode* step writes one row and attends over all
# rows so far. The model calls `cache.attend(layer, q, k, v)` in every layer — the seam the paged cache reuses.

# %%
cache = model.new_kv_cache(max_len=64)
step_logits = [model.forward_step(ids, np.arange(len(ids)), cache)]          # prefill: all prompt tokens at once
tokens = list(ids)
for _ in range(10):                                                          # decode: one token per step
    nxt = int(step_logits[-1][-1].argmax())
    tokens.append(nxt)
    step_logits.append(model.forward_step([nxt], [len(tokens) - 1], cache))
print(cache)
print(repr(decode(tokens[len(ids):])))

# %% [markdown]
# **Proof:** the cached logits equal the dense model's on the same tokens — up to float32 rounding. They cannot be
# bit-identical: a one-row decode step multiplies `[1, H] @ W` where the dense pass multiplies `[T, H] @ W`, and
# BLAS sums the products in a different order for the two shapes. Each rounding is one float32 ulp (about
# `1.2e-7 ×` the value), so on this trained model, whose logits reach ~17, the gap is around 1e-5: a few ulps of
# the largest logit, and the same next token in every row.

# %%
cached_logits = np.concatenate(step_logits)
dense_logits = model.forward(tokens)  # prefill rows + one row per decode step = one row per token
max_diff = float(np.abs(cached_logits - dense_logits).max())
scale = float(np.abs(dense_logits).max())
ulps = max_diff / (np.finfo(np.float32).eps * scale)
print(f"max |cached - dense| = {max_diff:.1e}  (largest |logit| {scale:.1f}: {ulps:.0f} float32 ulps of it)")
assert ulps <= 16, "more than float32 rounding apart: the cache is wrong"
assert (cached_logits.argmax(-1) == dense_logits.argmax(-1)).all()

# %% [markdown]
# ## Why a KV cache: measured live
#
# Generate the same greedy continuation twice — recomputing everything every step, and with the cache — and time each
# step. (Timings depend on your machine and are not checked; the shape of the curves is the lesson.)

# %%
def step_times(use_cache: bool, n: int) -> np.ndarray:
    it = generate_ids(model, ids, SamplingParams(max_tokens=n, temperature=0), use_cache=use_cache)
    times, last = [], time.perf_counter()
    for _ in it:
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return np.array(times)


n_steps = 96
t_cache = step_times(True, n_steps)
t_naive = step_times(False, n_steps)
fig = go.Figure([
    go.Scatter(y=np.cumsum(t_naive) * 1e3, name="no cache: recompute the whole sequence",
               hovertemplate="%{x} tokens: %{y:.0f} ms<extra>no cache</extra>"),
    go.Scatter(y=np.cumsum(t_cache) * 1e3, name="KV cache: one token per step",
               hovertemplate="%{x} tokens: %{y:.0f} ms<extra>KV cache</extra>"),
])
fig.update_layout(title=f"Cumulative time to generate n tokens ({source})", xaxis_title="tokens generated",
                  yaxis_title="milliseconds", height=380, legend=dict(x=0.01, y=0.99))
show(fig)
print(f"{n_steps} tokens: no cache {t_naive.sum():.2f} s, cache {t_cache.sum():.2f} s "
      f"→ {t_naive.sum() / t_cache.sum():.1f}x faster")

# %%
assert len(t_naive) == len(t_cache) == n_steps
assert t_naive.sum() > t_cache.sum()  # recomputing is slower (by how much depends on the machine)

# %% [markdown]
# The no-cache curve bends upward — step *t* costs ∝ *t*, so the total is ∝ *n²* — while the cached one is nearly a
# straight line. A timing can be noisy; a count cannot. Here is the same comparison as a deterministic cost model
# (`minienv.model.cost`: matmul FLOPs of exactly the loop above, 2 per multiply-add):

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'new tokens':>10} {'rows, no cache':>15} {'rows, cache':>12} {'GFLOP, no cache':>16} {'GFLOP, cache':>13} {'ratio':>7}")
for n in (16, 64, 256, 1000):
    a = generation_cost(cfg, 19, n, use_cache=False)
    b = generation_cost(cfg, 19, n, use_cache=True)
    print(f"{n:>10} {a.tokens_processed:>15,} {b.tokens_processed:>12,} {a.gflops:>16.2f} {b.gflops:>13.3f} "
          f"{a.flops / b.flops:>6.0f}x")

# %% [markdown]
# Why is the measured speed-up smaller than the FLOP ratio? At this toy size a cached decode step does only ~6 MFLOP,
# so the fixed cost of a step (Python, ~40 small numpy calls) dominates; recomputing the whole sequence is mostly
# big matmuls. At real sizes (billions of parameters) the FLOPs dominate and the measured gap approaches the count.

# %%
costs = [generation_cost(cfg, 19, n, use_cache=False).flops / generation_cost(cfg, 19, n, use_cache=True).flops
         for n in (64, 128, 256)]
assert costs[0] < costs[1] < costs[2]  # the advantage grows with length: quadratic vs ~linear

# %% [markdown]
# ## What the cache costs: bytes per token
#
# Every token keeps a key and a value vector per KV head in every layer:
#
# $$\text{KV bytes per token} = 2 \times \text{layers} \times \text{kv\_heads} \times \text{head\_dim} \times \text{bytes per element}$$
#
# The numbers below come from each model's published `config.json` (Llama-2-13B has no GQA: 40 KV heads; Llama-3-8B
# and Qwen2.5-7B share K/V across 4 and 7 query heads).

# %%
# NBVAL_CHECK_OUTPUT
MODELS = {  # name: (layers, kv_heads, head_dim, bytes per element as served)
    "minienv target (float32)": (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 4),
    "Llama-3-8B (fp16)": (32, 8, 128, 2),
    "Llama-2-13B (fp16)": (40, 40, 128, 2),
    "Qwen2.5-7B (fp16)": (28, 4, 128, 2),
}
kv_per_token = {name: 2 * L * H * D * B for name, (L, H, D, B) in MODELS.items()}
print(f"{'model':<26}{'layers':>7}{'kv_heads':>9}{'head_dim':>9}{'KiB/token':>11}{'GiB @ 4k ctx':>14}")
for name, (L, H, D, B) in MODELS.items():
    b = kv_per_token[name]
    print(f"{name:<26}{L:>7}{H:>9}{D:>9}{b / 1024:>11.0f}{b * 4096 / 2**30:>14.3f}")

# %%
assert kv_per_token["Llama-3-8B (fp16)"] == 128 * 1024
assert kv_per_token["Llama-2-13B (fp16)"] == 800 * 1024
assert kv_per_token["Qwen2.5-7B (fp16)"] == 56 * 1024
assert kv_per_token["minienv target (float32)"] == cfg.kv_bytes_per_token(4)
# The claim below: one 4k-token Llama-2-13B request's KV (3.1 GiB) is about an eighth of its fp16 weights
# (13 B parameters × 2 bytes = 26 GB = 24.2 GiB), not a quarter.
kv_4k, weights = kv_per_token["Llama-2-13B (fp16)"] * 4096, 13e9 * 2
assert round(kv_4k / 2**30, 1) == 3.1 and round(weights / 2**30, 1) == 24.2 and round(8 * kv_4k / weights) == 1

# %% [markdown]
# A single 4k-token Llama-2-13B conversation holds 3.1 GiB of KV state — about an eighth of the 13 B
# model's own fp16 weights (26 GB = 24.2 GiB) for *one* request; eight such conversations weigh about as much as
# the model. KV memory, not compute, is what limits how many requests a GPU serves: notebook 16 counts it for real
# GPUs — an H100 holding Llama-3-8B has room for 459,099<!--out:16--> tokens of KV (about 918<!--out:16-->
# ShareGPT-sized requests), an A100-40GB holding OPT-13B for 14,494<!--out:16--> (28<!--out:16--> requests).
#
# ### Live: context length vs KV memory
# Drag the slider: the bars show one request's KV cache at that context length.

# %%
import ipywidgets as widgets

ctx_slider = widgets.IntSlider(value=4096, min=256, max=32768, step=256, description="context",
                               continuous_update=True, layout=widgets.Layout(width="520px"))
kv_fig = go.FigureWidget(go.Bar(x=list(kv_per_token), y=[b * ctx_slider.value / 2**30 for b in kv_per_token.values()],
                                texttemplate="%{y:.2f} GiB", textposition="outside",
                                hovertemplate="%{x}: %{y:.2f} GiB of KV<extra></extra>"))
kv_fig.update_layout(title="KV cache of one request", yaxis_title="GiB", height=360, yaxis_range=[0, 28])


def on_context_change(change) -> None:
    with kv_fig.batch_update():
        kv_fig.data[0].y = [b * change["new"] / 2**30 for b in kv_per_token.values()]
        kv_fig.layout.title.text = f"KV cache of one request at {change['new']:,} tokens"


ctx_slider.observe(on_context_change, names="value")
show(kv_fig, live=widgets.VBox([ctx_slider, kv_fig]))  # the PNG: the slider's first position

# %%
# The KV cache grows linearly with the context: Llama-2-13B holds 6.25 GiB at 8k tokens, twice its 4k figure.
assert kv_per_token["Llama-2-13B (fp16)"] * 8192 / 2**30 == 6.25 == 2 * kv_per_token["Llama-2-13B (fp16)"] * 4096 / 2**30

# %% [markdown]
# ## The contiguous per-request cache and what reserving `max_len` costs
#
# A contiguous cache must be allocated before the request starts — and nobody knows yet how long the answer will be.
# So each request reserves the model's maximum length. Take eight requests with seeded random prompt and output
# lengths on the bundled model (max 1024 tokens):

# %%
# NBVAL_CHECK_OUTPUT
lengths_rng = np.random.default_rng(2023)
prompt_lens = lengths_rng.integers(10, 200, size=8)
output_lens = lengths_rng.integers(5, 300, size=8)
reserved = used = 0
for p, o in zip(prompt_lens, output_lens):
    cache_i = ContiguousKVCache.from_config(cfg)  # reserves max_position_embeddings tokens
    cache_i.length = int(p + o)                            # what the finished request actually used
    reserved += cache_i.reserved_bytes
    used += cache_i.used_bytes
print(f"requests: {len(prompt_lens)}, tokens used per request: {(prompt_lens + output_lens).tolist()}")
print(f"reserved {reserved / 2**20:.1f} MiB, holding real tokens {used / 2**20:.1f} MiB "
      f"→ {100 * used / reserved:.1f}% utilisation")

# %%
assert 0 < used < reserved
assert reserved == 8 * 2 * cfg.num_hidden_layers * cfg.max_position_embeddings * cfg.num_key_value_heads * cfg.head_dim * 4

# %% [markdown]
# Most of the reservation holds nothing. Worse, the unused rows are *reserved*: no other request can use them, so the
# number of requests that fit at once — the batch size, hence throughput — is set by the worst case, not the real
# case. The vLLM paper measured that existing systems kept only 20–38 % of KV memory for real token states.
# **Notebook 03** measures this waste on a realistic workload; **notebook 04** fixes it by allocating the cache in
# small blocks on demand (PagedAttention), using the same `attend` seam you saw above.

# %% [markdown]
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/02_model_and_kv_cache.py` — is explained in notebook 00.)
#
# ### Exercise 1: the cached attention step, with a sliding window
#
# Implement one decode step of attention for a single head: given the new token's query `q [D]` and the cache's
# keys and values `K, V [t, D]` (the new token's own k/v already appended), return the attention output `[D]`.
# Some models attend only to the most recent tokens: a **sliding window** of `window` tokens (Mistral-7B v0.1 used
# 4096 in every layer). Rules: (1) the query attends to the last `window` cached tokens, its own included — to every
# cached token when `window` is None; (2) the output is one vector of size `D`; (3) scores are `q·k / sqrt(D)`,
# softmaxed over the attended tokens; (4) the softmax is numerically stable (the check uses scores in the
# thousands). The check names the rule a wrong answer breaks and tries the window's edges: one token, shorter than,
# exactly as long as and longer than the cache.

# %%
from minienv.exercises.model import check_decode_attention, check_kv_bytes_for_context


def decode_attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, window) -> np.ndarray:
    """Attention output [D] of one query over the last `window` of t cached keys / values [t, D] (None: all)."""
    raise NotImplementedError("your code here")


# %%
check_decode_attention(decode_attention)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# No mask is needed: the only query is the newest token, and every cached token is in its past. The window only
# decides *which* cached tokens take part; the attention over them is the prefill cell's, for one query row.
# </details>
#
# <details><summary>Hint 2</summary>
#
# The edges: with `window=1` the query sees only itself, so the output is `V[-1]`; a window longer than the cache
# takes the whole cache — does your way of picking "the last `window` rows" still work when `window > t`? And
# `exp(1000)` is `inf`: softmax does not change when one number is subtracted from every score — which one keeps
# every `exp` at most 1?
# </details>
#
# <details><summary>Hint 3</summary>
#
# Keep the last `window` rows of `K` and `V` (negative slicing needs no length arithmetic). Scores: those keys
# times the query, over the square root of `D`. Weights: their stable softmax, summing to 1. Output: the weights
# times the kept `V` rows.
# </details>
#
# ### Exercise 2: the price of a context with sliding-window layers
#
# The table above prices a token in a model whose every layer attends to the whole context. A sliding-window layer
# (exercise 1) attends only to the last `window` tokens, so it need keep only those in the cache; some models mix
# such layers with global ones (Gemma 2 alternates them). Write
# `kv_bytes_for_context(num_tokens, num_layers, num_heads, num_kv_heads, head_dim, dtype_bytes, window,
# global_every)`: the KV-cache bytes one request of `num_tokens` tokens holds. Rules: (1) a token stores a K **and**
# a V vector; (2) only the **KV heads** are stored; (3) every layer keeps its own, (4) times the bytes per element;
# (5) layers `global_every − 1`, `2 × global_every − 1`, … (0-based) are global and keep every token; the others are
# sliding-window layers, which keep only the last `window` tokens; `window=None` means every layer is global. The
# check names the rule a wrong answer breaks, tries the edges (a window longer than the context, exactly as long,
# an empty context, `global_every` of 1 and larger than `num_layers`), and ends on the table above (one token,
# `window=None`).

# %%
def kv_bytes_for_context(num_tokens, num_layers, num_heads, num_kv_heads, head_dim, dtype_bytes, window,
                         global_every):
    """Bytes of K and V a request of num_tokens tokens holds, with sliding-window layers."""
    raise NotImplementedError("your code here")


# %%
check_kv_bytes_for_context(kv_bytes_for_context)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Price one layer first: what does one token cost it, and how many tokens does it hold? A global layer holds the
# whole context; a sliding-window layer never looks further back than `window` tokens, so it has no reason to keep
# older ones. The request's bytes are the sum over the layers. (One of the arguments does not appear in the answer.)
# </details>
#
# <details><summary>Hint 2</summary>
#
# The edges: a window of 4 over a 3-token context — how many tokens can the layer hold, 4 or 3? And a context of
# exactly 4? Then count the global layers on paper for `num_layers = 7, global_every = 6` (only layer 5), for
# `global_every = 1` and for `global_every` larger than `num_layers`: one integer operation gives all three.
# </details>
#
# <details><summary>Hint 3</summary>
#
# Per layer and token: K and V, for each KV head, `head_dim` elements of `dtype_bytes` each. Multiply that by the
# tokens held summed over the layers: the global layers hold `num_tokens` each, the window layers the smaller of
# `num_tokens` and `window` each; the number of global layers is the quotient of `num_layers` by `global_every`
# (all of them when `window` is None).
# </details>

# %% [markdown]
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if this model used plain multi-head attention (as many KV heads as query heads)? Recompute its KiB per
#   token and GiB at 4k context from the formula, and say what GQA buys.
# * What if the cache stored K and V in 8 bits instead of 32? Which line of the cost table changes, and which does
#   not?
#
# ## Where this lives in vLLM / SGLang
#
# | minienv | vLLM v0.11.0 | SGLang v0.5.3 |
# |---|---|---|
# | `minienv/model/llama.py` (`LlamaModel.forward_step`) | [`vllm/model_executor/models/llama.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/model_executor/models/llama.py) (`LlamaAttention`, `LlamaDecoderLayer`) | [`python/sglang/srt/models/llama.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/models/llama.py) |
# | the `attend(layer, q, k, v)` backend seam | [`vllm/attention/layer.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/attention/layer.py) (`Attention`, which dispatches to a backend and writes the KV cache) | [`python/sglang/srt/layers/radix_attention.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/layers/radix_attention.py) (`RadixAttention`) |
# | `rope_cos_sin` / `apply_rope` | [`vllm/model_executor/layers/rotary_embedding/`](https://github.com/vllm-project/vllm/tree/v0.11.0/vllm/model_executor/layers/rotary_embedding) | same layer via `get_rope` |
# | `minienv/sampling.py` (`SamplingParams`, `Sampler`) | [`vllm/sampling_params.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/sampling_params.py), [`vllm/v1/sample/sampler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/sample/sampler.py), [`vllm/v1/sample/ops/topk_topp_sampler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/sample/ops/topk_topp_sampler.py) | [`python/sglang/srt/sampling/sampling_params.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/sampling/sampling_params.py) |
#
# Real engines never keep a contiguous `max_len` slab per request — that is exactly what their paged KV caches replace.
#
# ## Summary
# - A Llama decoder is embeddings, *L* × (RMSNorm → attention with RoPE and GQA → RMSNorm → SwiGLU MLP), and an LM
#   head; only attention looks across tokens.
# - Causality means a token's K and V never change once computed, so generation can **cache** them: per step, one
#   token's work instead of the whole sequence's (FLOP ratio above: 134×<!--out:above--> at 256 new tokens for this model).
# - The price is memory: `2 × layers × kv_heads × head_dim × bytes` per token — 128 KiB for Llama-3-8B in fp16,
#   800 KiB for Llama-2-13B.
# - A contiguous cache reserves `max_len` for every request and wastes most of it. Next: notebook 03 measures the
#   waste, notebook 04 pages it away.

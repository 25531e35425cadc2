# %% [markdown]
# # 12 · Speculative decoding: guess cheaply, verify in one call, keep the target's output
#
# Decoding is one target-model call per token, and each call reads every weight to produce one token. A model
# three times smaller, trained on the same text, guesses the next few tokens far more cheaply; the target then
# checks all the guesses **in one call** — the same call that would have produced one token — and keeps the ones
# it agrees with. This notebook builds that on the bundled target (2.0 M parameters) and draft (656 k), inside
# minienv's continuous-batching engine with its paged, prefix-cached KV.
#
# **Learning goals.** After this notebook you can
# 1. run **greedy speculation** by hand and say why its output is token-for-token the target's;
# 2. derive the **acceptance rule** of speculative *sampling* — keep a draft with probability min(1, p/q), else
#    draw from normalise(max(p − q, 0)), plus a bonus token — and check empirically that it leaves the target's
#    distribution unchanged;
# 3. explain what rejection means for a **paged, prefix-cached KV**: the slots of rejected drafts are given back
#    (truncate) *before* the commit, so a block holding an unverified token is never hashed into the prefix cache;
# 4. read acceptance numbers — per position, against the i.i.d. prediction — and say when speculation pays on a
#    CPU and when it does not;
# 5. find the same pieces in **vLLM** and **SGLang**.

# %%
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matrices: one BLAS thread is faster (see notebook 02)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from minienv.engine import InferenceEngine
from minienv.model import load_model
from minienv.paths import assets_dir
from minienv.sampling import SamplingParams
from minienv.tokenizer import load_tokenizer

tokenizer = load_tokenizer()
target = load_model()  # assets/target
draft = load_model(assets_dir() / "draft")  # assets/draft: same tokenizer, same training text, a third the size
print(f"target: {target.config.num_parameters():,} parameters, {target.config.num_hidden_layers} layers")
print(f"draft:  {draft.config.num_parameters():,} parameters, {draft.config.num_hidden_layers} layers")

PROMPTS = [
    "ROMEO.\nBut soft, what light through yonder window breaks?",
    "HAMLET.\nTo be, or not to be, that is the question:",
    "MACBETH.\nIs this a dagger which I see before me,",
    "JULIET.\nO Romeo, Romeo, wherefore art thou",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0)

# %% [markdown]
# ## The problem, with a number
#
# Plain decoding: one target call per generated token after the first. With the draft proposing four tokens per
# step and the target verifying them, how many target calls does the same greedy text take?

# %%
# NBVAL_CHECK_OUTPUT
plain = InferenceEngine(target, tokenizer, kv_budget_tokens=2048, block_size=4)
(plain_out,) = plain.generate([PROMPTS[0]], GREEDY)
spec = InferenceEngine(target, tokenizer, kv_budget_tokens=2048, block_size=4,
                       speculative_config={"method": "draft", "num_speculative_tokens": 4, "draft_model": draft})
(spec_out,) = spec.generate([PROMPTS[0]], GREEDY)
print(f"plain:       {plain.stats.num_steps} target calls for {len(plain_out.token_ids)} tokens")
print(f"speculative: {spec.stats.num_steps} target calls for {len(spec_out.token_ids)} tokens "
      f"({spec.speculator.stats.num_accepted_tokens} of {spec.speculator.stats.num_draft_tokens} drafts kept)")
print("same text:", spec_out.text == plain_out.text)

# %%
assert spec_out.token_ids == plain_out.token_ids  # greedy speculation never changes a token
assert spec.stats.num_steps < plain.stats.num_steps  # ... and takes fewer target calls

# %% [markdown]
# ## Build it small: greedy speculation in a dozen lines
#
# No cache, no batching — just the idea. The draft guesses `k` tokens one by one. The target runs **once** over
# the sequence plus all `k` guesses; because attention is causal, its logits at position *i* are what it would
# have predicted after the first *i* guesses. Keep guesses while they equal the target's argmax; at the first
# disagreement take the target's token instead. If all `k` survive, the last position's argmax is a free extra
# token (the *bonus*). Every emitted token is the target's argmax after the real prefix — greedy decoding, exactly.

# %%
def greedy_speculate(target, draft, ids, max_tokens, k):
    ids, out, calls = list(ids), [], 0
    while len(out) < max_tokens:
        guesses = []
        for _ in range(k):  # the draft: k cheap calls
            guesses.append(int(np.argmax(draft.forward(np.array(ids + guesses))[-1])))
        logits = target.forward(np.array(ids + guesses))[-(k + 1):]  # the target: ONE call, k + 1 positions
        calls += 1
        best = np.argmax(logits, axis=-1).tolist()
        kept = 0
        while kept < k and guesses[kept] == best[kept]:
            kept += 1
        new = guesses[:kept] + [best[kept]]  # the kept guesses + the target's own token (fix or bonus)
        ids, out = ids + new, out + new
    return out[:max_tokens], calls


prompt_ids = tokenizer.encode(PROMPTS[1])
by_hand, calls = greedy_speculate(target, draft, prompt_ids, 24, k=3)
reference = list(plain.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0))[0].token_ids)
print(f"{calls} target calls for 24 tokens; equal to plain greedy: {by_hand == reference}")
print(repr(tokenizer.decode(by_hand)))

# %%
assert by_hand == reference and calls < 24

# %% [markdown]
# ## Sampling: the acceptance rule, derived
#
# At temperature > 0 "equal to the argmax" means nothing; we need the drafts to come out distributed **exactly**
# as the target's own samples. The draft draws `d ~ q`; the target's distribution at that position is `p`.
#
# * keep `d` with probability `min(1, p(d) / q(d))`;
# * on rejection, draw from the **residual** `r = normalise(max(p − q, 0))` and stop;
# * if all `k` drafts are kept, draw a bonus token from `p` at position `k + 1`.
#
# Why it is exact, for one position: the chance of emitting `x` is *drafted and kept* plus *rejected, then drawn
# from the residual*:
#
# $$P(x) = q(x)\min\!\Big(1, \tfrac{p(x)}{q(x)}\Big) + P(\text{reject})\,r(x) = \min(p(x), q(x)) + \max(p(x)-q(x), 0) = p(x),$$
#
# because `P(reject) = Σ_y max(q(y) − p(y), 0) = Σ_y max(p(y) − q(y), 0)`, the residual's normaliser. A
# deterministic proposer (n-gram lookup, below) has `q = one-hot(d)`: keep `d` with probability `p(d)`, else draw
# from `p` with `d` removed. minienv's rule is `minienv.spec_decode.rejection.verify`.
#
# Checked, not just derived: on two bigram "models" over 4 tokens (target `P`, draft `Q`), the joint distribution
# of 3 generated tokens has 64 outcomes we can list exactly. 20,000 speculative samples against it, Pearson's
# chi-square at significance 0.001 — for `verify`, and for a classic bug kept in `minienv/lab/speculation.py`
# (`residual_forgotten`, broken on purpose): on rejection it draws the token from `p` instead of the residual. The
# last rows set the first generated token's frequencies beside `p`, the distribution they should follow:

# %%
# NBVAL_CHECK_OUTPUT
from minienv.lab.speculation import BigramWorld, chi_square_check, residual_forgotten
from minienv.spec_decode.rejection import verify

world = BigramWorld.make()  # the world chi_square_check samples by default; the first token follows token 0
correct = chi_square_check(verify, k=2, seed=0)
buggy = chi_square_check(residual_forgotten, k=2, seed=0)
print("min(1, p/q) + residual + bonus:", correct)
print("residual forgotten:            ", buggy)
print(f"\n{'first token':>11} {'target p':>9} {'draft q':>8} {'verify':>7} {'residual forgotten':>19}")
for t in range(world.vocab_size):
    print(f"{t:>11} {world.P[0, t]:>9.3f} {world.Q[0, t]:>8.3f} {correct.first_token[t]:>7.3f} "
          f"{buggy.first_token[t]:>19.3f}")

# %% [markdown]
# With the residual, the first token follows `p` to the third decimal. Without it, token 0 — the one the draft
# over-proposes (q 0.594<!--out--> against p 0.395<!--out-->) — comes out 0.607<!--out--> of the time, and token 1, which the
# draft rarely proposes, 0.373<!--out--> instead of 0.592<!--out-->: a rejected token 0 gets a second chance from `p`,
# so the draft's preferences leak into the output. The residual is exactly the mass that `min(p, q)` leaves out.

# %%
assert correct.passed and not buggy.passed
assert all(abs(correct.first_token[t] - world.P[0, t]) < 0.01 for t in range(world.vocab_size))
assert buggy.first_token[0] > world.P[0, 0] + 0.15 and buggy.first_token[1] < world.P[0, 1] - 0.15

# %% [markdown]
# ## minienv's version: speculation inside continuous batching
#
# `InferenceEngine(..., speculative_config={"method": "draft" | "ngram", "num_speculative_tokens": k})` — the shape
# of vLLM's `speculative_config`. Each step:
#
# 1. after sampling, every running request that decodes next gets up to `k` drafts (`request.spec_token_ids`) from
#    the **draft model**, which keeps its *own* paged KV cache (its own pool and manager), or from **n-gram prompt
#    lookup** (the longest recent n-gram that occurred earlier in the sequence; propose what followed it);
# 2. the scheduler reserves slots for the last token **and** the drafts: the request feeds `k + 1` tokens in the
#    same batched target call as every other request (prefill chunks, plain decodes);
# 3. verification turns those `k + 1` rows of logits into the tokens to append (for a sampled request, with the
#    randomness of each position fixed in advance — see "Reading acceptance" below); the scheduler **truncates** the
#    rejected drafts' slots *before* the commit that hashes full blocks — only verified tokens reach the prefix
#    cache. The draft's cache needs no message: next step it compares what it holds with the real tokens and
#    truncates to their common prefix.
#
# Step through it below. Each row is one verification for the first request: drafts kept (green), the first
# rejected (red, struck), the unjudged rest (pale), then the target's own token (blue: *bonus* or *fix*). Under
# the rows, its KV slots: the dashed red ones were reserved for the rejected drafts and are given back.

# %%
import ipywidgets as widgets

from minienv.viz import Stepper
from minienv.viz.spec_view import SpecRow, SpeculationView

method = widgets.ToggleButtons(options=["draft", "ngram"], value="draft", description="proposer")
live = {"view": SpeculationView(block_size=4, max_rows=6, title="request 0: drafts and verdicts")}


def live_reset():
    cfg = {"method": method.value, "num_speculative_tokens": 4}
    if method.value == "draft":
        cfg["draft_model"] = draft
    eng = InferenceEngine(target, tokenizer, kv_budget_tokens=512, block_size=4, speculative_config=cfg)
    live["rid"] = [eng.add_request(p, SamplingParams(max_tokens=40, temperature=0)) for p in PROMPTS][0]
    live["engine"], live["rows"] = eng, []
    live["view"].reset()


def live_step(i):
    eng = live["engine"]
    if not eng.has_unfinished_requests():
        return False
    req = eng.requests.get(live["rid"])
    drafts = list(req.spec_token_ids) if req is not None else []
    eng.step()
    eng.check_invariants()
    result = eng.speculator.last_results.get(live["rid"])
    if result is not None and result.num_draft_tokens:
        live["rows"].append(SpecRow(eng.stats.num_steps, [tokenizer.decode([t]) for t in drafts[:result.num_draft_tokens]],
                                    result.num_accepted, tokenizer.decode([result.token_ids[-1]])))
    kv = eng.kv_cache_manager
    held = kv.request(live["rid"]).num_tokens if kv.has_request(live["rid"]) else live["view"].num_tokens
    live["view"].update(live["rows"], num_tokens=held)
    s = eng.speculator.stats
    return f"step {eng.stats.num_steps}: {s.num_accepted_tokens}/{s.num_draft_tokens} drafts kept so far"


live_stepper = Stepper(live_step, live_reset, n_steps=None, interval_ms=700, description="engine step")
method.observe(lambda change: live_stepper.reset(), names="value")
live_stepper.reset()
widgets.VBox([method, live_stepper.widget, live["view"].widget])

# %% [markdown]
# For readers without a kernel: the view after eight steps with the draft model.

# %%
live_stepper.go_to(8)
live["view"].static()

# %%
assert live["rows"] and all(0 <= r.num_accepted <= len(r.drafts) for r in live["rows"])
assert live["view"].num_tokens == live["engine"].requests[live["rid"]].num_computed_tokens

# %% [markdown]
# ## The proofs
#
# **Greedy output is the target's, token for token** — with the draft and with n-gram lookup, at block sizes 1 to
# 16, under a budget tight enough to preempt, and with long prompts prefilled in chunks. After **every** step the
# engine's invariants hold (refcounts equal the tables holding each block, the free queue is consistent) and every
# running request's KV holds exactly its real, computed tokens: no draft survives a step, so no block with an
# unverified token can have been hashed.

# %%
# NBVAL_CHECK_OUTPUT
def run_checked(engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        engine.check_invariants()
        kv = engine.kv_cache_manager
        for req in engine.scheduler.running:  # KV slots for exactly the computed tokens: no draft's slot survives
            table, B = kv.request(req.request_id), kv.block_size
            assert table.num_tokens == req.num_computed_tokens
            for j, block_hash in enumerate(table.block_hashes):  # and every hashed block holds real tokens only
                entry = kv.index.entry_for_hash(block_hash)
                assert entry is None or entry.block_id != table.block_ids[j] or \
                    list(entry.key.token_ids) == req.all_token_ids[j * B:(j + 1) * B]
    return [done[i] for i in ids]


params = SamplingParams(max_tokens=24, temperature=0)
reference = [o.token_ids for o in InferenceEngine(target, tokenizer, kv_budget_tokens=4096).generate(PROMPTS, params)]
rows = []
for method_name in ("draft", "ngram"):
    for block_size, budget, chunk in ((1, 4096, 512), (4, 96, 512), (8, 4096, 16), (16, 4096, 512)):
        eng = InferenceEngine(target, tokenizer, kv_budget_tokens=budget, block_size=block_size,
                              max_num_seqs=4, max_num_batched_tokens=chunk,
                              speculative_config={"method": method_name, "num_speculative_tokens": 3})
        same = run_checked(eng, PROMPTS, params) == reference
        s = eng.speculator.stats
        rows.append((method_name, block_size, budget, chunk, same, eng.stats.num_preemptions, eng.stats.num_steps))
        print(f"{method_name:>5}, block {block_size:>2}, budget {budget:>4}, chunk {chunk:>3}: identical={same}, "
              f"{eng.stats.num_preemptions} preemptions, {eng.stats.num_steps} steps, "
              f"{s.num_accepted_tokens}/{s.num_draft_tokens} kept")

# %%
assert all(r[4] for r in rows)  # identical everywhere
assert any(r[5] > 0 for r in rows)  # the tight budget did preempt: rollback and preemption together

# %% [markdown]
# **Sampling keeps the target's distribution — in the engine too.** Three tokens at temperature 1 with top-k 3:
# the first comes from the prefill, the next two from one verification (one draft, then the bonus or the fix).
# The 27 possible outcomes' exact probabilities come from running the target over each prefix; 1,500 seeded
# requests through the speculative engine are tested against them. (The test suite runs this for both proposers
# and shows it failing for planted bugs in the engine's rule: keep every draft, take the bonus from the wrong
# position; rejection sampling's own planted bugs are caught on the enumerable world above.)

# %%
from minienv.lab.speculation import chi_square_critical, pearson_statistic
from minienv.sampling import Sampler

prompt = "ROMEO.\nO, she doth teach the torches to burn"
top3 = SamplingParams(max_tokens=3, temperature=1.0, top_k=3)
sampler, frontier = Sampler(top3), {(): 1.0}
for _ in range(3):  # the exact joint distribution of the next 3 tokens, by enumeration
    nxt = {}
    for seq, prob in frontier.items():
        p = sampler.probs(target.forward(np.array(tokenizer.encode(prompt) + list(seq)))[-1])
        nxt.update({seq + (int(t),): prob * p[t] for t in np.flatnonzero(p > 0)})
    frontier = nxt
n = 1500
eng = InferenceEngine(target, tokenizer, kv_budget_tokens=8192, block_size=16, max_num_seqs=64, history_size=0,
                      speculative_config={"method": "draft", "num_speculative_tokens": 1, "draft_model": draft})
samples = [tuple(o.token_ids) for o in eng.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=1.0,
                                                                                   top_k=3, seed=s) for s in range(n)])]
counts = {seq: samples.count(seq) for seq in frontier}
stat, dof = pearson_statistic(counts, frontier, n)  # rare outcomes pooled, as Pearson's test needs
print(f"{eng.speculator.stats.num_drafts} verifications; chi-square {stat:.1f}, critical {chi_square_critical(dof, 0.001):.1f} "
      f"at alpha 0.001 (dof {dof}): consistent with the target = {stat <= chi_square_critical(dof, 0.001)}")

# %%
assert all(s in frontier for s in samples)  # nothing the target gives probability 0
assert stat <= chi_square_critical(dof, 0.001)

# %% [markdown]
# ## Reading acceptance: per position, and the temperature
#
# `engine.speculator.stats` counts what vLLM exports as `vllm:spec_decode_num_drafts`, `…_num_draft_tokens`,
# `…_num_accepted_tokens` and `…_num_accepted_tokens_per_pos`. Position `i` is only judged if positions
# `1 … i−1` were kept, so the per-position rates fall. If every judged draft were kept independently with
# probability α, a verification would emit `(1 − α^(k+1)) / (1 − α)` tokens on average.
#
# What is α? Summing the kept-probability over the draft's choices gives
# `Σ_x q(x)·min(1, p(x)/q(x)) = Σ_x min(p(x), q(x)) = 1 − TV(p, q)`: one minus the total-variation distance
# between the two models' distributions. So temperature does not simply lower acceptance: as it rises, **both**
# distributions flatten towards uniform and overlap more. Greedy (temperature 0) instead needs the two argmaxes to
# agree exactly.
#
# **The engine's rule is a close cousin.** With min(1, p/q) the emitted token depends on *what was proposed*: a
# request that was preempted (no drafts in its resume step) or whose drafts did not fit a step would emit other
# tokens than the same seeded request alone. So minienv's engine fixes each position's randomness first
# (exponential noise `E`, a function of the seed and the position), takes the target's token as the Gumbel-max
# sample `argmax(p / E)` — exactly distributed as `p` — and lets the draft propose `argmax(q / E)` with the same
# noise. Verification is then the greedy rule against the target's sample: the text never depends on the
# proposals, and a draft is kept with probability P(argmax(p/E) = argmax(q/E)), a little below 1 − TV (Daliri,
# Musco & Suresh 2024, "drafter-invariant speculative decoding"). First α predicted from the models themselves, at
# every position of a greedy continuation, then the engine's measured α:

# %%
# NBVAL_CHECK_OUTPUT
from minienv.sampling import scale_logits, softmax

text_ids = tokenizer.encode(PROMPTS[0]) + list(plain_out.token_ids)
p_logits = target.forward(np.array(text_ids))[len(tokenizer.encode(PROMPTS[0])) - 1:]
q_logits = draft.forward(np.array(text_ids))[len(tokenizer.encode(PROMPTS[0])) - 1:]
predicted = {0.0: float(np.mean(p_logits.argmax(-1) == q_logits.argmax(-1)))}
for temperature in (0.5, 1.0, 1.5, 2.0):
    p_t, q_t = softmax(scale_logits(p_logits, temperature)), softmax(scale_logits(q_logits, temperature))
    predicted[temperature] = float(np.mean(np.minimum(p_t, q_t).sum(-1)))  # 1 - TV(p, q), averaged
print("predicted α (1 - TV):", {t: round(a, 2) for t, a in predicted.items()})

# %%
stats_by_t = {}
for temperature in predicted:
    eng = InferenceEngine(target, tokenizer, kv_budget_tokens=4096, block_size=16,
                          speculative_config={"method": "draft", "num_speculative_tokens": 4, "draft_model": draft})
    eng.generate(PROMPTS * 4, [SamplingParams(max_tokens=48, temperature=temperature, seed=i) for i in range(16)])
    s = stats_by_t[temperature] = eng.speculator.stats
    a = s.conditional_acceptance_rate
    print(f"temperature {temperature:.1f}: measured α = {a:.2f} (predicted {predicted[temperature]:.2f}), per position "
          f"{[round(x / s.num_drafts, 2) for x in s.accepted_per_pos]}, {s.mean_acceptance_length:.2f} tokens per "
          f"verification (i.i.d. prediction {(1 - a ** 5) / (1 - a):.2f})")

# %% [markdown]
# Read both rows against each other, not against a slogan. From greedy to temperature 0.5 the overlap jumps
# (predicted 0.58<!--out--> → 0.75<!--out-->): sampling no longer needs the two argmaxes to agree. Past that the
# prediction is *not* monotone — 0.78<!--out--> at 1.0, 0.76<!--out--> at 1.5, 0.78 at 2.0 — because flattening
# two distributions does not always bring them closer at every step. The engine's measured α stays below the
# overlap and flatter — 0.67<!--out--> at 0.5, 0.65<!--out--> at 1.0, 0.67<!--out--> at 2.0 — the price of its coupled
# rule: a draft is kept only when the two Gumbel-max samples agree, and flatter distributions give the shared noise
# more ways to pick different tokens. Greedy is unaffected (0.63<!--out-->).

# %%
assert predicted[0.5] > predicted[0.0] and predicted[2.0] > predicted[0.5]  # flatter distributions overlap more
measured = {t: s.conditional_acceptance_rate for t, s in stats_by_t.items()}
assert all(measured[t] < predicted[t] for t in predicted if t > 0)  # the coupled rule keeps fewer than 1 - TV
for t in predicted:  # the overlap predicts the engine's acceptance (different texts: loosely)
    assert abs(measured[t] - predicted[t]) < 0.15, (t, measured[t], predicted[t])
for s in stats_by_t.values():
    assert s.accepted_per_pos == sorted(s.accepted_per_pos, reverse=True)  # position i needs i - 1 kept

# %% [markdown]
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/12_speculative_decoding.py` — is explained in notebook 00.)
#
# ### Exercise 1: the acceptance step
#
# Write `accept_step(drafts, target_probs, draft_probs, rng)`: `drafts` are `k` token ids, `target_probs` is
# `[k + 1, V]` (the target's `p` at each position), `draft_probs` is `[k, V]` (the `q` each draft was drawn from);
# return the tokens to append. Rules: (1) return the kept drafts, a prefix of `drafts`, followed by exactly **one**
# token of the target's; (2) keep draft `i` with probability `min(1, p(d)/q(d))`; (3) on the first rejection draw
# the token from `normalise(max(p − q, 0))` and stop; (4) if all are kept — also when `k = 0` — draw a bonus token
# from `p` at position `k + 1`; (5) draw only from `rng`, so the same seed gives the same tokens. The check tries
# each rule's edges, then grades the distribution with the chi-square test above.

# %%
from minienv.exercises.speculative_decoding import check_accept_step, check_ngram


def accept_step(drafts, target_probs, draft_probs, rng):
    """The tokens a request appends after verifying ``drafts`` (see the rules above)."""
    raise NotImplementedError("your code here")


# %%
check_accept_step(accept_step)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# "With probability x" is `rng.random() < x`. Multiply both sides by `q(d)` and there is no division to worry
# about when `q(d)` is tiny.
# </details>
#
# <details><summary>Hint 2</summary>
#
# To draw from a vector of non-negative weights `w` that need not sum to 1 — the residual does not — take the
# cumulative sums and find where `rng.random()` times their total falls (`np.searchsorted`). `rng.choice(V, p=w)`
# refuses weights that do not sum to 1.
# </details>
#
# <details><summary>Hint 3</summary>
#
# One loop over the drafts, with one way out per rule: a kept draft goes on, a rejection returns at once. Where
# does the loop end when nothing was rejected — and when there was nothing to judge?
# </details>
#
# ### Exercise 2: prompt lookup
#
# Write `propose(token_ids, k, min_n, max_n)`: for `n` from `max_n` down to `min_n` (both included), find the
# **latest** earlier occurrence of the sequence's last `n` tokens (it may overlap the suffix but must end before the
# last token, so something follows it) and return up to `k` tokens that followed it; `[]` if no `n` matches (an
# empty or one-token sequence included). The check compares you with minienv's `NgramProposer` on hand-made cases
# (one per rule) and on 300 random sequences.

# %%
def propose(token_ids, k, min_n, max_n):
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
    raise NotImplementedError("your code here")


# %%
check_ngram(propose)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# The suffix is `token_ids[t - n:]` with `t = len(token_ids)`. A window starting at `s` is
# `token_ids[s:s + n]`; the suffix itself starts at `t - n`, so earlier windows start at `t - n - 1` down to 0 —
# search them latest first.
# </details>
#
# <details><summary>Hint 2</summary>
#
# `n` cannot exceed `t - 1` (something must follow the match). Return `token_ids[s + n:s + n + k]`.
# </details>

# %% [markdown]
# **Does it pay here?** `benchmarks/bench_spec_decode.py` measures k = 1 … 8 for both proposers. On this CPU a
# call's cost is mostly per-call overhead, not weight reads, so the draft's `k` calls cost almost as much as the
# target's one — fewer target calls (0.42–0.73 per token with the draft, `docs/BENCHMARKS.md`) do not become wall-clock speed: the draft
# proposer is slower than plain decoding at every k we measured. N-gram lookup costs nothing to propose and wins
# where the text is already in the prompt (a user pasting an earlier answer back, an edit, code with repeated
# patterns). On a GPU, decoding is bound by reading the weights, the draft is truly cheap, and the verify call
# costs about one decode step: that is where the papers' 2–3× come from (notebook 16's roofline clock: one
# Llama-3-8B step on an H100 takes 6.63 ms<!--out:16--> for one token per sequence, and verifying more tokens in the same step
# adds compute, not weight reads, until the step turns compute-bound).
#
# **On a real model the verdict moves, but on a CPU only partly** (notebook 15). SmolLM2-135M-Instruct is
# memory-bound: a decode step reads 538 MB of float32 weights for one token, so verifying drafts no longer costs
# one step per draft — but one token streams the weights at full read bandwidth while a 5-token verify step still
# goes through BLAS and costs ~4.5 decode steps. Measured by `benchmarks/bench_real_model.py --parts spec` on a quiet
# host (paired rounds; `docs/BENCHMARKS.md`, "The other parts on a quiet host"): n-gram speculation runs at 0.70×
# plain on a grounded task (copying a passage from the prompt, 54 % of drafts accepted) and 0.68× on free chat
# (36 %) — a smaller loss than the toy's, not a win. (An earlier run on a loaded host read 0.98× / 0.87×: plain
# decoding has since become faster, the verify step has not.)
#
# ## Traps real engines shipped
#
# * **Speculation changed greedy output.** Any mismatch between how the verifier and the plain sampler read the
#   logits (a different mask, a temperature applied on one side only, a padded vocabulary) makes "greedy with
#   speculation" drift. Lesson: test speculative greedy against plain greedy, token for token, on many prompts.
# * **An unverified token in the prefix cache.** Hash a block at the commit *before* truncating the rejected
#   drafts and the cache serves K/V for tokens that were never generated. Lesson: truncate, then commit.
# * **A refcount off by one on rollback.** Freeing the slots of rejected drafts must release exactly the blocks
#   past the new end, last first, and nothing a fork or a shared prefix still holds (`KVCacheManager.truncate`).
# * **Inter-token latency looks better than it is.** With several tokens per step, "time between tokens" is
#   mostly zero inside a step and large between steps; per-token averages hide that.
# * **The bonus from the wrong position.** The bonus comes from `p` at position `k + 1` — an off-by-one takes it
#   from position `k`, and the chi-square test catches it.
#
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if the draft model were the target itself? What would α be at temperature 0, and why would speculation
#   still not pay?
#
# ## Where it lives
#
# | minienv | vLLM v0.11.0 | SGLang v0.5.3 |
# |---|---|---|
# | `minienv/spec_decode/rejection.py` — `verify` | [`vllm/v1/sample/rejection_sampler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/sample/rejection_sampler.py) (`RejectionSampler`) | [`python/sglang/srt/speculative/eagle_info.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/speculative/eagle_info.py) (`EagleVerifyInput.verify` calls the `tree_speculative_sampling_target_only` kernel; in `eagle_utils.py` before PR #10735) |
# | `minienv/spec_decode/ngram.py` — `NgramProposer` | [`vllm/v1/spec_decode/ngram_proposer.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/spec_decode/ngram_proposer.py) (`NgramProposer`, `prompt_lookup_min/max`) | [`python/sglang/srt/speculative/ngram_worker.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/speculative/ngram_worker.py) (`--speculative-algorithm NGRAM`; `lookahead_worker.py` / `LOOKAHEAD` before PR #11010, merged around this release) |
# | `minienv/spec_decode/draft.py` — `DraftProposer` | `vllm/v1/spec_decode/draft_model.py` (added by PR #24322, after v0.11.0; v0.11.0 has EAGLE/Medusa/MTP in `eagle.py`, `medusa.py`) | [`python/sglang/srt/speculative/standalone_worker.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/speculative/standalone_worker.py) (`--speculative-algorithm STANDALONE`) |
# | `minienv/spec_decode/speculator.py` — `SpeculativeConfig`, `SpecDecodingStats` | [`vllm/config/speculative.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/config/speculative.py), [`vllm/v1/spec_decode/metrics.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/spec_decode/metrics.py) | [`python/sglang/srt/speculative/spec_info.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/speculative/spec_info.py) |
# | `Scheduler.update_from_output(plan, num_rejected)` — truncate, then commit | [`vllm/v1/core/sched/scheduler.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/core/sched/scheduler.py) (`update_from_output`: `num_computed_tokens -= num_rejected`) | [`python/sglang/srt/speculative/eagle_info.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/speculative/eagle_info.py) (verify, then free the rejected slots) |
#
# ## Summary
#
# * Propose `k` tokens cheaply; the target scores all `k + 1` positions in **one** call, keeps a prefix of the
#   guesses and adds one token of its own.
# * Greedy speculation is token-for-token plain decoding. Sampling with `min(1, p/q)`, the residual and the bonus
#   is distributed exactly as the target (derived, then checked by chi-square); forget the residual and it is not.
# * In a paged, prefix-cached engine rejection is a **truncate before the commit**: only verified blocks are hashed.
# * Acceptance α is the overlap `1 − TV(p, q)`: it falls with the draft position, and is higher at temperature 2.0
#   than at 0.5 — though not at every temperature in between.
# * The engine's coupled rule (each position's noise fixed by the seed) keeps a little less than that, so a seeded
#   request's text never depends on the proposals.
# * Speculation pays when a target call is expensive and proposing is nearly free: on a GPU, or n-gram lookup on
#   text the prompt already contains.

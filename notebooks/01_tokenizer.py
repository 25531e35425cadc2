# %% [markdown]
# # 01 · Tokenizer: from text to token ids with byte-level BPE
#
# An inference engine never sees text. The first box of the engine map turns the prompt into a list of integer
# **token ids**; everything after it — the scheduler's token budget, the KV cache's blocks, the model's
# embedding table — counts and stores *tokens*. So the tokenizer decides how long every sequence is, and with it
# how much KV memory a request needs and how many decode steps it takes.
#
# **Learning goals.** After this notebook you can
# 1. say why neither characters nor words make good tokens, with numbers: sequence length vs vocabulary size;
# 2. run byte-pair encoding (BPE) by hand, merge by merge, and watch the sequence shrink;
# 3. explain why a *byte-level* tokenizer never needs an "unknown" token (emoji, CJK, anything);
# 4. use minienv's `BPETokenizer` — the one the bundled models were trained with — and read its
#    `tokenizer.json`, which the Hugging Face `tokenizers` library loads to the very same ids;
# 5. find the tokenizer in vLLM and SGLang.

# %% [markdown]
# ## The problem, with a number
#
# Take one famous passage (the bundled models were trained on the plays, in this modern-spelling edition) and
# count what two naive schemes would cost.

# %%
# NBVAL_CHECK_OUTPUT
import re

PASSAGE = """Ham.
To be, or not to be,--that is the question:--
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune
Or to take arms against a sea of troubles,
And by opposing end them?--To die,--to sleep,--
No more; and by a sleep to say we end
The heartache, and the thousand natural shocks
That flesh is heir to,--'tis a consummation
Devoutly to be wish'd. To die,--to sleep;--
To sleep! perchance to dream:--ay, there's the rub;
For in that sleep of death what dreams may come,
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life;
"""


def words_of(text):
    return re.findall(r"[A-Za-z']+|[^A-Za-z'\s]", text)


words = words_of(PASSAGE)
print(f"characters: {len(PASSAGE):4d} tokens, vocabulary {len(set(PASSAGE)):3d} distinct characters")
print(f"words:      {len(words):4d} tokens, vocabulary {len(set(words)):3d} distinct words (and punctuation)")
print(f"UTF-8 bytes:{len(PASSAGE.encode()):5d} tokens, vocabulary 256 (every possible byte)")

NEXT_LINE = "For who would bear the whips and scorns of time,"
unknown = [w for w in words_of(NEXT_LINE) if w not in set(words)]
print(f"\nthe very next line has {len(words_of(NEXT_LINE))} words; {len(unknown)} are not in the word vocabulary:")
print(unknown)

# %% [markdown]
# Characters give a tiny vocabulary but long sequences: every character is a model step and a KV-cache slot
# (notebook 02 puts a byte count on a slot). Words give short sequences but a vocabulary that never ends: six
# of the next line's eleven words were never seen, and a word-level model would have to map them all to one
# `<unk>` id, losing them. (Covering all of Unicode by characters is no better: 150 000 code points.)
#
# BPE sits in between: start from bytes (vocabulary 256, nothing unknown), then **learn** a fixed number of
# merges so that frequent character runs — common words, " the", "'d" — become single tokens.
#
# ## Build it small: BPE, merge by merge
#
# The whole algorithm: count adjacent pairs, merge the most frequent pair into a new token everywhere, repeat.
# Here it is on a short text, as bytes, with nothing else.

# %%
# NBVAL_CHECK_OUTPUT
from collections import Counter


def merge_pair(seq, pair, new_id):
    """Replace every (a, b) in seq, left to right, without overlaps, by new_id."""
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


TOY = "the cat sat on the mat; the rat sat on the hat"
seq = list(TOY.encode("utf-8"))
vocab = {i: bytes([i]) for i in range(256)}
print(f"start: {len(seq)} tokens (one per byte)")
for step in range(10):
    counts = Counter(zip(seq, seq[1:]))
    # most frequent pair; ties go to the smallest pair, so the run is deterministic
    pair, n = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    new_id = 256 + step
    vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
    seq = merge_pair(seq, pair, new_id)
    print(f"merge {step + 1:2d}: {vocab[pair[0]]!r:7} + {vocab[pair[1]]!r:7} -> {vocab[new_id]!r:10} "
          f"(seen {n}x)  now {len(seq)} tokens")
print("tokens:", " | ".join(vocab[i].decode() for i in seq))

# %% [markdown]
# Ten merges took the text from 46<!--out--> tokens to 13<!--out-->. Two things to notice:
#
# * merges stack: `'at'` is learned first, then `'at '`, `'sat '`, `'at sat '`; a token is always the
#   concatenation of two earlier tokens, so the vocabulary is a tree over the 256 bytes;
# * the merges run across word boundaries (`'on the '`, `'at sat '`): on a flat byte stream the trainer
#   memorises this one text's phrases instead of learning reusable word pieces. Real
#   tokenizers first cut the text into **pre-tokens** — words with their leading space, numbers, punctuation
#   runs, whitespace runs — and only merge *inside* a pre-token. That keeps tokens word-like, and it makes
#   encoding fast: each distinct pre-token is encoded once and cached.
#
# ## minienv's version
#
# `minienv.tokenizer` is the same algorithm with those two refinements. Its pre-tokenizer is a regular
# expression like GPT-2's, written with ASCII classes only so that Python's `re` and the Rust `tokenizers`
# library (Oniguruma) split every string identically — the reference tests check that on the corpus and on
# random text.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.tokenizer import BPETokenizer, load_tokenizer, pretokenize

print(pretokenize("To be, or not to be,--that is the question:--\nWhether 'tis nobler"))

small = BPETokenizer.train(PASSAGE, vocab_size=256 + 12 + 1)  # 12 merges + <|endoftext|>
print("\nfirst merges learned on the passage:",
      [small.id_to_token(a) + "+" + small.id_to_token(b) for a, b in small.merges])
print("passage:", len(PASSAGE.encode()), "bytes ->", len(small.encode(PASSAGE)), "tokens with 12 merges")

# %% [markdown]
# Now the **bundled** tokenizer: trained by `training/train.py` on the training plays, 2048 ids = 256 bytes +
# 1791 merges + `<|endoftext|>`. The models in `assets/target` and `assets/draft` read and write these ids.

# %%
# NBVAL_CHECK_OUTPUT
tok = load_tokenizer()
print(tok)
line = "To be, or not to be,--that is the question:--"
ids = tok.encode(line)
print(ids)
print(tok.tokens(line))
assert tok.decode(ids) == line
print(f"{len(line)} characters -> {len(ids)} tokens; eos_token_id = {tok.eos_token_id}")

# %% [markdown]
# How much each merge buys: encode the passage with only the first *k* of the bundled tokenizer's merges (the
# ids of a BPE vocabulary are nested, so the first *k* merges are themselves a valid tokenizer).

# %%
# NBVAL_CHECK_OUTPUT
KS = [0, 25, 50, 100, 200, 400, 800, 1200, len(tok.merges)]
lengths = [len(BPETokenizer(tok.merges[:k]).encode(PASSAGE)) for k in KS]
for k, n in zip(KS, lengths):
    print(f"{k:5d} merges: {n:4d} tokens  ({n / len(PASSAGE):.3f} per character)")

# %%
import plotly.graph_objects as go

from minienv.viz.static import show  # the live figure, with a PNG of it for readers without a kernel

fig = go.Figure(go.Scatter(x=KS, y=lengths, mode="lines+markers",
                           hovertemplate="first %{x} merges: %{y} tokens<extra></extra>"))
fig.update_layout(title="The passage's length in tokens vs the number of BPE merges", xaxis_title="merges",
                  yaxis_title="tokens", height=320, width=640, margin=dict(l=50, r=20, t=50, b=40))
show(fig)

# %%
assert lengths[0] == len(PASSAGE.encode()), "no merges: one token per byte"
assert all(a >= b for a, b in zip(lengths, lengths[1:])), "every merge can only shorten the sequence"
assert lengths[-1] < 0.35 * lengths[0], "the full vocabulary cuts the passage to about a third"
assert lengths[3] < 0.65 * lengths[0], "the first 100 merges (' t', 'he', ' the', ...) already cut a third"

# %% [markdown]
# The first few dozen merges (`' t'`, `'he'`, `' the'`, ...) buy the most; after a few hundred, each merge saves
# little on this text. Vocabulary size is a trade: every id costs a row in the embedding table and a column of
# the output layer (2048 × 192 floats each in the bundled target model), while fewer tokens mean fewer decode
# steps and fewer KV-cache slots.
#
# ## Why byte-level means no unknown token
#
# The vocabulary contains all 256 byte values, so *any* string has an encoding: characters outside the training
# text simply fall back to their UTF-8 bytes. A token may even hold part of a character (`‹f0 9f›` below is half of
# an emoji); decoding joins the bytes first and only then turns them into text, so nothing is lost.

# %%
# NBVAL_CHECK_OUTPUT
for s in ["Ophelia", "Ophélie", "😀", "漢字", "e\u0301", "tab\there\x00", ""]:
    ids = tok.encode(s)
    assert tok.decode(ids) == s  # lossless, always
    print(f"{s!r:16} {len(s.encode()):2d} bytes -> {len(ids):2d} tokens {ids}  "
          f"{[tok.id_to_bytes(i) for i in ids]}")

# %% [markdown]
# Merges are learned by frequency over all the plays, so even a name from *Hamlet* takes five tokens here, and
# `"Ophélie"` splits its `é` into two byte-tokens. The emoji and the CJK characters, never seen in training, cost
# one token per byte — expensive, but representable. And the special token `<|endoftext|>` — which separated the plays in
# training and ends generation — is matched as a whole before anything else:

# %%
# NBVAL_CHECK_OUTPUT
ids = tok.encode("Exit.<|endoftext|>ACT I.")
print(ids, "->", [tok.id_to_token(i) for i in ids])
assert tok.eos_token_id in ids and tok.decode(ids) == "Exit.<|endoftext|>ACT I."

# %% [markdown]
# ## Live: type and see the tokens
#
# Edit the text: every token is a coloured span with its id underneath. Spaces show as `·`, newlines as `⏎`.
# Try a long word ("Rosencrantz"), a modern word ("smartphone"), digits, another language, an emoji. (Below the
# widget is the same view as static HTML, for readers without a running kernel.)

# %%
from IPython.display import display

from minienv.viz.tokens import TokenView

view = TokenView(tok, "Ham.\nTo be, or not to be,--that is the question:--\nSmartphones? 😀 漢字")
view

# %%
display(view.static())

# %%
assert view.ids == tok.encode(view.text), "the view shows exactly the encoder's ids"
view.update("Alas, poor Yorick!")  # what typing does: the tokens follow the text
assert view.ids == tok.encode("Alas, poor Yorick!")
assert tok.decode(view.ids) == view.text, "and the ids decode back to the text typed"
print(view)

# %% [markdown]
# ## Proof cells
#
# Round trips on random strings from all of Unicode (seeded), and the file format: `save` writes Hugging Face
# `tokenizer.json`, `load` reads it back to an identical tokenizer. When the `tokenizers` library is installed,
# it must produce the same ids from the same file (the reference tier checks this on the whole corpus).

# %%
# NBVAL_CHECK_OUTPUT
import json
import random
import tempfile
from pathlib import Path

rng = random.Random(0)
points = [rng.randrange(0x110000) for _ in range(20_000)]
samples = ["".join(chr(c) for c in points[i : i + 40] if not 0xD800 <= c < 0xE000) for i in range(0, 20_000, 40)]
assert all(tok.decode(tok.encode(s)) == s for s in samples)
print(f"{len(samples)} random Unicode strings round-trip")

with tempfile.TemporaryDirectory() as d:
    path = tok.save(Path(d) / "tokenizer.json")
    assert BPETokenizer.load(path) == tok
    data = json.loads(path.read_text())
print("tokenizer.json:", data["model"]["type"], "|", len(data["model"]["vocab"]), "vocab entries |",
      len(data["model"]["merges"]), "merges | pre-tokenizer:",
      [p["type"] for p in data["pre_tokenizer"]["pretokenizers"]])

# %%
try:
    import tokenizers
except ImportError:
    print("tokenizers not installed: skipping the side-by-side check")
else:
    from minienv.paths import assets_dir

    hf = tokenizers.Tokenizer.from_file(str(assets_dir() / "tokenizer.json"))
    for s in [PASSAGE, *samples[:50]]:
        assert hf.encode(s, add_special_tokens=False).ids == tok.encode(s)
    print("tokenizers", tokenizers.__version__, "gives the same ids")

# %% [markdown]
# ## The bundled tokenizer on the corpus
#
# `training/train.py` recorded these numbers when it trained the tokenizer (`assets/training_log.json`). The
# tokens-per-character ratio is what converts "a 2 000-character prompt" into KV-cache slots.

# %%
# NBVAL_CHECK_OUTPUT
from minienv.paths import assets_dir

log = json.loads((assets_dir() / "training_log.json").read_text())["tokenizer"]
print(f"vocabulary: {log['vocab_size']} ids, <|endoftext|> = {log['eos_token_id']}")
print(f"training text: {log['train_tokens']:,} tokens, {log['tokens_per_char']:.3f} tokens per character "
      f"(~{1 / log['tokens_per_char']:.1f} characters per token)")
print(f"held-out plays: {log['heldout_tokens']:,} tokens")
print(f"this passage:  {len(tok.encode(PASSAGE)) / len(PASSAGE):.3f} tokens per character")
longest = sorted(range(256, 256 + len(tok.merges)), key=lambda i: (-len(tok.id_to_bytes(i)), i))[:8]
print("longest tokens:", [tok.id_to_token(i) for i in longest])

# %% [markdown]
# ## Exercises
#
# (How they work — stubs, checks, hints, `solutions/01_tokenizer.py` — is explained in notebook 00.)
#
# ### Exercise 1: one merge step of training
#
# Real BPE training does not re-scan the text: it keeps a table of **pre-token → count** and merges inside
# those. Write `merge_step(words)`:
#
# * `words` maps a pre-token, given as a tuple of token ids, to how often it occurs, e.g.
#   `{(116, 104, 101): 5, (32, 116, 104, 101): 9}`;
# * count every adjacent pair, **weighted by the word's count**;
# * pick the most frequent pair; break ties by the smallest pair (`(a, b) < (c, d)` as tuples);
# * the new token's id is `max id in any word + 1`, or 256 if that is smaller;
# * return `(pair, new_id, new_words)` where `new_words` has every occurrence of the pair merged, left to right,
#   without overlaps (`(5, 5, 5)` with pair `(5, 5)` becomes `(new, 5)`), counts unchanged, input untouched;
# * return `None` if no word has two tokens left.
#
# `merge_pair` from the "build it small" section is yours to use.

# %%
from minienv.exercises.tokenizer import check_encode_word, check_merge_step


def merge_step(words):
    """One BPE training step on a {pre-token ids: count} table: (pair, new_id, new_words), or None."""
    raise NotImplementedError("your code here")


# %%
check_merge_step(merge_step)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Three parts: count (a `Counter` over `zip(w, w[1:])`, adding the word's count, not 1), choose, rebuild the dict.
# </details>
#
# <details><summary>Hint 2</summary>
#
# `min(counts, key=lambda p: (-counts[p], p))` gives the most frequent pair and, among equals, the smallest.
# </details>
#
# <details><summary>Hint 3</summary>
#
# `{tuple(merge_pair(list(w), pair, new_id)): c for w, c in words.items()}` builds a new dict and leaves the input
# alone. Two different words never merge into the same tuple: the new id is fresh, so merging is reversible.
# </details>
#
# **The trap.** The tempting count adds 1 per word instead of the word's count: it sees each *distinct* pre-token
# once, as if "the" were as rare as "thistles". The check has a case for exactly that, and such an answer stops
# with the rule it broke and the case that shows it:
#
# ```
# ExerciseFailed: ✗ count pairs weighted by the word's count: (1, 2) occurs 5 times, (3, 4) only twice
#   words={(1, 2): 5, (3, 4, 3, 4): 1}
#   expected ((1, 2), 256, {(256,): 5, (3, 4, 3, 4): 1})
#   got      ((3, 4), 256, {(1, 2): 5, (256, 256): 1})
# ```

# %% [markdown]
# ### Exercise 2: encode one pre-token
#
# Encoding applies the learned merges to new text. Write `encode_word(word, merges)`: `word` is a pre-token's
# UTF-8 bytes, `merges` the learned pairs in the order they were learned (merge `i` creates id `256 + i`). Start
# from the bytes, then (1) apply the **lowest-rank** merge present in the word — not the leftmost pair; (2) a
# merge replaces every occurrence of its pair; (3) repeat until no merge applies (one merge can create the pair
# of a later one). The check compares you with `BPETokenizer.encode` on every pre-token of a text.

# %%
def encode_word(word, merges):
    """The token ids of one pre-token's bytes after BPE: lowest-rank merge first, until none applies."""
    raise NotImplementedError("your code here")


# %%
check_encode_word(encode_word)

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `rank = {pair: i for i, pair in enumerate(merges)}` tells you each merge's rank and, with `256 + i`, its id.
# </details>
#
# <details><summary>Hint 2</summary>
#
# Loop: collect the word's adjacent pairs that have a rank; stop if there are none; else merge the one with the
# smallest rank everywhere with `merge_pair`.
# </details>
#
# <details><summary>Hint 3</summary>
#
# Applying every merge once, in rank order, over the whole word gives the same result — a merge's pair is made of
# tokens that only earlier merges create. minienv's `BPETokenizer._bpe` loops the first way and caches per
# pre-token.
# </details>

# %% [markdown]
# ## What if…?
#
# Open questions, with no check and no single answer — try them in a cell of your own:
#
# * What if you trained the tokenizer on Python code instead of Shakespeare? How would the token count of an English
#   prompt change — and with it, every KV-memory figure of the next notebooks, which are all per token?
#
# ## Where this lives in vLLM / SGLang
#
# > **vLLM** (paths as of v0.11.0)
# > * [`vllm/transformers_utils/tokenizer.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/transformers_utils/tokenizer.py) — `get_tokenizer()`: loads the model's tokenizer through
# >   `transformers` (`AutoTokenizer`, i.e. the same `tokenizer.json` format minienv writes) and wraps it.
# > * [`vllm/v1/engine/processor.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/engine/processor.py) — turns a prompt into `prompt_token_ids` before the
# >   request reaches the scheduler: the token count it produces is what the KV-cache manager budgets.
# > * [`vllm/v1/engine/detokenizer.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/v1/engine/detokenizer.py) — `IncrementalDetokenizer`: turns generated ids back into text *while
# >   streaming*, using `tokenizers`' `DecodeStream`. It has to, because a token can end in the middle of a
# >   UTF-8 character (the `‹f0 9f›` token above): text is emitted only once the bytes form whole characters.
# > * [`vllm/transformers_utils/detokenizer_utils.py`](https://github.com/vllm-project/vllm/blob/v0.11.0/vllm/transformers_utils/detokenizer_utils.py) — the slow-path helpers (`detokenize_incrementally`).
# >
# > **SGLang** (v0.5.3)
# > * [`python/sglang/srt/managers/tokenizer_manager.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/tokenizer_manager.py) — `TokenizerManager`, a separate process that tokenizes
# >   requests and sends ids to the scheduler over ZeroMQ, so tokenization never blocks the GPU loop.
# > * [`python/sglang/srt/managers/detokenizer_manager.py`](https://github.com/sgl-project/sglang/blob/v0.5.3/python/sglang/srt/managers/detokenizer_manager.py) — `DetokenizerManager`, the process that turns output
# >   ids back into (incremental) text.
# >
# > Both engines use Hugging Face tokenizers (Rust) rather than their own BPE: minienv writes its own for the
# > lesson, but saves it in the same format, so its ids are exactly what those engines would compute.

# %% [markdown]
# ## Summary
#
# * Tokens are the unit the whole engine counts: sequence length, decode steps, KV-cache slots, token budgets.
# * Characters make sequences long; words make the vocabulary unbounded and need `<unk>`. **BPE** learns merges
#   from data: frequent runs become single tokens, rare ones fall back to pieces.
# * **Byte-level** BPE starts from all 256 bytes, so every string encodes and decodes losslessly — emoji, CJK,
#   control characters — at the price of more tokens for text unlike the training data.
# * Pre-tokenization keeps merges inside words and makes encoding cacheable per pre-token.
# * minienv's `BPETokenizer` trains, encodes and decodes in pure Python and saves `tokenizer.json`; the
#   `tokenizers` library reads that file to identical ids. The bundled one (2048 ids, ~0.37<!--out:above--> tokens per
#   character on Shakespeare) is what the target and draft models speak.
#
# Next: [02 · the model and its KV cache](02_model_and_kv_cache.ipynb) — what happens to those ids.

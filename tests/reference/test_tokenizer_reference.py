"""Reference tier: the `tokenizers` library, reading our tokenizer.json, must produce exactly our ids.

This is what makes `assets/tokenizer.json` a real HF tokenizer rather than a look-alike: any engine that loads it
(vLLM, SGLang, transformers) sees the same token ids minienv trained its models on. The pre-tokenizer regex is
ASCII-only with explicit whitespace sets precisely so that Python's `re` and Oniguruma agree; the hypothesis
strategies below aim at the places where they could disagree (Unicode whitespace, apostrophes, digits, letters
outside ASCII).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minienv.paths import REPO_ROOT
from minienv.tokenizer import BPETokenizer, load_tokenizer

pytestmark = pytest.mark.reference

if os.environ.get("MINIENV_REQUIRE_TIERS") == "1":
    import tokenizers  # a missing dependency must fail in CI, not skip
else:
    tokenizers = pytest.importorskip("tokenizers")

BUNDLED = REPO_ROOT / "assets" / "tokenizer.json"
# Where training/prepare_corpus.py leaves the corpus; tests never download it.
CORPUS_CANDIDATES = [
    Path(os.environ.get("MINIENV_CORPUS", "/nonexistent")),
    Path("/tmp/minienv-corpus"),
    Path.home() / ".cache" / "minienv" / "corpus-prepared",  # prepare_corpus.py's default --out
]
TRICKY = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2028\u2029\u202f\u3000'sdmtlvreSDMT aZ09_-.,;:!?é漢😀\u0301"


@pytest.fixture(scope="module")
def pair():
    return load_tokenizer(), tokenizers.Tokenizer.from_file(str(BUNDLED))


def hf_ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def _check(pair, text: str) -> None:
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf_ids(hf, text), repr(text)
    assert hf.decode(ids, skip_special_tokens=False) == ours.decode(ids) == text


@settings(max_examples=400, deadline=None)
@given(st.text())
def test_same_ids_on_any_text(pair, text):
    _check(pair, text)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list(TRICKY)), max_size=40))
def test_same_ids_where_regex_engines_could_differ(pair, text):
    _check(pair, text)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=20), st.just("<|endoftext|>")), max_size=6))
def test_same_ids_with_special_tokens(pair, parts):
    _check(pair, "".join(parts))


def test_same_ids_on_fixed_texts(pair):
    for text in ["", "To be, or not to be: that is the question:\n", "  leading and trailing  \n\n",
                 "perform'd 'tis o'er 'Tis I'll we've they're", "1600 A.D. — 42nd", "😀 漢字 e\u0301",
                 "a\u00a0b\u2028c\x85d", "<|endoftext|>HAMLET.\n<|endoftext|>"]:
        _check(pair, text)


def _corpus_text() -> tuple[str, bool]:
    """The prepared corpus if it is on this machine (``python training/prepare_corpus.py``), else a stand-in.

    Tests never download, and CI runs on a clean clone, so the stand-in must be strong on its own: every
    vocabulary entry as text (so every merge is exercised, alone and next to its neighbours) plus the
    Shakespeare-like samples recorded in ``assets/training_log.json``.
    """
    for folder in CORPUS_CANDIDATES:
        if (folder / "train.txt").is_file():
            return (folder / "train.txt").read_text(encoding="utf-8") + (folder / "heldout.txt").read_text(
                encoding="utf-8"), True
    tok = load_tokenizer()
    vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    parts = ["".join(vocab), " ".join(vocab), "\n".join(vocab), "\n\n".join(vocab[::-1])]
    import json

    models = json.loads((REPO_ROOT / "assets" / "training_log.json").read_text())["models"]  # committed
    for model in models.values():
        parts += [s["text"] for s in model["samples"]]
    return "\n\n".join(parts), False


def test_same_ids_on_the_corpus(pair):
    text, full = _corpus_text()
    ours, hf = pair
    # batch by line blocks: tokenizers is fast on many medium strings; equality must hold for the whole text too
    chunks = text.split("\n\n")
    got = [ours.encode(c) for c in chunks]
    want = [e.ids for e in hf.encode_batch(chunks, add_special_tokens=False)]
    assert got == want
    assert ours.encode(text) == hf_ids(hf, text)
    assert sum(map(len, got)) > (1_000_000 if full else 10_000)


def test_small_trained_tokenizer_matches_too(tmp_path):
    """Not just the bundled file: any tokenizer minienv trains and saves is read identically."""
    text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 20 + "é😀 漢字"
    ours = BPETokenizer.train(text, vocab_size=330)
    path = ours.save(tmp_path / "tokenizer.json")
    hf = tokenizers.Tokenizer.from_file(str(path))
    for t in [text, "winter summer York é", "", "\n\n  x"]:
        assert ours.encode(t) == hf_ids(hf, t)


def test_transformers_fast_tokenizer_agrees(pair):
    transformers = pytest.importorskip("transformers")
    ours, _ = pair
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED), eos_token="<|endoftext|>")
    text = "KING.\nWhat news, my lord?<|endoftext|>"
    assert fast(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert fast.eos_token_id == ours.eos_token_id

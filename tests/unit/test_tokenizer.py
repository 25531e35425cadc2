"""Byte-level BPE: lossless round trips, training determinism, tokenizer.json save/load, clear errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minienv.paths import REPO_ROOT
from minienv.tokenizer import PRETOKENIZE_PATTERN, BPETokenizer, bytes_to_unicode, load_tokenizer, pretokenize

SAMPLE = (
    "ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n"
    "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\nDeny thy father and refuse thy name.\n"
    "'Tis but thy name that is my enemy; thou art thyself, though not a Montague.\n"
) * 3
HARD = [
    "", " ", "\n", "\n\n\n", "  \t\r\n\x0b\x0c ", "a  b", "a\u00a0b", "\x00\x01\x7f", "😀🎭👩‍👩‍👧",
    "漢字かなカナ한국어", "e\u0301 n\u0303", "\ufeffBOM", "\u2028\u2029\x85", "'s 'S 'll'd'", "123 4567 x1",
    "<|endoftext|>", "a<|endoftext|>b<|endoftext|>", "<|endoftext", "\udc80".encode("utf-8", "surrogatepass")
    .decode("utf-8", "replace"),
]
BUNDLED = REPO_ROOT / "assets" / "tokenizer.json"


@pytest.fixture(scope="module")
def small() -> BPETokenizer:
    return BPETokenizer.train(SAMPLE, vocab_size=300)


@pytest.fixture(scope="module")
def bundled() -> BPETokenizer:
    return load_tokenizer()


def test_byte_alphabet_is_a_bijection_onto_printable_chars():
    m = bytes_to_unicode()
    assert sorted(m) == list(range(256)) and len(set(m.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in m.values())
    assert m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ" and m[ord("a")] == "a"


@pytest.mark.parametrize("text", HARD)
def test_round_trip_hard_strings(small, text):
    assert small.decode(small.encode(text)) == text


@pytest.mark.parametrize("text", HARD)
def test_round_trip_hard_strings_bundled(bundled, text):
    assert bundled.decode(bundled.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(small, text):
    assert small.decode(small.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text_bundled(bundled, text):
    ids = bundled.encode(text)
    assert all(0 <= i < bundled.vocab_size for i in ids)
    assert bundled.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_pretokens_cover_the_text(text):
    pieces = pretokenize(text)
    assert "".join(pieces) == text and all(pieces)


def test_no_unknown_token_every_byte_encodes(small):
    # 256 single-byte tokens: any byte string has ids, so "unknown" cannot happen
    assert [small.id_to_bytes(i) for i in range(256)] == [bytes([b]) for b in range(256)]


def test_training_is_deterministic_and_greedy():
    a = BPETokenizer.train(SAMPLE, vocab_size=320)
    b = BPETokenizer.train(SAMPLE, vocab_size=320)
    assert a == b and a.merges == b.merges
    assert a.vocab_size == 320 and a.eos_token_id == 319 and len(a.merges) == 320 - 256 - 1
    # the first merge is the most frequent adjacent byte pair inside pre-tokens
    from collections import Counter
    from itertools import pairwise

    pairs = Counter()
    for piece in pretokenize(SAMPLE):
        raw = piece.encode()
        pairs.update(pairwise(raw))
    top = max(pairs.values())
    best = min((bytes([x]), bytes([y])) for (x, y), c in pairs.items() if c == top)
    assert (a.id_to_bytes(a.merges[0][0]), a.id_to_bytes(a.merges[0][1])) == best


def test_merges_shrink_the_sequence(small):
    bytes_only = BPETokenizer([])
    assert len(small.encode(SAMPLE)) < 0.6 * len(bytes_only.encode(SAMPLE)) == 0.6 * len(SAMPLE.encode())


def test_save_load_equality(small, tmp_path):
    path = small.save(tmp_path / "tokenizer.json")
    loaded = BPETokenizer.load(path)
    assert loaded == small
    assert BPETokenizer.load(tmp_path) == small  # a directory works too
    for text in HARD + [SAMPLE]:
        assert loaded.encode(text) == small.encode(text)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["model"]["type"] == "BPE" and data["pre_tokenizer"]["pretokenizers"][0]["pattern"] == {
        "Regex": PRETOKENIZE_PATTERN
    }
    assert data["added_tokens"][0]["content"] == "<|endoftext|>" and data["added_tokens"][0]["special"]


def test_special_tokens(small):
    eos = small.eos_token_id
    assert small.encode("<|endoftext|>") == [eos]
    ids = small.encode("Romeo<|endoftext|>Juliet")
    assert eos in ids and small.decode(ids) == "Romeo<|endoftext|>Juliet"
    assert small.decode(ids, skip_special_tokens=True) == "RomeoJuliet"
    assert small.id_to_token(eos) == "<|endoftext|>" and small.token_to_id("<|endoftext|>") == eos


def test_token_helpers(small):
    for i in range(small.vocab_size - 1):
        tok = small.id_to_token(i)
        if small.id_to_bytes(i).decode("utf-8", "replace") == tok and "\ufffd" not in tok:
            assert small.token_to_id(tok) == i
    assert small.id_to_stored(small.token_to_id(" the")) == "Ġthe"
    assert small.token_to_id("Ġthe") == small.token_to_id(" the")
    assert "".join(small.tokens("the sun")) == "the sun" and small.tokens(" the") == [" the"]


def test_bad_input(small, tmp_path):
    with pytest.raises(TypeError, match="str"):
        small.encode(b"bytes")
    with pytest.raises(TypeError):
        small.encode(None)
    with pytest.raises(ValueError, match="unknown token id"):
        small.decode([small.vocab_size])
    with pytest.raises(ValueError, match="unknown token id"):
        small.decode([-1])
    with pytest.raises(TypeError):
        small.decode("abc")
    with pytest.raises(TypeError):
        small.decode([1.5])
    with pytest.raises(ValueError):
        small.id_to_token(10**6)
    with pytest.raises(ValueError, match="not a single token"):
        small.token_to_id("Montague-Capulet")
    with pytest.raises(ValueError, match="smaller"):
        BPETokenizer.train("abc", vocab_size=100)
    with pytest.raises(TypeError):
        BPETokenizer.train(b"abc", vocab_size=300)
    data = small.to_hf_dict()
    data["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                             "use_regex": True}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="pre_tokenizer"):
        BPETokenizer.load(bad)


def test_numpy_ids_decode(small):
    import numpy as np
    ids = small.encode("Romeo")
    assert small.decode(np.array(ids)) == "Romeo"


def test_bundled_tokenizer_shape(bundled):
    assert bundled.vocab_size == 2048 and bundled.eos_token_id == 2047
    text = "ROMEO.\nBut soft, what light through yonder window breaks?\n"
    ids = bundled.encode(text)
    assert len(ids) < 0.5 * len(text)  # trained on Shakespeare: common words are single tokens
    assert " light" in bundled.tokens(text)


def test_token_view_shows_every_token(small):
    pytest.importorskip("ipywidgets")
    from minienv.viz.tokens import TokenView, token_spans, tokens_html

    text = "the sun\n😀"
    spans = token_spans(small, text)
    assert [s.token_id for s in spans] == small.encode(text)
    assert b"".join(s.raw for s in spans) == text.encode("utf-8")
    assert any(s.label.startswith("‹") for s in spans)  # a byte-token of the emoji, shown in hex
    assert "⏎" in "".join(s.label for s in spans) and "·" in "".join(s.label for s in spans)
    html = tokens_html(small, text)
    assert html.count('class="mnv-tok"') == len(spans) and f"{len(spans)} tokens" in html
    view = TokenView(small, "the")
    assert view.ids == small.encode("the")
    view.input.value = "<|endoftext|>sun"  # what typing does
    assert view.ids == small.encode("<|endoftext|>sun") and view.spans[0].special
    view.update("the sun")
    assert view.text == "the sun" and view.output.value == view.to_html()
    with pytest.raises(TypeError):
        view.update(3)
    with pytest.raises(TypeError):
        tokens_html(small, None)

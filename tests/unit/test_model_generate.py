"""The single-request generation loop, with a fake tokenizer (one token per character)."""

from __future__ import annotations

import numpy as np
import pytest

from minienv.generate import TextStream, complete, generate, generate_ids, trim_at_stop
from minienv.model import LlamaConfig, LlamaModel, random_weights
from minienv.sampling import SamplingParams


class CharTokenizer:
    """id = ord(char) - 32 for printable ASCII; id 95 is end-of-sequence."""

    eos_token_id = 95

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 32 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i + 32) for i in ids if i != 95)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=48, tie_word_embeddings=True)
    return LlamaModel(cfg, random_weights(cfg, seed=11, scale=0.3))


def greedy_by_hand(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(np.argmax(model.forward(ids)[-1])))
    return ids[-n:]


def test_cached_and_uncached_greedy_agree_with_the_dense_model(model):
    tok = CharTokenizer()
    params = SamplingParams(max_tokens=12, temperature=0)
    cached = list(generate(model, tok, "To be", params, use_cache=True))
    uncached = list(generate(model, tok, "To be", params, use_cache=False))
    expected = [t for t in greedy_by_hand(model, tok.encode("To be"), 12)]
    expected = expected[: expected.index(95)] if 95 in expected else expected
    assert cached == uncached == expected


def test_seeded_sampling_is_reproducible_and_same_with_or_without_cache(model):
    tok = CharTokenizer()
    p = SamplingParams(max_tokens=15, temperature=1.0, top_k=20, seed=7)
    a = list(generate(model, tok, "abc", p))
    b = list(generate(model, tok, "abc", p, use_cache=False))
    assert a == b and len(a) >= 1


def test_streams_one_token_at_a_time(model):
    it = generate(model, CharTokenizer(), "hello", SamplingParams(max_tokens=5, temperature=0))
    assert isinstance(next(it), int)


def test_stops_at_eos_without_yielding_it(model):
    tok = CharTokenizer()
    first = int(np.argmax(model.forward(tok.encode("Q"))[-1]))
    assert list(generate_ids(model, tok.encode("Q"), SamplingParams(max_tokens=5, temperature=0),
                             eos_token_id=first)) == []


def test_stop_string_ends_generation(model):
    tok = CharTokenizer()
    free = list(generate(model, tok, "xy", SamplingParams(max_tokens=10, temperature=0)))
    text = tok.decode(free)
    stop = text[3:5]
    first = text.find(stop)
    got = list(generate(model, tok, "xy", SamplingParams(max_tokens=10, temperature=0, stop=stop)))
    assert tok.decode(got) == text[: first + len(stop)]
    assert complete(model, tok, "xy", SamplingParams(max_tokens=10, temperature=0, stop=stop)) == text[:first]


def test_bad_requests_fail_before_any_work(model):
    tok = CharTokenizer()
    with pytest.raises(TypeError, match="prompt must be a str"):
        generate(model, tok, 123, SamplingParams())
    with pytest.raises(TypeError, match="prompt must be a str"):
        generate(model, tok, [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings \\(48\\)"):
        generate(model, tok, "a" * 40, SamplingParams(max_tokens=9))
    with pytest.raises(ValueError, match="zero tokens"):
        generate(model, tok, "", SamplingParams())
    # exactly at the limit is fine
    assert len(list(generate(model, tok, "a" * 40, SamplingParams(max_tokens=8, temperature=0)))) <= 8


def test_text_stream_holds_back_partial_utf8():
    data = "héllo ✓".encode()
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    stream = TextStream(decode)
    pieces = [stream.push(b) for b in data] + [stream.flush()]
    assert "".join(pieces) == "héllo ✓"
    assert all("\ufffd" not in p for p in pieces)


def test_trim_at_stop():
    assert trim_at_stop("abc\n\nxyz", ["\n\n", "y"]) == "abc"
    assert trim_at_stop("abc", []) == "abc"

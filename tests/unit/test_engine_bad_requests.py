"""Bad requests at the engine's door: each a clear error that names the problem, and nothing queued."""

from __future__ import annotations

import numpy as np
import pytest

from minienv import InferenceEngine, InvalidRequestError, SamplingParams


@pytest.fixture()
def engine(model, tok):
    return InferenceEngine(model, tok, kv_budget_tokens=256, block_size=4)


@pytest.mark.parametrize("call, error, message", [
    (lambda e: e.add_request(np.zeros((2, 3), dtype=np.int64)), InvalidRequestError, r"1-D array .* shape \(2, 3\)"),
    (lambda e: e.add_request(np.array(5)), InvalidRequestError, r"1-D array .* shape \(\)"),
    (lambda e: e.abort(1), TypeError, r"request ids are str, got 1 \(int\)"),
    (lambda e: e.generate(["ok", "bad \ud800"], SamplingParams(max_tokens=2)), InvalidRequestError,
     r"prompt 1: .*lone surrogate"),
    (lambda e: e.add_request("hi", SamplingParams(temperature=1e400)), ValueError, "temperature must be a finite"),
    (lambda e: e.add_request(""), InvalidRequestError, "the prompt is empty"),
])
def test_bad_request_is_refused_and_nothing_is_queued(engine, call, error, message):
    with pytest.raises(error, match=message):
        call(engine)
    assert not engine.requests and not engine.has_unfinished_requests()
    engine.check_invariants()


def test_enable_prefix_caching_must_be_a_bool(model, tok):
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False, got 'no'"):
        InferenceEngine(model, tok, kv_budget_tokens=256, enable_prefix_caching="no")

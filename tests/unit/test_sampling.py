"""Sampling: parameter validation, greedy == argmax, top-k/top-p supports, seeded reproducibility."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minienv.sampling import Sampler, SamplingParams, apply_top_k, apply_top_p


@pytest.mark.parametrize("kw,exc,msg", [
    ({"temperature": -0.1}, ValueError, "temperature"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_k": -2}, ValueError, "top_k"),
    ({"top_k": 2.5}, ValueError, "top_k"),  # wrong types are ValueErrors too
    ({"max_tokens": 0}, ValueError, "max_tokens"),
    ({"max_tokens": "3"}, TypeError, "max_tokens"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"stop": 3}, TypeError, "stop"),
    ({"stop": [""]}, TypeError, "stop"),
])
def test_bad_params_are_clear_errors(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        SamplingParams(**kw)


def test_defaults_and_stop_normalisation():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop) == (16, 1.0, 0, 1.0, None, None)
    assert SamplingParams(stop="\n").stop_strings == ["\n"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(top_k=-1).top_k == -1


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal((20, 50))
    s = Sampler(SamplingParams(temperature=0))
    assert s.sample(logits).tolist() == np.argmax(logits, axis=-1).tolist()
    assert s.sample(logits[3]) == int(np.argmax(logits[3]))


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 30), seed=st.integers(0, 2**31 - 1))
def test_top_k_never_samples_outside_top_k(k, seed):
    logits = np.random.default_rng(seed).standard_normal(30) * 3
    s = Sampler(SamplingParams(temperature=1.5, top_k=k, seed=seed))
    allowed = set(np.argsort(-logits)[:k].tolist())
    draws = s.sample(np.tile(logits, (200, 1)))
    assert set(draws.tolist()) <= allowed


def test_top_p_keeps_the_nucleus():
    probs = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = np.log(probs)
    kept = np.isfinite(apply_top_p(logits, 0.8))
    assert kept.tolist() == [True, True, True, False, False]  # 0.5+0.2 < 0.8 <= 0.5+0.2+0.15
    assert np.isfinite(apply_top_p(logits, 0.01)).sum() == 1  # the top token always survives
    s = Sampler(SamplingParams(top_p=0.8, seed=1))
    assert set(s.sample(np.tile(logits, (2000, 1))).tolist()) == {0, 1, 2}
    # renormalised: within the nucleus, frequencies follow the probabilities
    freq = np.bincount(Sampler(SamplingParams(top_p=0.8, seed=2)).sample(np.tile(logits, (20000, 1))), minlength=5)
    np.testing.assert_allclose(freq[:3] / 20000, probs[:3] / probs[:3].sum(), atol=0.02)


def test_top_k_ties_and_batch_rows_are_independent():
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [5.0, 0.0, 0.0, 4.0]])
    kept = np.isfinite(apply_top_k(logits, 2))
    assert kept.tolist() == [[False, True, True, False], [True, False, False, True]]


def test_same_seed_same_tokens_different_seed_differs():
    logits = np.random.default_rng(0).standard_normal((64, 40))
    a = Sampler(SamplingParams(temperature=1.0, seed=123)).sample(logits)
    b = Sampler(SamplingParams(temperature=1.0, seed=123)).sample(logits)
    c = Sampler(SamplingParams(temperature=1.0, seed=124)).sample(logits)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()


def test_temperature_sharpens_and_flattens():
    logits = np.array([2.0, 1.0, 0.0])
    cold = Sampler(SamplingParams(temperature=0.1)).probs(logits)
    hot = Sampler(SamplingParams(temperature=10.0)).probs(logits)
    assert cold[0] > 0.99 and hot.max() < 0.4
    freq = np.bincount(Sampler(SamplingParams(seed=0)).sample(np.tile(logits, (20000, 1))), minlength=3) / 20000
    np.testing.assert_allclose(freq, np.exp(logits) / np.exp(logits).sum(), atol=0.02)

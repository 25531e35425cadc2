"""The model's one product, ``W @ X`` (:mod:`minienv.model.linear`): the numba row-dot route for one token agrees
with numpy's product, several tokens go through numpy itself, and without numba one token does too."""

from __future__ import annotations

import numpy as np
import pytest

from minienv.model import linear as linear_mod
from minienv.model.linear import linear

needs_numba = pytest.mark.skipif(linear_mod.NUMBA_MISSING is not None, reason="numba is not installed")


def _case(n_out: int, n_in: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    x = rng.standard_normal((n_in, tokens), dtype=np.float32)
    return w, x, np.empty((n_out, tokens), dtype=np.float32)


@needs_numba
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (960, 576), (576, 1536), (2048, 192)])
def test_one_token_goes_through_the_row_dot_kernel_and_equals_numpy(shape, monkeypatch):
    w, x, out = _case(*shape, tokens=1)
    calls = []
    kernel = linear_mod._row_dot
    monkeypatch.setattr(linear_mod, "_row_dot", lambda *a: (calls.append(1), kernel(*a)))
    assert linear(w, x, out) is out and calls == [1]
    np.testing.assert_allclose(out, w.astype(np.float64) @ x, rtol=1e-5, atol=1e-5 * np.sqrt(shape[1]))


@needs_numba
def test_one_token_as_a_strided_column_and_non_finite_values():
    w, x, out = _case(64, 48, tokens=1)
    rows = np.ascontiguousarray(np.repeat(x.T, 3, axis=0))  # [3, 48]: attention's output, token-major
    linear(w, rows[:1].T, out)  # the model hands o_proj a transposed view
    np.testing.assert_allclose(out, w @ x, rtol=1e-5, atol=1e-4)
    w[5, 7], x[3, 0] = np.nan, np.inf  # fastmath without nnan/ninf: a NaN or inf still reaches the output
    linear(w, x, out)
    assert np.isnan(out[5, 0]) and not np.isfinite(out[:, 0]).all()


def test_several_tokens_are_numpys_product_bit_for_bit():
    w, x, out = _case(300, 200, tokens=5)
    linear(w, x, out)
    assert np.array_equal(out, np.matmul(w, x))


def test_without_numba_one_token_is_numpys_product(monkeypatch):
    monkeypatch.setattr(linear_mod, "_row_dot", None)
    w, x, out = _case(100, 40, tokens=1)
    assert np.array_equal(linear(w, x, out), np.matmul(w, x))

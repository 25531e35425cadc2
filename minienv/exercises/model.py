"""Notebook 02's exercises: the cached attention step, and the KV bytes one token costs."""

from __future__ import annotations

import numpy as np

from minienv.exercises._check import exercise, fail, require
from minienv.model import causal_attention


def _reference(q: np.ndarray, K: np.ndarray, V: np.ndarray) -> np.ndarray:
    """minienv's kernel on one head: the newest token (position t-1) attends to positions 0..t-1."""
    t = len(K)
    return causal_attention(q[None, None].astype(np.float32), K[:, None].astype(np.float32),
                            V[:, None].astype(np.float32), np.array([t - 1]))[0, 0]


def _call(fn, rule: str, *args):
    try:
        with np.errstate(all="ignore"):
            return np.asarray(fn(*args), dtype=np.float64)
    except Exception as err:  # noqa: BLE001 - the student's code failing on this case breaks this case's rule
        fail(rule, f"your function raised {type(err).__name__}: {err}")


@exercise("write decode_attention(q, K, V): softmax(K @ q / sqrt(D)) @ V, one query over every cached token")
def check_decode_attention(fn) -> str:
    """Cases ordered so each isolates one rule: one cached token, the shape, the scale, then huge scores."""
    r = np.random.default_rng(42)
    rule = "the query attends to every cached token, its own included: with one cached token the output is its V"
    q, K, V = r.standard_normal(8), r.standard_normal((1, 8)), r.standard_normal((1, 8))
    got = _call(fn, rule, q, K, V)
    require(got.shape == (8,), "the output is one vector of size D (the weighted sum of V rows), not the weights",
            f"t=1, D=8: expected shape (8,), got {got.shape}")
    require(np.allclose(got, V[0], atol=1e-5), rule,
            f"t=1: expected V[0] = {np.round(V[0][:3], 4)}..., got {np.round(got.ravel()[:3], 4)}...")
    for t, d in [(7, 16), (33, 64)]:
        q, K, V = r.standard_normal(d), r.standard_normal((t, d)), r.standard_normal((t, d))
        rule = "the output is one vector of size D (the weighted sum of V rows), not the weights"
        got = _call(fn, rule, q, K, V)
        require(got.shape == (d,), rule, f"t={t}, D={d}: expected shape ({d},), got {got.shape}")
        want = _reference(q, K, V)
        require(np.allclose(got, want, atol=1e-4),
                "scores are q·k / sqrt(D), softmaxed over all t cached tokens, then weight the V rows",
                f"t={t}, D={d}: expected {np.round(want[:3], 4)}..., got {np.round(got[:3], 4)}...")
    q, K, V = 60 * r.standard_normal(64), 60 * r.standard_normal((9, 64)), r.standard_normal((9, 64))
    rule = "softmax must be numerically stable: subtract the largest score before exp (scores here reach ~3000)"
    got = _call(fn, rule, q, K, V)
    want = _reference(q, K, V)
    require(np.all(np.isfinite(got)) and np.allclose(got, want, atol=1e-4), rule,
            f"expected {np.round(want[:3], 4)}..., got {np.round(got[:3], 4)}...")
    return "one query attending to every cached token: O(t) work per step instead of O(t²)"


# The rules of exercise 2, as the check names them
_LAYERS_RULE = "layers global_every − 1, 2 × global_every − 1, … are global: num_layers // global_every of them " \
               "(layer 0 is a sliding-window layer unless global_every is 1)"
_NONE_RULE = "window=None means every layer is global: there is no window to take a min with"
_GLOBAL_RULE = ("a global layer keeps every token of the context, window or not: the window applies only to the "
                "sliding-window layers")
_EVERY1_RULE = "num_layers // global_every layers are global: with global_every = 1, every layer — the window applies " \
               "to none"
_WINDOW_RULE = "a sliding-window layer keeps only the last `window` tokens"
_LONGER_RULE = "a window longer than the context keeps the whole context: min(tokens, window)"
# (num_tokens, num_layers, num_heads, num_kv_heads, head_dim, dtype_bytes, window, global_every), bytes, the rule.
# Ordered so that each case isolates one rule: a wrong answer fails first on the case of the rule it breaks.
_KV_CASES = [
    ((1, 1, 4, 4, 8, 1, None, 1), 64, "a token stores a K and a V vector: two tensors, so × 2"),
    ((1, 1, 32, 8, 128, 1, None, 1), 2048, "with grouped-query attention only the KV heads are stored (8 here, not "
                                           "the 32 query heads)"),
    ((1, 32, 1, 1, 4, 1, None, 1), 256, "every layer keeps its own K and V: × num_layers"),
    ((1, 1, 2, 2, 16, 4, None, 1), 256, "× the bytes per element (4 for float32, 2 for fp16)"),
    ((5, 2, 1, 1, 1, 1, None, 1), 20, "× the tokens of the context"),
    ((10, 3, 1, 1, 1, 1, 4, 1), 60, _GLOBAL_RULE),  # every layer global although the window (4) is shorter
    ((10, 2, 1, 1, 1, 1, 4, 2), 28, _WINDOW_RULE),
    ((3, 2, 1, 1, 1, 1, 4, 2), 12, _LONGER_RULE),
    ((3, 4, 1, 1, 1, 1, 100, 4), 24, _LONGER_RULE),  # a window far longer than the context
    ((4, 2, 1, 1, 1, 1, 4, 2), 16, "a context exactly as long as the window fills it: min(tokens, window)"),
    ((10, 7, 1, 1, 1, 1, 4, 6), 68, _LAYERS_RULE),
    ((10, 5, 1, 1, 1, 1, 4, 2), 2 * (2 * 10 + 3 * 4), _LAYERS_RULE),
    ((10, 3, 1, 1, 1, 1, 4, 5), 24, _LAYERS_RULE),  # global_every > num_layers: no global layer at all
    ((0, 4, 1, 1, 8, 2, 4, 2), 0, "an empty context costs nothing"),
    ((0, 4, 1, 1, 8, 2, None, 1), 0, "an empty context costs nothing"),
    ((1, 32, 32, 8, 128, 2, None, 1), 128 * 1024, "Llama-3-8B in fp16: 128 KiB per token (the table above)"),
    ((1, 40, 40, 40, 128, 2, None, 1), 800 * 1024, "Llama-2-13B in fp16: 800 KiB per token (the table above)"),
    ((1, 28, 28, 4, 128, 2, None, 1), 56 * 1024, "Qwen2.5-7B in fp16: 56 KiB per token (the table above)"),
    ((6000, 42, 16, 8, 256, 2, 4096, 2), 2 * 8 * 256 * 2 * (21 * 6000 + 21 * 4096),
     "Gemma-2-9B-like, 6000 tokens: 21 global layers keep 6000, 21 window layers keep 4096"),
]


@exercise("write kv_bytes_for_context(num_tokens, num_layers, num_heads, num_kv_heads, head_dim, dtype_bytes, "
          "window, global_every)")
def check_kv_bytes_for_context(fn) -> str:
    for args, want, rule in _KV_CASES:
        try:
            got = fn(*args)
        except TypeError as err:
            if args[6] is None and "NoneType" in str(err):  # min(tokens, None) and the like
                fail(_NONE_RULE, f"{args}: your function raised TypeError: {err}")
            fail(rule, f"{args}: your function raised TypeError: {err}")
        except Exception as err:  # noqa: BLE001
            fail(rule, f"{args}: your function raised {type(err).__name__}: {err}")
        if rule == _GLOBAL_RULE and got != want:  # every layer global: windowed everywhere, or miscounted?
            n, layers, _, kv_heads, head_dim, dtype_bytes, window, _ = args
            windowed = 2 * kv_heads * head_dim * dtype_bytes * layers * min(n, window)
            rule = _GLOBAL_RULE if got == windowed else _EVERY1_RULE
        require(got == want, rule, f"(tokens, layers, heads, kv_heads, head_dim, bytes, window, global_every) = "
                                   f"{args}: expected {want}, got {got}")
    return "2 × kv_heads × head_dim × bytes × (global layers × tokens + window layers × min(tokens, window))"

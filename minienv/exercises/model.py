"""Notebook 02's exercises: the cached attention step with a sliding window, and the KV bytes a context costs with
sliding-window layers."""

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
    except TypeError as err:
        if args[-1] is None and "NoneType" in str(err):  # K[-None:] and the like
            fail(_NO_WINDOW_RULE, f"window=None: your function raised TypeError: {err}")
        fail(rule, f"your function raised TypeError: {err}")
    except Exception as err:  # noqa: BLE001 - the student's code failing on this case breaks this case's rule
        fail(rule, f"your function raised {type(err).__name__}: {err}")


_NO_WINDOW_RULE = "window=None means no window: the query attends to every cached token"
_OWN_RULE = "the window ends at the query's own token: it attends to the last `window` cached tokens, its own included"
_WINDOW_ATT_RULE = "a sliding window of `window` tokens: only the last `window` cached tokens get any weight"
_LONGER_ATT_RULE = "a window longer than the cache covers the whole cache: every cached token, no more"
_SHAPE_RULE = "the output is one vector of size D (the weighted sum of V rows), not the weights"
_SCALE_RULE = "scores are q·k / sqrt(D), softmaxed over the attended tokens, then weight their V rows"


@exercise("write decode_attention(q, K, V, window): softmax(K @ q / sqrt(D)) @ V over the last `window` cached "
          "tokens (all of them when window is None)")
def check_decode_attention(fn) -> str:
    """Cases ordered so each isolates one rule: one cached token, the shape, the scale, the window at its edges
    (one token, shorter than, equal to and longer than the cache), then huge scores."""
    r = np.random.default_rng(42)
    q, K, V = r.standard_normal(8), r.standard_normal((1, 8)), r.standard_normal((1, 8))
    own = "the query attends to its own token too: with one cached token the output is its V"
    got = _call(fn, own, q, K, V, None)
    require(got.shape == (8,), _SHAPE_RULE, f"t=1, D=8: expected shape (8,), got {got.shape}")
    require(np.allclose(got, V[0], atol=1e-5), own, f"t=1: expected V[0] = {np.round(V[0][:3], 4)}..., got {np.round(got.ravel()[:3], 4)}...")
    for t, d in [(7, 16), (33, 64)]:
        q, K, V = r.standard_normal(d), r.standard_normal((t, d)), r.standard_normal((t, d))
        got = _call(fn, _SHAPE_RULE, q, K, V, None)
        require(got.shape == (d,), _SHAPE_RULE, f"t={t}, D={d}: expected shape ({d},), got {got.shape}")
        want = _reference(q, K, V)
        if not np.allclose(got, want, atol=1e-4):
            rule = _OWN_RULE if np.allclose(got, _reference(q, K[:-1], V[:-1]), atol=1e-4) else _SCALE_RULE
            fail(rule, f"t={t}, D={d}, window=None: expected {np.round(want[:3], 4)}..., got {np.round(got[:3], 4)}...")
    # The window: t = 12 cached tokens, D = 16; windows 1 and 5 (shorter), 12 (equal), 20 (longer).
    t, d = 12, 16
    q, K, V = r.standard_normal(d), r.standard_normal((t, d)), r.standard_normal((t, d))
    for window, rule in ((5, _WINDOW_ATT_RULE), (1, _WINDOW_ATT_RULE), (12, _WINDOW_ATT_RULE),
                         (20, _LONGER_ATT_RULE), (13, _LONGER_ATT_RULE)):
        got = _call(fn, rule, q, K, V, window)
        want = _reference(q, K[-window:], V[-window:])
        if got.shape == want.shape and np.allclose(got, want, atol=1e-4):
            continue
        if window < t and np.allclose(got, _reference(q, K[-window - 1:-1], V[-window - 1:-1]), atol=1e-4):
            rule = _OWN_RULE
        fail(rule, f"t={t} cached tokens, window={window}: expected {np.round(want[:3], 4)}..., got "
                   f"{np.round(got.ravel()[:3], 4)}..." + (" (window=1: the output is V[-1])" if window == 1 else ""))
    q, K, V = 60 * r.standard_normal(64), 60 * r.standard_normal((9, 64)), r.standard_normal((9, 64))
    rule = "softmax must be numerically stable: subtract the largest score before exp (scores here reach ~3000)"
    for window in (None, 4):
        got = _call(fn, rule, q, K, V, window)
        want = _reference(q, K[-(window or 9):], V[-(window or 9):])
        require(np.all(np.isfinite(got)) and np.allclose(got, want, atol=1e-4), rule,
                f"window={window}: expected {np.round(want[:3], 4)}..., got {np.round(got[:3], 4)}...")
    return ("one query attending to the cached tokens of its window: O(window) work and memory per step, however "
            "long the context")


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

"""Solutions to notebook 02's exercises."""

import numpy as np


def decode_attention(q, K, V, window):
    if window is not None:  # a sliding window: only the last `window` cached tokens, the query's own included
        K, V = K[-window:], V[-window:]
    s = K @ q / np.sqrt(q.shape[-1])  # the newest token may see everything left in the window, itself included
    w = np.exp(s - s.max())  # subtract the max: exp never overflows
    return (w / w.sum()) @ V


def kv_bytes_for_context(num_tokens, num_layers, num_heads, num_kv_heads, head_dim, dtype_bytes, window,
                         global_every):
    per_token_layer = 2 * num_kv_heads * head_dim * dtype_bytes  # K and V, KV heads only
    num_global = num_layers if window is None else num_layers // global_every  # layers g-1, 2g-1, ...
    kept_local = num_tokens if window is None else min(num_tokens, window)  # a window layer keeps its last tokens
    return per_token_layer * (num_global * num_tokens + (num_layers - num_global) * kept_local)

"""Solutions of notebook 16's exercises: a lone stream's decode time from the bytes one step reads; the batch from
which a decode step is compute-bound."""

from __future__ import annotations


def predict_decode_ms(model, gpu, mbu, overhead_s):
    """Weights read once per step (layers + LM head + final norm; the embedding is only gathered) at the bandwidth a
    step really reaches, plus the fixed per-step overhead, in milliseconds. The KV of a new stream is negligible."""
    read = model.num_layers * model.layer_params + model.lm_head_params + model.hidden_size
    seconds = read * model.dtype_bytes / (gpu.bandwidth_gbs * 1e9 * mbu) + overhead_s
    return seconds * 1e3


def compute_bound_batch(model, gpu, context, mfu, mbu):
    """A decode step of b requests: compute b·f against memory w + b·k (the weights once, each request's KV). The
    smallest whole b with b·f >= w + b·k, or None when f <= k (each request adds more memory time than compute)."""
    import math

    peak = gpu.peak_tflops * 1e12 * mfu
    bandwidth = gpu.bandwidth_gbs * 1e9 * mbu
    w = (model.num_layers * model.layer_params + model.lm_head_params + model.hidden_size) * model.dtype_bytes / bandwidth
    flops = (2 * model.num_layers * model.layer_params + 2 * model.hidden_size * model.vocab_size
             + 4 * model.num_layers * model.num_heads * model.head_dim * (context + 1))
    f = flops / peak
    k = (context + 2) * model.kv_bytes_per_token / bandwidth
    if f <= k:
        return None
    return max(1, math.ceil(w / (f - k)))

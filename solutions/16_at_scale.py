"""Solution of notebook 16's exercise: a lone stream's decode time from the bytes one step reads."""

from __future__ import annotations


def predict_decode_ms(model, gpu, mbu, overhead_s):
    """Weights read once per step (layers + LM head + final norm; the embedding is only gathered) at the bandwidth a
    step really reaches, plus the fixed per-step overhead, in milliseconds. The KV of a new stream is negligible."""
    read = model.num_layers * model.layer_params + model.lm_head_params + model.hidden_size
    seconds = read * model.dtype_bytes / (gpu.bandwidth_gbs * 1e9 * mbu) + overhead_s
    return seconds * 1e3

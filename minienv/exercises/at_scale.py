"""Notebook 16's exercise: predict a lone stream's decode time on a GPU from the bytes it must read, checked
against the roofline clock (:class:`minienv.sim.roofline.RooflineClock`) for every model and GPU it knows.
"""

from __future__ import annotations

import math
import numbers

from minienv.exercises._check import exercise, fail, require

RULES = {
    "number": "return one number: milliseconds per output token",
    "ms": "answer in milliseconds, not seconds",
    "bytes": "a step reads bytes: parameters × model.dtype_bytes",
    "embedding": "the embedding table is only gathered (one row per token): count the layers, the LM head and the "
                 "final norm — not the embedding (unless tied: then the LM head IS it, read once)",
    "mbu": "a step streams memory at gpu.bandwidth_gbs × 1e9 × mbu bytes/s, not the datasheet peak",
    "overhead": "add the fixed per-step overhead (overhead_s) once per step",
}

_PAIRS = (("Llama-3-8B", "H100-SXM"), ("Llama-3-8B", "A100-40GB"), ("Qwen2.5-7B", "L4"), ("OPT-13B", "A100-80GB"),
          ("Llama-2-13B", "H200"), ("Mistral-7B", "RTX-4090"), ("minienv-target", "H100-SXM"))


def _diagnose(got_ms: float, model, gpu, mbu: float, overhead_s: float, want_ms: float) -> str:
    """Name the rule a near-miss breaks, by recomputing the answer with each rule broken."""
    read = model.num_layers * model.layer_params + model.lm_head_params + model.hidden_size
    bw = gpu.bandwidth_gbs * 1e9
    variants = {
        "ms": want_ms / 1e3,
        "bytes": (read / (bw * mbu) + overhead_s) * 1e3,
        "embedding": (model.num_params * model.dtype_bytes / (bw * mbu) + overhead_s) * 1e3,
        "mbu": (read * model.dtype_bytes / bw + overhead_s) * 1e3,
        "overhead": read * model.dtype_bytes / (bw * mbu) * 1e3,
    }
    best = min(variants, key=lambda k: abs(math.log(max(got_ms, 1e-12) / variants[k])))
    return best if abs(got_ms / variants[best] - 1) < 0.02 else "bytes"


@exercise("write predict_decode_ms(model, gpu, mbu, overhead_s): one stream's time per output token, from bytes")
def check_decode_prediction(fn) -> str:
    """``fn(model, gpu, mbu, overhead_s)`` within 0.5 % of the clock's batch-1 decode step, for seven model/GPU
    pairs and two sets of efficiency factors."""
    from minienv.sim import RooflineClock, get_gpu, get_model

    for mbu, overhead_s in ((0.8, 1e-3), (0.6, 4e-3)):
        for name, gpu_name in _PAIRS:
            model, gpu = get_model(name), get_gpu(gpu_name)
            want_ms = RooflineClock(model, gpu, mbu=mbu, overhead_s=overhead_s).decode_time(1, 0) * 1e3
            got = fn(model, gpu, mbu, overhead_s)
            if isinstance(got, bool) or not isinstance(got, numbers.Real) or not math.isfinite(got):
                fail(RULES["number"], f"predict_decode_ms({name}, {gpu_name}, {mbu}, {overhead_s}) returned {got!r}")
            if abs(got / want_ms - 1) > 0.005:
                rule = _diagnose(float(got), model, gpu, mbu, overhead_s, want_ms)
                fail(RULES[rule], f"{name} on {gpu_name} (mbu {mbu}, overhead {overhead_s * 1e3:g} ms): you said "
                                  f"{got:.3f} ms, the clock says {want_ms:.3f} ms")
    require(True, RULES["number"])
    return ("your bytes-over-bandwidth prediction matches the clock for 7 models and GPUs: a lone stream's speed is "
            "set by how fast the GPU can read the weights once")

"""Notebook 16's exercises, checked against the roofline clock (:class:`minienv.sim.roofline.RooflineClock`):
predict a lone stream's decode time on a GPU from the bytes it must read (for every model and GPU the clock knows),
and find the batch size from which a decode step stops being memory-bound.
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


# ------------------------------------------------------------------------------------------ exercise 2
BATCH_RULES = {
    "weights": "the weights (the layers, the LM head, the final norm — the embedding is only gathered) are read once "
               "per step, whatever the batch: their time is shared by every request",
    "per_request": "every request adds the same work: its FLOPs (layers, its LM-head row, attention over its "
                   "context + 1 keys) and its bytes (its context's KV read, plus 1 token's KV read and 1 written)",
    "roofs": "a step computes at gpu.peak_tflops × 1e12 × mfu FLOP/s and streams memory at gpu.bandwidth_gbs × 1e9 "
             "× mbu bytes/s",
    "smallest": "answer the smallest whole batch size (at least 1) whose compute time reaches its memory time",
    "never": "return None when no batch size is compute-bound (a request adds at least as much memory time as "
             "compute time)",
    "type": "return an int (a batch size) or None",
}

#: (model, gpu, context, mfu, mbu), and the rule each case is at the edge of
BATCH_CASES = [
    (("Llama-3-8B", "H100-SXM", 512, 0.5, 0.8), "per_request"),   # the chapter's setting: 974.6 -> 975
    (("Llama-3-8B", "A100-80GB", 512, 0.5, 0.8), "smallest"),     # 162.5 -> 163 (rounding gives 162)
    (("Llama-3-8B", "L4", 0, 0.5, 0.8), "per_request"),           # an empty context: only the new token's KV
    (("Qwen2.5-7B", "H200", 128, 0.5, 0.8), "per_request"),
    (("OPT-13B", "A100-40GB", 128, 0.5, 0.8), "smallest"),        # 258.995 -> 259
    (("Qwen2.5-7B", "A100-40GB", 1024, 0.6, 0.7), "roofs"),
    (("Mistral-7B", "RTX-4090", 1024, 0.5, 0.8), "per_request"),  # KV nearly as slow as compute: 1,472
    (("minienv-target", "L4", 0, 0.002, 1.0), "smallest"),         # compute-bound from the first request: 1
    (("OPT-13B", "A100-40GB", 2048, 0.5, 0.8), "never"),          # no GQA, long context: never
    (("Llama-3-8B", "H100-SXM", 8192, 0.5, 0.8), "never"),
]


def _parts(model, gpu, context: int, mfu: float, mbu: float, *, kv: bool = True, attn: bool = True,
           head: bool = True, mfu_on: bool = True, mbu_on: bool = True) -> tuple[float, float, float]:
    """(the weights' memory time, a request's compute time, a request's memory time) of a decode step, seconds."""
    peak = gpu.peak_tflops * 1e12 * (mfu if mfu_on else 1.0)
    bw = gpu.bandwidth_gbs * 1e9 * (mbu if mbu_on else 1.0)
    weights = (model.num_layers * model.layer_params + model.lm_head_params + model.hidden_size) * model.dtype_bytes
    flops = (2 * model.num_layers * model.layer_params + (2 * model.hidden_size * model.vocab_size if head else 0)
             + (4 * model.num_layers * model.num_heads * model.head_dim * (context + 1) if attn else 0))
    nbytes = (context + 2) * model.kv_bytes_per_token if kv else 0
    return weights / bw, flops / peak, nbytes / bw


def _solve(w: float, f: float, k: float, rounding=math.ceil, never=None):
    """The smallest b with b·f >= w + b·k (rounded as given), or ``never`` when f <= k."""
    return never if f <= k else max(1, rounding(w / (f - k)))


def compute_bound_batch_reference(model, gpu, context: int, mfu: float = 0.5, mbu: float = 0.8) -> int | None:
    """The smallest batch of decode requests (each holding ``context`` tokens) whose step is compute-bound on the
    roofline clock, or None. Linear in the batch: compute ``b·f`` against memory ``w + b·k``; confirmed on the clock
    itself (``StepCost.bound``) around the answer."""
    from minienv.sim import RooflineClock, get_gpu, get_model

    model = get_model(model) if isinstance(model, str) else model
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    b = _solve(*_parts(model, gpu, context, mfu, mbu))
    if b is None:
        return None
    clock = RooflineClock(model, gpu, mfu=mfu, mbu=mbu)
    bound = lambda n: clock.step_cost([(1, context)] * n).bound  # noqa: E731
    while b > 1 and bound(b - 1) == "compute":  # float rounding at an exact boundary: the clock decides
        b -= 1
    while bound(b) != "compute":
        b += 1
    return b


def _batch_slips(model, gpu, context: int, mfu: float, mbu: float) -> list[tuple[str, object]]:
    w, f, k = _parts(model, gpu, context, mfu, mbu)
    return [
        ("weights", _solve(w, f, k + w)),  # the weights read per request
        ("weights", None if f <= k + w else 1),
        ("weights", _solve(w * model.num_params / (model.num_layers * model.layer_params + model.lm_head_params
                                                   + model.hidden_size), f, k)),  # the embedding read too
        ("per_request", _solve(w, f, 0.0)),  # no KV bytes
        ("per_request", _solve(*_parts(model, gpu, context, mfu, mbu, attn=False))),
        ("per_request", _solve(*_parts(model, gpu, context, mfu, mbu, head=False))),
        ("per_request", _solve(w, f, k * (context + 1) / (context + 2))),  # the new token's KV write forgotten
        ("roofs", _solve(*_parts(model, gpu, context, mfu, mbu, mfu_on=False))),
        ("roofs", _solve(*_parts(model, gpu, context, mfu, mbu, mbu_on=False))),
        ("roofs", _solve(*_parts(model, gpu, context, mfu, mbu, mfu_on=False, mbu_on=False))),
        ("smallest", _solve(w, f, k, rounding=math.floor)),
        ("smallest", _solve(w, f, k, rounding=round)),
        ("smallest", _solve(w, f, k, rounding=lambda x: math.floor(x) + 1)),
        ("never", _solve(w, f, k, never=0)),
        ("never", _solve(w, f, k, never=-1)),
    ]


@exercise("write compute_bound_batch(model, gpu, context, mfu, mbu): the smallest batch whose decode step is "
          "compute-bound, or None", none_ok=True)
def check_compute_bound_batch(fn) -> str:
    """``fn`` against :func:`compute_bound_batch_reference` on ten model/GPU/context cases: short and long contexts,
    an empty one, an answer of 1, answers just past a whole number, two where no batch is compute-bound."""
    from minienv.sim import get_gpu, get_model

    got, want, shown, slips = [], [], [], []
    for (name, gpu_name, ctx, mfu, mbu), rule in BATCH_CASES:
        model, gpu = get_model(name), get_gpu(gpu_name)
        fn.rule = BATCH_RULES[rule]  # an exception on this case is reported under its rule
        answer = fn(model, gpu, ctx, mfu, mbu)
        if answer is not None and (isinstance(answer, bool) or not isinstance(answer, numbers.Integral)):
            fail(BATCH_RULES["type"], f"compute_bound_batch({name}, {gpu_name}, {ctx}, {mfu}, {mbu}) returned "
                                      f"{answer!r}")
        got.append(None if answer is None else int(answer))
        want.append(compute_bound_batch_reference(model, gpu, ctx, mfu, mbu))
        shown.append(f"{name} on {gpu_name}, context {ctx}, mfu {mfu}, mbu {mbu}")
        slips.append(_batch_slips(model, gpu, ctx, mfu, mbu))
    fn.rule = None
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if wrong:
        score: dict[str, int] = {}
        for j, (rule, _) in enumerate(slips[0]):
            score[rule] = max(score.get(rule, 0), sum(got[i] == slips[i][j][1] for i in wrong))
        best = max(score, key=lambda r: score[r])
        if score[best] == 0:
            i = wrong[0]
            fail("the step's compute time (batch × a request's FLOPs) reaches its memory time (the weights once + "
                 "batch × a request's KV bytes)", f"{shown[i]}: expected {want[i]}, got {got[i]}")
        i = next(i for i in wrong if any(got[i] == v for r, v in slips[i] if r == best))
        fail(BATCH_RULES[best], f"{shown[i]}: expected {want[i]}, got {got[i]}")
    return (f"compute_bound_batch agrees with the clock in all {len(BATCH_CASES)} cases: the weights' time is shared, "
            "so enough requests make a step compute-bound — unless each request's KV costs more than its FLOPs")

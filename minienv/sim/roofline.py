"""The roofline clock: what one engine step would take on a named GPU, from the shape the scheduler built.

A step is a list of chunks ``(num_new_tokens, num_context_tokens)`` — for each scheduled request, the tokens it
computes now and the tokens already in its KV cache. From that shape:

* **FLOPs** = ``2 x (layer params) x T`` for the T tokens (every weight is one multiply-add per token) + the LM head
  ``2 x hidden x vocab`` per *sampling* row only (like vLLM, logits only for each request's last token) +
  attention ``4 x layers x heads x head_dim x (keys each query attends to)`` (QK^T and PV, two FLOPs each);
* **bytes** = the weights, read **once per step whatever the batch** (the reason batching is nearly free on a
  GPU) + the KV cache each request reads (its whole context, once per step) + the KV written (every new token);
* **time** = ``max(FLOPs / (peak x mfu), bytes / (bandwidth x mbu))`` + an all-reduce per attention and MLP block
  under tensor parallelism + a fixed per-step overhead (scheduling, kernel launches, sampling).

Tensor parallelism splits FLOPs, weights and KV heads ideally over ``tp`` GPUs and adds a ring all-reduce of
``T x hidden`` activations twice per layer: ``2 (tp-1)/tp x bytes / link`` plus a latency per all-reduce.

What it is blind to (docs/ARCHITECTURE.md says more): kernels below their roofline at small shapes (a batch-1
prefill of 20 tokens is neither compute- nor bandwidth-bound: launch latency), tile quantization, attention
kernels that re-read KV for long prefills, CPU time that is not hidden, and GPU clocks under power limits. The
three efficiency factors stand in for all of it; a calibration would fit them per GPU to a few measured steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from minienv.sim.hardware import GIB, GPUSpec, get_gpu
from minienv.sim.models import ModelSpec, get_model


class ModelDoesNotFitError(ValueError):
    """The model's weights (per GPU) leave no room for KV cache on the GPU."""


@dataclass(frozen=True)
class StepCost:
    """One step's count and its time. ``bound``: which roof set the time ("compute" or "memory")."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    num_tokens: int

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


#: stated, not fitted: dense GEMMs in serving engines reach roughly half the tensor-core peak across a step's mix
#: of shapes; decode kernels stream HBM at roughly 80 % of the datasheet bandwidth (Databricks' "MBU" figures for
#: well-tuned engines are 60-80 %); one step costs ~1 ms of scheduling, sampling and launch latency that the GPU
#: does not hide
DEFAULT_MFU = 0.5
DEFAULT_MBU = 0.8
DEFAULT_OVERHEAD_S = 1.0e-3
ALLREDUCE_LATENCY_S = 10e-6  # per all-reduce call, NCCL's small-message latency order within an NVLink node


class RooflineClock:
    """Times engine steps of ``model`` on ``tp`` x ``gpu``.

    Args:
        model, gpu: a :class:`ModelSpec` / :class:`GPUSpec` or a known name.
        tensor_parallel_size: GPUs the model is split over (must divide the attention and KV heads).
        mfu, mbu: fractions of peak compute / bandwidth a step achieves; overhead_s: fixed time per step.
    """

    def __init__(self, model: ModelSpec | str, gpu: GPUSpec | str, *, tensor_parallel_size: int = 1,
                 mfu: float = DEFAULT_MFU, mbu: float = DEFAULT_MBU, overhead_s: float = DEFAULT_OVERHEAD_S):
        self.model, self.gpu = get_model(model), get_gpu(gpu)
        tp = tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        m = self.model
        if m.num_heads % tp or m.num_kv_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {m.name}'s {m.num_heads} attention heads "
                             f"and {m.num_kv_heads} KV heads: each GPU must hold whole heads")
        for name, v in (("mfu", mfu), ("mbu", mbu)):
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if not overhead_s >= 0:
            raise ValueError(f"overhead_s must be >= 0, got {overhead_s!r}")
        self.tp, self.mfu, self.mbu, self.overhead_s = tp, float(mfu), float(mbu), float(overhead_s)
        self._layer_flops_per_token = 2.0 * m.num_layers * m.layer_params
        self._head_flops_per_row = 2.0 * m.hidden_size * m.vocab_size
        self._attn_flops_per_key = 4.0 * m.num_layers * m.num_heads * m.head_dim
        # weights read per step: the layers, the final norm and the LM head (the embedding is only gathered: T rows)
        self._weight_bytes = (m.num_layers * m.layer_params + m.lm_head_params + m.hidden_size) * m.dtype_bytes
        self._kv_bytes_per_token = m.kv_bytes_per_token
        self._peak = self.gpu.peak_tflops * 1e12 * self.mfu
        self._bw = self.gpu.bandwidth_gbs * 1e9 * self.mbu
        self._act_bytes_per_token = m.hidden_size * m.dtype_bytes

    def __repr__(self) -> str:
        return (f"RooflineClock({self.model.name} on {self.tp} x {self.gpu.name}, mfu={self.mfu}, mbu={self.mbu}, "
                f"overhead={self.overhead_s * 1e3:g} ms)")

    # ------------------------------------------------------------------ one step
    def step_cost(self, chunks: Iterable[tuple[int, int]], num_sampling: int | None = None) -> StepCost:
        """The cost of a step computing, per request, ``(num_new_tokens, num_context_tokens)``.

        ``num_sampling``: rows that go through the LM head (default: one per chunk)."""
        tokens = keys = ctx_read = 0
        n_chunks = 0
        for n, ctx in chunks:
            if n < 0 or ctx < 0:
                raise ValueError(f"a chunk needs num_new_tokens >= 0 and context >= 0, got ({n}, {ctx})")
            tokens += n
            keys += n * ctx + n * (n + 1) // 2  # query i (0-based) sees ctx + i + 1 keys, causal
            ctx_read += ctx + n
            n_chunks += 1
        rows = n_chunks if num_sampling is None else num_sampling
        return self._cost(tokens, keys, ctx_read, rows)

    def _cost(self, tokens: int, keys: int, ctx_read: int, rows: int) -> StepCost:
        if not tokens:  # nothing computed: no weights read, no launch
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
        tp = self.tp
        flops = (self._layer_flops_per_token * tokens + self._head_flops_per_row * rows
                 + self._attn_flops_per_key * keys)
        kv = self._kv_bytes_per_token
        nbytes = self._weight_bytes + kv * ctx_read + kv * tokens  # read the context's KV, write the new tokens'
        comm = 0.0
        if tp > 1:
            size = tokens * self._act_bytes_per_token
            per_call = ALLREDUCE_LATENCY_S + 2 * (tp - 1) / tp * size / (self.gpu.link_gbs * 1e9)
            comm = 2 * self.model.num_layers * per_call
        return StepCost(flops, nbytes, flops / tp / self._peak, nbytes / tp / self._bw, comm,
                        self.overhead_s, tokens)

    def decode_time(self, batch: int, context: int) -> float:
        """Seconds of one decode step of ``batch`` requests each holding ``context`` tokens (the notebook's curve)."""
        return self.step_cost([(1, context)] * batch).time_s

    # ------------------------------------------------------------------ memory
    def kv_budget_tokens(self, gpu_memory_utilization: float = 0.9, *, reserve_gib: float = 1.0) -> int:
        """KV token slots the GPUs have left after the weights (vLLM's ``gpu_memory_utilization`` idea): of each
        GPU's memory, ``utilization`` is the engine's; weights (split over ``tp``) and ``reserve_gib`` of
        activations / CUDA context come off; the rest holds KV, whose per-token size is also split over ``tp``.

        Raises :class:`ModelDoesNotFitError` naming both sizes when nothing is left."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        m, g = self.model, self.gpu
        usable = g.memory_bytes * gpu_memory_utilization
        weights = m.weight_bytes / self.tp
        free = usable - weights - reserve_gib * GIB
        per_token = m.kv_bytes_per_token / self.tp
        if free < per_token * 16:
            raise ModelDoesNotFitError(
                f"{m.name} does not fit on {self.tp} x {g.name}: its weights need {weights / GIB:.1f} GiB per GPU "
                f"({m.weight_bytes / GIB:.1f} GiB in all, {m.dtype_bytes}-byte weights) but each GPU offers "
                f"{usable / GIB:.1f} GiB ({g.memory_gib:g} GiB x gpu_memory_utilization {gpu_memory_utilization:g}) "
                f"minus {reserve_gib:g} GiB for activations; raise --tensor-parallel-size or pick a larger GPU")
        return int(free // per_token)


def batch1_decode_time(model: ModelSpec | str, gpu: GPUSpec | str, context: int = 0, **kw) -> float:
    """Seconds per output token of a lone stream: nearly ``weight bytes / (bandwidth x mbu)`` + overhead."""
    return RooflineClock(model, gpu, **kw).decode_time(1, context)

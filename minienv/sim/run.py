"""Run a trace through minienv's real engine on the roofline's virtual clock; report what vLLM's
``benchmark_serving`` reports.

The loop is a benchmark client's, driven by the virtual clock: a step listener charges each step the roofline time
of the shape the scheduler built, stamps every token with the clock, and then sends the requests that have arrived
by then — as a real client's requests land in the engine's queue while a step runs, and are scheduled at the next
one. When nothing is running the clock jumps to the next arrival. The engine is
:class:`~minienv.engine.InferenceEngine` unchanged — scheduler, KV manager, prefix cache, preemption — with the
no-math :class:`~minienv.sim.simulated_model.SimulatedModel`; the KV pool has as many blocks as the GPU has memory
left after the weights.

Metrics follow ``benchmark_serving``: TTFT = first token time - arrival; ITL = gaps between a request's tokens;
TPOT = (e2e - TTFT) / (output tokens - 1) per request; throughputs over the run's duration (first arrival to last
finish). Plus the vLLM paper's *normalized latency* (mean of e2e / output length, s/token), preemptions, KV usage
and the prefix-cache hit rate (tokens, like vLLM).
"""

from __future__ import annotations

import math
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from minienv.engine.core import InferenceEngine
from minienv.sampling import SamplingParams
from minienv.sim.reservation import LAYOUTS, ReservationKVManager, reservation_tokens
from minienv.sim.roofline import (DEFAULT_MBU, DEFAULT_MFU, DEFAULT_OVERHEAD_S, RooflineClock, StepCost)
from minienv.sim.simulated_model import SimTokenizer, SimulatedModel
from minienv.sim.workloads import TraceRequest


@dataclass
class SimConfig:
    """Everything a simulation needs besides its trace (the CLI's flags)."""

    model: str = "Llama-3-8B"
    gpu: str = "H100-SXM"
    tensor_parallel_size: int = 1
    scheduling: str = "continuous"
    kv_layout: str = "paged"
    enable_prefix_caching: bool = False
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    mfu: float = DEFAULT_MFU
    mbu: float = DEFAULT_MBU
    overhead_s: float = DEFAULT_OVERHEAD_S


@dataclass
class SimResult:
    """One run's figures: ``metrics`` holds vLLM's result keys and ours; ``steps`` (if kept) one row per step:
    (clock s, step s, tokens, running requests, KV blocks used)."""

    config: SimConfig
    clock: RooflineClock
    num_blocks: int
    metrics: dict[str, Any]
    steps: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 5)))


def _pct(values: Sequence[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


class _Progress:
    """A one-line progress bar on stderr, redrawn at most twice a second."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.stream, self.last = total, stream, 0.0

    def update(self, done: int, sim_s: float, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < 0.5:
            return
        self.last = now
        filled = int(30 * done / self.total)
        self.stream.write(f"\rsimulate [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} requests, "
                          f"{sim_s:8.1f} s simulated")
        self.stream.flush()
        if force:
            self.stream.write("\n")


def simulate(trace: list[TraceRequest], config: SimConfig | None = None, *, max_concurrency: int | None = None,
             progress: bool = False,
             keep_steps: bool = False, on_step: Callable[[float, StepCost, InferenceEngine], None] | None = None,
             ) -> SimResult:
    """Serve ``trace`` with minienv's engine timed by the roofline of ``config``; return the figures.

    Args:
        max_concurrency: like ``benchmark_serving --max-concurrency``: at most this many requests in flight; a
            request is sent when it has arrived *and* a slot is free, and its latencies count from then.
        keep_steps: keep one row per step in ``result.steps`` (the notebook's KV-fill and throughput views).
        on_step: ``on_step(clock_s, cost, engine)`` after every step (live views).
    """
    cfg = config or SimConfig()
    if cfg.kv_layout not in LAYOUTS:
        raise ValueError(f"unknown --kv-layout {cfg.kv_layout!r}; known: {', '.join(LAYOUTS)}")
    if cfg.kv_layout != "paged" and cfg.scheduling != "continuous":
        raise ValueError("the reservation layouts are the Orca baselines: they need --scheduler continuous")
    if not trace:
        raise ValueError("the trace is empty")
    if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                        or max_concurrency < 1):
        raise ValueError(f"max_concurrency must be an int >= 1 or None, got {max_concurrency!r}")
    cap = max_concurrency or len(trace)
    clock = RooflineClock(cfg.model, cfg.gpu, tensor_parallel_size=cfg.tensor_parallel_size, mfu=cfg.mfu,
                          mbu=cfg.mbu, overhead_s=cfg.overhead_s)
    max_len = clock.model.max_model_len
    budget = clock.kv_budget_tokens(cfg.gpu_memory_utilization)  # ModelDoesNotFitError names both sizes
    num_blocks = budget // cfg.block_size
    if num_blocks < 1:
        raise ValueError(f"the KV budget of {budget} tokens holds no block of {cfg.block_size} tokens")
    lens: dict[str, tuple[int, int]] = {str(i): (r.prompt_len, r.output_len) for i, r in enumerate(trace)}
    factory = None
    if cfg.kv_layout != "paged":
        def reserve(rid: str) -> int:
            p, o = lens[rid]
            return reservation_tokens(cfg.kv_layout, p, o, max_len)

        def factory(n: int, bs: int, prefix: bool) -> ReservationKVManager:
            return ReservationKVManager(n, bs, reserve, enable_prefix_caching=prefix)
    engine = InferenceEngine(SimulatedModel(max_len), SimTokenizer(), kv_budget_tokens=num_blocks * cfg.block_size,
                             block_size=cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                             max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                             scheduling=cfg.scheduling, history_size=0, finished_retention=0,
                             kv_cache_manager_factory=factory)
    n = len(trace)
    arrival = np.array([r.arrival_s for r in trace])
    # per-request clock stamps as Python lists: one element read and written per token (a numpy scalar costs more)
    first: list[float] = [math.nan] * n
    last: list[float] = [math.nan] * n
    done_at: list[float] = [math.nan] * n
    itl = array("d")
    step_rows: list[tuple[float, float, int, int, int]] = []
    pool = engine.kv_cache_manager.pool
    counters = engine.counters
    state = {"now": 0.0, "kv_sum": 0, "kv_peak": 0, "steps": 0, "busy": 0.0, "sent": 0}

    def send_arrived() -> None:
        """The client: send every request that has arrived by the clock (and has a concurrency slot)."""
        i, now = state["sent"], state["now"]
        while i < n and trace[i].arrival_s <= now and i - counters.finished < cap:
            r = trace[i]
            arrival[i] = max(arrival[i], now)  # sent later than it arrived: a concurrency slot was busy
            engine.add_request(r.prompt, SamplingParams(max_tokens=r.output_len, temperature=0.0), request_id=str(i))
            i += 1
        state["sent"] = i

    def charge(record) -> None:
        plan = record.scheduler_output
        sched = plan.scheduled
        cost = clock.step_cost([(s.num_new_tokens, s.num_computed_tokens) for s in sched],
                               sum([s.samples for s in sched]))
        step_s = cost.time_s
        now = state["now"] = state["now"] + step_s
        state["busy"] += step_s
        for rid in record.sampled:
            i = int(rid)
            t = last[i]
            if t == t:  # not NaN: a token after the first
                itl.append(now - t)
            else:
                first[i] = now
            last[i] = now
        for rid in record.finished:
            done_at[int(rid)] = now
        used = pool.num_used_blocks
        state["kv_sum"] += used
        state["kv_peak"] = max(state["kv_peak"], used)
        state["steps"] += 1
        if keep_steps:
            step_rows.append((now, step_s, cost.num_tokens, len(sched), used))
        if on_step is not None:
            on_step(now, cost, engine)
        if bar is not None:
            bar.update(counters.finished, now)
        send_arrived()

    bar = _Progress(n) if progress else None
    engine.add_step_listener(charge)
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    while state["sent"] < n or engine.has_unfinished_requests():
        send_arrived()
        if not engine.has_unfinished_requests():
            state["now"] = max(state["now"], trace[state["sent"]].arrival_s)  # idle: jump to the next arrival
            continue
        # NOTE: run(), not step(): this client reads no outputs (the listener stamps the tokens), and step() would
        # build every running request's output after every step (profiled: 12 % of notebook 16's simulations, 44 %
        # of 2,000 ShareGPT requests at 30/s); run() builds each once, when it returns. Sending from the listener
        # (not between step() calls) keeps the steps, and so every figure, the same.
        engine.run()
    wall, cpu = time.perf_counter() - t_wall, time.process_time() - t_cpu
    if bar is not None:
        bar.update(engine.counters.finished, state["now"], force=True)

    out_len = np.array([r.output_len for r in trace], dtype=float)
    in_len = np.array([r.prompt_len for r in trace], dtype=float)
    first_a, done_a = np.array(first), np.array(done_at)
    ttft = (first_a - arrival) * 1e3
    e2e = (done_a - arrival) * 1e3
    multi = out_len > 1
    tpot = (e2e[multi] - ttft[multi]) / (out_len[multi] - 1)
    itl_ms = np.frombuffer(itl, dtype=float) * 1e3 if len(itl) else np.zeros(0)
    duration = float(np.nanmax(done_a) - arrival.min())
    kv = engine.kv_cache_manager
    ps = kv.prefix_stats
    m: dict[str, Any] = {
        "model": clock.model.name, "gpu": clock.gpu.name, "tensor_parallel_size": clock.tp,
        "scheduler": cfg.scheduling, "kv_layout": cfg.kv_layout, "block_size": cfg.block_size,
        "duration": duration, "completed": int(np.isfinite(done_a).sum()),
        "total_input_tokens": int(in_len.sum()), "total_output_tokens": int(out_len.sum()),
        "request_throughput": n / duration, "output_throughput": out_len.sum() / duration,
        "total_token_throughput": (in_len.sum() + out_len.sum()) / duration,
    }
    for key, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl_ms), ("e2el", e2e)):
        m[f"mean_{key}_ms"] = float(np.mean(values)) if len(values) else 0.0
        m[f"median_{key}_ms"] = _pct(values, 50)
        m[f"std_{key}_ms"] = float(np.std(values)) if len(values) else 0.0
        m[f"p99_{key}_ms"] = _pct(values, 99)
    steps = max(1, state["steps"])
    m.update({
        "normalized_latency_s_per_token": float(np.mean(e2e / 1e3 / out_len)),
        "num_preemptions": engine.scheduler.num_preemptions,
        "kv_cache_blocks": num_blocks, "kv_cache_tokens": num_blocks * cfg.block_size,
        "kv_usage_mean": state["kv_sum"] / steps / num_blocks, "kv_usage_peak": state["kv_peak"] / num_blocks,
        "prefix_cache_hit_rate": ps.hits / ps.queries if ps.queries else 0.0,
        "num_steps": state["steps"], "gpu_busy_fraction": state["busy"] / duration if duration else 0.0,
        "sim_wall_s": wall, "sim_cpu_s": cpu, "sim_requests_per_s": n / wall if wall else math.inf,
    })
    rows = np.array(step_rows, dtype=float) if step_rows else np.zeros((0, 5))
    return SimResult(cfg, clock, num_blocks, m, rows)

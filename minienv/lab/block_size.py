"""Block size, measured: the sweep, the dynamic scheme against the best fixed size, and an auto-tuner.

An exhibit (notebook 13, ``benchmarks/bench_block_size.py``); nothing here is needed to serve. Every memory,
hit and preemption number comes from driving minienv's real :class:`~minienv.scheduler.Scheduler` and
:class:`~minienv.kv.kv_cache_manager.KVCacheManager` (or :class:`~minienv.lab.dynamic_blocks.DynamicKVCacheManager`)
step by step with a *stub model*: the scheduler plans each step exactly as in the engine, the manager allocates,
hashes, evicts and preempts for real, and the stub "samples" a token per finished chunk that no other request
ever produces (so only prompts are shared). Attention times come from the real paged-attention kernel
(:func:`minienv.kv.paged_attention.paged_attention`) on block tables the real manager laid out.

What a block size trades (notebook 03 derived the first line; this module measures all of them):

* **internal fragmentation** — the empty tail of each request's last block, about ``(B - 1) / 2`` slots;
* **prefix-hit tokens** — hits are whole blocks, so a shared prefix of ``P`` tokens yields ``floor(P / B) * B``;
* **preemptions at a fixed budget** — wasted slots are slots other requests cannot have;
* **block-table memory** — ``ceil(len / B)`` entries per sequence, padded to the longest in a step;
* **attention time** — the kernel reads K/V block by block: per-block costs against padded, masked keys.

Metrics are defined once, here: ``frag`` is wasted / allocated slots summed over steps (wasted = tails of last
blocks + blocks reserved by the dynamic scheme); ``hit_tokens`` counts prompt tokens served from the cache at
first admission (resumes after preemption not counted); ``miss`` is the fraction of the prompt tokens that a
token-granular cache (block size 1) would have served and this block size does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from minienv.kv.block_table import cdiv, pad_block_tables
from minienv.lab.dynamic_blocks import DynamicBlockConfig, DynamicKVCacheManager
from minienv.kv.errors import KVBudgetError
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.kv.paged_attention import PagedAttentionMetadata, paged_attention
from minienv.lab.workload import ALPACA, SHAREGPT, generate_workload
from minienv.request import Request, RequestMetrics
from minienv.sampling import SamplingParams
from minienv.scheduler import Scheduler

__all__ = [
    "BLOCK_SIZES", "TraceRequest", "Trace", "sharegpt_trace", "alpaca_trace", "shared_prompt_trace", "standard_traces",
    "check_block_size", "RunResult", "simulate", "sweep", "decode_batch", "with_timings", "attention_time", "LengthStats", "length_stats",
    "predicted_fragmentation", "predicted_hit_tokens", "Recommendation", "recommend_block_size", "objective",
    "format_table", "DEFAULT_DYNAMIC", "best_fixed", "ENTRY_COST_KEYS", "row_key", "step_time_us", "step_work", "NUM_LAYERS",
]

#: The sweep's block sizes: every power of two from 1 to 256.
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Output tokens the stub model produces: ids >= this are never in a prompt, so outputs are never shared.
_OUTPUT_BASE = 1 << 20


# ------------------------------------------------------------------------------------------------ traces
@dataclass(frozen=True)
class TraceRequest:
    prompt: tuple[int, ...]
    output_len: int

    @property
    def total_len(self) -> int:
        return len(self.prompt) + self.output_len


@dataclass(frozen=True)
class Trace:
    """A named, seeded list of requests (all arriving at once: an offline batch keeps memory under pressure)."""

    name: str
    requests: tuple[TraceRequest, ...]

    @property
    def max_total_len(self) -> int:
        return max(r.total_len for r in self.requests)


def _from_workload(name: str, specs, rng: np.random.Generator) -> Trace:
    reqs = tuple(TraceRequest(tuple(int(t) for t in rng.integers(0, 1 << 16, s.prompt_len)), s.output_len)
                 for s in specs)
    return Trace(name, reqs)


def sharegpt_trace(num_requests: int = 48, *, max_len: int = 1024, seed: int = 0) -> Trace:
    """ShareGPT-like lengths (long tails: mean 161 in / 338 out before clipping); random, unshared prompts."""
    specs = generate_workload(num_requests, SHAREGPT, max_len=max_len, seed=seed)
    return _from_workload("ShareGPT-like", specs, np.random.default_rng(seed + 1))


def alpaca_trace(num_requests: int = 96, *, max_len: int = 1024, seed: int = 0) -> Trace:
    """Alpaca-like lengths (short: mean 19 in / 58 out); random, unshared prompts."""
    specs = generate_workload(num_requests, ALPACA, max_len=max_len, seed=seed)
    return _from_workload("Alpaca-like", specs, np.random.default_rng(seed + 1))


def shared_prompt_trace(num_requests: int = 96, *, system_prompt_lens: Sequence[int] = (240, 100, 500, 60),
                        seed: int = 0) -> Trace:
    """Requests that start with one of a few system prompts (first one: 240 tokens, the trap's length), then an
    Alpaca-like question and answer. What a shared prefix yields depends on how it falls on block boundaries."""
    rng = np.random.default_rng(seed + 2)
    systems = [tuple(int(t) for t in rng.integers(0, 1 << 16, n)) for n in system_prompt_lens]
    specs = generate_workload(num_requests, ALPACA, max_len=512, seed=seed)
    weights = np.array([1 / (k + 1) for k in range(len(systems))])
    picks = rng.choice(len(systems), size=num_requests, p=weights / weights.sum())
    reqs = tuple(TraceRequest(systems[k] + tuple(int(t) for t in rng.integers(0, 1 << 16, s.prompt_len)),
                              s.output_len) for k, s in zip(picks, specs))
    return Trace("shared system prompts", reqs)


def standard_traces(seed: int = 0, *, scale: float = 1.0) -> list[Trace]:
    """The three traces of the sweep (``scale`` < 1 shrinks request counts for a quick notebook run)."""
    n = lambda k: max(8, int(round(k * scale)))  # noqa: E731
    return [sharegpt_trace(n(48), seed=seed), alpaca_trace(n(96), seed=seed), shared_prompt_trace(n(96), seed=seed)]


# ------------------------------------------------------------------------------------------------ validation
def check_block_size(block_size: object, kv_budget_tokens: int | None = None) -> int:
    """A block size must be an int >= 1 and, given a budget, no larger than it. Returns it; raises
    :class:`~minienv.kv.errors.KVBudgetError` naming the problem otherwise."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise KVBudgetError(f"block_size must be an int, got {block_size!r} ({type(block_size).__name__})")
    if block_size < 1:
        raise KVBudgetError(f"block_size must be >= 1 token, got {block_size}")
    if kv_budget_tokens is not None and block_size > kv_budget_tokens:
        raise KVBudgetError(f"block_size {block_size} is larger than the KV budget of {kv_budget_tokens} tokens: "
                            "not even one block fits")
    return int(block_size)


# ------------------------------------------------------------------------------------------------ simulation
@dataclass(frozen=True)
class RunResult:
    """One trace served at one block size (or with the dynamic scheme): the measured columns of the sweep."""

    trace: str
    scheme: str
    block_size: int
    kv_budget_tokens: int
    steps: int
    frag: float  # wasted / allocated KV slots, summed over steps
    hit_tokens: int  # prompt tokens served by the prefix cache at first admission
    prompt_tokens: int
    preemptions: int
    peak_table_entries: int  # block-table entries of the running requests, at the peak
    peak_table_bytes: int  # the padded int64 [seqs, max blocks] array a step builds, at the peak
    computed_tokens: int  # tokens run through the (stub) model, recomputation after preemption included
    peak_table_segments: int = 0  # runs of consecutive block ids in those tables (what a run-length table stores)
    manager_us: float = 0.0  # CPU time per step of the scheduler + KV manager (+ the stub), microseconds
    runs_cut: int = 0
    runs_missed: int = 0
    attn_us: float | None = None  # filled by sweep(): per-layer decode attention, median microseconds
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _output_token(index: int, position: int) -> int:
    return _OUTPUT_BASE + index * 4096 + position


def simulate(trace: Trace, kv_budget_tokens: int, block_size: int | None = None, *,
             dynamic: DynamicBlockConfig | None = None, enable_prefix_caching: bool = True,
             max_num_seqs: int = 32, max_num_batched_tokens: int = 512, check_every: int = 0) -> RunResult:
    """Serve ``trace`` through the real scheduler and KV manager with a stub model; measure the sweep's columns.

    Exactly one of ``block_size`` (a plain :class:`KVCacheManager`) and ``dynamic`` (a
    :class:`DynamicKVCacheManager`) is given. The budget must hold the longest request alone (the engine refuses
    such a request up front; here it is a :class:`KVBudgetError`). ``check_every`` > 0 runs every invariant
    check that often (tests).
    """
    if (block_size is None) == (dynamic is None):
        raise ValueError("give exactly one of block_size and dynamic")
    if dynamic is not None:
        mgr: KVCacheManager = DynamicKVCacheManager.from_budget(kv_budget_tokens, dynamic,
                                                               enable_prefix_caching=enable_prefix_caching)
        b, scheme = dynamic.block_size, "dynamic"
    else:
        b = check_block_size(block_size, kv_budget_tokens)
        mgr = KVCacheManager.from_budget(kv_budget_tokens, b, enable_prefix_caching=enable_prefix_caching)
        scheme = "fixed"
    need = cdiv(trace.max_total_len, b) * b
    if need > mgr.kv_budget_tokens:
        raise KVBudgetError(f"the longest request of {trace.name!r} needs {need} KV slots at block size {b}, more "
                            f"than the budget of {mgr.kv_budget_tokens}: it could never run")
    sched = Scheduler(mgr, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    index: dict[str, int] = {}
    for i, r in enumerate(trace.requests):
        rid = f"r{i}"
        index[rid] = i
        sched.add_request(Request(rid, list(r.prompt), SamplingParams(max_tokens=r.output_len),
                                  RequestMetrics(0.0, 0)))
    requests = dict(sched.requests)
    wasted = allocated = peak_entries = peak_bytes = peak_segments = computed = 0
    pool = mgr.pool
    t_start = time.process_time()
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        if plan.is_empty:
            raise RuntimeError(f"no progress at step {plan.step}: the budget cannot run the waiting request")
        # The step's KV: every running request holds its table (its slots for this step are reserved).
        entries = max_blocks = tails = 0
        for req in sched.running:
            kv = mgr.request(req.request_id)
            n = len(kv.block_ids)
            entries += n
            max_blocks = max(max_blocks, n)
            tails += n * b - kv.num_tokens
        if entries > peak_entries:  # at a new peak, count the tables' runs of consecutive ids too
            peak_segments = sum(1 + int(np.count_nonzero(np.diff(mgr.request(r.request_id).block_ids) != 1))
                                for r in sched.running)
        reserved = mgr.num_reserved_blocks if dynamic is not None else 0
        wasted += tails + reserved * b
        allocated += pool.num_used_blocks * b
        peak_entries = max(peak_entries, entries)
        peak_bytes = max(peak_bytes, len(sched.running) * max(max_blocks, 1) * 8)
        computed += plan.num_scheduled_tokens
        sched.update_from_output(plan)
        for s in plan.scheduled:
            if not s.samples:
                continue
            req = requests[s.request_id]
            req.append_output_token(_output_token(index[s.request_id], req.num_output_tokens))
            if req.num_output_tokens >= req.max_tokens:
                sched.finish_request(s.request_id)
        if check_every and sched.num_steps % check_every == 0:
            sched.check_invariants()
    elapsed = time.process_time() - t_start
    hits = sum(r.metrics.num_cached_tokens for r in requests.values())
    stats = mgr.dynamic_stats() if dynamic is not None else None
    return RunResult(trace.name, scheme, b, mgr.kv_budget_tokens, sched.num_steps, wasted / max(allocated, 1),
                     hits, sum(len(r.prompt) for r in trace.requests), sched.num_preemptions, peak_entries,
                     peak_bytes, computed, peak_segments, 1e6 * elapsed / max(sched.num_steps, 1),
                     stats.runs_cut if stats else 0, stats.runs_missed if stats else 0)


# ------------------------------------------------------------------------------------------------ attention time
def _layout(lengths: Sequence[int], mgr: KVCacheManager, chunk: int = 8) -> list[list[int]]:
    """Grow the sequences in the manager the way serving does — prompts, then decode chunks round-robin — so
    their blocks interleave in the pool as they would in a running engine. Returns the block tables."""
    rng = np.random.default_rng(0)
    reqs = []
    for i, n in enumerate(lengths):
        first = min(n, max(1, n // 2))
        reqs.append(KVRequest(f"s{i}", [int(t) for t in rng.integers(0, 1 << 16, first)]))
        mgr.allocate(reqs[i])
        reqs[i].num_computed_tokens = first
        mgr.commit(reqs[i])
    while any(r.num_tokens < n for r, n in zip(reqs, lengths)):
        for r, n in zip(reqs, lengths):
            k = min(chunk, n - r.num_tokens)
            if k > 0:
                r.all_token_ids += [_OUTPUT_BASE + j for j in range(k)]
                assert mgr.append_slots(r, k) is not None
                r.num_computed_tokens = r.num_tokens
                mgr.commit(r)
    return [mgr.block_ids(f"s{i}") for i in range(len(lengths))]


def attention_time(lengths: Sequence[int], block_size: int | None = None, *, dynamic: DynamicBlockConfig | None = None,
                   num_kv_heads: int = 2, num_heads: int = 4, head_dim: int = 48, kernel: str = "auto",
                   repeats: int = 7, seed: int = 0) -> dict[str, float]:
    """Per-layer time of one decode step of paged attention (the real kernel) over sequences of ``lengths``.

    The block tables are laid out by the real manager (plain or dynamic) as a running engine would; the pool
    holds random K/V; the head shape is the bundled model's. Returns ``{"min_us", "median_us", "tokens",
    "padded_keys", "blocks"}``: the timing over ``repeats`` calls, and the work the kernel sees (keys padded to
    whole blocks, block-table entries).
    """
    b = dynamic.block_size if dynamic is not None else check_block_size(block_size)
    blocks_needed = sum(cdiv(n, b) for n in lengths)
    if dynamic is not None:
        extra = dynamic.run_blocks * len(lengths)
        mgr: KVCacheManager = DynamicKVCacheManager(blocks_needed + extra, dynamic, enable_prefix_caching=False)
    else:
        mgr = KVCacheManager(blocks_needed, b, enable_prefix_caching=False)
    tables = _layout(lengths, mgr)
    rng = np.random.default_rng(seed)
    # laid out as a KVPool's layer (heads outermost in memory), so the kernels read it in place
    kv_layer = rng.standard_normal((2, num_kv_heads, mgr.num_blocks, b, head_dim), dtype=np.float32).transpose(
        0, 2, 3, 1, 4)
    lens = np.asarray(lengths, dtype=np.int64)
    bt = pad_block_tables(tables)
    slots = bt[np.arange(len(lens)), (lens - 1) // b] * b + (lens - 1) % b
    meta = PagedAttentionMetadata(bt, lens - 1, np.ones(len(lens), dtype=np.int64), slots, b)
    q = rng.standard_normal((len(lens), num_heads, head_dim), dtype=np.float32)
    paged_attention(q, kv_layer, meta, kernel=kernel)  # warm (the block walk compiles on first use)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        paged_attention(q, kv_layer, meta, kernel=kernel)
        times.append(time.process_time() - t0)
    return {"min_us": 1e6 * min(times), "median_us": 1e6 * float(np.median(times)), "tokens": int(lens.sum()),
            "padded_keys": int(bt.shape[1] * b * len(lens)), "blocks": int(sum(len(t) for t in tables))}


# ------------------------------------------------------------------------------------------------ the sweep
def decode_batch(trace: Trace, num_seqs: int = 16) -> list[int]:
    """Lengths of a representative decode batch: the first ``num_seqs`` requests, halfway through their output."""
    return [len(r.prompt) + max(1, r.output_len // 2) for r in trace.requests[:num_seqs]]


def with_timings(run: RunResult, attention: Sequence[dict[str, float]], manager_us: Sequence[float],
                 dynamic: DynamicBlockConfig | None = None, *, timed: bool = True) -> RunResult:
    """The sweep's row: ``run`` (the deterministic columns of :func:`simulate`) with the timings of one or more
    rounds — ``attention`` the :func:`attention_time` results, ``manager_us`` the runs' manager times.

    ``attn_us`` / ``manager_us`` become medians over the rounds and ``extra`` keeps the minima
    (``attn_us_min``, ``manager_us_min``), the attended layout (``padded_keys``, ``batch_blocks``: deterministic)
    and the dynamic configuration, if any. ``timed=False`` (tests that need only the layout) leaves the attention
    time out."""
    extra = {"manager_us_min": min(manager_us), "dynamic": dynamic, "padded_keys": attention[0]["padded_keys"],
             "batch_blocks": attention[0]["blocks"]}
    attn_us = None
    if timed:
        extra["attn_us_min"] = min(a["min_us"] for a in attention)
        attn_us = float(np.median([a["median_us"] for a in attention]))
    return replace(run, attn_us=attn_us, manager_us=float(np.median(manager_us)), extra=extra)


def sweep(traces: Sequence[Trace], kv_budget_tokens: int, block_sizes: Sequence[int] = BLOCK_SIZES, *,
          dynamic: DynamicBlockConfig | Sequence[DynamicBlockConfig] = (), attention: bool = True,
          num_seqs: int = 16, rounds: int = 1, **simulate_kwargs) -> dict[str, list[RunResult]]:
    """Every trace at every block size, then each ``dynamic`` configuration: ``{trace name: [RunResult]}``.

    With one round this is notebook 13's loop (simulate, time one decode step, :func:`with_timings`). With more,
    the timings are taken in interleaved rounds (each round runs every configuration once, starting one
    configuration later than the round before, so drift in the machine's speed hits all alike). The deterministic
    columns are those of the first round. ``attention=False`` times nothing but lays the decode batch out (tests).
    """
    configs: list[tuple[int | None, DynamicBlockConfig | None]] = [(b, None) for b in block_sizes]
    configs += [(None, d) for d in ([dynamic] if isinstance(dynamic, DynamicBlockConfig) else list(dynamic))]
    out: dict[str, list[RunResult]] = {}
    for trace in traces:
        batch = decode_batch(trace, num_seqs)
        first: dict[int, RunResult] = {}
        attn: list[list[dict[str, float]]] = [[] for _ in configs]
        mgr_t: list[list[float]] = [[] for _ in configs]
        for rnd in range(max(1, rounds)):
            # each round starts one configuration later: none always runs right after the same neighbour
            for k in [(rnd + i) % len(configs) for i in range(len(configs))]:
                b, d = configs[k]
                r = simulate(trace, kv_budget_tokens, b, dynamic=d, **simulate_kwargs)
                first.setdefault(k, r)
                mgr_t[k].append(r.manager_us)
                attn[k].append(attention_time(batch, b, dynamic=d, repeats=9 if attention else 1))
        out[trace.name] = [with_timings(first[k], attn[k], mgr_t[k], configs[k][1], timed=attention)
                           for k in range(len(configs))]
    return out


#: Layers of the bundled model: a step runs the attention kernel once per layer.
NUM_LAYERS = 4


def step_time_us(r: RunResult, num_layers: int = NUM_LAYERS) -> float | None:
    """The block-size-dependent part of a decode step: attention in every layer + scheduler and KV manager.
    Uses the minimum over rounds when there is one (the least disturbed measurement), else the median."""
    if r.attn_us is None:
        return None
    attn = r.extra.get("attn_us_min", r.attn_us) if r.extra else r.attn_us
    mgr = r.extra.get("manager_us_min", r.manager_us) if r.extra else r.manager_us
    return num_layers * attn + mgr


def row_key(r: RunResult) -> int | str:
    """A row's name in tables: its block size, or ``"dyn B/T/m"`` for a dynamic configuration."""
    d = r.extra.get("dynamic") if r.extra else None
    if r.scheme != "dynamic":
        return r.block_size
    return f"dyn {d.block_size}/{d.threshold_tokens}/{d.run_blocks}" if d else "dynamic"


def step_work(r: RunResult, num_layers: int = NUM_LAYERS, entry_cost: float | None = None) -> float | None:
    """The same step in key reads, from the layout the real manager produced (deterministic, unlike a timer):
    ``num_layers x padded keys + entry_cost x table entries`` of the decode batch :func:`sweep` timed."""
    if not r.extra or "padded_keys" not in r.extra:
        return None
    cost = ENTRY_COST_KEYS if entry_cost is None else entry_cost
    return num_layers * r.extra["padded_keys"] + cost * r.extra["batch_blocks"]


def objective(rows: Sequence[RunResult], time: str = "measured") -> dict[int | str, float]:
    """The single number the tuner is judged by, per row (lower is better), all three terms fractions:

    ``frag`` (memory wasted) + ``miss`` (prompt tokens a token-granular cache would serve that this size does
    not, over all prompt tokens) + ``slowdown`` (step time over the fastest row, minus 1). ``time="measured"``
    uses :func:`step_time_us` (process CPU time: the truth, but noisy on a shared machine); ``time="work"`` uses
    :func:`step_work` (key reads of the real layout under the cost model: deterministic, for tests); the slowdown
    is 0 when the rows have neither. Keys: :func:`row_key` (the block size, or ``"dyn B/T/m"``).
    """
    if time not in ("measured", "work"):
        raise ValueError(f"time must be 'measured' or 'work', got {time!r}")
    cost = step_time_us if time == "measured" else step_work
    best_hits = max(r.hit_tokens for r in rows)
    timed = [t for r in rows if (t := cost(r)) is not None]
    fastest = min(timed) if timed else None
    out: dict[int | str, float] = {}
    for r in rows:
        miss = (best_hits - r.hit_tokens) / r.prompt_tokens
        t = cost(r)
        slow = (t / fastest - 1) if (fastest and t is not None) else 0.0
        out[row_key(r)] = r.frag + miss + slow
    return out


def format_table(results: Mapping[str, Sequence[RunResult]]) -> str:
    """The sweep as one text table (what the benchmark and the notebook print). ``table`` is the peak number of
    block-table entries of the running requests (``segs``: runs of consecutive ids among them), ``attn`` the
    per-layer decode attention and ``mgr`` the scheduler + manager time per step (medians, microseconds),
    ``J`` the :func:`objective`."""
    lines = [f"{'trace':<22}{'config':>15}{'frag %':>8}{'hit tok':>9}{'hit %':>7}{'preempt':>8}{'table':>7}"
             f"{'segs':>6}{'tbl KiB':>8}{'attn us':>8}{'mgr us':>8}{'J':>7}"]
    for name, rows in results.items():
        obj = objective(rows)
        for r in rows:
            key = row_key(r)
            attn = f"{r.attn_us:>8.0f}" if r.attn_us is not None else f"{'-':>8}"
            lines.append(f"{name:<22}{str(key):>15}{100 * r.frag:>8.2f}{r.hit_tokens:>9}{100 * r.hit_rate:>7.1f}"
                         f"{r.preemptions:>8}{r.peak_table_entries:>7}{r.peak_table_segments:>6}"
                         f"{r.peak_table_bytes / 1024:>8.1f}{attn}{r.manager_us:>8.0f}{obj[key]:>7.3f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the auto-tuner
@dataclass(frozen=True)
class LengthStats:
    """What the tuner needs to know about a workload: each request's prompt and output length, and the prompt
    tokens it shares with an earlier request (its longest common prefix with any earlier prompt)."""

    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    shared_prefix_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.prompt_lens)
        if n == 0 or len(self.output_lens) != n or len(self.shared_prefix_lens) != n:
            raise ValueError("LengthStats needs one prompt, output and shared-prefix length per request (>= 1)")
        for p, o, s in zip(self.prompt_lens, self.output_lens, self.shared_prefix_lens):
            if p < 1 or o < 1 or not 0 <= s <= p:
                raise ValueError(f"invalid lengths: prompt {p}, output {o}, shared prefix {s}")


def length_stats(trace: Trace) -> LengthStats:
    """Lengths of a trace and, per request, its longest prompt prefix shared with an earlier request (a token
    trie, O(total prompt tokens))."""
    root: dict = {}
    shared = []
    for r in trace.requests:
        node, depth, matched = root, 0, True
        best = 0
        for t in r.prompt:
            nxt = node.get(t)
            if nxt is None:
                matched = False
                nxt = node[t] = {}
            elif matched:
                best = depth + 1
            node = nxt
            depth += 1
        shared.append(best)
    return LengthStats(tuple(len(r.prompt) for r in trace.requests), tuple(r.output_len for r in trace.requests),
                       tuple(shared))


def predicted_fragmentation(stats: LengthStats, block_size: int, *, sharing: bool = True) -> float:
    """Wasted / allocated slots over every request's life, from lengths alone.

    A request with prompt ``p`` and output ``o`` is in the cache at lengths ``l = p .. p + o - 1`` (one step each:
    the prompt's step, then one per decode; the last sampled token is never fed back), holding ``ceil(l / B)``
    blocks with ``(-l) mod B`` empty slots. With ``sharing``, the whole blocks of its shared prefix are counted
    once, with the first request that had them (an approximation: it assumes they stay resident); without
    sharing or preemption this is exactly what :func:`simulate` measures.
    """
    b = check_block_size(block_size)
    wasted = alloc = 0
    for p, o, s in zip(stats.prompt_lens, stats.output_lens, stats.shared_prefix_lens):
        ls = np.arange(p, p + o, dtype=np.int64)
        a = -(-ls // b) * b
        wasted += int((a - ls).sum())
        alloc += int(a.sum()) - (o * (min(s, p - 1) // b * b) if sharing else 0)
    return wasted / alloc


def predicted_hit_tokens(stats: LengthStats, block_size: int) -> int:
    """Prefix-hit tokens if nothing were evicted: whole blocks of each shared prefix, never the prompt's last
    token (``min(shared, prompt - 1) // B * B``)."""
    b = check_block_size(block_size)
    return sum(min(s, p - 1) // b * b for s, p in zip(stats.shared_prefix_lens, stats.prompt_lens))


#: What one block-table entry of a running request costs per step, in key reads of one attention layer: the
#: scheduler and manager walk, copy and hash tables entry by entry. ``benchmarks/bench_block_size.py`` fits it
#: from CPU times (1.6 - 4.9 on the three traces here); 3 is the round middle.
ENTRY_COST_KEYS = 3.0


@dataclass(frozen=True)
class Recommendation:
    block_size: int
    reasoning: str
    scores: dict[int, float]  # predicted objective per candidate


def recommend_block_size(workload: Trace | LengthStats, kv_budget_tokens: int, *,
                         candidates: Sequence[int] = BLOCK_SIZES, num_seqs: int = 16,
                         entry_cost: float = ENTRY_COST_KEYS, num_layers: int = NUM_LAYERS) -> Recommendation:
    """Recommend a block size for a workload and a KV budget, with the reasoning, from lengths alone.

    It predicts the same objective the sweep measures (:func:`objective`): ``frag`` from the lengths
    (:func:`predicted_fragmentation`), ``miss`` from the shared prefixes (:func:`predicted_hit_tokens`), and the
    step slowdown from a cost model — a decode step over a batch of ``num_seqs`` sequences costs
    ``num_layers x padded keys + entry_cost x table entries`` key reads, keys padded to whole blocks of the
    longest sequence (the kernel attends over the padded table, masked) — and picks the lowest. Candidates larger than the budget, or whose longest request would not fit it, are dropped.
    """
    stats = workload if isinstance(workload, LengthStats) else length_stats(workload)
    if isinstance(kv_budget_tokens, bool) or not isinstance(kv_budget_tokens, int) or kv_budget_tokens < 1:
        raise KVBudgetError(f"kv_budget_tokens must be an int >= 1, got {kv_budget_tokens!r}")
    cands = [check_block_size(b) for b in candidates]
    if not cands:
        raise ValueError("no candidate block sizes")
    longest = max(p + o for p, o in zip(stats.prompt_lens, stats.output_lens))
    fits = [b for b in cands if b <= kv_budget_tokens and cdiv(longest, b) * b <= kv_budget_tokens]
    if not fits:
        raise KVBudgetError(f"no candidate block size fits the longest request ({longest} tokens) in a budget of "
                            f"{kv_budget_tokens} tokens")
    total_prompt = sum(stats.prompt_lens)
    hits = {b: predicted_hit_tokens(stats, b) for b in fits}
    best_hits = max(predicted_hit_tokens(stats, 1), max(hits.values()))
    batch = [p + max(1, o // 2) for p, o in list(zip(stats.prompt_lens, stats.output_lens))[:num_seqs]]
    cost = {b: num_layers * len(batch) * (cdiv(max(batch), b) * b) + entry_cost * sum(cdiv(n, b) for n in batch)
            for b in fits}
    fastest = min(cost.values())
    parts = {b: (predicted_fragmentation(stats, b), (best_hits - hits[b]) / total_prompt, cost[b] / fastest - 1)
             for b in fits}
    scores = {b: sum(v) for b, v in parts.items()}
    pick = min(fits, key=lambda b: (scores[b], b))
    f, m, s = parts[pick]
    mean_len = float(np.mean([p + o / 2 for p, o in zip(stats.prompt_lens, stats.output_lens)]))
    shared = sum(stats.shared_prefix_lens)
    why = [f"block size {pick}: predicted fragmentation {f:.1%} (mean live length {mean_len:.0f} tokens, "
           f"about (B-1)/2 = {(pick - 1) / 2:.1f} empty slots per request)"]
    if shared:
        why.append(f"prefix hits {hits[pick]} of {shared} shareable prompt tokens (lost to block granularity: "
                   f"{m:.1%} of all prompt tokens)")
    else:
        why.append("no shared prefixes: hits do not constrain the block size")
    why.append(f"a step {s:.1%} slower than the fastest candidate (a table entry costs about {entry_cost:.0f} key "
               "reads; keys are padded to whole blocks)")
    smaller = [b for b in fits if b < pick]
    larger = [b for b in fits if b > pick]
    if smaller:
        b = smaller[-1]
        why.append(f"{b} would cut fragmentation to {parts[b][0]:.1%} but make a step {parts[b][2]:.1%} slower")
    if larger:
        b = larger[0]
        why.append(f"{b} would waste {parts[b][0]:.1%} and lose {parts[b][1]:.1%} of prompt tokens to granularity")
    return Recommendation(pick, "; ".join(why), scores)


#: The dynamic scheme's default: 16-token blocks, singly for the first 128 tokens, then runs of 8 (128 tokens).
DEFAULT_DYNAMIC = DynamicBlockConfig(block_size=16, threshold_tokens=128, run_blocks=8)


def best_fixed(rows: Sequence[RunResult], time: str = "measured") -> RunResult:
    """The fixed-size row with the lowest :func:`objective`."""
    obj = objective(rows, time)
    fixed = [r for r in rows if r.scheme == "fixed"]
    return min(fixed, key=lambda r: (obj[r.block_size], r.block_size))

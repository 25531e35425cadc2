"""Observation: engine-wide stats, step records, dashboard snapshots and per-request timelines.

Nothing here changes the engine, and everything is pulled when a view asks (``engine.stats``, ``snapshot()``,
``timeline()``) except the :class:`StepRecord` appended to the bounded ``history`` ring after each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from minienv.kv.interface import KVCacheStats, KVEvent
from minienv.request import FinishReason, Request
from minienv.scheduler import SchedulerOutput

#: the engine (``minienv.engine.core.InferenceEngine``), which calls into this module: annotated loosely so that
#: nothing here imports the engine back
Engine = Any


@dataclass(frozen=True)
class EngineStats:
    """Engine-wide counters and the KV budget's state (vLLM's scheduler and prefix-cache stats). Block counts are
    physical blocks, each counted once; ``kv_usage`` is the fraction *in use* (cached-free blocks are resident but
    reclaimable). Prefix-cache queries and hits are tokens, counted at every admission, resumes included."""

    num_steps: int
    num_waiting: int
    num_running: int
    num_finished: int
    kv_budget_tokens: int
    block_size: int
    num_blocks: int
    num_blocks_in_use: int
    num_cached_free_blocks: int
    num_free_empty_blocks: int
    kv_usage: float
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    evicted_blocks: int
    evicted_tokens: int
    num_preemptions: int
    num_prompt_tokens: int  # prompt tokens of admitted requests (each request once)
    num_computed_tokens: int  # tokens run through the model: prefill chunks + decodes + recomputation
    num_generated_tokens: int
    busy_time_s: float  # wall time inside step()
    #: static padding: tokens computed for finished members still in their batch (thrown away; in computed tokens)
    num_padding_tokens: int = 0
    num_errors: int = 0  # requests finished with finish_reason "error"
    num_failed_steps: int = 0  # steps that raised and were rolled back
    peak_kv_usage: float = 0.0  # the largest ``kv_usage`` after any step so far

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries_tokens
        return self.prefix_cache_hits_tokens / q if q else 0.0

    @property
    def generation_throughput(self) -> float:
        """Generated tokens per second of engine time."""
        return self.num_generated_tokens / self.busy_time_s if self.busy_time_s > 0 else 0.0

    @property
    def resident_tokens(self) -> int:
        return (self.num_blocks_in_use + self.num_cached_free_blocks) * self.block_size


@dataclass(frozen=True)
class StepRecord:
    """What one engine step did: its plan, its tokens, who finished, the KV events, the stats after it."""

    step: int
    scheduler_output: SchedulerOutput
    sampled: dict[str, int]  # request id -> token sampled in this step (EOS included)
    finished: dict[str, FinishReason]
    kv_events: tuple[KVEvent, ...]
    stats: EngineStats
    duration_s: float
    token_time: float = 0.0  # time.perf_counter() when this step's tokens came out (their first_token/finished time)


@dataclass(frozen=True)
class RequestView:
    """One request as a dashboard draws it. ``block_refcounts[j]`` is the refcount of ``block_ids[j]``."""

    request_id: str
    status: str
    prompt: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    num_tokens: int  # prompt + generated so far
    num_computed_tokens: int  # of them, with K/V in the cache now
    num_cached_tokens: int
    num_preemptions: int
    block_ids: tuple[int, ...]
    block_refcounts: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class EngineSnapshot:
    """Everything a dashboard shows, between two steps. ``free_queue`` is head first (the order allocations take
    and evict blocks) as ``(block_id, is_cached)``; ``block_refcounts`` / ``block_states`` cover every physical
    block; ``finished`` holds the finished requests still remembered; ``last_step`` is None without history."""

    step: int
    waiting: tuple[RequestView, ...]
    running: tuple[RequestView, ...]
    finished: tuple[RequestView, ...]
    free_queue: tuple[tuple[int, bool], ...]
    block_refcounts: tuple[int, ...]
    block_states: tuple[str, ...]
    stats: EngineStats
    last_step: StepRecord | None
    static_batch: tuple[str, ...] = ()  # static scheduling: the current batch's unfinished members


@dataclass(frozen=True)
class TimelineEntry:
    """A request's state in one step: ``waiting``, ``prefill`` (``num_tokens`` computed), ``decode``,
    ``preempted`` (this step freed its KV), ``paused`` (running, but no budget this step) or ``finished`` (its last
    token came out of this step)."""

    request_id: str
    step: int
    state: str
    num_tokens: int = 0


def engine_stats(engine: Engine, kv: KVCacheStats) -> EngineStats:
    """The engine's counters, its scheduler's and the KV manager's stats ``kv`` (read now) as one record."""
    sch, c = engine.scheduler, engine.counters
    return EngineStats(
        num_steps=sch.num_steps, num_waiting=len(sch.waiting), num_running=len(sch.running),
        num_finished=c.finished, kv_budget_tokens=kv.kv_budget_tokens, block_size=kv.block_size,
        num_blocks=kv.num_blocks, num_blocks_in_use=kv.num_in_use, num_cached_free_blocks=kv.num_cached_free,
        num_free_empty_blocks=kv.num_free_empty, kv_usage=kv.usage,
        prefix_cache_queries_tokens=kv.prefix_queries_tokens, prefix_cache_hits_tokens=kv.prefix_hits_tokens,
        evicted_blocks=kv.evicted_blocks, evicted_tokens=kv.evicted_tokens, num_preemptions=sch.num_preemptions,
        num_prompt_tokens=c.prompt_tokens, num_computed_tokens=c.computed_tokens,
        num_generated_tokens=c.generated_tokens, busy_time_s=c.busy_s, num_errors=c.errors,
        num_padding_tokens=getattr(sch, "num_padding_tokens", 0),  # the static policy's count
        num_failed_steps=c.failed_steps, peak_kv_usage=c.peak_blocks_in_use / kv.num_blocks,
    )


def request_view(engine: Engine, req: Request) -> RequestView:
    mgr = engine.kv_cache_manager
    blocks: tuple[int, ...] = ()
    if mgr.has_request(req.request_id):
        blocks = tuple(mgr.request(req.request_id).block_ids)
    return RequestView(
        request_id=req.request_id, status=req.status.value, prompt=req.prompt,
        num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
        max_tokens=req.max_tokens, num_tokens=req.num_tokens, num_computed_tokens=req.num_computed_tokens,
        num_cached_tokens=req.metrics.num_cached_tokens, num_preemptions=req.metrics.num_preemptions,
        block_ids=blocks, block_refcounts=tuple(mgr.ref_cnt(b) for b in blocks), text=req.text,
        finish_reason=req.finish_reason,
    )


def engine_snapshot(engine: Engine) -> EngineSnapshot:
    mgr = engine.kv_cache_manager
    sch = engine.scheduler
    finished = [r for r in engine.requests.values() if r.is_finished] + list(engine.retained.values())
    blocks = mgr.pool.blocks
    return EngineSnapshot(
        step=sch.num_steps,
        waiting=tuple(request_view(engine, r) for r in sch.waiting),
        running=tuple(request_view(engine, r) for r in sch.running),
        finished=tuple(request_view(engine, r) for r in finished),
        free_queue=tuple(mgr.free_queue()),
        block_refcounts=tuple(b.ref_cnt for b in blocks),
        block_states=tuple(mgr.block_state(b.block_id).value for b in blocks),
        stats=engine.stats,
        last_step=engine.history[-1] if engine.history else None,
        static_batch=tuple(getattr(sch, "static_batch", ())),
    )


def timeline(history: Iterable[StepRecord]) -> list[TimelineEntry]:
    """Per request and step, from step records. Static padding is not a request's work and is left out."""
    out: list[TimelineEntry] = []
    for rec in history:
        plan = rec.scheduler_output
        seen = set()
        for s in plan.scheduled:
            if s.kind == "padding":
                continue
            state = "finished" if s.request_id in rec.finished else s.kind
            out.append(TimelineEntry(s.request_id, rec.step, state, s.num_new_tokens))
            seen.add(s.request_id)
        for rid in plan.preempted:
            out.append(TimelineEntry(rid, rec.step, "preempted"))
            seen.add(rid)
        for state, ids in (("waiting", plan.waiting), ("paused", plan.running)):
            for rid in ids:
                if rid not in seen:
                    out.append(TimelineEntry(rid, rec.step, state))
                    seen.add(rid)
    return out

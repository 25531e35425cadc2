"""``InferenceEngine``: model + tokenizer + KV cache manager + scheduler, driven one batched step at a time.

The engine loop (vLLM's ``LLMEngine.step``), once per step::

    plan = scheduler.schedule()            # who runs, how many tokens each, preemptions, admissions
    logits = model.forward_step(...)       # ONE batched call for every scheduled token (paged attention)
    scheduler.update_from_output(plan)     # the K/V now exist: commit (full blocks become prefix-cache hits)
    sample -> append -> stop checks        # per request, each with its own seeded sampler
    scheduler.finish_request(...)          # finished requests free their blocks (full ones stay cached)

Why one call: every weight matrix is read once per step for the whole batch instead of once per request; on a
small model the per-call overhead dominates, so batching 16 requests costs little more than running one.

Why outputs do not depend on batching: each request has its own :class:`~minienv.sampling.Sampler` (its own
seeded generator), attention reads only the request's own blocks, and a preempted request recomputes exactly its
own tokens. The nothing-lost test checks it: under a budget of ~10 % of what the requests need, with many
preemptions, every greedy output equals the request generated alone.

Three ways in:

* ``engine.generate(prompts, params)`` -> one finished :class:`RequestOutput` per prompt, in order. Every prompt
  is validated first; a bad one raises :class:`InvalidRequestError` naming its index and *nothing* is queued.
* ``engine.add_request(prompt, params)`` -> request id; ``engine.step()`` -> outputs of this step;
  ``engine.abort(id)``. A bad request raises for that request only; the engine keeps serving the others.
* ``engine.stream(prompts, params)`` -> yields incremental outputs (``delta_text``, ``delta_token_ids``) as
  tokens are produced.

For dashboards: ``engine.snapshot()`` (queues, block tables with refcounts, the free queue in LRU order, budget
use, stats, each request's text so far) at any moment, ``engine.history`` (one :class:`StepRecord` per step:
the :class:`~minienv.scheduler.SchedulerOutput`, sampled tokens, finished requests, KV events, stats) and
``engine.timeline()`` (per request and step: waiting / prefill / decode / preempted). A dashboard loop::

    engine = InferenceEngine(kv_budget_tokens=512, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
        snap = engine.snapshot()        # snap.waiting / snap.running: RequestView (block_ids, block_refcounts, text)
        plan = snap.last_step.scheduler_output   # admitted, preempted, scheduled (kind, num_new_tokens)
        ...                             # snap.free_queue (LRU head first), snap.stats (kv_usage, hits, evictions)

On a busy machine set ``OPENBLAS_NUM_THREADS=1`` before numpy is imported: at these matrix sizes a second BLAS
thread saves nothing, and spinning BLAS threads on an oversubscribed CPU made a step ~100x slower in our runs.
"""

from __future__ import annotations

import codecs
import copy
import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from minienv.generate import trim_at_stop
from minienv.kv.block_table import cdiv
from minienv.kv.errors import KVBudgetError
from minienv.kv.kv_cache_manager import KVCacheManager, KVEvent
from minienv.kv.kv_pool import KVPool, num_blocks_for_budget
from minienv.kv.paged_attention import PagedAttentionBackend, PagedAttentionMetadata
from minienv.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestMetrics,
    RequestNotFoundError,
    RequestStatus,
    check_token_ids,
    kv_tokens_needed,
)
from minienv.sampling import SamplingParams
from minienv.scheduler import Scheduler, SchedulerOutput, SchedulingPolicy, VictimPolicy, most_recently_admitted



# ---------------------------------------------------------------------------------------------------- text
class IncrementalDetokenizer:
    """Output text, grown one token at a time, decoding only what is new.

    A byte-level token can end inside a UTF-8 character, so text is released only up to the last complete
    character. With a tokenizer that exposes each token's bytes (``id_to_bytes``, as minienv's BPE does), the
    bytes go through Python's incremental UTF-8 decoder — O(1) per token, and exactly ``decode(all ids)``.
    Otherwise tokens are held in ``pending`` until ``decode(pending)`` no longer ends in U+FFFD. Either way each
    push costs a few tokens' work, not the whole output's (``generate.TextStream`` re-decodes everything: O(n^2)).
    """

    def __init__(self, tokenizer: Any):
        self.decode = tokenizer.decode
        self.id_to_bytes = getattr(tokenizer, "id_to_bytes", None)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if self.id_to_bytes else None
        self.pending: list[int] = []

    def push(self, token_id: int) -> str:
        if self._utf8 is not None:
            return self._utf8.decode(self.id_to_bytes(token_id))
        self.pending.append(token_id)
        text = self.decode(self.pending)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        text = self.decode(self.pending) if self.pending else ""
        self.pending = []
        return text


# ---------------------------------------------------------------------------------------------------- outputs
@dataclass(frozen=True)
class RequestOutput:
    """What a request has produced so far (vLLM's ``RequestOutput``, flattened: one completion per request).

    ``token_ids`` are the generated ids (the end-of-sequence token is *not* included — it ends the request, like
    :func:`minienv.generate.generate`; the token completing a stop string *is*). ``text`` is their decoded text:
    once finished by a stop string it is cut before the stop string; while running it holds back the last
    ``len(longest stop) - 1`` characters, which might yet turn out to start a stop string — so streamed text
    never has to be taken back. ``delta_text`` / ``delta_token_ids`` are what is new since this request's
    previous output (streaming).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    metrics: RequestMetrics
    stop_reason: str | None = None
    delta_text: str = ""
    delta_token_ids: tuple[int, ...] = ()

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at first admission."""
        return self.metrics.num_cached_tokens

    @property
    def num_preemptions(self) -> int:
        return self.metrics.num_preemptions

    @property
    def ttft(self) -> float | None:
        return self.metrics.ttft

    @property
    def tpot(self) -> float | None:
        return self.metrics.tpot

    @property
    def e2e_latency(self) -> float | None:
        return self.metrics.e2e_latency


@dataclass(frozen=True)
class EngineStats:
    """Engine-wide counters and the KV budget's state (vLLM's scheduler stats + prefix-cache stats).

    Block counts are physical blocks, each counted once (SGLang #35270). ``kv_usage`` is the fraction of blocks
    *in use*; cached-free blocks are resident (they count against the budget) but reclaimable.
    Prefix-cache queries and hits are in tokens, counted at every admission — re-admissions after preemption
    included, which is exactly where the cache pays: a resume is mostly hits.
    """

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
    """Everything a dashboard shows, at one moment (between steps).

    ``free_queue`` is head first — the order allocations take (and evict) blocks — as ``(block_id, is_cached)``.
    ``block_refcounts[b]`` / ``block_states[b]`` cover every physical block. ``last_step`` is the most recent
    :class:`StepRecord` (None before the first step).
    """

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
    ``preempted`` (this step freed its KV) or ``finished`` (its last token came out of this step)."""

    request_id: str
    step: int
    state: str
    num_tokens: int = 0


# ---------------------------------------------------------------------------------------------------- engine
class InferenceEngine:
    """A continuous-batching engine over a paged, prefix-cached KV pool of ``kv_budget_tokens`` tokens.

    Parameters
    ----------
    model, tokenizer:
        A :class:`~minienv.model.LlamaModel` and a tokenizer (``encode`` / ``decode`` / ``eos_token_id``);
        ``None`` loads the bundled ones (``assets/target``, ``assets/tokenizer.json``).
    kv_budget_tokens:
        Token slots of KV for all requests together: ``kv_budget_tokens // block_size`` blocks, preallocated.
    block_size:
        Tokens per KV block.
    enable_prefix_caching:
        Reuse the K/V of full blocks whose prefix was computed before (and keep freed ones, LRU-evicted).
    max_num_seqs:
        Most requests running at once (the batch size cap).
    max_num_batched_tokens:
        Most tokens computed in one step (decodes + prefill chunks); must be >= ``max_num_seqs``.
    scheduling:
        ``"continuous"`` (refill the batch every step) or ``"static"`` (fixed batches; the baseline).
    static_padding:
        Only for ``"static"``: a finished member keeps its batch slot (and its KV blocks) until the batch ends,
        computing one discarded token per step in the same batched model call — what a padded batch
        (``transformers.generate``) does. Default True; False is the charitable baseline where finished members
        stop computing. Outputs are identical either way; ``stats.num_padding_tokens`` counts the wasted tokens.
    record_history:
        Keep a :class:`StepRecord` per step in ``history`` (small; turn off for very long runs).
    victim_policy:
        Which request to preempt when a running one cannot get a block (default: the most recently admitted);
        called with the candidates not yet scheduled in the step, oldest first. Outputs never depend on it.
    """

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        *,
        kv_budget_tokens: int = 8192,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        scheduling: SchedulingPolicy = "continuous",
        record_history: bool = True,
        victim_policy: VictimPolicy | None = None,
        static_padding: bool = True,
    ):
        if model is None:
            from minienv.model import load_model

            model = load_model()
        if tokenizer is None:
            from minienv.tokenizer import load_tokenizer

            tokenizer = load_tokenizer()
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None and vocab > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {vocab} ids but the model only {model.config.vocab_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        num_blocks = num_blocks_for_budget(kv_budget_tokens, block_size)  # KVBudgetError below one block
        self.block_size = int(block_size)
        self.kv_pool = KVPool.for_model(model.config, num_blocks * block_size, block_size)
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                               kv_pool=self.kv_pool)
        self.scheduler = Scheduler(self.kv_cache_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, scheduling=scheduling,
                                   victim_policy=victim_policy or most_recently_admitted,
                                   static_padding=static_padding,
                                   max_position=model.config.max_position_embeddings)
        self.backend = PagedAttentionBackend(self.kv_pool)
        self.record_history = record_history
        self.history: list[StepRecord] = []
        self.requests: dict[str, Request] = {}  # every request ever added (finished ones too), by id
        self._streams: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, tuple[int, int]] = {}  # id -> (tokens, chars) already reported (streaming)
        self._ids = itertools.count()
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        self._kv_events: list[KVEvent] = []
        if record_history:
            self.kv_cache_manager.add_listener(self._kv_events.append)
        self._num_prompt_tokens = 0
        self._num_computed_tokens = 0
        self._num_generated_tokens = 0
        self._num_finished = 0
        self._busy = 0.0

    # ------------------------------------------------------------------ configuration views
    @property
    def kv_budget_tokens(self) -> int:
        return self.kv_cache_manager.kv_budget_tokens

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    @property
    def scheduling(self) -> str:
        return self.scheduler.scheduling

    def __repr__(self) -> str:
        return (f"InferenceEngine(kv_budget_tokens={self.kv_budget_tokens}, block_size={self.block_size}, "
                f"max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens}, "
                f"scheduling={self.scheduling!r}{self._padding_repr()}, prefix_caching="
                f"{'on' if self.kv_cache_manager.enable_prefix_caching else 'off'})")

    def _padding_repr(self) -> str:
        charitable = self.scheduling == "static" and not self.scheduler.static_padding
        return ", static_padding=False" if charitable else ""

    # ------------------------------------------------------------------ validation
    def _validate(self, prompt: Any, params: Any) -> tuple[list[int], str | None, SamplingParams]:
        """Turn (prompt, params) into token ids and checked params, or raise ``InvalidRequestError``.

        Runs before anything is queued, so a rejected request leaves the engine exactly as it was.
        """
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a minienv.SamplingParams, got {type(params).__name__}")
        try:  # re-run SamplingParams' checks on a private copy (a caller may have mutated theirs since)
            params = dataclasses.replace(params)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"bad sampling parameters: {exc}") from exc
        text: str | None = None
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty; give at least one character")
            text = prompt
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (Sequence, np.ndarray)):
            raise InvalidRequestError(f"a prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
        else:
            try:
                ids = check_token_ids(list(prompt), self.model.config.vocab_size)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from exc
        if not ids:
            raise InvalidRequestError("the prompt is empty (zero tokens); give at least one token")
        need = kv_tokens_needed(len(ids), params.max_tokens)
        limit = self.model.config.max_position_embeddings
        if need > limit:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the model's "
                f"max_position_embeddings ({limit}); shorten the prompt or lower max_tokens")
        if need > self.kv_budget_tokens:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} tokens can never fit in the "
                f"KV budget of {self.kv_budget_tokens} tokens ({self.num_blocks} blocks of {self.block_size}), even "
                "alone; raise kv_budget_tokens or lower max_tokens")
        return ids, text, params

    # ------------------------------------------------------------------ requests in
    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None) -> str:
        """Validate and queue one request; return its id. A bad request raises ``InvalidRequestError`` and the
        engine is unchanged (everything already queued keeps being served)."""
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}")
            if request_id in self.requests:
                raise InvalidRequestError(f"request id {request_id!r} is already used")
        ids, text, params = self._validate(prompt, sampling_params)
        return self._add(ids, text, params, request_id)

    def _add(self, ids: list[int], text: str | None, params: SamplingParams, request_id: str | None) -> str:
        if request_id is None:
            request_id = str(next(self._ids))
            while request_id in self.requests:
                request_id = str(next(self._ids))
        metrics = RequestMetrics(arrival_time=time.perf_counter(), arrival_step=self.scheduler.num_steps)
        req = Request(request_id, ids, params, metrics, prompt=text)
        self.requests[request_id] = req
        self._streams[request_id] = IncrementalDetokenizer(self.tokenizer)
        self._emitted[request_id] = (0, 0)
        self.scheduler.add_request(req)
        return request_id

    def abort(self, request_id: str) -> RequestOutput:
        """Stop an unfinished request now: it leaves its queue and frees its blocks. Unknown or already finished
        ids raise :class:`RequestNotFoundError` and change nothing."""
        if request_id not in self.scheduler.requests:
            raise RequestNotFoundError(request_id)
        req = self.scheduler.finish_request(request_id, pad=False)
        req.finish("abort", time.perf_counter(), self.scheduler.num_steps)
        self._num_finished += 1
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every request that produced a token or finished in it."""
        reqs = self._step()
        return [self._output(r) for r in reqs]

    def _step(self) -> list[Request]:
        """One engine step; returns the requests that sampled a token in it (finished ones included).

        ``generate`` calls this directly: building a :class:`RequestOutput` per request per step is work only
        streaming callers need.
        """
        if not self.scheduler.has_unfinished_requests():
            return []
        t0 = time.perf_counter()
        self._kv_events.clear()
        plan = self.scheduler.schedule()
        if plan.is_empty:  # cannot happen: validation guarantees a lone request always fits
            raise RuntimeError(f"engine step {plan.step} scheduled nothing with requests pending: {plan}")
        sched = plan.scheduled
        n_seqs = len(sched)
        tables = [self.kv_cache_manager.request(s.request_id).block_ids for s in sched]
        width = max(len(t) for t in tables)
        block_tables = np.zeros((n_seqs, width), dtype=np.int64)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        meta = PagedAttentionMetadata(
            block_tables,
            np.fromiter((s.num_computed_tokens for s in sched), dtype=np.int64, count=n_seqs),
            np.fromiter((s.num_new_tokens for s in sched), dtype=np.int64, count=n_seqs),
            np.concatenate([s.slot_mapping for s in sched]),
            self.block_size,
        )
        token_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in sched), dtype=np.int64,
                                count=meta.num_tokens)
        sampling = [i for i, s in enumerate(sched) if s.samples]
        self.backend.set_metadata(meta)
        if sampling:
            logits = self.model.forward_step(token_ids, meta.positions, self.backend,
                                             logits_indices=meta.query_start_loc[1:][sampling] - 1)
        else:  # every sequence is mid-prefill: K/V only, no logits needed (one row keeps shapes simple)
            logits = self.model.forward_step(token_ids, meta.positions, self.backend, logits_indices=[0])
        self.scheduler.update_from_output(plan)
        self._num_computed_tokens += meta.num_tokens
        for s in sched:
            if s.is_new and not s.is_resume:
                req = self.requests[s.request_id]
                self._num_prompt_tokens += req.num_prompt_tokens
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time, req.metrics.first_scheduled_step = t0, plan.step

        # sample: greedy rows in one argmax, the others each with their own seeded sampler
        reqs = [self.requests[sched[i].request_id] for i in sampling]
        tokens = [0] * len(reqs)
        greedy_rows = [k for k, r in enumerate(reqs) if r.sampling_params.greedy]
        if greedy_rows:
            for k, t in zip(greedy_rows, np.argmax(logits[greedy_rows], axis=-1).tolist()):
                tokens[k] = t
        for k, r in enumerate(reqs):
            if not r.sampling_params.greedy:
                tokens[k] = int(r.sampler.sample(logits[k]))

        now = time.perf_counter()
        done_step = plan.step + 1  # "after this step": the step count at which the token exists
        sampled: dict[str, int] = {}
        finished: dict[str, FinishReason] = {}
        for r, tok in zip(reqs, tokens):
            sampled[r.request_id] = tok
            reason = self._process_token(r, tok, now, done_step)
            if reason is not None:
                self.scheduler.finish_request(r.request_id)
                r.finish(reason, now, done_step)
                self._num_finished += 1
                finished[r.request_id] = reason
        self._busy += time.perf_counter() - t0
        if self.record_history or self._step_listeners:
            record = StepRecord(plan.step, plan, sampled, finished, tuple(self._kv_events), self.stats,
                                time.perf_counter() - t0)
            if self.record_history:
                self.history.append(record)
            for listener in self._step_listeners:
                listener(record)
        return reqs

    def _process_token(self, req: Request, token: int, now: float, step: int) -> FinishReason | None:
        """Append a sampled token and decide whether the request ends (EOS / stop string / max_tokens)."""
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time, m.first_token_step = now, step
        if self.eos_token_id is not None and token == self.eos_token_id:
            req.text += self._streams[req.request_id].flush()
            return "eos"
        req.append_output_token(token)
        self._num_generated_tokens += 1
        stream = self._streams[req.request_id]
        before = len(req.text)
        req.text += stream.push(token)
        stops = req.sampling_params.stop_strings
        if stops:
            longest = max(len(s) for s in stops)
            tail = req.text[max(0, before - longest + 1):]
            hit = [s for s in stops if s in tail]
            if hit:
                cut = trim_at_stop(req.text, stops)
                matched = min(hit, key=lambda s: req.text.find(s))
                req.text, req.stop_reason = cut, matched
                return "stop"
        if req.num_output_tokens >= req.max_tokens:
            req.text += stream.flush()
            return "length"
        return None

    def _output(self, req: Request) -> RequestOutput:
        """The request's visible output now, with what is new since its previous output as the delta."""
        text = req.text
        if not req.is_finished and req.sampling_params.stop_strings:
            hold = max(len(s) for s in req.sampling_params.stop_strings) - 1
            text = text[:max(0, len(text) - hold)]
        n_tok, n_chr = self._emitted[req.request_id]
        ids = tuple(req.output_token_ids)
        self._emitted[req.request_id] = (len(ids), len(text))
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_tuple, text=text,
            token_ids=ids, finished=req.is_finished, finish_reason=req.finish_reason,
            metrics=copy.copy(req.metrics), stop_reason=req.stop_reason,
            delta_text=text[n_chr:], delta_token_ids=ids[n_tok:],
        )

    # ------------------------------------------------------------------ batch APIs
    def _validate_batch(self, prompts: Any, sampling_params: Any) -> list[tuple[list[int], str | None, SamplingParams]]:
        if isinstance(prompts, str) or (isinstance(prompts, (Sequence, np.ndarray)) and len(prompts) > 0
                                        and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # one prompt (a string, or one list of token ids)
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, (Sequence, np.ndarray)):
            raise InvalidRequestError(f"prompts must be a str or a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InvalidRequestError(
                    f"{len(prompts)} prompts but {len(sampling_params)} sampling params; give one, or one per prompt")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        checked = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                checked.append(self._validate(p, sp))
            except InvalidRequestError as exc:
                raise InvalidRequestError(str(exc), index=i) from exc
        return checked

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); one finished output per prompt, in order.

        ``prompts``: strings and/or token-id lists (or a single one). ``sampling_params``: one for all, or a list.
        All prompts are validated before anything is queued: a bad one raises :class:`InvalidRequestError` whose
        ``index`` names it, and the engine is unchanged. Requests added earlier with :meth:`add_request` are
        served alongside (their outputs are in ``engine.output(id)``).
        """
        checked = self._validate_batch(prompts, sampling_params)
        ids = [self._add(tok, text, sp, None) for tok, text, sp in checked]
        pending = set(ids)
        while pending and self.scheduler.has_unfinished_requests():
            for req in self._step():
                if req.is_finished:
                    pending.discard(req.request_id)
        return [self.output(i) for i in ids]

    def stream(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Queue the prompts now (validated like :meth:`generate`) and return an iterator of incremental outputs.

        Each yielded :class:`RequestOutput` carries ``delta_text`` / ``delta_token_ids`` (new since that request's
        previous output) and the cumulative ``text``; the last one per request has ``finished=True``. Closing the
        iterator early aborts the requests it still owns.
        """
        checked = self._validate_batch(prompts, sampling_params)
        ids = [self._add(tok, text, sp, None) for tok, text, sp in checked]
        return self._stream(ids)

    def _stream(self, ids: list[str]) -> Iterator[RequestOutput]:
        mine = set(ids)
        try:
            while any(not self.requests[i].is_finished for i in mine):
                for out in self.step():
                    if out.request_id in mine and (out.delta_token_ids or out.delta_text or out.finished):
                        yield out
        finally:
            for i in mine:
                if i in self.scheduler.requests:
                    self.abort(i)

    def run(self, max_steps: int | None = None) -> int:
        """Step until every request has finished (or ``max_steps``); return the number of steps run."""
        n = 0
        while self.scheduler.has_unfinished_requests() and (max_steps is None or n < max_steps):
            self.step()
            n += 1
        return n

    def output(self, request_id: str) -> RequestOutput:
        """The current output of any request this engine has seen (finished ones included)."""
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(request_id, "report")
        n_tok, n_chr = self._emitted[request_id]
        out = self._output(req)
        self._emitted[request_id] = (n_tok, n_chr)  # a look, not a stream: leave the stream position alone
        return out

    # ------------------------------------------------------------------ observation
    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Call ``listener(record)`` after every step (live dashboards); ``record_history`` is not required."""
        if not self._step_listeners and not self.record_history:
            self.kv_cache_manager.add_listener(self._kv_events.append)
        self._step_listeners.append(listener)

    @property
    def stats(self) -> EngineStats:
        kv = self.kv_cache_manager.stats()
        sch = self.scheduler
        return EngineStats(
            num_steps=sch.num_steps, num_waiting=sch.num_waiting, num_running=sch.num_running,
            num_finished=self._num_finished, kv_budget_tokens=kv.kv_budget_tokens, block_size=kv.block_size,
            num_blocks=kv.num_blocks, num_blocks_in_use=kv.num_in_use, num_cached_free_blocks=kv.num_cached_free,
            num_free_empty_blocks=kv.num_free_empty, kv_usage=kv.usage,
            prefix_cache_queries_tokens=kv.prefix_queries_tokens, prefix_cache_hits_tokens=kv.prefix_hits_tokens,
            evicted_blocks=kv.evicted_blocks, evicted_tokens=kv.evicted_tokens, num_preemptions=sch.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens, num_computed_tokens=self._num_computed_tokens,
            num_generated_tokens=self._num_generated_tokens, busy_time_s=self._busy,
            num_padding_tokens=sch.num_padding_tokens,
        )

    def _view(self, req: Request) -> RequestView:
        mgr = self.kv_cache_manager
        blocks: tuple[int, ...] = ()
        refs: tuple[int, ...] = ()
        if mgr.has_request(req.request_id):
            blocks = tuple(mgr.request(req.request_id).block_ids)
            refs = tuple(mgr.pool.blocks[b].ref_cnt for b in blocks)
        return RequestView(
            request_id=req.request_id, status=req.status.value, prompt=req.prompt,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            max_tokens=req.max_tokens, num_tokens=req.num_tokens, num_computed_tokens=req.num_computed_tokens,
            num_cached_tokens=req.metrics.num_cached_tokens, num_preemptions=req.metrics.num_preemptions,
            block_ids=blocks, block_refcounts=refs, text=req.text, finish_reason=req.finish_reason,
        )

    def snapshot(self) -> EngineSnapshot:
        """The whole engine state for a dashboard (O(blocks + requests); call between steps)."""
        mgr = self.kv_cache_manager
        sch = self.scheduler
        finished = [r for r in self.requests.values() if r.is_finished]
        return EngineSnapshot(
            step=sch.num_steps,
            waiting=tuple(self._view(r) for r in sch.waiting),
            running=tuple(self._view(r) for r in sch.running),
            finished=tuple(self._view(r) for r in finished),
            free_queue=tuple(mgr.free_queue()),
            block_refcounts=tuple(b.ref_cnt for b in mgr.pool.blocks),
            block_states=tuple(mgr.block_state(b.block_id).value for b in mgr.pool.blocks),
            stats=self.stats,
            last_step=self.history[-1] if self.history else None,
            static_batch=tuple(sch.static_batch),
        )

    def timeline(self) -> list[TimelineEntry]:
        """Per request and step (from ``history``): waiting / prefill / decode / preempted / finished.

        A request that is neither scheduled nor waiting in a step while unfinished is running but got no budget
        (a long prefill paused); it appears as ``"paused"``. Static padding (a finished member's discarded tokens)
        is not a request's work and is left out; ``SchedulerOutput.num_padding_tokens`` counts it per step.
        """
        out: list[TimelineEntry] = []
        for rec in self.history:
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
            for rid in plan.waiting:
                if rid not in seen:
                    out.append(TimelineEntry(rid, rec.step, "waiting"))
                    seen.add(rid)
            for rid in plan.running:
                if rid not in seen:
                    out.append(TimelineEntry(rid, rec.step, "paused"))
        return out

    def check_invariants(self) -> None:
        """Scheduler + KV manager invariants, and every request's (tests, notebooks)."""
        self.scheduler.check_invariants()
        for r in self.requests.values():
            r.check()

    def reset_prefix_cache(self) -> int:
        """Evict every cached-free block; return how many."""
        return self.kv_cache_manager.reset_prefix_cache()


def required_kv_tokens(prompt_lens: Sequence[int], max_tokens: int | Sequence[int], block_size: int) -> int:
    """KV token slots all requests would need at once, block-rounded: the 100 % the nothing-lost test takes 10 % of."""
    mts = [max_tokens] * len(prompt_lens) if isinstance(max_tokens, int) else list(max_tokens)
    return sum(cdiv(p + m, block_size) * block_size for p, m in zip(prompt_lens, mts))


__all__ = [
    "EngineSnapshot", "EngineStats", "InferenceEngine", "InvalidRequestError", "KVBudgetError", "RequestNotFoundError",
    "RequestOutput", "RequestStatus", "RequestView", "StepRecord", "TimelineEntry", "required_kv_tokens",
]

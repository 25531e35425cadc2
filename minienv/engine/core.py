"""``InferenceEngine``: model + tokenizer + KV cache manager + scheduler, driven one batched step at a time.

One step (vLLM's ``EngineCore.step``): ``scheduler.schedule()`` plans it; ONE batched ``model.forward_step`` runs
every scheduled token; ``scheduler.update_from_output`` commits the K/V; each sampling request gets a token, is
checked for its end, and its consumer is notified.

Invariants:

* **a step is a transaction**: if anything raises before it commits (the model, the stop button's
  ``KeyboardInterrupt``), ``scheduler.rollback`` returns every request to where it was and the exception
  propagates, so resuming gives each request the output it has alone. (Evictions and preemptions made while
  planning stand: both are valid states that change no output.) Bookkeeping runs with Ctrl-C deferred
  (:mod:`minienv.engine.interrupts`), so an interrupt never lands halfway through a refcount update;
* **a failure of one request finishes only it** (``finish_reason="error"``, its blocks freed): an undecodable
  token, a failing sampler, non-finite logits;
* **outputs are routed per consumer** (:mod:`minienv.engine.outputs`): ``step()``, each ``generate()`` call and
  each ``stream()`` iterator get every token of their own requests exactly once, in any interleaving;
* **memory is bounded**: a request is forgotten once its consumer has read its final output (the last
  ``finished_retention`` are kept for look-ups), and ``history`` is a ring of ``history_size`` step records.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from minienv.engine.inputs import build_step_inputs
from minienv.engine.interrupts import CtrlC
from minienv.engine.observe import (EngineSnapshot, EngineStats, StepRecord, TimelineEntry, engine_snapshot,
                                    engine_stats, timeline)
from minienv.engine.outputs import (Consumer, IncrementalDetokenizer, OutputRouter, RequestOutput, append_token,
                                    make_output)
from minienv.engine.validation import validate_batch, validate_request
from minienv.kv.block_table import cdiv
from minienv.kv.interface import KVEvent, KVManager
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.kv.kv_pool import KVPool, num_blocks_for_budget
from minienv.kv.paged_attention import PagedAttentionBackend
from minienv.kv_tier import KVTierConnector
from minienv.request import FinishReason, InvalidRequestError, Request, RequestMetrics, RequestNotFoundError
from minienv.sampling import SamplingParams
from minienv.scheduler import SchedulingPolicy, VictimPolicy, make_scheduler
from minienv.spec_decode import SpeculativeConfig, Speculator

Prompts = "str | Sequence[int] | Sequence[str | Sequence[int]]"


#: default KV budget of a real model given by name or path: SmolLM2-135M keeps 45 KiB of float32 K/V per token, so
#: the toy's 8192-token default would preallocate 377 MB; 2048 tokens (94 MB) holds a few conversations
PRETRAINED_KV_BUDGET_TOKENS = 2048


@dataclass
class EngineCounters:
    """Running totals the engine keeps itself (the KV manager and the scheduler count the rest)."""

    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    errors: int = 0
    failed_steps: int = 0
    busy_s: float = 0.0
    peak_blocks_in_use: int = 0  # after a step; a counter, so it covers runs longer than ``history``


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


class InferenceEngine:
    """A continuous-batching engine over a paged, prefix-cached KV pool of ``kv_budget_tokens`` tokens.

    Parameters
    ----------
    model, tokenizer:
        A :class:`~minienv.model.LlamaModel` and a tokenizer (``encode`` / ``decode`` / ``eos_token_id``); ``None``
        loads the bundled ones. ``model`` may also name a real model (``"smollm2-135m-instruct"``, downloaded once
        into the user cache), a path to a Llama ``.gguf`` file or Hugging Face folder, or an already loaded
        :class:`~minienv.model.pretrained.Pretrained` (engines sharing one copy of the weights): it then brings its own
        tokenizer and chat template (:meth:`chat`), and ``kv_budget_tokens`` defaults to
        ``PRETRAINED_KV_BUDGET_TOKENS`` instead of 8192. A tokenizer smaller than the model's (padded) vocabulary is fine: logits past its
        last id are masked, so the engine never samples an id it cannot decode. A larger one is refused.
    kv_budget_tokens, block_size:
        Token slots of KV for all requests: ``kv_budget_tokens // block_size`` blocks, preallocated.
        ``engine.kv_budget_tokens`` reports the budget rounded down to whole blocks.
    enable_prefix_caching:
        Reuse the K/V of full blocks computed before (and keep freed ones, LRU-evicted).
    max_num_seqs, max_num_batched_tokens:
        Most requests running at once; most tokens computed in one step (``>= max_num_seqs``).
    scheduling, static_padding:
        ``"continuous"`` or ``"static"`` (the baseline); for ``"static"``, whether finished members keep computing
        a discarded token until their batch ends, as a padded batch does (default True).
    victim_policy:
        Which request to preempt when a running one gets no block (default: the most recently admitted).
    step_planner:
        ``(needs, budget) -> tokens each computes``: how a step's token budget is split over the running requests'
        prefill chunks (default: the scheduler's rule, decodes first; notebook 07's Exercise 2, used by 14).
    history_size, finished_retention:
        Step records kept in ``history`` (a ring; 0 = none); finished requests remembered after their consumer read
        them (for ``output(id)`` and ``snapshot()``).
    kv_tier:
        A persistent KV tier under the pool (:mod:`minienv.kv_tier`): a directory (embedded SQLite store), a
        ``redis://`` URL, or a store object. Full committed blocks are saved there and loaded at admission instead
        of recomputed; ``engine.kv_tier.stats`` counts. None (default): no tier.
    speculative_config:
        ``{"method": "draft" | "ngram", "num_speculative_tokens": k, ...}`` (or a
        :class:`~minienv.spec_decode.SpeculativeConfig`) turns on speculative decoding; ``None`` (default) is off.
    kv_cache_manager_factory:
        ``factory(num_blocks, block_size, enable_prefix_caching) -> manager``, called once instead of
        ``KVCacheManager(...)``: the seam through which a different manager (the capstone's, a lab's) runs in the
        real engine: it implements the :class:`~minienv.kv.interface.KVManager` protocol. ``None`` (default):
        minienv's own :class:`KVCacheManager`.
    attention_kernel:
        ``"auto"`` (the numba block walk when numba is installed, else numpy), ``"numpy"`` or ``"numba"``
        (:mod:`minienv.kv.paged_attention`).
    """

    def __init__(self, model: Any = None, tokenizer: Any = None, *, kv_budget_tokens: int | None = None,
                 block_size: int = 16, enable_prefix_caching: bool = True, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, scheduling: SchedulingPolicy = "continuous",
                 victim_policy: VictimPolicy | None = None, static_padding: bool = True, history_size: int = 256,
                 finished_retention: int = 256, kv_tier: Any = None, speculative_config: Any = None,
                 kv_cache_manager_factory: Callable[[int, int, bool], KVManager] | None = None,
                 attention_kernel: str = "auto",
                 step_planner: Callable[[list[int], int], Sequence[int]] | None = None):
        if kv_cache_manager_factory is not None and not callable(kv_cache_manager_factory):
            raise ValueError("kv_cache_manager_factory must be a callable (num_blocks, block_size, "
                             f"enable_prefix_caching) -> manager, got {type(kv_cache_manager_factory).__name__}")
        for name, flag in (("enable_prefix_caching", enable_prefix_caching), ("static_padding", static_padding)):
            if not isinstance(flag, (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        history_size = _check_count("history_size", history_size)
        self.finished_retention = _check_count("finished_retention", finished_retention)
        #: the model's chat template (:meth:`chat`), None for the bundled toy; the name servers report
        self.chat_template: Any = None
        self.model_name = "minienv-bundled"
        from minienv.model.pretrained import Pretrained
        if isinstance(model, (str, os.PathLike, Pretrained)):  # a real model by name, .gguf path or HF folder
            if tokenizer is not None:
                raise ValueError("a model given by name or path brings its own tokenizer: pass tokenizer=None")
            from minienv.model.pretrained import load_pretrained
            pre = model if isinstance(model, Pretrained) else load_pretrained(model)
            model, tokenizer = pre.model, pre.tokenizer
            self.chat_template, self.model_name = pre.chat_template, pre.name
            if kv_budget_tokens is None:
                kv_budget_tokens = PRETRAINED_KV_BUDGET_TOKENS
        if kv_budget_tokens is None:
            kv_budget_tokens = 8192
        if model is None:
            from minienv.model import load_model
            model = load_model()
        if tokenizer is None:
            from minienv.tokenizer import load_tokenizer
            tokenizer = load_tokenizer()
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None and vocab > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {vocab} ids but the model only {model.config.vocab_size}: "
                             "it would encode ids the model has no embedding for")
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        #: sampled ids stop here: past the tokenizer's vocabulary a padded model's logits mean nothing
        self.num_sampled_ids = int(vocab if vocab is not None else model.config.vocab_size)
        num_blocks = num_blocks_for_budget(kv_budget_tokens, block_size)  # KVBudgetError below one block
        self.block_size = int(block_size)
        self.kv_pool = KVPool.for_model(model.config, num_blocks * self.block_size, self.block_size)
        if kv_cache_manager_factory is None:
            self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size,
                                                   enable_prefix_caching=bool(enable_prefix_caching))
        else:
            self.kv_cache_manager = kv_cache_manager_factory(num_blocks, self.block_size, bool(enable_prefix_caching))
        self.kv_tier = None if kv_tier is None else KVTierConnector(kv_tier, model=model, kv_pool=self.kv_pool)
        self.scheduler = make_scheduler(
            self.kv_cache_manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            scheduling=scheduling, victim_policy=victim_policy, step_planner=step_planner,
            static_padding=bool(static_padding),
            max_position=model.config.max_position_embeddings, kv_tier=self.kv_tier)
        self.backend = PagedAttentionBackend(self.kv_pool, kernel=attention_kernel)
        spec = SpeculativeConfig.coerce(speculative_config)
        if spec is not None and scheduling != "continuous":
            raise ValueError("speculative decoding needs scheduling='continuous' (the static baseline does not "
                             "speculate)")
        #: speculative decoding (None: off): proposes drafts after each step, verifies them in the next
        self.speculator: Speculator | None = None if spec is None else Speculator(
            spec, target_model=model, tokenizer=tokenizer, block_size=self.block_size,
            kv_budget_tokens=self.kv_budget_tokens, num_sampled_ids=self.num_sampled_ids,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens)
        self.history: deque[StepRecord] = deque(maxlen=history_size)
        self.requests: dict[str, Request] = {}  # unfinished, or finished with the final output unread
        self.retained: OrderedDict[str, Request] = OrderedDict()  # finished and read, most recent last
        self.counters = EngineCounters()
        self.router = OutputRouter()
        self._step_consumer = Consumer("step")
        self._ids = itertools.count()
        self._step_listeners: list[Callable[[StepRecord], None]] = []
        self._finish_listeners: list[Callable[[Request], None]] = []
        self._kv_events: list[KVEvent] = []
        self._ctrl_c = CtrlC()  # Ctrl-C waits for the end of the bookkeeping (minienv.engine.interrupts)
        if history_size:
            self.kv_cache_manager.add_listener(self._kv_events.append)

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
        charitable = not getattr(self.scheduler, "static_padding", True)
        return (f"InferenceEngine(kv_budget_tokens={self.kv_budget_tokens}, block_size={self.block_size}, "
                f"max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens}, "
                f"scheduling={self.scheduling!r}{', static_padding=False' if charitable else ''}, prefix_caching="
                f"{'on' if self.kv_cache_manager.enable_prefix_caching else 'off'})")

    # ------------------------------------------------------------------ requests in
    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None) -> str:
        """Validate and queue one request (its outputs come out of :meth:`step`); return its id. A bad request
        raises :class:`InvalidRequestError` and changes nothing."""
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}")
            if request_id in self.requests or request_id in self.retained:
                raise InvalidRequestError(f"request id {request_id!r} is already used")
        ids, text, params = validate_request(self, prompt, sampling_params)
        return self._add(ids, text, params, request_id, self._step_consumer)

    def _add(self, ids: list[int], text: str | None, params: SamplingParams, request_id: str | None,
             consumer: Consumer) -> str:
        while request_id is None or request_id in self.requests or request_id in self.retained:
            request_id = str(next(self._ids))
        req = Request(request_id, ids, params, RequestMetrics(time.perf_counter(), self.scheduler.num_steps),
                      prompt=text)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self.requests[request_id] = req
        self.router.attach(req, consumer)
        self.scheduler.add_request(req)
        return request_id

    def abort(self, request_id: str) -> RequestOutput:
        """Stop an unfinished request now (it leaves its queue, its blocks are freed); return its final output.

        For a request of :meth:`add_request` that *is* its delivery (``step()`` will not repeat it); a
        ``generate`` / ``stream`` request is still delivered there, and the returned output is only a look.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request ids are str, got {request_id!r} ({type(request_id).__name__})")
        if request_id not in self.scheduler.requests:
            raise RequestNotFoundError(request_id)
        req = self.requests[request_id]
        with self._ctrl_c.handling(), self._ctrl_c.deferred():
            self._finish(req, "abort", time.perf_counter(), self.scheduler.num_steps)
            if req.consumer is not self._step_consumer:
                return make_output(req, advance=False)
            del self._step_consumer.pending[request_id]
            self._step_consumer.live.pop(request_id, None)
            out = make_output(req, advance=True)
            self._release(req)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ consumers
    def step(self) -> list[RequestOutput]:
        """Run one step; return the new outputs of :meth:`add_request` requests (including progress made while
        another consumer drove the engine, and finals of aborted requests)."""
        self._engine_step()
        return self._deliver(self._step_consumer)

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt together; one finished output per prompt, in order.

        ``prompts``: strings and/or token-id sequences (or a single one); ``sampling_params``: one for all, or one
        per prompt. All are validated before anything is queued (a bad one raises :class:`InvalidRequestError`
        whose ``index`` names it). If a step raises, the requests stay, handed to the ``step()`` consumer.
        """
        consumer = Consumer("generate")
        ids = [self._add(tok, text, sp, None, consumer) for tok, text, sp in validate_batch(
            self, prompts, sampling_params)]
        unfinished = [self.requests[i] for i in ids]
        seen = -1  # the engine's finished count when ``unfinished`` was last filtered
        try:
            with self._ctrl_c.handling():  # once for the whole call, not per step
                while unfinished:
                    if seen != self.counters.finished:  # every finish (in a step, or an abort) counts in _finish
                        seen = self.counters.finished
                        unfinished = [r for r in unfinished if not r.is_finished]
                        if not unfinished:
                            break
                    self._engine_step()
        except BaseException:
            self.router.adopt(consumer, self._step_consumer)
            raise
        consumer.pending.clear()
        outs = [make_output(self.requests[i], advance=True) for i in ids]
        for i in ids:
            self._release(self.requests[i])
        return outs

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or a list of them, each
        rendered with the model's chat template (which opens the assistant's turn) and generated together; one
        finished :class:`RequestOutput` per conversation, in order. Generation ends at the template's end-of-turn
        token (the tokenizer's ``eos_token_id``). A malformed conversation raises :class:`InvalidRequestError`
        naming it, and nothing is queued."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template (the bundled toy continues text: use "
                                      "generate); load a chat model, e.g. InferenceEngine(model="
                                      "'smollm2-135m-instruct')")
        one = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if isinstance(conversations, (str, bytes, dict)) or not isinstance(conversations, (list, tuple)) \
                or not conversations:
            raise InvalidRequestError("chat() takes a conversation (a list of {'role', 'content'} dicts) or a "
                                      f"non-empty list of them, got {type(messages).__name__}")
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                prompts.append(self.chat_template.render(conv))
            except ValueError as exc:
                raise InvalidRequestError(str(exc), index=None if one else i) from exc
        return self.generate(prompts, sampling_params)

    def stream(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               ) -> Iterator[RequestOutput]:
        """Queue the prompts now (validated like :meth:`generate`); return an iterator of incremental outputs.

        Each carries ``delta_text`` / ``delta_token_ids`` (new since that request's previous output) and the
        cumulative ``text``; the last per request has ``finished=True``. Closing the iterator early aborts the
        requests it still owns; if a step raises, they are handed to the ``step()`` consumer instead.
        """
        consumer = Consumer("stream")
        for tok, text, sp in validate_batch(self, prompts, sampling_params):
            self._add(tok, text, sp, None, consumer)
        return self._stream(consumer)

    def _stream(self, consumer: Consumer) -> Iterator[RequestOutput]:
        try:
            while consumer.live:
                outs = self._deliver(consumer)
                if outs:
                    yield from outs
                elif consumer.live:
                    self._engine_step()
        except GeneratorExit:
            for req in list(consumer.live.values()):
                if not req.is_finished:
                    self._finish(req, "abort", time.perf_counter(), self.scheduler.num_steps)
                self._release(req)
            consumer.live.clear()
            raise
        except BaseException:
            self.router.adopt(consumer, self._step_consumer)
            raise

    def run(self, max_steps: int | None = None) -> int:
        """Step until every request has finished (or ``max_steps``); return the steps run. Final outputs of
        :meth:`add_request` requests are read with :meth:`output`."""
        n = 0
        with self._ctrl_c.handling():  # once for the whole run, not per step
            while self.scheduler.has_unfinished_requests() and (max_steps is None or n < max_steps):
                self._engine_step()
                n += 1
        self._deliver(self._step_consumer)
        return n

    def output(self, request_id: str) -> RequestOutput:
        """The current output of a live or retained request: a look that changes no consumer's deltas."""
        req = self.requests.get(request_id) or self.retained.get(request_id)
        if req is None:
            raise RequestNotFoundError(request_id, "report")
        return make_output(req, advance=False)

    def _deliver(self, consumer: Consumer) -> list[RequestOutput]:
        outs, done = self.router.drain(consumer)
        for req in done:
            self._release(req)
        return outs

    def _release(self, req: Request) -> None:
        """Forget a finished request whose consumer has read its final output (keep the last few for look-ups)."""
        self.requests.pop(req.request_id, None)
        req.detokenizer = req.consumer = None
        if self.finished_retention:
            self.retained[req.request_id] = req
            while len(self.retained) > self.finished_retention:
                self.retained.popitem(last=False)

    # ------------------------------------------------------------------ the step
    def _engine_step(self) -> None:
        """One step, with Ctrl-C handled (:mod:`minienv.engine.interrupts`)."""
        if self.scheduler.has_unfinished_requests():
            with self._ctrl_c.handling():  # a no-op inside run() / generate(), which installed it once
                self._step_transaction()

    def _step_transaction(self) -> None:
        """One transactional step (see the module docstring)."""
        sch = self.scheduler
        t0 = time.perf_counter()
        self._kv_events.clear()
        plan = inputs = None
        ctrl_c = self._ctrl_c
        try:
            with ctrl_c.deferred():  # bookkeeping: a Ctrl-C waits for its end (then the plan is rolled back)
                plan = sch.schedule()  # rolls itself back if it raises
            # the model call: a Ctrl-C lands at once, and the step is rolled back
            if plan.is_empty:  # validation guarantees a lone request always fits
                raise RuntimeError(f"engine step {plan.step} scheduled nothing with requests pending: {plan}")
            inputs = build_step_inputs(plan, self.kv_cache_manager, self.kv_pool)
            self.backend.set_metadata(inputs.metadata)
            logits = self.model.forward_step(inputs.token_ids, inputs.metadata.positions, self.backend,
                                             logits_indices=inputs.logits_indices)
        except BaseException:
            if plan is not None:
                with ctrl_c.deferred():
                    sch.rollback(plan, kv_written=inputs is not None)  # inputs built: copies applied
                    self.counters.failed_steps += 1
            raise
        with ctrl_c.deferred():
            self._commit(plan, [plan.scheduled[i] for i in inputs.sampling], inputs.num_logits, logits, t0,
                         len(inputs.token_ids))

    def _commit(self, plan, sampling, num_logits: list[int], logits: np.ndarray, t0: float,
                num_tokens: int) -> None:
        """After the model call: sample (verify drafts), commit the K/V, append, finish; record the step.
        ``num_tokens``: the tokens the model computed (``plan.num_scheduled_tokens``, which sums the plan)."""
        reqs = [self.requests[s.request_id] for s in sampling]
        if self.speculator is not None:
            self.speculator.last_results.clear()
        plain = len(num_logits) == sum(num_logits)  # no drafts in this step
        if plain and self.speculator is not None:  # a speculating engine samples with its coupled draws (_verify)
            plain = not any([req.sampling_params.temperature for req in reqs])
        if plain:
            tokens, errors = self._sample(reqs, logits[:len(reqs)])
            emitted = [[t] for t in tokens]
            rejected: dict[str, int] = {}
        else:
            emitted, errors, rejected = self._verify(sampling, reqs, num_logits, logits)
        self.scheduler.update_from_output(plan, rejected)  # rejected drafts are truncated before the commit
        if self.kv_tier is not None:  # newly full, committed (verified) blocks go to the persistent tier
            self.kv_tier.save_committed(plan, self.kv_cache_manager, self.scheduler.requests)
        c = self.counters
        c.computed_tokens += num_tokens
        for s in plan.scheduled if plan.admitted else ():  # is_new: exactly the requests admitted in this step
            if s.is_new and not s.is_resume:
                req = self.requests[s.request_id]
                c.prompt_tokens += req.num_prompt_tokens
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time, req.metrics.first_scheduled_step = t0, plan.step
        now = time.perf_counter()
        done_step = plan.step + 1  # the step count at which the token exists
        sampled: dict[str, int] = {}
        finished: dict[str, FinishReason] = {}
        eos, notify = self.eos_token_id, self.router.notify
        for req, toks, err in zip(reqs, emitted, errors, strict=True):
            reason: FinishReason | None = "error" if err else None
            if err is None:
                sampled[req.request_id] = toks[-1]
                first = req.metrics.first_token_time is None
                for tok in toks:  # one token, or the verified run of a speculative decode
                    try:
                        reason = append_token(req, tok, eos)
                    except Exception as exc:  # noqa: BLE001 - the tokenizer failed on this request's token
                        reason, err = "error", f"could not detokenize token {tok}: {type(exc).__name__}: {exc}"
                        break
                    if first:  # TTFT: only a request that did receive a token has one
                        req.metrics.first_token_time, req.metrics.first_token_step, first = now, done_step, False
                    c.generated_tokens += reason != "eos"
                    if reason is not None:
                        break  # a stop inside the run: the tokens after it are dropped
            if reason is not None:
                self._finish(req, reason, now, done_step, err)
                finished[req.request_id] = reason
            else:
                notify(req)
        kv_stats = self.kv_cache_manager.stats()
        c.peak_blocks_in_use = max(c.peak_blocks_in_use, kv_stats.num_in_use)
        interrupted: BaseException | None = None
        if self.speculator is not None:
            # NOTE: the drafts are for the NEXT step, and this step is already committed: a failing proposer is
            # rolled back by the speculator (no drafts, no draft KV of the batch), this step still gets its one
            # record, and the next step decodes plainly — the text does not change (coupled draws). An exception
            # of the proposer is counted and warned about once; a KeyboardInterrupt / SystemExit is raised once
            # the step is recorded, as a Ctrl-C that arrives during the bookkeeping is.
            try:
                self._propose(plan)
            except Exception as exc:  # noqa: BLE001 - speculation only saves time; the step stands without it
                if self.speculator.stats.num_failed_proposals == 1:
                    warnings.warn(f"speculative proposer failed ({type(exc).__name__}: {exc}); those requests decode "
                                  "without drafts this step (counted in speculator.stats.num_failed_proposals)",
                                  RuntimeWarning, stacklevel=4)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the step's record
                interrupted = exc
        c.busy_s += time.perf_counter() - t0
        if self.history.maxlen or self._step_listeners:
            record = StepRecord(plan.step, plan, sampled, finished, tuple(self._kv_events),
                                engine_stats(self, kv_stats), time.perf_counter() - t0, now)
            self.history.append(record)
            for listener in self._step_listeners:
                listener(record)
        if interrupted is not None:
            raise interrupted

    def _verify(self, sampling, reqs: list[Request], num_logits: list[int], logits: np.ndarray):
        """Speculative decoding: each request's rows -> the verified run of tokens it appends, and its rejections.

        A greedy request without drafts this step takes exactly the plain path (:meth:`_sample`); a sampled one is
        verified with no drafts, so every token of a sampled request in a speculating engine comes from the same
        (seed, position) draws whether or not it was speculated. A row block with a non-finite entry finishes its
        request with an error, as there.
        """
        assert self.speculator is not None
        emitted: list[list[int]] = []
        errors: list[str | None] = []
        rejected: dict[str, int] = {}
        offsets = np.cumsum([0] + num_logits)
        for s, req, lo, hi in zip(sampling, reqs, offsets[:-1], offsets[1:], strict=True):
            rows = logits[lo:hi]
            if s.num_spec_tokens == 0 and req.sampling_params.greedy:
                (tok,), (err,) = self._sample([req], rows)
                emitted.append([tok] if err is None else [])
                errors.append(err)
                continue
            drafts = list(s.token_ids[len(s.token_ids) - s.num_spec_tokens:])
            err = None if np.isfinite(rows).all() else \
                "the model produced non-finite logits (NaN or inf) for this request"
            if err is None:
                try:
                    result = self.speculator.verify(req, drafts, rows)
                except Exception as exc:  # noqa: BLE001 - belongs to this request's sampling parameters
                    err = f"sampling failed: {type(exc).__name__}: {exc}"
            emitted.append([] if err else result.token_ids)
            errors.append(err)
            if err is None and result.num_accepted < len(drafts):
                rejected[req.request_id] = len(drafts) - result.num_accepted
        return emitted, errors, rejected

    def _propose(self, plan) -> None:
        """Drafts for every running request that decodes next step; preempted ones let go of theirs."""
        spec = self.speculator
        assert spec is not None
        for rid in plan.preempted:
            spec.free(rid)
        ready = []
        for r in self.scheduler.running:
            if r.num_computed_tokens == r.num_tokens - 1:
                ready.append(r)
            else:
                r.spec_token_ids, r.spec_probs = [], None
        spec.propose(ready)

    _NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"

    def _sample(self, reqs: list[Request], logits: np.ndarray) -> tuple[list[int], list[str | None]]:
        """One token per request (greedy rows in one argmax), or an error message for a row that is not finite or
        whose sampler fails: that request alone finishes with the error."""
        finite = np.isfinite(logits).all(axis=-1).tolist()
        if logits.shape[-1] > self.num_sampled_ids:  # a padded vocabulary: never pick an id without a token
            logits = logits.copy()
            logits[:, self.num_sampled_ids:] = -np.inf
        argmax = logits.argmax(axis=-1).tolist() if len(reqs) else []
        tokens: list[int] = [0] * len(reqs)
        errors: list[str | None] = [None] * len(reqs)
        for k, req in enumerate(reqs):
            if not finite[k]:
                errors[k] = self._NON_FINITE
            elif req.sampling_params.greedy:
                tokens[k] = argmax[k]
            else:
                try:
                    tokens[k] = int(req.sampler.sample(logits[k]))
                except Exception as exc:  # noqa: BLE001 - belongs to this request's sampling parameters
                    errors[k] = f"sampling failed: {type(exc).__name__}: {exc}"
        return tokens, errors

    def _finish(self, req: Request, reason: FinishReason, now: float, step: int, error: str | None = None) -> None:
        """End a request: out of the scheduler (which frees its blocks, or keeps them as static padding), owner
        notified."""
        self.scheduler.finish_request(req.request_id, reason)
        if self.speculator is not None:
            self.speculator.free(req.request_id)
        if self.kv_tier is not None:  # a request id names one instance: nothing staged survives it
            self.kv_tier.forget(req.request_id)
        req.finish(reason, now, step, error)
        self.counters.finished += 1
        self.counters.errors += reason == "error"
        self.router.notify(req)
        for listener in self._finish_listeners:
            listener(req)

    # ------------------------------------------------------------------ observation
    def add_step_listener(self, listener: Callable[[StepRecord], None]) -> None:
        """Call ``listener(record)`` after every step (live dashboards, metrics), whatever ``history_size`` is."""
        if not self._step_listeners and not self.history.maxlen:
            self.kv_cache_manager.add_listener(self._kv_events.append)
        self._step_listeners.append(listener)

    def add_finish_listener(self, listener: Callable[[Request], None]) -> None:
        """Call ``listener(request)`` when a request finishes, in a step or by an abort between steps (metrics)."""
        self._finish_listeners.append(listener)

    @property
    def stats(self) -> EngineStats:
        return engine_stats(self, self.kv_cache_manager.stats())

    def snapshot(self) -> EngineSnapshot:
        """The whole engine state for a dashboard (O(blocks + requests); call between steps)."""
        return engine_snapshot(self)

    def timeline(self) -> list[TimelineEntry]:
        """Per request and step, from ``history``: waiting / prefill / decode / preempted / paused / finished."""
        return timeline(self.history)

    def check_invariants(self) -> None:
        """Scheduler, KV manager, request and routing invariants (tests, notebooks)."""
        self.scheduler.check_invariants()
        for rid, r in self.requests.items():
            r.check()
            assert r.consumer is not None and (rid in r.consumer.live or r.is_finished), rid
            assert 0 <= r.delivered_tokens <= r.num_output_tokens, rid
            assert r.is_finished or rid in self.scheduler.requests, rid
        assert len(self.retained) <= self.finished_retention

    def reset_prefix_cache(self) -> int:
        """Evict every cached-free block; return how many."""
        return self.kv_cache_manager.reset_prefix_cache()


def required_kv_tokens(prompt_lens: Sequence[int], max_tokens: int | Sequence[int], block_size: int) -> int:
    """KV token slots all requests would need at once, block-rounded: the 100 % a tight test takes 10 % of."""
    mts = [max_tokens] * len(prompt_lens) if isinstance(max_tokens, int) else list(max_tokens)
    return sum(cdiv(p + m, block_size) * block_size for p, m in zip(prompt_lens, mts, strict=True))

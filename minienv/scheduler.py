"""The scheduler: which requests run in the next step, how many tokens each computes, and who is preempted.

It owns the waiting queue (FIFO; a preempted request re-enters at the front) and the running list (admission
order), and is the only caller of the KV manager's ``lookup`` / ``allocate`` / ``append_slots`` / ``commit`` /
``free`` for requests (the :class:`~minienv.kv.interface.KVManager` protocol: minienv's manager, the capstone's
and the labs' all run here the same way). Each :meth:`Scheduler.schedule` returns one :class:`SchedulerOutput`,
the plan of one batched model call.

:class:`Scheduler` is continuous batching (vLLM v1's ``Scheduler.schedule``). One step:

1. **Running requests first**, oldest first: a decode computes 1 token, a prefill (a long prompt, a resume) its
   next chunk — the budget left minus one token per decode still to come, so a long prefill never starves decodes.
2. **Preemption by recompute**: a running request that gets no block (``append_slots`` returns None) makes a
   victim — ``victim_policy`` over the requests not yet scheduled this step, the asking one first; by default the
   most recently admitted. The victim frees its KV (full blocks stay cached-free, so its resume is mostly prefix
   hits) and goes to the front of the waiting queue with its tokens and sampler. Repeat until the block is granted
   or the request was the victim itself.
3. **Admission**, unless the step preempted (memory is tight): while budget and ``max_num_seqs`` allow, the head
   of the queue takes its prefix hit and slots for its first chunk; if they do not fit it waits, and nobody
   overtakes it (FCFS).

:class:`StaticBatchScheduler` is the baseline continuous batching is measured against.

Why every request finishes: the oldest running request can always get its block (every other block is free,
cached-free or held by a younger, preemptible request, and the engine refuses a request that could not fit the
budget alone), so the oldest finishes, and by induction all do.

State is owned once: a request's tokens and ``num_computed_tokens`` live in its :class:`~minienv.request.Request`
(the scheduler advances them; the manager reads them), the block tables in the manager.

Invariants (``check_invariants``): between steps a running request holds exactly ``num_computed_tokens`` reserved
KV slots; a waiting one holds none; ``len(running) <= max_num_seqs``; a step schedules
``<= max_num_batched_tokens`` tokens.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import numpy as np

from minienv.kv.interface import KVManager, SlotAllocation
from minienv.request import FinishReason, Request, RequestNotFoundError, RequestStatus

SchedulingPolicy = Literal["continuous", "static"]
StepKind = Literal["prefill", "decode", "padding"]
#: Picks the preemption victim among candidates (oldest first; ``candidates[0]`` is the request that needs a block).
VictimPolicy = Callable[[Sequence[Request]], Request]
#: ``planner(needs, budget) -> tokens each computes``: how a step's token budget is split over the running requests
#: not yet scheduled in it (``needs``: what each still has to compute, 1 for a decode, in running order). None:
#: the scheduler's own rule (decodes reserved first, prefill chunks take the rest in order: notebook 07's Exercise 2)
StepPlanner = Callable[[list[int], int], Sequence[int]]


def most_recently_admitted(candidates: Sequence[Request]) -> Request:
    """vLLM's rule: preempt the request admitted last (it has the least work to lose, in a FCFS world)."""
    return candidates[-1]


@dataclass(slots=True)  # one per request per step: a plain record (a frozen __init__ costs twice as much)
class ScheduledRequest:
    """One request's part of a step: positions ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.

    ``kind``: ``"decode"`` (one token after the prompt), ``"prefill"`` (a chunk of a prompt or of a resume) or
    ``"padding"`` (a finished static-batch member's discarded token). ``samples``: the chunk reaches the last known
    token, so its logits give a new token. ``num_cached_tokens``: the prefix hit of an admission in this step.
    """

    request_id: str
    kind: StepKind
    num_new_tokens: int
    num_computed_tokens: int
    samples: bool
    is_new: bool = False  # admitted (or re-admitted after preemption) in this step
    is_resume: bool = False  # re-admitted after a preemption
    num_cached_tokens: int = 0
    #: the step's input tokens for this request, taken from the request (``all_token_ids`` slice + its drafts)
    token_ids: tuple[int, ...] = field(default=(), repr=False)
    #: copy-on-write copies ``(src, dst)`` the KV pool's owner applies before this step writes
    blocks_to_copy: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    #: speculative decoding: the last ``num_spec_tokens`` of ``token_ids`` are drafts to verify (a decode only)
    num_spec_tokens: int = 0


@dataclass
class SchedulerOutput:
    """The plan of one engine step (vLLM: ``SchedulerOutput``), in batch order: the model's input is the scheduled
    chunks concatenated. ``waiting`` / ``running`` are the queues' ids *after* scheduling (for timelines)."""

    step: int
    scheduled: list[ScheduledRequest]
    preempted: list[str]
    admitted: list[str]
    waiting: list[str]
    running: list[str]
    max_num_batched_tokens: int
    scheduling: SchedulingPolicy = "continuous"

    def _tokens(self, *kinds: StepKind) -> int:
        if not kinds:
            return sum([s.num_new_tokens for s in self.scheduled])
        return sum([s.num_new_tokens for s in self.scheduled if s.kind in kinds])

    @property
    def num_scheduled_tokens(self) -> int:
        return self._tokens()

    @property
    def num_prefill_tokens(self) -> int:
        return self._tokens("prefill")

    @property
    def num_decode_tokens(self) -> int:
        return self._tokens("decode")

    @property
    def num_padding_tokens(self) -> int:
        """Tokens computed and thrown away (static padding)."""
        return self._tokens("padding")

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def by_id(self) -> dict[str, ScheduledRequest]:
        return {s.request_id: s for s in self.scheduled}


class Scheduler:
    """Continuous batching over one :class:`KVManager`; the policy is the module docstring's.

    The engine drives it: ``add_request`` (validated), then per step ``schedule()`` -> model ->
    ``update_from_output(plan)`` (or ``rollback(plan)`` if the step failed) -> ``finish_request`` for those that ended.
    """

    scheduling: SchedulingPolicy = "continuous"

    def __init__(self, kv_cache_manager: KVManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 victim_policy: VictimPolicy = most_recently_admitted, kv_tier: Any = None,
                 step_planner: StepPlanner | None = None):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running request must be able to decode one token per step")
        self.kv = kv_cache_manager
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.victim_policy = victim_policy
        if step_planner is not None and not callable(step_planner):
            raise ValueError(f"step_planner must be a callable (needs, budget) -> tokens per request, got "
                             f"{type(step_planner).__name__}")
        self.step_planner = step_planner
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the default victim
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.num_steps = 0
        self.num_preemptions = 0
        #: a persistent KV tier connector (:class:`minienv.kv_tier.KVTierConnector`) or None: admissions read
        #: blocks beyond the local prefix hit from it
        self.kv_tier = kv_tier

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Plan the next step. If planning raises (a failing ``victim_policy``), its reservations are rolled back."""
        out = SchedulerOutput(self.num_steps, [], [], [], [], [], self.max_num_batched_tokens, self.scheduling)
        self.num_steps += 1
        try:
            self._plan(out)
        except BaseException:
            self.rollback(out, kv_written=False)
            raise
        out.waiting = [r.request_id for r in self.waiting]
        out.running = [r.request_id for r in self.running]
        return out

    def rollback(self, plan: SchedulerOutput, *, kv_written: bool = True) -> None:
        """Undo the latest plan, whose step failed before it committed: every scheduled request back where it was.

        Reserved slots are given back (freed blocks return to the head of the free queue, where they were taken),
        copy-on-writes are undone where the original's K/V are intact, admitted requests return to the head of the
        waiting queue in order, the step count and the prefix-cache counters are restored. Preemptions stand: a
        preempted request is a valid waiting one with the same output. ``kv_written``: the step applied its copies
        and called the model (False when planning or building the inputs failed).
        """
        for s in reversed(plan.scheduled):
            req = self.requests.get(s.request_id)
            if s.is_new and req is not None:
                self.kv.undo_allocate(s.request_id)  # its blocks back where they were in the free queue
                self.running.remove(req)
                req.status = RequestStatus.PREEMPTED if s.is_resume else RequestStatus.WAITING
                req.num_computed_tokens = 0
                if req.metrics.first_scheduled_step is None:
                    req.metrics.num_cached_tokens = 0  # set by this (undone) first admission
                self.waiting.appendleft(req)
            else:  # a running request's chunk or decode (or a padding token)
                self.kv.undo_append_slots(s.request_id, s.num_computed_tokens, kv_written=kv_written)
        self.num_steps = plan.step

    def _plan(self, out: SchedulerOutput) -> None:
        budget = self._schedule_running(out)
        if not out.preempted:
            self._admit(out, budget)

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Step 1 and 2 of the module docstring; returns the token budget left."""
        budget = self.max_num_batched_tokens
        i = 0
        decodes_after = sum([not r.is_prefilling for r in self.running])  # budget kept for later decodes
        while i < len(self.running):
            req = self.running[i]
            spec: list[int] = []
            if req.num_tokens_to_compute == 1:
                decodes_after -= 1
                n = 1
                if req.spec_token_ids:  # drafts ride along when the budget has room beyond the decodes to come
                    spec = req.spec_token_ids[:max(0, budget - decodes_after - 1)]
            else:
                n = (min(req.num_tokens_to_compute, budget - decodes_after) if self.step_planner is None
                     else self._planned_chunk(i, budget))
                if n <= 0:  # no budget for this prefill chunk this step; it keeps its blocks
                    i += 1
                    continue
            start = req.num_computed_tokens
            while (alloc := self.kv.append_slots(req, n + len(spec))) is None:
                if spec:  # no room for the drafts: decode plainly before anyone is preempted
                    spec = []
                    continue
                if self._reclaim():
                    continue
                candidates = self.running[i:]  # not yet scheduled in this step; req first
                victim = self.victim_policy(candidates)
                if not any(victim is c for c in candidates):
                    raise ValueError(f"victim_policy returned {victim!r}, which is not one of its candidates")
                decodes_after -= victim is not req and not victim.is_prefilling
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if alloc is None:
                continue  # req preempted itself; running[i] is now the next one
            budget -= n + len(spec)
            out.scheduled.append(self._scheduled(req, alloc, n, start, spec))
            i += 1
        return budget

    def _planned_chunk(self, i: int, budget: int) -> int:
        """The prefill chunk ``step_planner`` gives ``running[i]``: planned over the requests not yet scheduled in
        this step and the budget left, again for every chunk (so budget a preemption frees goes to those after
        it). The plan is held to the rules every plan keeps; one that breaks them raises ``ValueError`` naming the
        rule, and the step is rolled back."""
        needs = [r.num_tokens_to_compute for r in self.running[i:]]
        plan = [int(x) for x in self.step_planner(list(needs), budget)]
        where = f"(needs {needs}, budget {budget}: got {plan})"
        if len(plan) != len(needs):
            raise ValueError(f"step_planner must return one number per running request, in order {where}")
        if sum(plan) > budget:
            raise ValueError(f"step_planner's plan computes more tokens than the budget {where}")
        if any(not 0 <= p <= n for p, n in zip(plan, needs)):
            raise ValueError(f"step_planner gives a request more than it needs, or a negative count {where}")
        if any(p != 1 for p, n in zip(plan, needs) if n == 1):
            raise ValueError(f"step_planner must give every decode its token {where}")
        return plan[0]

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Step 3: admit from the head of the waiting queue while the budget, ``max_num_seqs`` and memory allow."""
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if not self._may_admit(req):
                break
            tokens = req.all_token_ids
            hit = self.kv.lookup(tokens).num_cached_tokens
            # persistent KV tier: blocks beyond the local hit, read and verified (0 without a tier)
            ext = self.kv_tier.prepare(req.request_id, tokens, hit) if self.kv_tier is not None else 0
            n = min(len(tokens) - hit - ext, budget)
            alloc = self.kv.allocate(req, ext + n)
            if alloc is None:
                if self._reclaim():
                    continue
                break  # FCFS: the head waits for memory; nobody overtakes it
            self.waiting.popleft()
            if ext:  # the tier's K/V go into the fresh blocks; the step computes the n tokens after them
                alloc = self.kv_tier.load(req.request_id, tokens, alloc, ext)
            is_resume = req.status is RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = alloc.num_cached_tokens + ext
            if not is_resume and req.metrics.first_scheduled_step is None:
                req.metrics.num_cached_tokens = alloc.num_cached_tokens
            self.running.append(req)
            out.admitted.append(req.request_id)
            budget -= n
            out.scheduled.append(self._scheduled(req, alloc, n, req.num_computed_tokens, is_new=True,
                                                 is_resume=is_resume))

    def _may_admit(self, req: Request) -> bool:
        """Whether the policy lets the head of the queue in now (continuous batching: always)."""
        return True

    def _reclaim(self) -> bool:
        """Free KV held outside the running requests before anyone waits or is preempted; True if any was freed."""
        return False

    @staticmethod
    def _scheduled(req: Request, alloc: SlotAllocation, n: int, start: int, spec: Sequence[int] = (), *,
                   is_new: bool = False, is_resume: bool = False) -> ScheduledRequest:
        """The step's part for ``req``: its ``n`` tokens from ``start`` (read from the request) and its drafts."""
        samples = start + n == req.num_tokens
        decode = n == 1 and samples and start >= req.num_prompt_tokens and not is_new
        tokens = req.all_token_ids[start:start + n]
        if spec:
            tokens += spec
        return ScheduledRequest(req.request_id, "decode" if decode else "prefill", n + len(spec), start, samples,
                                is_new, is_resume, alloc.num_cached_tokens, tuple(tokens),
                                alloc.blocks_to_copy, len(spec))

    def _preempt(self, req: Request) -> None:
        """Free the request's KV (full blocks stay cached-free) and put it at the front of the waiting queue."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.spec_token_ids, req.spec_probs = [], None
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, output: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> None:
        """After the model step the scheduled tokens' K/V exist: advance each request's ``num_computed_tokens``
        and commit it (its full computed blocks become findable).

        ``num_rejected[id]`` drafts at the end of a speculative decode were rejected: their slots are truncated
        and they are not counted computed, so only verified tokens are ever hashed into the prefix cache.
        """
        requests, kv = self.requests, self.kv
        for s in output.scheduled:
            if s.kind == "padding":  # a finished static-batch member's discarded token: nothing to commit
                continue
            req = requests[s.request_id]
            rejected = num_rejected.get(s.request_id, 0) if num_rejected else 0
            req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens - rejected
            if rejected:
                kv.truncate(s.request_id, req.num_computed_tokens)
            req.metrics.num_computed_tokens_total += s.num_new_tokens
            kv.commit(req)

    # ------------------------------------------------------------------ leaving
    def finish_request(self, request_id: str, reason: FinishReason | None = None) -> Request:
        """Remove a finished (or aborted) request from whichever queue holds it and free its KV."""
        req = self.requests.pop(request_id, None)
        if req is None:
            raise RequestNotFoundError(request_id, "finish")
        if req in self.running:
            self.running.remove(req)
            self._free_finished(req, reason)
        else:
            self.waiting.remove(req)
        return req

    def _free_finished(self, req: Request, reason: FinishReason | None) -> None:
        self.kv.free(req.request_id)

    def check_invariants(self) -> None:
        assert len(self.running) <= self.max_num_seqs
        ids = [r.request_id for r in (*self.running, *self.waiting)]
        assert sorted(ids) == sorted(self.requests), "queues and the request map disagree"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
            assert self.kv.request(r.request_id).num_tokens == r.num_computed_tokens, r.request_id
            r.check()
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.kv.has_request(r.request_id), f"waiting request {r.request_id} holds KV"
            r.check()
        self.kv.check_invariants()


class StaticBatchScheduler(Scheduler):
    """Static batching, the baseline: a *batch* is the first ``max_num_seqs`` waiting requests, fixed when nothing
    runs; only its members are admitted, and the next batch forms once all have finished. Budgets, chunking and
    preemption are the continuous scheduler's, so a comparison measures one thing: refilling a freed slot at once
    versus waiting for the batch's longest member.

    **Padding** (``padding=True``): a padded batch (``transformers.generate``, FasterTransformer: what the Orca and
    vLLM papers measured against) keeps a finished member's row, computed and thrown away until the longest member
    ends. Here a finished member becomes a *padding slot*: its output is final, but it keeps its KV and, in every
    step that runs live work, feeds its last token at its next position (kind ``"padding"``, never sampled,
    committed, counted against the token and KV budgets). In static batching's favour, a padding slot is released
    (newest first) before any live request waits or is preempted, and before it would pass the model's last
    position, and prompts are not padded to the longest. ``padding=False`` is the *charitable* baseline.

    Invariant: padding slots are finished members of the current batch holding KV; the batch's end frees them all.
    """

    scheduling: SchedulingPolicy = "static"

    def __init__(self, kv_cache_manager: KVManager, *, padding: bool = True, max_position: int | None = None,
                 **kwargs):
        super().__init__(kv_cache_manager, **kwargs)
        self.static_padding = bool(padding)
        self.max_position = max_position  # a padding slot never feeds a position >= this (the model's limit)
        self._batch: set[str] = set()  # the current batch's unfinished members
        self._batch_before: frozenset[str] = frozenset()  # the batch before the latest plan (for rollback)
        self._padding: dict[str, Request] = {}  # padding slot -> its finished request (it feeds its last token)
        self.num_padding_tokens = 0

    @property
    def static_batch(self) -> list[str]:
        """The current batch's unfinished members, running first."""
        return [r.request_id for r in (*self.running, *self.waiting) if r.request_id in self._batch]

    @property
    def padding_slots(self) -> list[str]:
        return list(self._padding)

    def add_request(self, request: Request) -> None:
        if request.request_id in self._padding:
            self._release_padding(request.request_id)  # an id reused while its finished namesake pads
        super().add_request(request)

    def schedule(self) -> SchedulerOutput:
        self._batch_before = frozenset(self._batch)
        return super().schedule()

    def rollback(self, plan: SchedulerOutput, *, kv_written: bool = True) -> None:
        super().rollback(plan, kv_written=kv_written)
        self._batch = set(self._batch_before)

    def _plan(self, out: SchedulerOutput) -> None:
        super()._plan(out)
        if self._padding and out.scheduled:
            self._schedule_padding(out, self.max_num_batched_tokens - out.num_scheduled_tokens)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        if not self._batch and not self.running:
            self._batch = {r.request_id for r in itertools.islice(self.waiting, self.max_num_seqs)}
        super()._admit(out, budget)

    def _schedule_padding(self, out: SchedulerOutput, budget: int) -> None:
        """Every padding slot computes one discarded token, after the live work, while the budget lasts."""
        for rid, req in list(self._padding.items()):
            if budget < 1:
                break
            pos = self.kv.request(rid).num_tokens
            past_end = self.max_position is not None and pos >= self.max_position
            alloc = None if past_end else self.kv.append_slots(req, 1)
            if alloc is None:  # padding never takes memory from live work
                self._release_padding(rid)
                continue
            budget -= 1
            out.scheduled.append(ScheduledRequest(rid, "padding", 1, pos, False, token_ids=(req.all_token_ids[-1],),
                                                  blocks_to_copy=alloc.blocks_to_copy))

    def _may_admit(self, req: Request) -> bool:
        return req.request_id in self._batch

    def _reclaim(self) -> bool:
        return self._release_padding()

    def update_from_output(self, output: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> None:
        self.num_padding_tokens += output.num_padding_tokens  # finished members' discarded tokens: counted only
        super().update_from_output(output, num_rejected)

    def finish_request(self, request_id: str, reason: FinishReason | None = None) -> Request:
        """A member that ends naturally while others of its batch run becomes a padding slot (an abort or an error
        frees at once); the batch's last member frees them all."""
        req = super().finish_request(request_id, reason)
        self._batch.discard(request_id)
        if not self._batch:
            while self._release_padding():
                pass
        return req

    def _free_finished(self, req: Request, reason: FinishReason | None) -> None:
        rid = req.request_id
        if (self.static_padding and reason not in ("abort", "error") and rid in self._batch
                and len(self._batch) > 1 and req.all_token_ids):
            self._padding[rid] = req
        else:
            super()._free_finished(req, reason)

    def _release_padding(self, request_id: str | None = None) -> bool:
        """Free one padding slot's KV (the given one, else the newest); False if there is none."""
        if not self._padding:
            return False
        if request_id is None:
            request_id = next(reversed(self._padding))
        del self._padding[request_id]
        self.kv.free(request_id)
        return True

    def check_invariants(self) -> None:
        for rid in self._padding:
            assert rid not in self.requests and self.kv.has_request(rid), f"padding slot {rid} is not a finished member"
        assert not self._padding or self._batch, "padding slots outlived their static batch"
        super().check_invariants()


def make_scheduler(kv_cache_manager: KVManager, *, scheduling: SchedulingPolicy = "continuous",
                   victim_policy: VictimPolicy | None = None, static_padding: bool = True,
                   max_position: int | None = None, **kwargs) -> Scheduler:
    """The scheduler for a policy name: ``"continuous"`` or ``"static"`` (whose padding options it passes on)."""
    kwargs["victim_policy"] = victim_policy or most_recently_admitted
    if scheduling == "static":
        return StaticBatchScheduler(kv_cache_manager, padding=static_padding, max_position=max_position, **kwargs)
    if scheduling != "continuous":
        raise ValueError(f"scheduling must be 'continuous' or 'static', got {scheduling!r}")
    return Scheduler(kv_cache_manager, **kwargs)

"""The scheduler: which requests run in the next step, how many tokens each computes, and who gets preempted.

It owns the waiting queue (FIFO; preempted requests re-enter at the *front*) and the running list (in admission
order), and it is the only caller of the KV cache manager's ``allocate`` / ``append_slots`` / ``free`` for
requests. Each call to :meth:`Scheduler.schedule` produces one :class:`SchedulerOutput`: the step's plan, which
the engine turns into ONE batched model call.

Continuous batching (``scheduling="continuous"``; vLLM v1's ``Scheduler.schedule``), one step:

1. **Running requests first**, oldest first. A decoding request computes 1 token. A request still prefilling (a
   long prompt, or a resume) computes the next chunk: as much of what is left of ``max_num_batched_tokens`` as it
   can use, minus one token reserved for each decode still to be scheduled after it — so a long prefill never
   starves the decodes ("chunked prefill keeps decodes flowing").
2. **Preemption by recompute.** If a running request cannot get a block (``append_slots`` returns None), the most
   recently admitted running request is preempted: its blocks are freed (last block first; its full blocks stay
   cached-free in the LRU, so resuming is mostly prefix hits), ``num_computed_tokens`` is reset to 0, and it goes
   to the *front* of the waiting queue, keeping its generated tokens and its sampler. Repeat until the block is
   granted or the request itself was the victim. The victim is never a request already scheduled in this step
   (victims come from the end of the running list, which is scheduled last), so no scheduled work is undone.
   ``victim_policy`` swaps the rule (an exercise in notebook 07): it picks from the *candidates*, the requests
   not yet scheduled in this step (the one asking for the block first, then the younger ones).
3. **Admission.** With what is left of the token budget, and while fewer than ``max_num_seqs`` run, admit
   waiting requests in order: prefix lookup (hits are whole cached blocks, never the last token), then slots for
   the first chunk of what is not cached. A request whose chunk does not fit in the free blocks stays at the
   head of the queue (FCFS: nobody overtakes it). No admission in a step that preempted (the memory is tight;
   admitting would only preempt again) — vLLM's rule.

Static batching (``scheduling="static"``), the baseline: a *batch* is the first ``max_num_seqs`` waiting
requests, fixed when the running set is empty; only members of the current batch are admitted, and the next batch
forms only after every member has finished. Budgets, chunking and preemption are the same, so the comparison
measures exactly one thing: refilling the batch as soon as a slot frees versus waiting for the longest member.

**Padding** (``static_padding=True``, the default for ``"static"``): classic static batching runs the batch as one
padded tensor (``transformers.generate`` on a batch, FasterTransformer — what the Orca and vLLM papers measured
against), so a member that has finished keeps its row: it is computed every step, its token thrown away, until the
longest member ends. minienv does that work for real: a finished member becomes a *padding slot* — it leaves the
request queues (its output is final and unchanged) but keeps its KV blocks, and in every step that runs live work
of its batch it feeds its last token at its next position through the same batched model call (kind
``"padding"``: one token, never sampled, its K/V appended and committed like any token). When the batch's last
member finishes, every padding slot frees its blocks. Padding tokens count against ``max_num_batched_tokens``
(scheduled after the live work) and their blocks against the KV budget, as a padded batch's rows do. Two
departures, both in static batching's favour: under memory pressure a padding slot is released (most recent first)
before any live request is preempted, and a padding slot that would pass the model's last position stops; prompts
are *not* padded to the batch's longest prompt (a left-padded prefill would compute ``longest - own`` extra tokens
per member). ``static_padding=False`` is the *charitable* baseline: a finished member stops computing at once, so
only the idle-slot loss is measured.

Why every request finishes (the default policy): the oldest running request can always get its block — every
other block is free, cached-free (evictable) or held by a younger request that can be preempted, and the engine
rejects up front any request that could not fit the whole budget alone. So each step makes progress, the oldest
request finishes, and by induction all do; the property tests check it down to a budget of one request's size.

Invariants (``check_invariants``): every running request holds KV in the manager with
``num_computed_tokens`` equal to the manager's; waiting requests hold none; ``len(running) <= max_num_seqs``;
a step's scheduled tokens never exceed ``max_num_batched_tokens``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import numpy as np

from minienv.kv.kv_cache_manager import KVCacheManager, SlotAllocation
from minienv.request import Request, RequestNotFoundError, RequestStatus

SchedulingPolicy = Literal["continuous", "static"]
StepKind = Literal["prefill", "decode", "padding"]
#: Picks the preemption victim among candidates (oldest first; ``candidates[0]`` is the request that needs a block).
VictimPolicy = Callable[[Sequence[Request]], Request]


def most_recently_admitted(candidates: Sequence[Request]) -> Request:
    """vLLM's rule: preempt the request admitted last (it has the least work to lose, in a FCFS world)."""
    return candidates[-1]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a step.

    ``kind`` is ``"decode"`` for one token after the prompt is in the cache, ``"prefill"`` for a chunk of a prompt
    (or of a resume: prompt + tokens generated before preemption), ``"padding"`` for the discarded token of a
    finished static-batch member (``request_id`` is the finished request's; static padding, see the module doc).
    ``num_computed_tokens`` is the count *before* this step, so the chunk covers positions
    ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.
    ``samples`` is True when the chunk reaches the last known token: the step's logits for it give a new token.
    ``num_cached_tokens`` is the prefix-cache hit taken when the request was admitted in this step (else 0).
    """

    request_id: str
    kind: StepKind
    num_new_tokens: int
    num_computed_tokens: int
    samples: bool
    is_new: bool = False  # admitted (or re-admitted after preemption) in this step
    is_resume: bool = False  # re-admitted after a preemption
    num_cached_tokens: int = 0
    token_ids: tuple[int, ...] = field(default=(), repr=False)
    slot_mapping: np.ndarray = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    #: copy-on-write copies ``(src, dst)`` the KV pool must apply before this step writes (the pool's owner does)
    blocks_to_copy: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    #: speculative decoding: the last ``num_spec_tokens`` of ``token_ids`` are drafts to verify (a decode only)
    num_spec_tokens: int = 0


@dataclass
class SchedulerOutput:
    """The plan of one engine step (vLLM: ``SchedulerOutput``), and a record of what scheduling did.

    ``scheduled`` is in batch order: the model's input tokens are the scheduled chunks concatenated in this order.
    ``waiting`` / ``running`` are the queue contents *after* scheduling (ids, in order), for timelines and
    dashboards.
    """

    step: int
    scheduled: list[ScheduledRequest]
    preempted: list[str]
    admitted: list[str]
    waiting: list[str]
    running: list[str]
    max_num_batched_tokens: int
    scheduling: SchedulingPolicy = "continuous"
    #: static scheduling: the batch's members before this step planned (a rollback restores them)
    static_batch_before: frozenset[str] = field(default=frozenset(), repr=False)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.kind == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.kind == "decode")

    @property
    def num_padding_tokens(self) -> int:
        """Tokens computed and thrown away (static padding): finished members still in their batch's rows."""
        return sum(s.num_new_tokens for s in self.scheduled if s.kind == "padding")

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def by_id(self) -> dict[str, ScheduledRequest]:
        return {s.request_id: s for s in self.scheduled}


class Scheduler:
    """Waiting and running queues over one :class:`KVCacheManager`; see the module docstring for the policy.

    The engine drives it: ``add_request`` (already validated), then per step ``schedule()`` -> model ->
    ``update_from_output(output)`` -> ``finish_request`` for the requests that ended.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        scheduling: SchedulingPolicy = "continuous",
        victim_policy: VictimPolicy = most_recently_admitted,
        static_padding: bool = True,
        max_position: int | None = None,
    ):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}): "
                "every running request must be able to decode one token in every step"
            )
        if scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {scheduling!r}")
        self.kv = kv_cache_manager
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.scheduling: SchedulingPolicy = scheduling
        self.victim_policy = victim_policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the preemption victim
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.num_steps = 0
        self.num_preemptions = 0
        self._static_batch: set[str] = set()  # static mode: ids of the current batch's unfinished members
        #: static padding on? (only meaningful with scheduling="static")
        self.static_padding = bool(static_padding) and scheduling == "static"
        self.max_position = max_position  # padding never feeds a position >= this (the model's limit)
        #: padding slots: finished members of the current static batch -> the token they keep feeding
        self._padding: dict[str, int] = {}
        self.num_padding_tokens = 0  # padding tokens computed so far (each one wasted work)

    # ------------------------------------------------------------------ queues
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.request_id in self._padding:  # an id reused while its finished namesake still pads
            self._release_padding(request.request_id)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def static_batch(self) -> list[str]:
        """Static mode: the current batch's unfinished members (empty in continuous mode)."""
        return [r.request_id for r in (*self.running, *self.waiting) if r.request_id in self._static_batch]

    @property
    def padding_slots(self) -> list[str]:
        """Static padding: ids of finished members that still hold their KV and compute a discarded token per step."""
        return list(self._padding)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """Plan the next step: decode/continue running requests, preempt on block shortage, admit waiting ones.

        If planning raises (a ``victim_policy`` that fails, say), what it reserved so far is rolled back first.
        """
        out = SchedulerOutput(step=self.num_steps, scheduled=[], preempted=[], admitted=[], waiting=[], running=[],
                              max_num_batched_tokens=self.max_num_batched_tokens, scheduling=self.scheduling,
                              static_batch_before=frozenset(self._static_batch))
        self.num_steps += 1
        try:
            self._plan(out)
        except BaseException:
            self.rollback(out)
            raise
        out.waiting = [r.request_id for r in self.waiting]
        out.running = [r.request_id for r in self.running]
        return out

    def rollback(self, plan: SchedulerOutput) -> None:
        """Undo a plan whose step failed before it committed: every scheduled request back where it was.

        Reserved slots are given back (``truncate`` to the tokens computed before the step), requests admitted by
        the plan return to the head of the waiting queue in their order, and the step count is restored. The
        prefix-cache counters of undone admissions are taken back. Preemptions the plan made stand: a preempted
        request is a valid waiting request, and its resume gives the same output.
        """
        for s in reversed(plan.scheduled):
            req = self.requests.get(s.request_id)
            if s.is_new and req is not None:
                stats = self.kv.prefix_stats
                stats.requests -= 1
                stats.queries -= req.num_tokens
                stats.hits -= s.num_cached_tokens
                released = self.kv.free(s.request_id)
                self.running.remove(req)
                req.status = RequestStatus.PREEMPTED if s.is_resume else RequestStatus.WAITING
                req.num_computed_tokens = 0
                if req.metrics.first_scheduled_step is None:
                    req.metrics.num_cached_tokens = 0  # set by this (undone) first admission
                self.waiting.appendleft(req)
            else:  # a running request's chunk or decode, or a padding slot's token
                released = self.kv.truncate(s.request_id, s.num_computed_tokens)
            self.kv.return_to_head(released)
        self._static_batch = set(plan.static_batch_before)
        self.num_steps = plan.step

    def _plan(self, out: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens
        scheduled, preempted, admitted = out.scheduled, out.preempted, out.admitted

        # 1. running requests, oldest first. `decodes_after` = decodes not yet scheduled (reserved budget).
        decodes_after = sum(1 for r in self.running if not r.is_prefilling)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            remaining = req.num_tokens_to_compute
            spec: list[int] = []
            if remaining == 1:
                decodes_after -= 1
                n = 1
                # drafts ride along when the budget has room beyond the decodes still to come
                spec = req.spec_token_ids[:max(0, budget - decodes_after - 1)]
            else:
                n = min(remaining, budget - decodes_after)
                if n <= 0:
                    i += 1
                    continue  # no budget left for this prefill chunk this step; it keeps its blocks
            start = req.num_computed_tokens
            tokens = req.all_token_ids[start:start + n] + spec
            while (alloc := self.kv.append_slots(req.request_id, tokens)) is None:
                if spec:  # no room for the drafts: decode plainly before preempting anyone
                    spec, tokens = [], tokens[:n]
                    continue
                if self._release_padding():
                    continue  # a padding slot gave its blocks back before any live request is preempted
                candidates = self.running[i:]  # not yet scheduled in this step; req first
                victim = self.victim_policy(candidates)
                if not any(victim is c for c in candidates):
                    raise ValueError(f"victim_policy returned {victim!r}, which is not one of its candidates")
                if not victim.is_prefilling:
                    decodes_after -= victim is not req
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if alloc is None:
                continue  # the request preempted itself; running[i] is now the next one (default policy: none)
            budget -= n + len(spec)
            scheduled.append(self._scheduled(req, alloc, n, start, is_new=False, num_spec=len(spec)))
            i += 1

        # 2. admission (continuous: any waiting request; static: members of the current batch only)
        if not preempted:
            if self.scheduling == "static" and not self._static_batch and not self.running:
                self._static_batch = {r.request_id for r in list(self.waiting)[: self.max_num_seqs]}
            while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
                req = self.waiting[0]
                if self.scheduling == "static" and req.request_id not in self._static_batch:
                    break
                tokens = req.all_token_ids
                hit = self.kv.lookup(tokens).num_cached_tokens
                n = min(len(tokens) - hit, budget)
                alloc = self.kv.allocate(req.request_id, tokens, num_new_tokens=n)
                if alloc is None:
                    if self._release_padding():
                        continue
                    break  # FCFS: the head waits for memory; nobody overtakes it
                self.waiting.popleft()
                is_resume = req.status is RequestStatus.PREEMPTED
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = alloc.num_cached_tokens
                if not is_resume and req.metrics.first_scheduled_step is None:
                    req.metrics.num_cached_tokens = alloc.num_cached_tokens
                self.running.append(req)
                admitted.append(req.request_id)
                budget -= n
                scheduled.append(self._scheduled(req, alloc, n, req.num_computed_tokens, is_new=True,
                                                 is_resume=is_resume, num_cached=alloc.num_cached_tokens))

        # 3. static padding: every finished member of the batch computes one discarded token (after the live work)
        if self._padding and scheduled:
            for rid, token in list(self._padding.items()):
                if budget < 1:
                    break
                pos = self.kv.request(rid).num_tokens
                if self.max_position is not None and pos >= self.max_position:
                    self._release_padding(rid)
                    continue
                alloc = self.kv.append_slots(rid, [token])
                if alloc is None:
                    self._release_padding(rid)  # padding never takes memory from live work
                    continue
                budget -= 1
                scheduled.append(ScheduledRequest(rid, "padding", 1, pos, False, token_ids=alloc.token_ids,
                                                  slot_mapping=alloc.slot_mapping,
                                                  blocks_to_copy=alloc.blocks_to_copy))


    def _scheduled(self, req: Request, alloc: SlotAllocation, n: int, start: int, *, is_new: bool,
                   is_resume: bool = False, num_cached: int = 0, num_spec: int = 0) -> ScheduledRequest:
        samples = start + n == req.num_tokens
        kind: StepKind = "decode" if (n == 1 and samples and start >= req.num_prompt_tokens and not is_new) \
            else "prefill"
        return ScheduledRequest(req.request_id, kind, n + num_spec, start, samples, is_new, is_resume, num_cached,
                                alloc.token_ids, alloc.slot_mapping, alloc.blocks_to_copy, num_spec)

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
        """After the model step: the scheduled tokens' K/V exist. Commit them (full blocks become findable).

        ``num_rejected[id]`` drafts at the end of a speculative decode were rejected: their slots are truncated
        *before* the commit, so only verified tokens are ever hashed into the prefix cache.
        """
        for s in output.scheduled:
            rejected = (num_rejected or {}).get(s.request_id, 0)
            if rejected:
                self.kv.truncate(s.request_id, s.num_computed_tokens + s.num_new_tokens - rejected)
            if s.kind == "padding":
                self.kv.commit(s.request_id)
                self.num_padding_tokens += s.num_new_tokens
                continue
            req = self.requests[s.request_id]
            self.kv.commit(s.request_id)
            req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens - rejected
            req.metrics.num_computed_tokens_total += s.num_new_tokens

    # ------------------------------------------------------------------ leaving
    def finish_request(self, request_id: str, *, pad: bool = True) -> Request:
        """Remove a request that has finished (or is aborted) from whichever queue holds it; free its KV.

        Static padding: a running member whose batch has other unfinished members keeps its KV as a padding slot
        instead (``pad=False``, e.g. an abort, frees at once). The batch's last member frees every padding slot.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            raise RequestNotFoundError(request_id, "finish")
        in_batch = request_id in self._static_batch
        self._static_batch.discard(request_id)
        if req in self.running:
            self.running.remove(req)
            if pad and self.static_padding and in_batch and self._static_batch and req.all_token_ids:
                self._padding[request_id] = int(req.all_token_ids[-1])
            else:
                self.kv.free(request_id)
        else:
            self.waiting.remove(req)
        if not self._static_batch:
            while self._release_padding():
                pass
        return req

    def _release_padding(self, request_id: str | None = None) -> bool:
        """Free one padding slot's KV (the given one, else the most recent); False if there is none."""
        if not self._padding:
            return False
        if request_id is None:
            request_id = next(reversed(self._padding))
        del self._padding[request_id]
        self.kv.free(request_id)
        return True

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        assert len(self.running) <= self.max_num_seqs
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert sorted(ids) == sorted(self.requests), "queues and the request map disagree"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
            kv = self.kv.request(r.request_id)
            assert kv.num_computed_tokens == r.num_computed_tokens == kv.num_tokens, r.request_id
            r.check()
        for rid in self._padding:
            assert rid not in self.requests and self.kv.has_request(rid), f"padding slot {rid} is not a finished member"
        assert not self._padding or self._static_batch, "padding slots outlived their static batch"
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.kv.has_request(r.request_id), f"waiting request {r.request_id} holds KV"
            r.check()
        self.kv.check_invariants()


def make_scheduler(kv_cache_manager: KVCacheManager, *, scheduling: SchedulingPolicy = "continuous",
                   victim_policy: VictimPolicy | None = None, **kwargs) -> Scheduler:
    """The scheduler for a policy name (``"continuous"`` or ``"static"``)."""
    return Scheduler(kv_cache_manager, scheduling=scheduling, victim_policy=victim_policy or most_recently_admitted,
                     **kwargs)

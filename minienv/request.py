"""One request's life in the engine: its tokens, how far they are computed, its sampler, metrics and outcome.

A request moves ``WAITING -> RUNNING -> FINISHED_*``, possibly through ``PREEMPTED`` (back in the waiting queue,
its KV blocks freed) and ``RUNNING`` again any number of times. What it *owns* survives preemption: its prompt,
the tokens it has generated so far, and its sampler (with the random generator's state). What it loses is only
its KV, and ``num_computed_tokens`` says how much of that it has:

* ``all_token_ids = prompt_token_ids + output_token_ids`` — every token the request knows;
* ``num_computed_tokens`` — how many of them have K/V in the cache (vLLM v1's central counter).

One rule drives every step, whatever the phase (vLLM v1's design): *compute the next
``num_tokens - num_computed_tokens`` tokens, possibly in chunks; when the last one is computed, sample a token.*
A fresh prompt, a chunk in the middle of a long prompt, a single decode token and a preempted request's resume
(prompt + generated so far, recomputed) are all that one rule, which is why a preempted request continues exactly
where it stopped: the token it feeds last is the token it had sampled last.

Invariants (kept by the scheduler and engine, asserted by ``check()``):
``0 <= num_computed_tokens <= num_tokens``; a running request has ``num_computed_tokens < num_tokens`` between
steps (it always has at least the last sampled token to feed); a waiting (or preempted) request has
``num_computed_tokens == 0`` and holds no KV blocks.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

from minienv.sampling import Sampler, SamplingParams

FinishReason = Literal["length", "stop", "eos", "abort", "error"]


class RequestStatus(enum.Enum):
    """Where a request is (vLLM's ``RequestStatus``, minus the states minienv has no use for)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue after preemption; resumes by recomputing its KV
    FINISHED_LENGTH = "finished_length"  # max_tokens generated
    FINISHED_STOPPED = "finished_stopped"  # a stop string appeared in the output
    FINISHED_EOS = "finished_eos"  # the model produced the end-of-sequence token
    FINISHED_ABORTED = "finished_aborted"  # abort(request_id)
    FINISHED_ERROR = "finished_error"  # a failure that belonged to this request alone (its message in ``error``)

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")


_FINISHED_STATUS: dict[str, RequestStatus] = {
    "length": RequestStatus.FINISHED_LENGTH,
    "stop": RequestStatus.FINISHED_STOPPED,
    "eos": RequestStatus.FINISHED_EOS,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
}


class InvalidRequestError(ValueError):
    """A request the engine refuses before queueing it: nothing was queued, the engine keeps serving the rest.

    ``index`` is the position of the bad prompt in a :meth:`InferenceEngine.generate` call (None for
    ``add_request``).
    """

    def __init__(self, message: str, index: int | None = None):
        self.index = index
        super().__init__(message if index is None else f"prompt {index}: {message}")


class RequestNotFoundError(KeyError):
    """An unknown (or already finished) request id, e.g. given to ``abort``. Nothing was changed."""

    def __init__(self, request_id: object, action: str = "abort"):
        self.request_id = request_id
        super().__init__(
            f"cannot {action} request {request_id!r}: the engine has no unfinished request with that id "
            "(never added, or already finished / aborted); nothing was changed"
        )

    __str__ = Exception.__str__  # KeyError would repr() the message


@dataclass
class RequestMetrics:
    """Per-request timings, in seconds (``time.perf_counter``) *and* in engine steps.

    Seconds are what a user feels; steps are deterministic (the same workload gives the same numbers on any
    machine), which is what notebooks print and tests compare.

    * **TTFT** (time to first token) = first token - arrival: queueing + prefill (+ any resume before it).
    * **TPOT** (time per output token) = (finish - first token) / (output tokens - 1): the decode pace.
    * **e2e latency** = finish - arrival.
    """

    arrival_time: float
    arrival_step: int
    first_scheduled_time: float | None = None
    first_scheduled_step: int | None = None
    first_token_time: float | None = None
    first_token_step: int | None = None
    finished_time: float | None = None
    finished_step: int | None = None
    num_output_tokens: int = 0
    #: prompt tokens served by the prefix cache when the request was first admitted (not counting resumes)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    #: tokens this request ran through the model, prefill chunks + decodes + recomputation after preemption
    num_computed_tokens_total: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None until finished; 0.0 for a single-token output)."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def ttft_steps(self) -> int | None:
        """Engine steps from arrival to first token (1 = the first token came out of the step it arrived before)."""
        if self.first_token_step is None:
            return None
        return self.first_token_step - self.arrival_step

    @property
    def tpot_steps(self) -> float | None:
        if self.finished_step is None or self.first_token_step is None:
            return None
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.finished_step - self.first_token_step) / (self.num_output_tokens - 1)

    @property
    def e2e_steps(self) -> int | None:
        if self.finished_step is None:
            return None
        return self.finished_step - self.arrival_step


@dataclass(eq=False)
class Request:
    """A request inside the engine. Built by :class:`~minienv.engine.InferenceEngine` after validation.

    ``text`` is the detokenized output so far (cut before the stop string once a stop string finishes it); the
    engine keeps it current every step, so a dashboard can show each request's text growing.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    metrics: RequestMetrics
    prompt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None  # the stop string that ended the request
    text: str = ""
    error: str | None = None  # why the request finished with "error"
    #: output routing (kept by the engine's output processor): the consumer that owns this request's outputs and
    #: how much of ``output_token_ids`` / ``text`` it has been given so far
    consumer: object = field(default=None, repr=False)
    delivered_tokens: int = 0
    delivered_chars: int = 0
    detokenizer: object = field(default=None, repr=False)
    #: speculative decoding: the drafts proposed for this request's next step, and the distributions they were
    #: drawn from (``None``: greedy or a deterministic proposer); [] when it does not speculate
    spec_token_ids: list[int] = field(default_factory=list, repr=False)
    spec_probs: object = field(default=None, repr=False)
    sampler: Sampler = field(init=False, repr=False)
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)
        # One sampler (and random generator) for the request's whole life: preemption does not reset it, so a
        # seeded sampled request gives the same tokens however often it is preempted or whatever it is batched with.
        self.sampler = Sampler(self.sampling_params)

    # ------------------------------------------------------------------ tokens
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + generated tokens (the live list: do not mutate; use :meth:`append_output_token`)."""
        return self._all_token_ids

    @property
    def prompt_token_tuple(self) -> tuple[int, ...]:
        """The prompt as a tuple, built once (outputs share it instead of copying the prompt every step)."""
        t = self.__dict__.get("_prompt_tuple")
        if t is None:
            t = self.__dict__["_prompt_tuple"] = tuple(self.prompt_token_ids)
        return t

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens without K/V yet: the whole prompt when fresh, 1 when decoding, prompt+output-so-far on resume."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token to compute: a prompt (or a resume) is not fully in the cache yet."""
        return self.num_tokens_to_compute > 1

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.metrics.num_output_tokens = len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    # ------------------------------------------------------------------ status
    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def finish(self, reason: FinishReason, time: float, step: int, error: str | None = None) -> None:
        self.status = _FINISHED_STATUS[reason]
        self.finish_reason = reason
        self.error = error
        self.metrics.finished_time = time
        self.metrics.finished_step = step

    def check(self) -> None:
        """Assert the module's invariants for this request (tests, notebooks)."""
        assert 0 <= self.num_computed_tokens <= self.num_tokens, self
        assert self._all_token_ids == self.prompt_token_ids + self.output_token_ids
        if self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            assert self.num_computed_tokens == 0
        if self.status is RequestStatus.RUNNING:
            assert self.num_computed_tokens < self.num_tokens
        assert self.num_output_tokens <= self.max_tokens


def kv_tokens_needed(num_prompt_tokens: int, max_tokens: int) -> int:
    """Token slots a request may hold at its largest: ``prompt + max_tokens``.

    (Strictly the last sampled token is never fed back, so ``- 1`` would do; the engine uses the plain sum, which
    keeps the rule easy to check by hand.)
    """
    return num_prompt_tokens + max_tokens


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


def check_token_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """Plain ints in ``[0, vocab_size)`` or a ``ValueError`` naming the first bad one."""
    out = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"token ids must be ints, got {t!r}")
        t = int(t)
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} out of range: the model's vocab_size is {vocab_size}")
        out.append(t)
    return out

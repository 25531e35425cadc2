"""One request's life in the engine: its tokens, how far they are computed, its sampler, metrics and outcome.

A request moves ``WAITING -> RUNNING -> FINISHED_*``, possibly through ``PREEMPTED`` (back in the waiting queue,
its KV freed) any number of times. Preemption takes only its KV: it keeps its prompt, its generated tokens and its
sampler (with the random generator's state). One rule drives every step (vLLM v1's): *compute the next
``num_tokens - num_computed_tokens`` tokens, possibly in chunks; when the last is computed, sample a token.* A
prompt, a chunk of one, a decode and a resume are all that rule, which is why a preempted request continues
exactly where it stopped.

Invariants (``check()``): ``0 <= num_computed_tokens <= num_tokens``; ``all_token_ids == prompt + output``; a
running request has at least its last sampled token to compute between steps; a waiting one has
``num_computed_tokens == 0`` and no KV.
"""

from __future__ import annotations

import enum
import functools
import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Sequence

from minienv.sampling import Sampler, SamplingParams

FinishReason = Literal["length", "stop", "eos", "abort", "error"]


class RequestStatus(enum.Enum):
    """Where a request is (vLLM's ``RequestStatus``, minus the states minienv has no use for)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; resumes by recomputing its KV
    FINISHED_LENGTH = "finished_length"  # max_tokens generated
    FINISHED_STOPPED = "finished_stopped"  # a stop string appeared in the output
    FINISHED_EOS = "finished_eos"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # a failure that belonged to this request alone (message in ``error``)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED_STATUSES  # a set look-up: read for every request in every step


_FINISHED_STATUSES = frozenset(s for s in RequestStatus if s.value.startswith("finished"))
_FINISHED_STATUS = {"length": RequestStatus.FINISHED_LENGTH, "stop": RequestStatus.FINISHED_STOPPED,
                    "eos": RequestStatus.FINISHED_EOS, "abort": RequestStatus.FINISHED_ABORTED,
                    "error": RequestStatus.FINISHED_ERROR}


class InvalidRequestError(ValueError):
    """A request refused before queueing; nothing was queued. ``index`` is the bad prompt's position in a
    ``generate`` / ``stream`` call (None for ``add_request``)."""

    def __init__(self, message: str, index: int | None = None):
        self.index = index
        super().__init__(message if index is None else f"prompt {index}: {message}")


class RequestNotFoundError(KeyError):
    """An unknown (or already finished) request id, e.g. given to ``abort``. Nothing was changed."""

    def __init__(self, request_id: object, action: str = "abort"):
        self.request_id = request_id
        super().__init__(f"cannot {action} request {request_id!r}: the engine has no unfinished request with that "
                         "id (never added, or already finished / aborted); nothing was changed")

    __str__ = Exception.__str__  # KeyError would repr() the message


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class RequestMetrics:
    """Per-request timings in seconds (``time.perf_counter``; what a user feels) *and* in engine steps
    (deterministic: what notebooks print and tests compare). TTFT = first token - arrival (queueing + prefill);
    TPOT = (finish - first token) / (output tokens - 1), the decode pace; e2e = finish - arrival."""

    arrival_time: float
    arrival_step: int
    first_scheduled_time: float | None = None
    first_scheduled_step: int | None = None
    first_token_time: float | None = None
    first_token_step: int | None = None
    finished_time: float | None = None
    finished_step: int | None = None
    num_output_tokens: int = 0
    #: prompt tokens served by the prefix cache at the first admission (not resumes)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    #: tokens run through the model for this request: prefill chunks + decodes + recomputation after preemption
    num_computed_tokens_total: int = 0

    def copy(self) -> "RequestMetrics":
        """A snapshot for an output (every field is a number or None, so a shallow copy is a full one)."""
        return dataclasses.replace(self)

    def _pace(self, first: float | None, finished: float | None) -> float | None:
        if first is None or finished is None:
            return None
        return 0.0 if self.num_output_tokens <= 1 else (finished - first) / (self.num_output_tokens - 1)

    @property
    def ttft(self) -> float | None:
        return _span(self.arrival_time, self.first_token_time)

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None until finished; 0.0 for one output token)."""
        return self._pace(self.first_token_time, self.finished_time)

    @property
    def e2e_latency(self) -> float | None:
        return _span(self.arrival_time, self.finished_time)

    @property
    def ttft_steps(self) -> int | None:
        """Steps from arrival to first token (1: the first token came out of the step right after arrival)."""
        return _span(self.arrival_step, self.first_token_step)  # type: ignore[return-value]

    @property
    def tpot_steps(self) -> float | None:
        return self._pace(self.first_token_step, self.finished_step)

    @property
    def e2e_steps(self) -> int | None:
        return _span(self.arrival_step, self.finished_step)  # type: ignore[return-value]


@dataclass(eq=False)
class Request:
    """A request inside the engine, built by :class:`~minienv.engine.InferenceEngine` after validation.

    ``text`` is the detokenized output so far (cut before the stop string that finished it), kept current every
    step. ``consumer`` owns its outputs; ``delivered_tokens`` / ``delivered_chars`` say how much it has been given.
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
        # One sampler for the request's whole life: preemption does not reset it, so a seeded request gives the
        # same tokens however often it is preempted and whatever it is batched with.
        self.sampler = Sampler(self.sampling_params)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + generated tokens (the live list: do not mutate; use :meth:`append_output_token`)."""
        return self._all_token_ids

    @functools.cached_property
    def prompt_token_tuple(self) -> tuple[int, ...]:
        """The prompt as a tuple, built once (outputs share it instead of copying the prompt every step)."""
        return tuple(self.prompt_token_ids)

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
        """Tokens without K/V yet: the prompt when fresh, 1 when decoding, prompt + output so far on resume."""
        return len(self._all_token_ids) - self.num_computed_tokens  # read for every running request every step

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens_to_compute > 1

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.metrics.num_output_tokens = len(self.output_token_ids)

    def finish(self, reason: FinishReason, time: float, step: int, error: str | None = None) -> None:
        self.status = _FINISHED_STATUS[reason]
        self.finish_reason, self.error = reason, error
        self.metrics.finished_time, self.metrics.finished_step = time, step

    def check(self) -> None:
        """Assert the module's invariants for this request (tests, notebooks)."""
        assert 0 <= self.num_computed_tokens <= self.num_tokens, self
        assert self._all_token_ids == self.prompt_token_ids + self.output_token_ids
        if self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            assert self.num_computed_tokens == 0
        if self.status is RequestStatus.RUNNING:
            assert self.num_computed_tokens < self.num_tokens
        assert self.num_output_tokens <= self.max_tokens


def check_token_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """Plain ints in ``[0, vocab_size)``, or a ``ValueError`` naming the first bad one."""
    out = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"token ids must be ints, got {t!r}")
        t = int(t)
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} out of range: the model's vocab_size is {vocab_size}")
        out.append(t)
    return out

"""A closed-loop load generator for a :class:`~minienv.serving.client.Client`: ``concurrency`` threads, each
sending its next request as soon as its previous one ended, and an account of how every request ended.

A request here is a :class:`Job`: a prompt, ``max_tokens``, and optionally a cancellation after some chunks or a
deadline. :func:`run_load` returns one :class:`Outcome` per job that ended — completed (with its completion),
cancelled, or a status code — plus the jobs that did not end within the time bound: those are *lost*, and a
correct server and client lose none. Latencies are measured here, at the client: time to the first chunk and to
the end of the stream (what a user waits), not the server's own figures.

Invariant: every job is in exactly one of ``outcomes``, ``lost`` and ``not_started``; ``lost`` is non-empty only if
a call hung past ``time_limit``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from minienv.serving.client import Client, Completion, ServingError


@dataclass(frozen=True)
class Job:
    """One request of a load: ``cancel_after`` chunks then cancel (None: never); ``deadline`` seconds (None: none)."""

    prompt: str | tuple[int, ...]
    max_tokens: int
    cancel_after: int | None = None
    deadline: float | None = None


@dataclass
class Outcome:
    """How job ``index`` ended: ``status`` is ``"completed"``, ``"cancelled"`` or a gRPC status code's name."""

    index: int
    status: str
    completion: Completion | None
    num_chunks: int  # chunks received before the end (a failure after output > 0: it was mid-stream)
    token_ids: tuple[int, ...]  # every token received, in order
    ttft_s: float | None  # send -> first chunk
    e2e_s: float  # send -> end
    details: str = ""


@dataclass
class LoadResult:
    outcomes: list[Outcome]
    lost: list[int]  # jobs started that did not end within the time limit
    not_started: list[int]  # jobs the time limit left unsent
    wall_s: float
    counts: Counter = field(default_factory=Counter)

    def completed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "completed"]

    @property
    def output_tokens(self) -> int:
        """Tokens received by every request, whatever its end (the server computed them all)."""
        return sum(len(o.token_ids) for o in self.outcomes)


def _one(client: Client, index: int, job: Job) -> Outcome:
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    ids: list[int] = []
    try:
        stream = client.stream(job.prompt, job.max_tokens, deadline=job.deadline)
        for chunk in stream:
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunks += 1
            ids += chunk.token_ids
            if job.cancel_after is not None and chunks >= job.cancel_after:
                stream.cancel()
        status = "cancelled" if stream.cancelled else "completed"
        return Outcome(index, status, stream.completion, chunks, tuple(ids), ttft, time.perf_counter() - t0)
    except ServingError as exc:
        return Outcome(index, exc.code.name, None, chunks, tuple(ids), ttft, time.perf_counter() - t0, exc.details)


def run_load(client: Client, jobs: Sequence[Job], *, concurrency: int = 64, time_limit: float = 600.0) -> LoadResult:
    """Run ``jobs`` through ``client`` from ``concurrency`` threads (closed loop); see the module docstring."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    todo: queue.Queue[tuple[int, Job]] = queue.Queue()
    for item in enumerate(jobs):
        todo.put(item)
    outcomes: dict[int, Outcome] = {}
    started: set[int] = set()
    lock = threading.Lock()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            try:
                index, job = todo.get_nowait()
            except queue.Empty:
                return
            with lock:
                started.add(index)
            outcome = _one(client, index, job)
            with lock:
                outcomes[index] = outcome

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True, name=f"load-{i}") for i in range(concurrency)]
    for t in threads:
        t.start()
    end = t0 + time_limit
    for t in threads:
        t.join(max(0.0, end - time.perf_counter()))
    stop.set()  # a worker still blocked in a call is abandoned: its job is lost
    wall = time.perf_counter() - t0
    with lock:
        done, sent = dict(outcomes), set(started)
    lost = sorted(sent - set(done))
    not_started = [i for i in range(len(jobs)) if i not in sent]
    result = LoadResult([done[i] for i in sorted(done)], lost, not_started, wall)
    result.counts = Counter(o.status for o in result.outcomes)
    return result


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_summary(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """p50 / p99 of TTFT and end-to-end latency over completed requests, in seconds."""
    done = [o for o in outcomes if o.status == "completed"]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    e2e = [o.e2e_s for o in done]
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99)}


# ---------------------------------------------------------------------------------------------- workloads
_PASSAGE = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and arrows of "
    "outrageous fortune, or to take arms against a sea of troubles, and by opposing end them. To die, to sleep, no "
    "more; and by a sleep to say we end the heart-ache and the thousand natural shocks that flesh is heir to. "
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. The evil that men do "
    "lives after them; the good is oft interred with their bones. Now is the winter of our discontent made glorious "
    "summer by this sun of York, and all the clouds that lour'd upon our house in the deep bosom of the ocean buried. "
    "All the world's a stage, and all the men and women merely players; they have their exits and their entrances, "
    "and one man in his time plays many parts. ")
_CHARACTERS = ("Hamlet", "Ophelia", "Horatio", "Lear", "Cordelia", "Macbeth", "Banquo", "Othello", "Desdemona",
               "Iago", "Prospero", "Miranda", "Viola", "Orsino", "Rosalind", "Portia", "Shylock", "Juliet", "Falstaff",
               "Puck", "Oberon", "Titania", "Brutus", "Cassius")


def mixed_jobs(n: int, *, seed: int = 0, cancel_fraction: float = 0.1, deadline_fraction: float = 0.1,
               max_tokens: Sequence[int] = (4, 8, 16, 32), deadline_s: tuple[float, float] = (0.02, 0.3),
               ) -> list[Job]:
    """``n`` jobs of mixed prompt lengths (a few words to a few hundred characters of Shakespeare, from random
    offsets) and mixed ``max_tokens``; a ``cancel_fraction`` cancel after 1-3 chunks, a ``deadline_fraction`` carry
    a short deadline (which some meet and some do not). Seeded: the same ``seed`` gives the same jobs."""
    import random

    rng = random.Random(seed)
    text = _PASSAGE * 2
    jobs = []
    for _ in range(n):
        start = rng.randrange(len(_PASSAGE))
        prompt = text[start:start + rng.choice((12, 40, 120, 400))].strip() or "To be"
        r = rng.random()
        cancel = rng.randint(1, 3) if r < cancel_fraction else None
        deadline = rng.uniform(*deadline_s) if cancel_fraction <= r < cancel_fraction + deadline_fraction else None
        jobs.append(Job(prompt, rng.choice(max_tokens), cancel_after=cancel, deadline=deadline))
    return jobs


def system_prompts(k: int) -> list[str]:
    """``k`` distinct system prompts of about 60-70 tokens, different from their first block on."""
    if not 1 <= k <= len(_CHARACTERS):
        raise ValueError(f"k must be in [1, {len(_CHARACTERS)}], got {k}")
    words = _PASSAGE.split()
    return [f"{name} speaks. You are {name}; answer in {name}'s voice, in verse. "
            + " ".join(words[7 * i:7 * i + 40]) + "\n" for i, name in enumerate(_CHARACTERS[:k])]


def shared_prefix_jobs(n: int, num_system_prompts: int, *, max_tokens: int = 8, seed: int = 0) -> list[Job]:
    """``n`` jobs, each a system prompt (chosen at random among ``num_system_prompts``) + its own short question."""
    import random

    rng = random.Random(seed)
    systems = system_prompts(num_system_prompts)
    return [Job(rng.choice(systems) + f"Question {i}: what of {rng.choice(_CHARACTERS)}?", max_tokens)
            for i in range(n)]

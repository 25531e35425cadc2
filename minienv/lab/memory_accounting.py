"""Where does KV-cache memory go? The bookkeeping of the vLLM paper's Figure 2.

Kwon et al. (SOSP 2023, Fig. 2) split the KV memory of a serving system into four parts and showed that systems
which reserve one *contiguous* chunk per request keep real token states in only 20.4-38.2 % of it, while paging
(vLLM) reaches 96.3 %. Notebook 03 replays a workload (``minienv.lab.workload``) through a fixed KV memory of
``kv_slots`` token slots under each allocation scheme and measures the same four parts.

The experiment's loop is the notebook's own ``serve`` (steps 0-4 below): it is the one route every result of the
chapter comes from, and ``tests/unit/test_memory_accounting.py`` runs that very loop, taken from the notebook. This
module keeps the bookkeeping the loop calls, one job per piece:

* :class:`Arrivals` — the requests in arrival order, released step by step (all at once when they all arrive at
  t = 0);
* two memories with one interface — :class:`ContiguousMemory` (Orca's reserved chunks) and :class:`PagedMemory`
  (vLLM's blocks), made by :func:`kv_memory`: ``admit`` a request (or ``None``), ``grow`` it by one token
  (``False`` when a paged request needs a block and none is free), ``free`` it, and ``slots``: every slot in one
  category at the end of a step (a :class:`StepSlots`);
* :func:`average_slots` and :func:`hole_blocked_fraction` — what the notebook reads off the steps.

The model
---------
Time advances in *steps* (one decode iteration). In step ``t``:

0. **Arrive.** The requests with ``arrival_time <= t * step_duration`` join the back of the waiting queue.
1. **Decode.** Every running request, in admission order, appends one token: its length grows by one.
   Under paging, a request whose last block is full first takes a new block; if none is free, the most
   recently admitted running request is *preempted* (all its blocks freed, put back at the front of the waiting
   queue; when re-admitted its prompt and the tokens it had generated are recomputed — vLLM's recompute).
2. **Finish.** A request whose length reached ``prompt_len + output_len`` leaves and frees its memory.
3. **Admit (FCFS).** While the oldest waiting request's allocation fits, it is admitted and its prompt is
   prefilled at once (length = prompt, or prompt + generated for a resumed request). Admission never skips the head of the queue, and (like vLLM's scheduler) no request
   is admitted in a step that had to preempt. Under paging, admission also leaves ``watermark`` (default 1 %, vLLM
   v0's default) of the blocks free, so that a just-admitted request is not preempted at once.
4. **Account.** The memory is split into the categories below (``memory.slots``).

Allocation schemes (``SCHEMES``)
--------------------------------
* ``orca_max``    — contiguous, reserves ``max_len`` slots (the model's maximum sequence length) per request.
* ``orca_pow2``   — contiguous, reserves ``prompt_len + next_pow2(output_len)`` (capped at ``max_len``): the
  output space over-reserved by at most 2x, the paper's example being 32 slots for a 25-token output.
* ``orca_oracle`` — contiguous, reserves exactly ``prompt_len + output_len`` (knows the future).
* ``paged``       — vLLM: ``kv_slots // block_size`` blocks of ``block_size`` slots, taken one at a time as the
  request grows; a request's blocks need not be adjacent. The blocks come from the engine's own
  :class:`~minienv.kv.block_pool.BlockPool` (allocate at admission and at block boundaries, free last block first
  on finish or preemption), so the simulation keeps the token counts and the pool keeps the blocks.

Contiguous chunks live in one linear address space, placed by one of two allocators:

* ``allocator="buddy"`` (default) — a binary buddy allocator (``BuddyAllocator``), which the paper assumed Orca
  uses: every chunk is rounded up to a power of two and aligned to it.
* ``allocator="first_fit"`` — ``FirstFitAllocator``: the lowest-addressed hole that is large enough; freed
  chunks merge with free neighbours.

Either way, holes between live chunks are what make external fragmentation.

The categories (exact definitions; every slot of the pool is in exactly one)
--------------------------------------------------------------------------
For a running request with current length ``l``, final length ``L = prompt_len + output_len`` and ``A`` allocated
slots (contiguous: its chunk; paged: ``blocks * block_size``):

* **token states**   ``l`` — slots holding K/V of tokens already computed (prompt + generated so far).
* **reservation**    ``min(A, L) - l`` — allocated, empty now, but a future token of this request will fill them.
* **internal frag.** ``A - min(A, L)`` — allocated to the request and never used by it (reserved beyond its real
  final length; for paging, the part of the last block past the request's final token).

and for the slots no request holds (``kv_slots - sum A``):

* **external frag.** free slots at a step that ends with an arrived request still waiting — memory that exists
  but cannot be given to the work that is queued (no hole large enough, or not enough left for the next
  reservation). This is the paper's "external fragmentation & others". For paging it also includes the
  ``kv_slots % block_size`` slots too few to form a block (always), and for the buddy allocator the slots by
  which it rounded live chunks up to a power of two (always: they belong to no request's reservation).
* **free**           free slots at a step that ends with nobody waiting: idle capacity, not waste.

So ``token_states + reservation + internal_frag + external_frag + free == kv_slots`` at every step.
:func:`average_slots` averages the steps over the *loaded window* — from the first step to the step at which the
last request was admitted (for the last time) — because the paper measured a serving system under sustained load;
the drain after the last admission (nothing left to admit, memory emptying) is excluded. ``window="all"``
averages over the whole run instead (the right choice when requests arrive over time).

Note on the paper's vLLM bar: it shows 96.3 % token states and 3.7 % "reservation + internal fragmentation"
without splitting them. With the definitions above, most of a paged request's empty last-block tail is
*reservation* (its next tokens will fill it); only the tail of its final block is internal fragmentation.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

from minienv.kv.block_pool import BlockPool
from minienv.lab.contiguous_allocators import BuddyAllocator, FirstFitAllocator, next_pow2
from minienv.lab.workload import RequestSpec

__all__ = [
    "SCHEMES",
    "SCHEME_LABELS",
    "CATEGORIES",
    "PAPER_FIGURE2",
    "FirstFitAllocator",
    "BuddyAllocator",
    "MemoryBreakdown",
    "StepSlots",
    "Arrivals",
    "RunningRequest",
    "ContiguousMemory",
    "PagedMemory",
    "kv_memory",
    "average_slots",
    "hole_blocked_fraction",
    "next_pow2",
    "contiguous_reservation",
    "blocks_needed",
    "paged_internal_fragmentation",
    "format_figure2_table",
]

SCHEMES = ("orca_max", "orca_pow2", "orca_oracle", "paged")
SCHEME_LABELS = {
    "orca_max": "Orca (Max)",
    "orca_pow2": "Orca (Pow2)",
    "orca_oracle": "Orca (Oracle)",
    "paged": "vLLM (paged)",
}
CATEGORIES = ("token_states", "reservation", "internal_frag", "external_frag", "free")

#: Kwon et al. 2023, Figure 2 (percent of KV-cache memory, OPT-13B on one A100-40GB, ShareGPT, §6.2).
#: The vLLM bar does not split reservation from internal fragmentation (3.7 % together); Oracle has no
#: internal fragmentation; the last category is "external fragmentation & others".
PAPER_FIGURE2: dict[str, dict[str, float | None]] = {
    "orca_max": {"token_states": 20.4, "reservation": 13.3, "internal_frag": 57.3, "external_frag": 8.9},
    "orca_pow2": {"token_states": 26.8, "reservation": 17.9, "internal_frag": 13.6, "external_frag": 41.6},
    "orca_oracle": {"token_states": 38.2, "reservation": 25.2, "internal_frag": 0.0, "external_frag": 36.6},
    "paged": {"token_states": 96.3, "reservation": None, "internal_frag": None, "external_frag": 0.0,
              "reservation+internal": 3.7},
}


# --------------------------------------------------------------------------------------------- sizes
def contiguous_reservation(scheme: str, prompt_len: int, output_len: int, max_len: int) -> int:
    """Slots a contiguous scheme reserves for a request at admission (see the module docstring)."""
    if scheme == "orca_max":
        return max_len
    if scheme == "orca_pow2":
        return min(max_len, prompt_len + next_pow2(output_len))
    if scheme == "orca_oracle":
        return prompt_len + output_len
    raise ValueError(f"{scheme!r} is not a contiguous scheme; choose one of {SCHEMES[:3]}")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def paged_internal_fragmentation(num_tokens: int, block_size: int) -> int:
    """Empty slots in the last block of a finished request of ``num_tokens`` tokens."""
    return blocks_needed(num_tokens, block_size) * block_size - num_tokens


# ------------------------------------------------------------------------------------- results
class StepSlots(NamedTuple):
    """One step's slots per category (they sum to ``kv_slots``), with how many requests run and wait, and
    whether the request at the head of the queue waits for a *hole* (contiguous schemes: the free memory in total
    would hold its chunk, no single hole does)."""

    token_states: int
    reservation: int
    internal_frag: int
    external_frag: int
    free: int
    running: int
    waiting: int
    hole_blocked: bool = False


@dataclass(frozen=True)
class MemoryBreakdown:
    """Average slots per category (see the module docstring); they sum to ``kv_slots``."""

    token_states: float
    reservation: float
    internal_frag: float
    external_frag: float
    free: float

    @property
    def total(self) -> float:
        return self.token_states + self.reservation + self.internal_frag + self.external_frag + self.free

    def percent(self, include_free: bool = True) -> dict[str, float]:
        """Each category as a percentage of the whole pool, or (``include_free=False``) of the pool minus the
        idle free memory — the view in which a lightly loaded system is not charged for having nothing to do."""
        total = self.total if include_free else self.total - self.free
        if total <= 0:
            return dict.fromkeys(CATEGORIES, 0.0)
        out = {c: 100.0 * getattr(self, c) / total for c in CATEGORIES}
        if not include_free:
            out["free"] = 0.0
        return out


class Arrivals:
    """The workload's requests in arrival order (FCFS: by arrival time, then id), released step by step.

    Each call of :meth:`next_step` is one step later: step ``t`` (from 0) releases every request with
    ``arrival_time <= t * step_duration`` not released yet, as waiting-queue entries ``(request, 0)`` (no token
    generated yet). ``len()`` is the number still to arrive, so the serving loop runs ``while arrivals or ...``.
    """

    def __init__(self, requests: Iterable[RequestSpec], step_duration: float = 1.0) -> None:
        if not (isinstance(step_duration, (int, float)) and step_duration > 0 and math.isfinite(step_duration)):
            raise ValueError(f"step_duration must be a finite number > 0, got {step_duration!r}")
        self.step_duration = step_duration
        self._queue = deque(sorted(requests, key=lambda r: (r.arrival_time, r.request_id)))
        if not self._queue:
            raise ValueError("the workload has no request")
        self._step = 0

    def __len__(self) -> int:
        return len(self._queue)

    def next_step(self) -> list[tuple[RequestSpec, int]]:
        """The requests that arrive by the start of the next step, as ``(request, 0)`` queue entries."""
        now = self._step * self.step_duration
        self._step += 1
        out = []
        while self._queue and self._queue[0].arrival_time <= now:
            out.append((self._queue.popleft(), 0))
        return out


@dataclass(eq=False)
class RunningRequest:
    """One admitted request: its length so far and the memory it holds (the memory object keeps the totals).
    Compared by identity, as the requests in a running list are (``r in running`` is a fast identity test)."""

    spec: RequestSpec
    length: int  # tokens whose K/V are stored
    alloc: int  # slots held (chunk size, or blocks * block_size)
    internal: int  # alloc - min(alloc, final length)
    start: int = -1  # chunk start address (contiguous schemes)
    blocks: list[int] = field(default_factory=list)  # block ids held in the real BlockPool (paged)
    final: int = field(init=False)  # prompt + output: the length at which it finishes (read every step)

    def __post_init__(self) -> None:
        self.final = self.spec.total_len

    @property
    def generated(self) -> int:
        """Output tokens so far (what a preempted request keeps and recomputes on resume)."""
        return self.length - self.spec.prompt_len

    @property
    def done(self) -> bool:
        return self.length >= self.final


class _KVMemory:
    """What both kinds of memory share: running totals over the requests they hold, and the per-step accounting.

    The totals move only in ``admit``/``grow``/``free``, so ``slots`` is O(1) whatever the number of requests.
    """

    def __init__(self, kv_slots: int) -> None:
        self.kv_slots = kv_slots
        self.tokens = self.alloc = self.internal = 0
        self.slack = 0  # buddy rounding of live chunks (contiguous only): held by no request's reservation
        self.unusable = 0  # slots too few to form a block (paged only)

    def _hold(self, r: RunningRequest, sign: int) -> None:
        self.tokens += sign * r.length
        self.alloc += sign * r.alloc
        self.internal += sign * r.internal

    def slots(self, running: Sequence[RunningRequest], waiting: Sequence[tuple[RequestSpec, int]]) -> StepSlots:
        """Every slot of the memory in exactly one category at the end of a step (see the module docstring);
        ``waiting`` holds the queue's ``(request, generated)`` entries, head first."""
        free_now = self.kv_slots - self.alloc - self.slack
        if waiting:  # memory exists, but the queued work cannot have it
            external, idle = free_now + self.slack, 0
        else:
            external = self.unusable + self.slack
            idle = self.kv_slots - self.alloc - external
        return StepSlots(self.tokens, self.alloc - self.tokens - self.internal, self.internal, external, idle,
                         len(running), len(waiting), bool(waiting) and self.hole_blocked(waiting[0][0]))

    def hole_blocked(self, spec: RequestSpec) -> bool:
        """Whether a waiting request waits for a hole rather than for memory (never, for paging)."""
        return False

    @staticmethod
    def _check_lengths(spec: RequestSpec) -> None:
        if spec.prompt_len < 1 or spec.output_len < 1:
            raise ValueError(f"request {spec.request_id}: prompt_len and output_len must be >= 1, "
                             f"got {spec.prompt_len} and {spec.output_len}")


class ContiguousMemory(_KVMemory):
    """Orca's schemes: one chunk per request, reserved at admission (``contiguous_reservation``) and placed by a
    buddy or first-fit allocator; it never grows, so decoding never needs memory."""

    def __init__(self, scheme: str, kv_slots: int, *, max_len: int = 2048, allocator: str = "buddy") -> None:
        contiguous_reservation(scheme, 1, 1, max_len)  # validates the scheme
        if allocator not in ("first_fit", "buddy"):
            raise ValueError(f"allocator must be 'first_fit' or 'buddy', got {allocator!r}")
        super().__init__(kv_slots)
        self.scheme, self.max_len, self.allocator = scheme, max_len, allocator
        self.space = (FirstFitAllocator if allocator == "first_fit" else BuddyAllocator)(kv_slots)
        # the largest chunk this memory can ever place: a buddy block lives inside one power-of-two region
        self.largest_chunk = kv_slots if allocator == "first_fit" else 1 << (kv_slots.bit_length() - 1)

    def reservation(self, spec: RequestSpec) -> int:
        return contiguous_reservation(self.scheme, spec.prompt_len, spec.output_len, self.max_len)

    def admit(self, spec: RequestSpec, generated: int = 0, busy: bool = False) -> RunningRequest | None:
        """Reserve the request's whole chunk, or ``None`` (nothing changed) when no hole holds it now.

        Raises ValueError (nothing changed) for a request no empty memory could hold — longer than ``max_len``, or
        a chunk larger than the largest one this memory can place — which would otherwise wait forever."""
        self._check_lengths(spec)
        if spec.total_len > self.max_len:
            raise ValueError(f"request {spec.request_id} has {spec.total_len} tokens > max_len={self.max_len}")
        size = self.reservation(spec)
        occupied = self.space.block_size(size)
        if occupied > self.largest_chunk:
            raise ValueError(f"request {spec.request_id} needs {occupied} slots and can never "
                             f"fit in {self.kv_slots} ({self.scheme}, {self.allocator} allocation)")
        # (not enough free memory in total: no hole can hold it, and the allocator need not look)
        start = self.space.allocate(size) if occupied <= self.space.free_slots else None
        if start is None:
            return None
        self.slack += occupied - size
        r = RunningRequest(spec, spec.prompt_len + generated, size, size - spec.total_len, start)
        self._hold(r, +1)
        return r

    def grow(self, r: RunningRequest) -> bool:
        """One more token, in the chunk reserved for it: always room."""
        r.length += 1
        self.tokens += 1
        return True

    def free(self, r: RunningRequest) -> None:
        self._hold(r, -1)
        self.space.free(r.start, r.alloc)
        self.slack -= self.space.block_size(r.alloc) - r.alloc

    def hole_blocked(self, spec: RequestSpec) -> bool:
        """For a request ``admit`` just refused: the free memory in total would hold its chunk, but no single hole
        does."""
        return self.space.free_slots >= self.space.block_size(self.reservation(spec))


class PagedMemory(_KVMemory):
    """vLLM: blocks of ``block_size`` slots from minienv's own :class:`BlockPool`, taken one at a time as a request
    grows. Admission keeps ``watermark`` of the blocks free while others run (vLLM v0's default 1 %)."""

    def __init__(self, kv_slots: int, *, block_size: int = 16, watermark: float = 0.01) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if kv_slots // block_size < 1:
            raise ValueError(f"kv_slots={kv_slots} holds no block of {block_size} slots")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        super().__init__(kv_slots)
        self.block_size = block_size
        self.pool = BlockPool(kv_slots // block_size)
        self.unusable = kv_slots - self.pool.num_blocks * block_size  # too few to form a block: always external
        self.watermark_blocks = int(watermark * self.pool.num_blocks)

    def admit(self, spec: RequestSpec, generated: int = 0, busy: bool = False) -> RunningRequest | None:
        """Blocks for the prompt (and the recomputed output of a resumed request), or ``None`` (nothing changed).

        Raises ValueError (nothing changed) for a request whose final length needs more blocks than the pool has:
        it could never finish, and would be preempted and resumed forever."""
        self._check_lengths(spec)
        if blocks_needed(spec.total_len, self.block_size) > self.pool.num_blocks:
            raise ValueError(f"request {spec.request_id} needs {blocks_needed(spec.total_len, self.block_size)} "
                             f"blocks of {self.block_size} and can never fit in {self.pool.num_blocks}")
        length = spec.prompt_len + generated
        nb, free_blocks = blocks_needed(length, self.block_size), self.pool.num_free_blocks
        if nb > free_blocks or (busy and nb + self.watermark_blocks > free_blocks):
            return None  # (the watermark never blocks a request that would run alone)
        alloc = nb * self.block_size
        r = RunningRequest(spec, length, alloc, max(0, alloc - spec.total_len), blocks=self.pool.allocate(nb))
        self._hold(r, +1)
        return r

    def grow(self, r: RunningRequest) -> bool:
        """One more token; a full last block first takes a new one. ``False`` (nothing changed): no block is free."""
        if r.length == r.alloc:
            if self.pool.num_free_blocks == 0:
                return False
            r.blocks += self.pool.allocate(1)
            r.alloc += self.block_size
            self.alloc += self.block_size
            new_internal = max(0, r.alloc - r.final)
            self.internal += new_internal - r.internal
            r.internal = new_internal
        r.length += 1
        self.tokens += 1
        return True

    def free(self, r: RunningRequest) -> None:
        self._hold(r, -1)
        self.pool.free(r.blocks[::-1])  # last block first, as the engine frees
        r.blocks = []


def kv_memory(scheme: str, kv_slots: int, *, max_len: int = 2048, block_size: int = 16, allocator: str = "buddy",
              watermark: float = 0.01) -> ContiguousMemory | PagedMemory:
    """An empty KV memory of ``kv_slots`` slots that places requests the way ``scheme`` does."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {SCHEMES}")
    if scheme == "paged":
        return PagedMemory(kv_slots, block_size=block_size, watermark=watermark)
    return ContiguousMemory(scheme, kv_slots, max_len=max_len, allocator=allocator)


def average_slots(steps: Iterable[StepSlots], window: str = "loaded") -> tuple[MemoryBreakdown, float]:
    """The time average of per-step slot counts, and of the running requests.

    ``window="loaded"`` (the paper's measurement under sustained load) averages up to the step of the last
    admission: the step after the last one that ended with a request waiting. That is exact when every request
    waits from t = 0; with arrivals over time use ``window="all"``, the whole run."""
    steps = list(steps)
    if not steps:
        raise ValueError("average_slots needs at least one step")
    if window not in ("loaded", "all"):
        raise ValueError(f"window must be 'loaded' or 'all', got {window!r}")
    n = len(steps) if window == "all" else 1 + max((i + 1 for i, st in enumerate(steps) if st.waiting), default=0)
    kept = steps[:n]
    breakdown = MemoryBreakdown(**{c: sum(getattr(st, c) for st in kept) / n for c in CATEGORIES})
    return breakdown, sum(st.running for st in kept) / n


def hole_blocked_fraction(steps: Iterable[StepSlots]) -> float:
    """Of the steps that ended with a request waiting, the fraction in which it waited for a hole: the free memory
    in total would hold its chunk, but no single hole does (external fragmentation in its purest form)."""
    blocked = [st.hole_blocked for st in steps if st.waiting]
    return sum(blocked) / len(blocked) if blocked else 0.0


def notebook_serve(path: Path | None = None) -> Callable:
    """Notebook 03's ``serve`` loop, taken from the notebook's own source (in a source checkout). The chapter's
    results have one route, the loop its reader reads; the benchmark and the tests run that loop, not a copy."""
    path = Path(__file__).resolve().parents[2] / "notebooks" / "03_kv_memory.py" if path is None else path
    try:
        src = path.read_text(encoding="utf-8")
        start = src.index("def serve(requests, memory, step_duration=1.0):")
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"notebook 03's serve loop not found in {path} (a source checkout is needed): {exc}") from None
    namespace = {"deque": deque, "Arrivals": Arrivals}
    exec(src[start:src.index("\n\n\n", start)], namespace)  # noqa: S102 - the repository's own notebook
    return namespace["serve"]


def format_figure2_table(results: dict[str, MemoryBreakdown], paper: dict = PAPER_FIGURE2) -> str:
    """A fixed-width text table: our category percentages, and token states ours vs the paper's (``results``: per
    scheme, an :func:`average_slots` breakdown)."""
    head = (f"{'scheme':<14}{'token':>7}{'reserv':>8}{'int.frag':>9}{'ext.frag':>9}{'free':>6}"
            f"{'paper token':>13}{'ours/paper':>11}")
    lines = [head, "-" * len(head)]
    for s, res in results.items():
        p = res.percent()
        ref = paper.get(s, {}).get("token_states")
        ratio = f"{p['token_states'] / ref:>11.2f}" if ref else f"{'-':>11}"
        lines.append(
            f"{SCHEME_LABELS[s]:<14}{p['token_states']:>7.1f}{p['reservation']:>8.1f}{p['internal_frag']:>9.1f}"
            f"{p['external_frag']:>9.1f}{p['free']:>6.1f}{(f'{ref:.1f}' if ref else '-'):>13}{ratio}"
        )
    return "\n".join(lines)

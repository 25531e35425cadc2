"""Notebook 13's exercises: predict the fragmentation of serving a trace, and the cost of a block size for a set of
requests, one term per column of the trade.

The first (:func:`check_fragmentation_prediction`) predicts one column, fragmentation, against what the real
scheduler and manager measure on seeded traces. The second puts three columns in one number a student can minimise —
empty slots, shared-prefix tokens recomputed because hits come in whole blocks, and block-table entries — so that
choosing a block size becomes an ``argmin`` over candidates. The check runs one hand-made case per rule (each
built so that exactly one term is non-zero), then random cases against :func:`block_size_cost_reference`.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from minienv.exercises._check import exercise, fail, require

# ------------------------------------------------------------------------------------------ exercise 1
_EXERCISE_BLOCK_SIZES = (1, 3, 16, 64)
_CASES: list[tuple[list[tuple[int, int]], int, float]] | None = None


def _fragmentation_cases() -> list[tuple[list[tuple[int, int]], int, float]]:
    """(lengths, block size, measured fragmentation): seeded traces served by the real scheduler and manager with
    room for everyone (no preemption) and no sharing, plus the smallest trace — one request of one prompt token and
    one output token. Computed once per process."""
    global _CASES
    if _CASES is None:
        from minienv.lab.block_size import Trace, alpaca_trace, sharegpt_trace, simulate

        tiny = Trace("one token", (_one_token_request(),))
        cases = []
        for trace in (alpaca_trace(24, seed=1), alpaca_trace(24, seed=2), sharegpt_trace(6, max_len=512, seed=3), tiny):
            lengths = [(len(r.prompt), r.output_len) for r in trace.requests]
            budget = sum(r.total_len + 64 for r in trace.requests)
            for b in _EXERCISE_BLOCK_SIZES:
                cases.append((lengths, b, simulate(trace, budget, b, enable_prefix_caching=False).frag))
        _CASES = cases
    return _CASES


def _one_token_request():
    from minienv.lab.block_size import TraceRequest

    return TraceRequest((7,), 1)


_FRAG_RULES = {
    "fraction": "answer a fraction in [0, 1) — wasted / allocated slots — not a percentage",
    "steps": "sum wasted and allocated slots over every step (lengths prompt, prompt + 1, …, prompt + output − 1), "
             "then divide once",
}


@exercise("write predict_fragmentation(lengths, B): wasted / allocated KV slots, summed over every step")
def check_fragmentation_prediction(fn) -> str:
    """``fn(lengths, block_size)`` against the fragmentation the real scheduler and manager measure, at block sizes
    1, 3, 16 and 64, on the smallest trace (one request, one token each way) and three seeded traces."""
    for lengths, b, measured in _fragmentation_cases():
        fn.rule = _FRAG_RULES["steps"]
        got = fn([tuple(x) for x in lengths], b)
        where = f"block size {b}, {len(lengths)} request(s) {lengths[:3]}{'…' if len(lengths) > 3 else ''}"
        require(isinstance(got, (float, int, np.floating)) and not isinstance(got, bool) and 0 <= got < 1,
                _FRAG_RULES["fraction"], f"{where}: got {got!r}")
        require(abs(float(got) - measured) <= 0.0005, _FRAG_RULES["steps"],
                f"{where}: the measured fragmentation is {measured:.4f}, you predicted {float(got):.4f}")
    return "predict_fragmentation equals the measured fragmentation on every trace and block size"


# ------------------------------------------------------------------------------------------ exercise 2


def block_size_cost_reference(requests: list[tuple[int, int, int]], block_size: int, entry_cost: float) -> float:
    """The cost the notebook states, written plainly (the check compares against it).

    ``requests``: ``(prompt_len, output_len, shared_len)`` — ``shared_len`` prompt tokens are a prefix some earlier
    request already has cached. Per request, at its final length ``L = prompt_len + output_len``:

    * **empty slots**: ``ceil(L / B) * B - L`` (the last block's unused tail; 0 when it is exactly full);
    * **recomputed shared tokens**: ``shared_len - hit`` with ``hit = min(shared_len, prompt_len - 1) // B * B``
      (hits are whole blocks, and never the prompt's last token — it must be computed to sample from it);
    * **table entries**: ``entry_cost * ceil(L / B)``.

    Summed over the requests. All three are in "token slots", so the sum is one number to minimise.
    """
    total = 0.0
    for prompt_len, output_len, shared_len in requests:
        length = prompt_len + output_len
        blocks = -(-length // block_size)
        hit = min(shared_len, prompt_len - 1) // block_size * block_size
        total += (blocks * block_size - length) + (shared_len - hit) + entry_cost * blocks
    return total


def pick_block_size(cost, requests: list[tuple[int, int, int]], candidates, entry_cost: float) -> int:
    """The candidate with the lowest ``cost(requests, B, entry_cost)``; the smaller block size among equals."""
    return min(candidates, key=lambda b: (cost(requests, b, entry_cost), b))


_RULES = {
    "empty": "empty slots: ceil(length / B) × B − length at the final length (prompt + output); 0 when exactly full",
    "whole": "a shared prefix hits in whole blocks only: the tokens past its last full block are recomputed",
    "last": "the prompt's last token is never a hit: at most prompt_len − 1 shared tokens can hit",
    "entries": "every block-table entry costs entry_cost: ceil(length / B) entries per request",
    "sum": "the cost is summed over all the requests",
    "number": "return one number",
}


@exercise("write block_size_cost(requests, B, entry_cost): empty slots + recomputed shared tokens + table entries")
def check_block_size_cost(fn) -> str:
    def ask(requests: list[tuple[int, int, int]], b: int, entry_cost: float) -> float:
        try:
            got = fn([tuple(r) for r in requests], b, entry_cost)
        except Exception as err:  # noqa: BLE001 — a crash on a valid case is a wrong answer, said plainly
            fail("the function must answer every case",
                 f"block_size_cost({requests}, {b}, {entry_cost}) raised {type(err).__name__}: {err}")
        if isinstance(got, bool) or not isinstance(got, (numbers.Real, np.floating, np.integer)):
            fail(_RULES["number"], f"block_size_cost({requests}, {b}, {entry_cost}) returned {got!r}")
        return float(got)

    def expect(requests: list[tuple[int, int, int]], b: int, entry_cost: float, rule: str, why: str) -> None:
        got, want = ask(requests, b, entry_cost), block_size_cost_reference(requests, b, entry_cost)
        require(math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9), _RULES[rule],
                f"{why}: block_size_cost({requests}, B={b}, entry_cost={entry_cost}) expected {want:g}, got {got:g}")

    # One term at a time: no sharing and free entries leave only the empty slots, and so on.
    expect([(9, 3, 0)], 8, 0, "empty", "12 tokens fill one block of 8 and 4 slots of a second")
    expect([(10, 6, 0)], 8, 0, "empty", "16 tokens fill two blocks of 8 exactly")
    expect([(40, 8, 20)], 8, 0, "whole", "20 shared tokens: two whole blocks (16) hit, 4 are recomputed")
    expect([(16, 16, 16)], 8, 0, "last", "a 16-token prompt that is all shared: only 15 can hit, so one block")
    expect([(9, 7, 0)], 4, 2.5, "entries", "16 tokens in blocks of 4: 4 entries, nothing empty or shared")
    expect([(9, 3, 0), (10, 6, 0), (40, 8, 20)], 8, 1, "sum", "three requests: add their costs")

    rng = np.random.default_rng(13)
    tried = 0
    for _ in range(300):
        requests = []
        for _ in range(int(rng.integers(1, 6))):
            prompt_len = int(rng.integers(1, 300))
            requests.append((prompt_len, int(rng.integers(1, 200)), int(rng.integers(0, prompt_len + 1))))
        b, entry_cost = int(rng.choice([1, 2, 3, 4, 8, 16, 32, 64, 128, 256])), float(rng.choice([0, 0.5, 4, 32]))
        got, want = ask(requests, b, entry_cost), block_size_cost_reference(requests, b, entry_cost)
        if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
            fail("cost = empty slots + recomputed shared tokens + entry_cost × entries, summed over requests",
                 f"block_size_cost({requests}, B={b}, entry_cost={entry_cost}) expected {want:g}, got {got:g}")
        tried += 1
    picks = {e: pick_block_size(fn, [(240 + 20, 60, 240)] * 4, (4, 8, 16, 32, 64, 128, 256), e) for e in (1, 32)}
    return (f"block_size_cost is right in all {tried + 6} cases; four requests behind a 240-token shared prompt "
            f"would pick B={picks[1]} at entry_cost 1 and B={picks[32]} at entry_cost 32")

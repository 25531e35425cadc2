"""Notebook 10's exercises: the backoff ceilings of gRPC's retry policy, and a prefix-aware router with a fallback.

Both checks run offline (no server): the first against gRPC's retry rule, the second against the routing rule the
notebook states, on hand-made cases (one per rule) and then on a trace of shared system prompts where the check
also measures what the routing is for — every prompt of a system prompt lands where its prefix is cached.
"""

from __future__ import annotations

import math

import numpy as np

from minienv.exercises._check import exercise, fail, require
from minienv.kv.hashing import ROOT_HASH, hash_block_tokens


# ------------------------------------------------------------------------------------------ retry backoff
def retry_ceilings_reference(max_attempts: int, initial_backoff: float, multiplier: float,
                             max_backoff: float) -> list[float]:
    """gRPC's retry rule (gRFC A6), written plainly: retry ``n`` (1-based) waits ``random(0, ceiling_n)`` with
    ``ceiling_n = min(initial_backoff * multiplier ** (n - 1), max_backoff)``; ``max_attempts`` counts the first
    call, so there are ``max_attempts - 1`` retries."""
    return [min(initial_backoff * multiplier ** (n - 1), max_backoff) for n in range(1, max_attempts)]


@exercise("write retry_ceilings(max_attempts, initial_backoff, multiplier, max_backoff): one ceiling per retry")
def check_retry_ceilings(fn) -> str:
    cases = [  # (args, the rule a wrong answer on this case breaks first)
        ((2, 0.1, 2.0, 10.0), "the first retry waits up to initial_backoff"),
        ((5, 0.1, 2.0, 10.0), "each ceiling is multiplier × the previous one (exponential, not linear)"),
        ((6, 0.1, 3.0, 1.0), "no ceiling exceeds max_backoff"),
        ((3, 5.0, 2.0, 1.0), "no ceiling exceeds max_backoff — the first one included (initial_backoff > max_backoff)"),
        ((4, 0.5, 1.0, 10.0), "each ceiling is multiplier × the previous one: a multiplier of 1 keeps them flat"),
        ((1, 0.1, 2.0, 10.0), "max_attempts counts the first call: max_attempts − 1 retries, one ceiling each"),
    ]
    for args, _ in cases + [((4, 0.05, 1.5, 0.1), "")]:
        got = fn(*args)
        try:
            got = [float(x) for x in got]
        except TypeError:
            fail("return a list of numbers, one per retry", f"retry_ceilings{args} returned {got!r}")
        want = retry_ceilings_reference(*args)
        if len(got) != len(want):
            fail("max_attempts counts the first call: max_attempts − 1 retries, one ceiling each",
                 f"retry_ceilings{args}: expected {len(want)} ceilings, got {len(got)}: {got}")
        if all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12) for g, w in zip(got, want)):
            continue
        where = f"retry_ceilings{args}: expected {want}, got {got}"
        max_attempts, initial, mult, cap = args
        if any(g > cap * (1 + 1e-9) for g in got):  # before the first value: a cap can apply to it
            fail("no ceiling exceeds max_backoff" + (" — the first one included" if got[0] > cap * (1 + 1e-9)
                                                     else ""), where)
        if not math.isclose(got[0], want[0]):
            fail("the first retry waits up to initial_backoff", where)
        fail("each ceiling is multiplier × the previous one (exponential, not linear), until max_backoff", where)
    worst = sum(retry_ceilings_reference(5, 0.05, 2.0, 1.0))
    return (f"retry_ceilings is gRPC's rule: 5 attempts at 50 ms × 2 wait at most {worst:.2f} s in all "
            "(each wait is random(0, ceiling): jitter spreads retries out)")


# ------------------------------------------------------------------------------------------ prefix routing
def first_block_instance(prompt_ids: list[int], n_instances: int, block_size: int) -> int:
    """Where the prefix of ``prompt_ids`` lives: its first full block's chain hash (notebook 05's
    ``hash_block_tokens(ROOT_HASH, ...)``), read as a big-endian integer from its first 8 bytes, mod the number of
    instances. Stable across processes and machines (sha256, never Python's ``hash()``)."""
    key = hash_block_tokens(ROOT_HASH, list(prompt_ids[:block_size]))
    return int.from_bytes(key[:8], "big") % n_instances


def pick_instance_reference(prompt_ids: list[int], loads: list[int], block_size: int, max_load: int) -> int:
    """The routing rule the notebook states, written plainly (the check compares against it)."""
    least_loaded = min(range(len(loads)), key=lambda i: (loads[i], i))
    if len(prompt_ids) < block_size:
        return least_loaded  # no full block: nothing cached anywhere to go to
    home = first_block_instance(prompt_ids, len(loads), block_size)
    return home if loads[home] < max_load else least_loaded


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(3, 2000, n)]


@exercise("write pick_instance(prompt_ids, loads, block_size, max_load): the instance index a request goes to")
def check_pick_instance(fn) -> str:
    """One case per rule, then a trace of shared system prompts against the rule written plainly."""
    bs = 8
    rng = np.random.default_rng(10)
    system = _tokens(rng, 3 * bs)

    def ask(prompt, loads, max_load=4):
        got = fn(list(prompt), list(loads), bs, max_load)
        require(isinstance(got, (int, np.integer)) and not isinstance(got, bool) and 0 <= got < len(loads),
                "return an instance index in range(len(loads))", f"loads {loads}: got {got!r}")
        return int(got)

    # Rule 1: the chain hash of the first full block picks the instance; nothing after it matters.
    for n in (2, 3, 4):
        idle = [0] * n
        for tail in (_tokens(rng, 5), _tokens(rng, 17), []):  # [] last: the boundary
            prompt = system[:bs] + tail
            want = first_block_instance(prompt, n, bs)
            got = ask(prompt, idle)
            rule = ("a prompt of exactly one block has a full block: its home decides (only a prompt shorter than "
                    "one block goes to the least-loaded instance)" if not tail else
                    "an idle home instance is int.from_bytes(hash_block_tokens(ROOT_HASH, first block)[:8], 'big') "
                    "% len(loads): only the first full block decides")
            require(got == want, rule, f"{n} idle instances, a {len(prompt)}-token prompt: expected {want}, got {got}")
    # Rule 2: an overloaded home instance (load >= max_load) -> the least-loaded one, lowest index on ties.
    for n in (2, 3, 4):
        for trial in range(6):
            prompt = _tokens(rng, bs + 3)
            home = first_block_instance(prompt, n, bs)
            loads = [int(x) for x in rng.integers(0, 3, n)]
            loads[home] = 4 + (trial % 2)  # at max_load (4), then above it
            low = min(loads)
            if trial % 3 == 0:  # make a tie for the least load, one index before the other
                others = [i for i in range(n) if i != home]
                for i in others:
                    loads[i] = low
            want = pick_instance_reference(prompt, loads, bs, 4)
            got = ask(prompt, loads)
            if got == home:
                fail("a home instance at max_load or above is overloaded: send the request elsewhere",
                     f"loads {loads}, max_load 4, home {home}: got {got}")
            require(loads[got] == min(loads), "the fallback is the least-loaded instance",
                    f"loads {loads}, home {home} overloaded: expected {want}, got {got}")
            require(got == want, "among equally loaded instances, the lowest index",
                    f"loads {loads}, home {home} overloaded: expected {want}, got {got}")
    # Rule 1, its edges: a home below max_load keeps the request even when another instance is idle; a prompt of
    # exactly one block has a full block (it is not "shorter than one block").
    for n in (2, 3, 4):
        for _ in range(4):
            prompt = _tokens(rng, bs + int(rng.integers(0, 2)) * 5)  # exactly one block, or one block and a tail
            home = first_block_instance(prompt, n, bs)
            loads = [0] * n
            loads[home] = 3  # busy, but below max_load (4)
            got = ask(prompt, loads)
            require(got == home, "a home instance below max_load keeps the request, even when another instance is "
                    "less loaded (its prefix is cached there)", f"{len(prompt)}-token prompt, loads {loads}, "
                    f"max_load 4: home {home}, got {got}")
    # Rule 3: a prompt shorter than one block has no full block to share: the least-loaded instance.
    for loads in ([3, 1, 2], [2, 2, 0, 5], [1, 1]):
        prompt = _tokens(rng, bs - 3)
        want = pick_instance_reference(prompt, loads, bs, 4)
        got = ask(prompt, loads)
        require(got == want, "a prompt shorter than one block has no full block: the least-loaded instance "
                "(lowest index on ties)", f"a {len(prompt)}-token prompt (block size {bs}), loads {loads}: "
                f"expected {want}, got {got}")
    # A trace: 5 system prompts × 12 questions arriving in a seeded order, 3 instances, load = requests in flight
    # (each request stays 4 arrivals). Every decision must be the rule's; then count where the prefixes went.
    systems = [_tokens(rng, 2 * bs) for _ in range(5)]
    order = [(s, q) for s in range(5) for q in range(12)]
    rng.shuffle(order)
    n, max_load, stay = 3, 3, 4
    inflight: list[list[int]] = []  # [instance, arrivals left]
    homes_of: dict[int, set] = {s: set() for s in range(5)}
    for s, q in order:
        loads = [sum(1 for i, _ in inflight if i == k) for k in range(n)]
        prompt = systems[s] + _tokens(rng, 1 + q % 5)
        want = pick_instance_reference(prompt, loads, bs, max_load)
        got = ask(prompt, loads, max_load)
        require(got == want, "every decision follows the three rules (home by first-block hash; overloaded → "
                "least loaded; lowest index on ties)", f"loads {loads}, max_load {max_load}: expected {want}, "
                f"got {got}")
        homes_of[s].add(got)
        inflight = [[i, left - 1] for i, left in inflight if left > 1] + [[got, stay]]
    spread = sum(len(h) for h in homes_of.values()) / len(homes_of)
    return (f"pick_instance routes by the first block and spills over only under load: each system prompt was "
            f"served by {spread:.1f} of {n} instances on average (round robin: all {n})")

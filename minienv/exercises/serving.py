"""Notebook 10's exercises: the backoff ceilings of gRPC's retry policy, and a prefix-aware router that keeps each
prefix's home when instances come and go, with a fallback under load.

Both checks run offline (no server). The first compares with gRPC's retry rule. The second measures the home rules
as properties of the student's own homes — only the first block decides, a fair share each, adding or removing an
instance moves only the prefixes that must move (which ``mod N`` breaks) — then each fallback rule at its edges,
then a trace of shared system prompts.
"""

from __future__ import annotations

import math
from collections import Counter

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
ADDRESSES = [f"10.0.0.{i}:50051" for i in range(1, 7)]  # instance names, as a client knows its servers

R_TYPE = "return the name of an instance: a key of loads"
R_BLOCK = "only the prompt's first full block decides its home: what follows it does not matter"
R_EXACT = ("a prompt of exactly one block has a full block: its home decides (only a prompt shorter than one "
           "block has none)")
R_ORDER = "the home depends on the set of instances, not on their order in loads"
R_SPREAD = "every instance is home to a fair share of the prefixes (the key must pick among all of them)"
R_STABLE = ("adding or removing an instance moves only the prefixes that must move: those the new instance wins, "
            "those the removed one held (mod N moves most of them)")
R_AFFINITY = ("a home with fewer than max_load requests in flight keeps the request, even when another instance "
              "is less loaded (its prefix is cached there)")
R_OVERLOAD = "a home with max_load or more requests in flight is overloaded: send the request elsewhere"
R_LEAST = "the fallback is the least-loaded instance"
R_TIE = "among equally loaded instances (the home not among them), the smallest name"
R_ALL = ("when every instance is overloaded, the least-loaded one still takes the request — the home included, "
         "and the home wins a tie (its cache has the prefix)")
R_SHORT = ("a prompt shorter than one block has no full block, so no home: the least-loaded instance, the "
           "smallest name on ties")
R_ONE = "with one instance, every request goes to it, overloaded or not"
R_INPUT = "do not modify loads"


def pick_instance_reference(prompt_ids: list[int], loads: dict[str, int], block_size: int, max_load: int,
                            home: str | None) -> str:
    """The routing rule the notebook states, written plainly, given the prefix's ``home`` (the student's own: the
    check measures the home rules on their homes first, then asks this; None for a prompt with no full block)."""
    if len(prompt_ids) < block_size:
        return min(loads, key=lambda name: (loads[name], name))  # no full block: nothing cached anywhere
    if loads[home] < max_load:
        return home
    return min(loads, key=lambda name: (loads[name], name != home, name))


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(3, 2000, n)]


@exercise("write pick_instance(prompt_ids, loads, block_size, max_load): the name of the instance a request goes to")
def check_pick_instance(fn) -> str:
    """The home rules as properties of the student's own homes (any stable, balanced hash passes: rendezvous, or a
    ring with enough points), each fallback rule at its edges, then a trace of shared system prompts."""
    bs, max_load = 8, 4
    rng = np.random.default_rng(10)

    def ask(prompt, loads, limit=max_load):
        given = dict(loads)
        got = fn(list(prompt), given, bs, limit)
        require(isinstance(got, str) and got in loads, R_TYPE,
                f"loads {loads}: got {got!r}" + (" (an index? return the name)" if isinstance(got, int) else ""))
        require(given == loads and list(given) == list(loads), R_INPUT, f"loads {loads} became {given}")
        return got

    def idle(names):
        return {name: 0 for name in names}

    def home(prompt, names):
        """The student's home for ``prompt``: where it goes when nobody is busy."""
        return ask(prompt, idle(names))

    four, five = ADDRESSES[:4], ADDRESSES[:5]
    # Rule 1: only the first full block decides; the order of loads does not.
    fn.rule = R_BLOCK
    for _ in range(12):
        first = _tokens(rng, bs)
        homes = {home(first + _tokens(rng, t), four) for t in (1, 5, 9, 17)}  # the second block differs too
        require(len(homes) == 1, R_BLOCK, f"four idle instances; prompts {first[:3]}… that share their first "
                f"block ({bs} tokens) went to {sorted(homes)}")
    fn.rule = R_EXACT
    for _ in range(8):
        first = _tokens(rng, bs)
        want, got = home(first + _tokens(rng, 5), four), home(first, four)
        require(got == want, R_EXACT, f"four idle instances: a {bs}-token prompt went to {got}, the same block "
                f"with a tail to {want}")
    fn.rule = R_ORDER
    for _ in range(12):
        prompt = _tokens(rng, bs + 3)
        shuffled = [str(a) for a in rng.permutation(five)]
        a, b = home(prompt, five), home(prompt, shuffled)
        require(a == b, R_ORDER, f"five idle instances: {a} with loads in the order {five}, {b} in the order "
                f"{shuffled}")
    # Rule 2: a fair share each. Rule 3: stable when the set changes.
    prompts = [_tokens(rng, bs + 2) for _ in range(400)]
    fn.rule = R_SPREAD
    for n in (2, 3, 5):
        shares = Counter(home(p, ADDRESSES[:n]) for p in prompts)
        low, high = min(shares.get(a, 0) for a in ADDRESSES[:n]), max(shares.values())
        require(low >= 0.5 * len(prompts) / n and high <= 1.6 * len(prompts) / n, R_SPREAD,
                f"{len(prompts)} prefixes over {n} idle instances: homes {dict(sorted(shares.items()))}")
    fn.rule = R_STABLE
    on4, on5 = [home(p, four) for p in prompts], [home(p, five) for p in prompts]
    moved = [(a, b) for a, b in zip(on4, on5) if a != b]
    require(all(b == five[-1] for _, b in moved), R_STABLE, f"adding {five[-1]} to four instances moved "
            f"{sum(b != five[-1] for _, b in moved)} of {len(prompts)} prefixes between the old ones")
    gone = five[1]
    rest = [a for a in five if a != gone]
    on_rest = [home(p, rest) for p in prompts]
    kept = sum(b != a for a, b in zip(on5, on_rest) if a != gone)
    require(kept == 0, R_STABLE, f"removing {gone} from five instances moved {kept} prefixes it did not hold")
    # Rule 4: affinity below max_load; at max_load or above, the least-loaded instance.
    fn.rule = R_AFFINITY
    for n in (2, 3, 5):
        for extra in (0, 5):
            prompt = _tokens(rng, bs + extra)
            names = ADDRESSES[:n]
            h = home(prompt, names)
            loads = {a: (max_load - 1 if a == h else 0) for a in names}
            got = ask(prompt, loads)
            require(got == h, R_AFFINITY, f"loads {loads}, max_load {max_load}: home {h}, got {got}")
    for ties in (False, True):  # first one least-loaded instance (is it the fallback?), then ties among them
        for n in (2, 3, 4, 5) if not ties else (3, 4, 5):
            for trial in range(4):
                prompt = _tokens(rng, bs + 3)
                names = [str(a) for a in rng.permutation(ADDRESSES[:n])]  # any order: ties go by name
                h = home(prompt, names)
                others = [a for a in names if a != h]
                if ties:  # two or more share the least load
                    low = int(rng.integers(0, max_load))
                    loads = {a: (low if i < 2 or trial % 2 else low + 1 + i % 2) for i, a in enumerate(others)}
                else:  # distinct loads below max_load
                    loads = dict(zip(others, (int(x) for x in rng.permutation(max_load)[:n - 1])))
                loads[h] = max_load + (trial % 2)  # exactly at max_load, then above it
                loads = {a: loads[a] for a in names}
                want = pick_instance_reference(prompt, loads, bs, max_load, home=h)
                fn.rule = R_OVERLOAD
                got = ask(prompt, loads)
                require(got != h, R_OVERLOAD, f"loads {loads}, max_load {max_load}: home {h} (load {loads[h]}), "
                        f"got {got}")
                require(loads[got] == min(loads.values()), R_LEAST, f"loads {loads}, home {h} overloaded: "
                        f"expected {want} (load {loads[want]}), got {got} (load {loads[got]})")
                require(got == want, R_TIE, f"loads {loads}, home {h} overloaded: expected {want}, got {got}")
    # Every instance overloaded: the least loaded, the home winning a tie.
    fn.rule = R_ALL
    for n in (2, 3, 5):
        for case in ("home least", "all equal", "home tied"):
            prompt = _tokens(rng, bs + 1)
            names = [str(a) for a in rng.permutation(ADDRESSES[:n])]
            h = home(prompt, names)
            loads = {a: max_load + 2 + int(rng.integers(0, 3)) for a in names}
            if case == "home least":
                loads[h] = max_load
            elif case == "all equal":
                loads = {a: max_load + 1 for a in names}
            else:  # the home ties with the smallest name among the others for the least load
                other = min(a for a in names if a != h)
                loads[h] = loads[other] = max_load + 1
            want = pick_instance_reference(prompt, loads, bs, max_load, home=h)
            got = ask(prompt, loads)
            require(got == want, R_ALL, f"loads {loads}, max_load {max_load} (all overloaded), home {h}: "
                    f"expected {want}, got {got}")
    # Rule 5: a prompt shorter than one block has no home.
    fn.rule = R_SHORT
    for length in (0, 1, bs - 1):
        for loads in ({ADDRESSES[2]: 3, ADDRESSES[0]: 1, ADDRESSES[1]: 2}, {ADDRESSES[1]: 2, ADDRESSES[3]: 0,
                      ADDRESSES[0]: 2, ADDRESSES[2]: 0}, idle(reversed(four)), {ADDRESSES[1]: 5, ADDRESSES[0]: 5}):
            prompt = _tokens(rng, length)
            want = pick_instance_reference(prompt, loads, bs, max_load, home=None)
            got = ask(prompt, loads)
            require(got == want, R_SHORT, f"a {length}-token prompt (block size {bs}), loads {loads}: expected "
                    f"{want}, got {got}")
    # One instance: nowhere else to go.
    fn.rule = R_ONE
    only = ADDRESSES[3]
    for length, load in ((bs + 2, 0), (bs + 2, max_load), (bs + 2, max_load + 3), (0, max_load), (bs, 1)):
        got = ask(_tokens(rng, length), {only: load})
        require(got == only, R_ONE, f"loads {{{only!r}: {load}}}, a {length}-token prompt: got {got!r}")
    # A trace: 5 system prompts × 12 questions arriving in a seeded order, 3 instances, load = requests in flight
    # (each request stays 4 arrivals). Every decision must follow the rules for the student's own homes.
    fn.rule = "every decision follows the rules"
    systems = [_tokens(rng, 2 * bs) for _ in range(5)]
    order = [(s, q) for s in range(5) for q in range(12)]
    rng.shuffle(order)
    names, limit, stay = ADDRESSES[:3], 3, 4
    inflight: list[list] = []  # [instance, arrivals left]
    homes_of: dict[int, set] = {s: set() for s in range(5)}
    for s, q in order:
        loads = {a: sum(1 for i, _ in inflight if i == a) for a in names}
        prompt = systems[s] + _tokens(rng, 1 + q % 5)
        want = pick_instance_reference(prompt, loads, bs, limit, home=home(prompt, names))
        got = ask(prompt, loads, limit)
        require(got == want, "every decision follows the rules (its home below max_load; overloaded → least "
                "loaded, the home winning a tie, then the smallest name)", f"loads {loads}, max_load {limit}: "
                f"expected {want}, got {got}")
        homes_of[s].add(got)
        inflight = [[i, left - 1] for i, left in inflight if left > 1] + [[got, stay]]
    spread = sum(len(h) for h in homes_of.values()) / len(homes_of)
    by_mod = sum(int.from_bytes(hash_block_tokens(ROOT_HASH, p[:bs])[:8], "big") % 5
                 != int.from_bytes(hash_block_tokens(ROOT_HASH, p[:bs])[:8], "big") % 4 for p in prompts)
    return (f"pick_instance keeps each prefix's home: removing one of five instances moved only its own "
            f"{sum(a == gone for a in on5) / len(prompts):.0%} of {len(prompts)} prefixes and adding a fifth to four "
            f"moved {len(moved) / len(prompts):.0%} (mod N: {by_mod / len(prompts):.0%}); on the trace each system "
            f"prompt was served by {spread:.1f} of {len(names)} instances on average (round robin: all {len(names)})")

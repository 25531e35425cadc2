"""The benchmark harness every script in ``benchmarks/`` shares: pinned BLAS, the machine's settings, interleaved
timing, one JSON line at the end.

A benchmark script uses it in this order::

    from _common import pin_blas_threads
    BLAS_THREADS = pin_blas_threads()            # before numpy is imported anywhere
    import numpy as np
    from _common import add_common_args, interleaved, print_settings, emit_json
    ...
    settings = print_settings()                  # numpy / BLAS build, thread variables, CPU count, load
    t = interleaved({"a": run_a, "b": run_b}, rounds=args.rounds, seed=args.seed)
    emit_json({"benchmark": "bench_x", "a_s": t["a"].as_dict(), ...})   # the last line printed

Why each piece exists (the rules a skeptical reader would ask for):

* **Pinned BLAS threads.** OpenBLAS reads its thread count once, when numpy loads it. minienv's matrices are
  tiny: a second thread costs more in hand-off than it saves, and on a shared machine spinning BLAS threads made
  small matmuls many times slower (one benchmark's ratio swung from 2.9x to 6.8x unpinned).
* **Interleaved rounds, order rotated and balanced.** Every variant runs once per round, so drift of a shared
  machine (a neighbour starting a job, thermal throttling) hits all variants alike instead of whichever ran last.
  Rotating one shuffled order is not enough: it moves every variant through every position but keeps each one's
  predecessor fixed, and a variant inherits its predecessor's state (caches, branch predictors, allocator): in
  bench_paged (15 paths), batch 1 x 128 keys, the backend's path / strongest dense read 1.30 and 1.35 in two
  runs of a rotation, where the path always ran after the same dense variant, and 1.19 and 1.23 in two runs of
  the design below, the same code back to back. So the rounds follow a Williams design
  (:func:`balanced_orders`): rotations of one seeded order whose neighbours differ by every distance, so that in
  each cycle of n rounds (2n for an odd n) every variant runs once in every position and right after every other
  variant equally often. At least three rounds.
* **No inherited garbage.** A run that builds its own engine leaves it behind as a web of reference cycles
  (scheduler, manager, listeners) that only Python's cycle collector frees — in the middle of whichever run comes
  next, on that run's clock. :func:`settle` (``gc.collect()``, untimed) runs before each such timed run, as
  :func:`race` does for its sides. (A balanced order spreads such a carry-over evenly; this removes it.)
* **Min and median.** The minimum is what the code costs when it gets the CPU (noise only ever adds time); the
  median shows how typical that is. Both are reported; ratios say which they use.
* **Settings printed and stored.** A ratio without the BLAS build and thread count it was measured with cannot
  be reproduced.
* **One JSON line, last.** Scripts and tests parse the last line; nothing after it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
MIN_ROUNDS = 3


def pin_blas_threads(default: str = "1") -> str:
    """Set the BLAS thread count from ``--blas-threads N`` (default 1) and return it.

    Must run before numpy is imported: OpenBLAS reads its thread count once, at load. One thread is the default
    because minienv's matrices are tiny — a second thread costs more in hand-off than it saves, and on a shared
    machine spinning BLAS threads made small matmuls many times slower.
    """
    threads, argv = default, sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg.startswith("--blas-threads="):
            threads = arg.split("=", 1)[1]
        elif arg == "--blas-threads" and i + 1 < len(argv):
            threads = argv[i + 1]
    if "numpy" in sys.modules and os.environ.get("OPENBLAS_NUM_THREADS") != threads:
        raise RuntimeError(f"pin_blas_threads() must run before numpy is imported: OpenBLAS read its thread count "
                           f"({os.environ.get('OPENBLAS_NUM_THREADS')}) at load, and {threads} was asked for")
    for var in THREAD_VARS:
        os.environ[var] = threads
    return threads


def add_common_args(ap: argparse.ArgumentParser, rounds: int = 5, quick_rounds: int = MIN_ROUNDS) -> None:
    """``--quick``, ``--rounds N`` (>= 3), ``--seed`` and ``--blas-threads`` (already read by
    :func:`pin_blas_threads`; declared here so argparse accepts it and ``--help`` shows it)."""
    ap.add_argument("--quick", action="store_true", help="a small, fast run (correctness, not figures)")
    ap.add_argument("--rounds", type=int, default=None,
                    help=f"interleaved timing rounds (default {rounds}; {quick_rounds} with --quick; >= {MIN_ROUNDS})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the variants' order in the rounds")
    ap.add_argument("--blas-threads", default="1", help="numpy OpenBLAS threads (default 1; read before numpy loads)")
    ap.set_defaults(_rounds_default=rounds, _quick_rounds=quick_rounds)


def rounds_of(args: argparse.Namespace) -> int:
    """The number of rounds the parsed arguments ask for (``--rounds``, else the quick or full default)."""
    n = args.rounds if args.rounds is not None else (args._quick_rounds if args.quick else args._rounds_default)
    if n < MIN_ROUNDS:
        raise SystemExit(f"--rounds must be >= {MIN_ROUNDS} (interleaved rounds), got {n}")
    return n


# ------------------------------------------------------------------------------------------------ settings
def blas_settings() -> dict[str, Any]:
    """What the timings depend on: numpy and its BLAS (threadpoolctl's view when installed, else numpy's build
    configuration), the thread variables, the CPU count and the load when asked."""
    import numpy as np

    out: dict[str, Any] = {
        "python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "threads_env": {v: os.environ.get(v) for v in THREAD_VARS},
    }
    try:
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on every platform
        out["load_average"] = None
    try:
        from threadpoolctl import threadpool_info

        out["blas"] = [{k: info.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer",
                                                 "architecture")} for info in threadpool_info()
                       if info.get("user_api") == "blas"]
        out["blas_source"] = "threadpoolctl"
    except ImportError:
        try:
            blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
            out["blas"] = [{"name": blas.get("name"), "version": blas.get("version"),
                            "configuration": blas.get("openblas configuration")}]
        except Exception:  # numpy < 1.25 has no mode="dicts"
            out["blas"] = None
        out["blas_source"] = "numpy.show_config (threadpoolctl not installed)"
    return out


def format_settings(s: dict[str, Any]) -> str:
    blas = ", ".join(f"{b.get('name') or b.get('internal_api')} {b.get('version')}"
                     + (f" ({b['num_threads']} threads)" if b.get("num_threads") else "") for b in (s["blas"] or []))
    env = " ".join(f"{k}={v}" for k, v in s["threads_env"].items())
    return (f"settings: python {s['python']}, numpy {s['numpy']}, BLAS {blas or 'unknown'}; {env}; "
            f"{s['cpu_count']} CPUs ({s['machine']}), load average {s['load_average']}")


def print_settings() -> dict[str, Any]:
    """Print the settings in one line and return them (the same dict :func:`emit_json` stores)."""
    s = blas_settings()
    print(format_settings(s), flush=True)
    return s


# ------------------------------------------------------------------------------------------------ timing
@dataclass
class Timing:
    """Seconds per call of one variant over the rounds (``samples`` on the chosen clock, ``wall`` always)."""

    samples: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    result: Any = None  # what the variant returned in the last round (outputs to check, counters to report)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def wall_min(self) -> float:
        return min(self.wall)

    @property
    def wall_median(self) -> float:
        return statistics.median(self.wall)

    def as_dict(self, scale: float = 1.0, digits: int = 6) -> dict[str, float]:
        """``{"min", "median"}`` times ``scale`` (1e6 for microseconds), rounded."""
        return {"min": round(self.min * scale, digits), "median": round(self.median * scale, digits)}


def interleaved(
    variants: dict[str, Callable[[], Any]],
    rounds: int = MIN_ROUNDS,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    warmup: bool = True,
    min_seconds: float = 0.0,
    before_each: Callable[[], Any] | None = None,
) -> dict[str, Timing]:
    """Run every variant once per round, in :func:`balanced_orders`' rounds; time each call.

    Args:
        variants: name -> a callable taking no arguments (its return value is kept in ``Timing.result``).
        rounds: at least 3; more rounds run while ``min_seconds`` have not passed.
        seed: seeds the shuffle of the first round's order (the same seed gives the same schedule).
        clock: ``time.perf_counter`` (wall) or ``time.thread_time`` (this thread's CPU time: with one BLAS
            thread, the work itself whatever the neighbours do). Wall time is recorded in ``Timing.wall`` too.
        warmup: call each variant once, untimed, before the rounds (first-call allocations, caches).
        before_each: called untimed before every timed call — e.g. evicting the CPU caches, so that no variant
            finds its data warm because the variant before it happened to read the same arrays.

    Returns:
        name -> :class:`Timing` (``.min`` and ``.median`` seconds per call).
    """
    if rounds < MIN_ROUNDS:
        raise ValueError(f"interleaved timing needs >= {MIN_ROUNDS} rounds, got {rounds}")
    if not variants:
        raise ValueError("interleaved timing needs at least one variant")
    orders = balanced_orders(list(variants), seed)
    out = {name: Timing() for name in variants}
    if warmup:
        for name in schedule(list(variants), 1, seed)[0]:
            out[name].result = variants[name]()
    start = time.perf_counter()
    r = 0
    while r < rounds or time.perf_counter() - start < min_seconds:
        for name in next(orders):
            if before_each is not None:
                before_each()
            w0, c0 = time.perf_counter(), clock()
            res = variants[name]()
            c1, w1 = clock(), time.perf_counter()
            t = out[name]
            t.samples.append(c1 - c0)
            t.wall.append(w1 - w0)
            t.result = res
        r += 1
    return out


def paired(num: list[float], den: list[float]) -> float:
    """``num / den`` within each round, median over rounds: a round's runs are adjacent and share the host's state,
    so this survives a host whose speed drifts from second to second (each side's minimum and median do not)."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def settle() -> None:
    """Untimed, right before a timed run that builds its own engine (or server, or manager): collect what earlier
    runs left for the cycle collector, so that no run pays for its predecessor's garbage."""
    gc.collect()


def race(sides: dict[str, Callable[[], tuple[float, Any]]], rounds: int, seed: int = 0
         ) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Run each side (a callable returning ``(seconds, output)``) once per round in :func:`schedule`'s order:
    every side's times, round by round, and its last output. :func:`settle` runs before each side."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    outs: dict[str, Any] = {}
    for order in schedule(list(sides), rounds, seed):
        for side in order:
            settle()
            t, outs[side] = sides[side]()
            times[side].append(t)
    return times, outs


def williams_rows(n: int) -> list[list[int]]:
    """A Williams design for ``n`` variants: ``n`` rows (``2n`` when ``n`` is odd), each a permutation of
    ``range(n)``, such that every index takes every position equally often and every ordered pair ``(a, b)``,
    ``a != b``, is adjacent (``b`` right after ``a``) equally often — once for an even ``n``, twice for an odd one.

    Row 0 is ``0, 1, n-1, 2, n-2, ...``: its successive differences, mod n, are ``1, n-2, 3, n-4, ...``, every
    distance 1..n-1 once; row r adds r to every entry, which moves each index through every position and keeps
    the differences, so the pair ``(a, a + d)`` turns up once per distance d. For an odd ``n`` the differences
    cannot all be distinct, and the mirrored rows supply the pairs the first n rows miss.
    """
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def balanced_orders(names: list[str], seed: int = 0) -> Iterator[list[str]]:
    """Round orders without end: :func:`williams_rows` over ``names``, cycle after cycle, with the names dealt to
    the design's indices by a seeded shuffle that is drawn again for every cycle (so long runs also vary which
    variants share a round's start and end). The same seed gives the same rounds."""
    rng = random.Random(seed)
    rows = williams_rows(len(names))
    while True:
        dealt = list(names)
        rng.shuffle(dealt)
        for row in rows:
            yield [dealt[i] for i in row]


def schedule(names: list[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """The first ``rounds`` orders of :func:`balanced_orders`: the order :func:`interleaved` runs ``names`` in,
    round by round (for scripts that drive rounds themselves, e.g. with a fresh engine per call, and for tests of
    the harness)."""
    orders = balanced_orders(names, seed)
    return [next(orders) for _ in range(rounds)]


# ------------------------------------------------------------------------------------------------ output
def _jsonable(x: Any) -> Any:
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    if isinstance(x, Timing):
        return x.as_dict()
    if hasattr(x, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(x)
    return str(x)


def _finite(x: Any) -> Any:
    """NaN / inf are not JSON: they become None (json.dumps would write bare NaN, which strict parsers reject)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def emit_json(result: dict[str, Any], settings: dict[str, Any] | None = None) -> None:
    """Print ``result`` as the benchmark's one JSON line (the last line it prints), with the settings added
    under ``"settings"`` (measured now unless given)."""
    if not isinstance(result, dict):
        raise TypeError(f"emit_json takes a dict, got {type(result).__name__}")
    full = dict(result)
    full.setdefault("settings", settings if settings is not None else blas_settings())
    line = json.dumps(_finite(json.loads(json.dumps(full, default=_jsonable))), allow_nan=False)
    sys.stdout.flush()
    print(line, flush=True)


def target_stand_in() -> Any:
    """training/train.py's "target" shape, for scripts that must run when ``assets/target`` is missing (they fill
    it with seeded random weights). Imported late: numpy must not load before :func:`pin_blas_threads`."""
    from minienv.model import LlamaConfig

    return LlamaConfig(vocab_size=2048, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=48, max_position_embeddings=1024,
                       rms_norm_eps=1e-5, tie_word_embeddings=True)

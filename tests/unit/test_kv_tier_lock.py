"""Another process holds the SQLite tier's write lock (a long write transaction left open) while an engine serves:
no step may wait for the lock's full timeout (10 s by default). What the engine does instead (stores.py's module
docstring): lookups and record reads go on (WAL), an LRU refresh is skipped, a write waits at most
``lock_timeout_s`` and is then a transient failure, so the tier rests for ``retry_interval_s``.

Measured on the commit before the bound (see docs/ARCHITECTURE.md, "The persistent KV tier"): one step stalled
10.2 s and the tier loaded nothing. Run with ``-s`` to print this run's figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from engine_harness import bundled
from minienv import InferenceEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)
HOLD_S = 1.5


def _hold_write_lock(path, seconds: float) -> subprocess.Popen:
    """A second process that takes the write lock (BEGIN IMMEDIATE + a write) and keeps it ``seconds``."""
    code = ("import sqlite3, sys, time\n"
            f"db = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE'); db.execute(\"UPDATE meta SET value=value WHERE name='clock'\")\n"
            f"print('locked', flush=True); time.sleep({seconds}); db.execute('COMMIT')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_write_lock_held_by_another_process_stalls_no_step_for_the_lock_timeout(tmp_path):
    model, tok = bundled()
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(5, 2000, 100)] for _ in range(4)]
    want = [o.token_ids for o in InferenceEngine(model, tok).generate(prompts, GREEDY)]
    InferenceEngine(model, tok, kv_tier=tmp_path).generate(prompts[:2], GREEDY)  # 2 stored: hits; 2 to save
    e = InferenceEngine(model, tok, kv_tier=tmp_path)
    e.kv_tier.retry_interval_s = 0.2
    assert e.kv_tier.store.lock_timeout_s == 0.05 and e.kv_tier.store.lock_timeout_s < 10.0
    holder = _hold_write_lock(tmp_path / "kv_tier.sqlite3", HOLD_S)
    try:
        t0 = time.perf_counter()
        outs = e.generate(prompts, GREEDY)
        run_s = time.perf_counter() - t0
        assert holder.poll() is None, "the lock was released before the run ended: nothing was measured"
    finally:
        holder.wait()
    steps = [r.duration_s for r in e.history]
    s = e.kv_tier.stats
    print(json.dumps({"lock_held_s": HOLD_S, "run_s": round(run_s, 3), "max_step_s": round(max(steps), 3),
                      "steps": len(steps), "hit_tokens": s.hit_tokens, "backend_errors": s.backend_errors,
                      "lru_refresh_skipped": e.kv_tier.store.lru_refresh_skipped}))
    assert [o.token_ids for o in outs] == want and all(o.finish_reason == "length" for o in outs)
    assert max(steps) < 1.0, f"a step waited {max(steps):.2f} s for another process's lock"
    assert s.hit_tokens == 192  # the two stored prompts were still loaded under the lock
    assert s.backend_errors >= 1 and e.kv_tier.enabled  # the refused write: transient, not switched off
    time.sleep(0.25)  # the lock is gone and the retry interval has passed: the tier stores again
    e.generate([prompts[2]], GREEDY)
    assert e.kv_tier.stats.stores > 0
    e.kv_tier.store.check_invariants()

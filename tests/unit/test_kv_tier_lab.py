"""Notebook 11's exhibits report honestly (its exercises are graded in tests/unit/test_exercises.py)."""

from __future__ import annotations

import numpy as np

from engine_harness import bundled
from minienv.lab.kv_tier_lab import keys_in_fresh_processes, serve_with_tier


def test_serve_with_tier_reports_where_blocks_came_from(tmp_path):
    m, tok = bundled()
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 2000, 100)]
    first = serve_with_tier(m, tok, prompt, tmp_path)
    second = serve_with_tier(m, tok, prompt, tmp_path)
    assert first.origins == ["computed"] * 6 and first.loaded_tokens == 0
    assert second.origins == ["tier"] * 6 and second.loaded_tokens == 96 and second.computed_tokens == 4
    assert second.token_ids == first.token_ids == serve_with_tier(m, tok, prompt, None).token_ids


def test_keys_are_the_same_in_fresh_processes_and_hash_is_not():
    out = keys_in_fresh_processes(list(range(16)), 16, bytes(32), seeds=("0", "1"))
    assert out["0"]["tier_key"] == out["1"]["tier_key"]
    assert out["0"]["python_hash"] != out["1"]["python_hash"]

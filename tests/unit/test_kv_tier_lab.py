"""Notebook 11's exercise checker grades the solution and rejects wrong answers; the exhibits report honestly."""

from __future__ import annotations

import numpy as np
import pytest

from engine_harness import bundled
from minienv.lab.kv_tier_lab import (SOLUTION_PATH, check_next_victim, keys_in_fresh_processes, load_solution,
                                     serve_with_tier)


def _solution():
    return load_solution()


def test_the_solution_is_the_file_in_the_repository():
    assert SOLUTION_PATH.name == "11_persistent_kv.py" and SOLUTION_PATH.parent.name == "solutions"


def test_the_solution_passes():
    assert check_next_victim(_solution()) == "check_next_victim: correct"


def test_the_stub_is_reported_as_not_implemented_without_failing():
    def stub(records):
        raise NotImplementedError

    assert "not implemented yet" in check_next_victim(stub)


def plain_lru(records):  # ignores the chains: may evict a parent
    return min(records, key=lambda r: r[2])[0]


def newest_leaf(records):
    parents = {p for _, p, _ in records}
    return max((t, k) for k, _, t in records if k not in parents)[1]


def oldest_stored(records):  # insertion order, not access order
    return records[0][0]


@pytest.mark.parametrize("wrong", [plain_lru, newest_leaf, oldest_stored], ids=lambda f: f.__name__)
def test_wrong_answers_are_rejected(wrong):
    with pytest.raises(AssertionError):
        check_next_victim(wrong)


def test_plain_lru_gets_the_strand_hint():
    with pytest.raises(AssertionError, match="strand"):
        check_next_victim(plain_lru)


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

"""The naive design fails in each of its four traps, and the real manager does not: its free list pops index 0 of a
Python list (O(n) per allocation); its LRU evictor evicts a block a running request still holds; it keys a prefix
by a hash of the whole prompt, so a common system prompt shares nothing; and it *sets* a reused block's refcount
to 1 instead of incrementing it, so the first owner to finish frees a block the other still uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from minienv.lab import naive_design
from minienv.lab.naive_design import (
    PagedAttentionManager,
    PrefixAwareRefcounter,
    TokenBudgetLRUEvictor,
    demo_evict_in_use,
    demo_pop0_timing,
    demo_refcount_set,
    demo_whole_prompt_hashing,
)

BUNDLED = Path(__file__).resolve().parents[2] / "assets" / "target" / "model.safetensors"  # committed


def test_module_is_marked_broken():
    assert naive_design.BROKEN is True
    assert "BROKEN" in naive_design.__doc__.splitlines()[0]
    for cls in (PagedAttentionManager, PrefixAwareRefcounter, TokenBudgetLRUEvictor):
        assert "NAIVE (BROKEN)" in cls.__doc__


def test_naive_evictor_frees_in_use_block_and_corrupts_a_running_request():
    d = demo_evict_in_use(naive_design.random_demo_model())
    assert d.naive_evicted_in_use, "the naive evictor should have taken a running request's block"
    assert d.naive_kv_overwritten, "B's prefill overwrote A's K/V in the stolen block"
    assert d.naive_corrupted and d.naive_first_divergence is not None
    assert d.ours_b_refused, "ours refuses B (typed error) instead of stealing A's block"
    assert d.ours_correct


def test_naive_evictor_corrupts_the_bundled_models_text():
    from minienv.model import load_model
    from minienv.tokenizer import load_tokenizer

    tok = load_tokenizer(BUNDLED.parent.parent / "tokenizer.json")
    d = demo_evict_in_use(load_model(BUNDLED.parent), tok.encode("To be, or not to be, that is"),
                          tok.encode("Now is the winter of our discontent made glorious"))
    assert d.naive_evicted_in_use and d.naive_kv_overwritten
    assert d.ours_b_refused and d.ours_correct


def test_naive_whole_prompt_hash_shares_nothing_between_prompts_with_a_common_system_prompt():
    d = demo_whole_prompt_hashing()
    assert d.naive_shared_blocks == 0
    # ours: every full block of the 32-token system prompt is shared by the 7 later prompts
    assert d.ours_shared_blocks == 7 * (d.system_prompt_tokens // d.block_size)
    assert d.ours_hit_tokens == 7 * d.system_prompt_tokens


def test_naive_refcount_set_frees_a_block_still_in_use():
    d = demo_refcount_set()
    assert d.naive_refcount_after_share == 1  # set, where 2 is right
    assert d.naive_freed_while_in_use and d.naive_block_reused_by == "r3"
    assert d.ours_refcount_after_share == 2 and d.ours_refcount_after_first_free == 1
    assert not d.ours_block_reused


def test_pop0_timing_demo_reports_every_size():
    # Performance is measured (benchmarks/bench_prefix_cache.py, notebook 06), not asserted here: a timing ratio
    # in a test flakes on a loaded machine. The O(n) claim is checked structurally below (the naive design really pops
    # index 0 of a Python list; ours takes the head of an OrderedDict).
    d = demo_pop0_timing(sizes=(1_000, 10_000), ops=200, repeats=1)
    assert d.sizes == (1_000, 10_000)
    assert len(d.naive_ns_per_op) == len(d.ours_ns_per_op) == 2
    assert all(t > 0 for t in d.naive_ns_per_op + d.ours_ns_per_op)


def test_naive_free_list_really_uses_pop0():
    mgr = PagedAttentionManager(4, 2)
    assert mgr.allocate_block() == 0 and mgr.free_list == [1, 2, 3]


def test_the_engine_path_never_imports_the_lab_and_never_exports_the_naive_classes():
    import subprocess
    import sys

    code = ("import sys, minienv, minienv.kv, minienv.engine, minienv.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('minienv.lab', 'minienv.viz'))))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    import minienv
    import minienv.kv

    for name in ("PagedAttentionManager", "PrefixAwareRefcounter", "TokenBudgetLRUEvictor"):
        assert not hasattr(minienv.kv, name)
        with pytest.raises(AttributeError):
            getattr(minienv, name)

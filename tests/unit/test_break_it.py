"""Break it yourself: with no bug every proof holds; each classic bug breaks exactly the proofs the notebooks say
it breaks, on the real engine; the workload really preempts and evicts (else the outputs proof would be weak)."""

from __future__ import annotations

import pytest

from minienv.engine import InferenceEngine
from minienv.lab import break_it as bi
from minienv.sampling import SamplingParams

BREAKS = {
    None: set(),
    "index_at_allocation": {"failed_step"},
    "hash_own_tokens": {"outputs"},
    "free_head_first": {"invariants"},
    "evict_in_use": {"outputs", "invariants"},
    "no_copy_on_write": {"copy_on_write"},
}


def test_every_bug_has_its_row():
    assert set(BREAKS) == {None, *bi.BUGS}


@pytest.mark.parametrize("bug", list(BREAKS), ids=str)
def test_each_bug_breaks_exactly_its_proofs(bug):
    results = bi.run_proofs(bug)
    assert {name for name, r in results.items() if not r.holds} == BREAKS[bug], {n: r.detail for n, r in results.items()}


def test_the_outputs_workload_preempts_and_evicts():
    model, tok = bi._setup()
    eng = InferenceEngine(model, tok, kv_budget_tokens=bi.BUDGET, block_size=bi.BLOCK, max_num_seqs=3,
                          max_num_batched_tokens=32, kv_cache_manager_factory=bi.factory(None))
    for wave in bi.WAVES:
        eng.generate(wave, SamplingParams(max_tokens=8, temperature=0))
    stats = eng.kv_cache_manager.stats()
    assert eng.scheduler.num_preemptions > 0 and stats.evicted_blocks > 0 and stats.prefix_hits_tokens > 0


def test_unknown_bug_is_refused():
    with pytest.raises(ValueError, match="bug must be None or one of"):
        bi.factory("off_by_one")
    with pytest.raises(ValueError, match="bug must be None or one of"):
        bi.BreakableKVCacheManager(4, 4, bug="nope")

"""minienv.lab: greedy serving through the engine, the eviction policies and hit-rate sweep, the paper accounting."""

from __future__ import annotations

import numpy as np
import pytest

from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.model import LlamaConfig, LlamaModel, random_weights
from minienv.generate import dense_greedy
from minienv.lab.eviction_experiments import (
    CacheRequest,
    CacheStream,
    NanoVLLMBlockManager,
    format_hit_rate_table,
    hit_rate_sweep,
    popular_prefix_workload,
    simulate_cache,
    usable_prefix_after_evictions,
)
from minienv.lab.naive_design import demo_evictor_damage
from minienv.lab.serving import load_demo_model, serve_greedy
from minienv.lab.sharing_experiments import (
    beam_search_saving,
    format_paper_table,
    paper_sharing_results,
    parallel_sampling_saving,
    shared_prefix_saving,
)


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    return LlamaModel(cfg, random_weights(cfg, seed=1, scale=0.3))


def prompts_with_system(seed=0, n=5):
    rng = np.random.default_rng(seed)
    system = list(map(int, rng.integers(0, 97, 13)))
    return [system + list(map(int, rng.integers(0, 97, int(rng.integers(1, 6))))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- serving loop
@pytest.mark.parametrize("num_blocks", [None, 12])  # ample, and tight enough to evict between requests
def test_serve_greedy_cache_on_equals_off_equals_dense(model, num_blocks):
    prompts = prompts_with_system()
    on = serve_greedy(model, prompts, 5, block_size=4, num_blocks=num_blocks, caching=True, max_running=2)
    off = serve_greedy(model, prompts, 5, block_size=4, num_blocks=num_blocks, caching=False, max_running=2)
    assert on.outputs == off.outputs == [dense_greedy(model, p, 5) for p in prompts]
    assert on.prefill_tokens_computed < off.prefill_tokens_computed == off.prompt_tokens
    assert on.cached_tokens_per_request[:2] == [0, 0]  # admitted in the same step: nothing committed yet
    if num_blocks == 12:
        assert on.evicted_blocks > 0
    on.manager.check_invariants()


def test_serve_greedy_arrivals_one_per_step(model):
    """Staggered arrivals: each request arrives after the one before was computed, so it can hit its prefix;
    idle steps before a late arrival are skipped, and the outputs do not change."""
    prompts = prompts_with_system(n=4)
    late = serve_greedy(model, prompts, 3, block_size=4, caching=True, arrival_steps=[0, 1, 2, 9],
                        check_invariants=True)
    together = serve_greedy(model, prompts, 3, block_size=4, caching=True)
    assert late.outputs == together.outputs == [dense_greedy(model, p, 3) for p in prompts]
    assert len(late.cached_tokens_per_request) == 4
    assert late.cached_tokens_per_request[0] == 0 and all(c > 0 for c in late.cached_tokens_per_request[1:])
    assert together.cached_tokens_per_request == [0, 0, 0, 0]  # all admitted in step 0: nothing committed yet
    # together: one 3-step batch. late: requests 0-2 overlap over steps 0-4 (request 2 arrives at 2, needs 3),
    # steps 5-8 are idle and skipped, request 3 runs its 3 steps alone from step 9: 5 + 3 model steps.
    assert together.steps == 3 and late.steps == 8
    with pytest.raises(ValueError, match="one step >= 0 per prompt"):
        serve_greedy(model, prompts, 3, block_size=4, arrival_steps=[0, 1])


def test_serve_greedy_poisoned_cache_changes_the_output(model):
    prompts = prompts_with_system(1)

    def poison(mgr, kv, i):
        if i == 1:
            for b in mgr.lookup(prompts[1]).block_ids:
                kv.kv_cache[:, :, b] = 3.0

    res = serve_greedy(model, prompts, 5, block_size=4, caching=True, max_running=1, before_admit=poison)
    assert res.cached_tokens_per_request[1] > 0
    assert res.outputs[1] != dense_greedy(model, prompts[1], 5)
    assert res.outputs[0] == dense_greedy(model, prompts[0], 5)


def test_serve_greedy_rejects_a_budget_too_small(model):
    with pytest.raises(ValueError, match="can never fit"):
        serve_greedy(model, [[1] * 20], 4, block_size=4, num_blocks=3)


def test_load_demo_model_falls_back_or_loads():
    demo = load_demo_model()
    ids = demo.encode("To be, or not to be")
    assert ids and all(0 <= i < demo.model.config.vocab_size for i in ids)
    assert demo.encode("To be, or not to be, that") [: len(ids) - 1] == ids[: len(ids) - 1]
    assert isinstance(demo.decode(ids[:3]), str)


# ---------------------------------------------------------------------------------------------- policies
def test_nano_vllm_manager_reproduces_its_deque_policy():
    m = NanoVLLMBlockManager(6, 4)
    assert m.allocate("a", list(range(9))) == 0
    assert list(m.free_block_ids) == [3, 4, 5]  # taken from the left
    m.free("a")
    assert list(m.free_block_ids) == [3, 4, 5, 2, 1, 0]  # appended on the right, table reversed
    assert m.allocate("b", list(range(9))) == 8  # two full blocks hit (removed from the middle)
    assert list(m.free_block_ids) == [4, 5, 2] and m.tables["b"] == [0, 1, 3]
    m.free("b")
    assert m.allocate("c", list(range(8))) == 8  # the whole prompt cached: nano-vllm #144
    assert m.full_prompt_hits == 1
    m.free("c")
    m.allocate("d", list(range(100, 124)))  # 6 blocks: every cached block evicted, stale dict entries stay
    assert m.evicted_blocks == 2 and m.lookup_blocks(list(range(9))) == 0 and len(m.hash_to_block_id) > 0


def test_nano_vllm_decode_blocks_are_hashed_when_full():
    m = NanoVLLMBlockManager(8, 4)
    m.allocate("a", [1, 2, 3])
    m.append("a", 4)  # fills block 0
    m.append("a", 5)  # new block
    assert m.tables["a"] == [0, 1] and m.hash[0] is not None and m.hash[1] is None
    m.free("a")
    assert m.allocate("b", [1, 2, 3, 4, 9]) == 4


def test_policies_agree_and_caching_helps_on_a_popular_prefix():
    reqs = popular_prefix_workload(60, seed=2)
    sweep = hit_rate_sweep(reqs, [256, 1024, 4096])
    lru = [s.hit_rate for s in sweep["minienv LRU"]]
    nano = [s.hit_rate for s in sweep["nano-vllm FIFO-of-frees"]]
    assert len(sweep["no caching"]) == len(lru) == 3 and all(s.hit_rate == 0 for s in sweep["no caching"])
    assert lru == sorted(lru) and lru[-1] > lru[0]
    assert max(abs(a - b) for a, b in zip(lru, nano, strict=True)) < 0.02
    table = format_hit_rate_table(sweep)
    assert "minienv LRU" in table and table.count("\n") == 3
    with pytest.raises(ValueError, match="cannot hold"):
        simulate_cache(reqs, 64)


def test_popular_prefix_workload_is_seeded_and_shares_prefixes():
    a, b = popular_prefix_workload(50, seed=4), popular_prefix_workload(50, seed=4)
    assert a == b and a != popular_prefix_workload(50, seed=5)
    popular = [r for r in a if r.prefix_id == 0]
    assert 10 < len(popular) < 40
    assert all(r.prompt[:96] == popular[0].prompt[:96] for r in popular)


def test_cache_stream_never_evicts_in_use_blocks():
    reqs = popular_prefix_workload(20, popular_share=0.3, prefix_len=8, num_tail_prefixes=3, question_mean=4,
                                   output_mean=3, vocab=50, seed=3)
    evictions = []
    for budget in (48, 128):
        mgr = KVCacheManager.from_budget(budget, 4)
        st = CacheStream(reqs, mgr, max_running=2)
        while st.step() is not None:
            mgr.check_invariants()
        assert st.done and st.evicted_in_use == [] and len(st.hits) == len(reqs)
        evictions.append(len(st.evictions))
        st.close()
    assert evictions[0] > evictions[1]
    with pytest.raises(ValueError, match="cannot hold"):
        CacheStream([CacheRequest(tuple(range(30)), 5, 0)], KVCacheManager(2, 4))


def test_usable_prefix_after_evictions():
    assert usable_prefix_after_evictions(5, 2, tail_first=True) == ([3, 4], 3, 0)
    assert usable_prefix_after_evictions(5, 2, tail_first=False) == ([0, 1], 0, 3)
    assert usable_prefix_after_evictions(4, 0, tail_first=False) == ([], 4, 0)


# ---------------------------------------------------------------------------------------------- paper accounting
def test_parallel_sampling_saving_grows_with_n_and_copies_n_minus_1_per_request():
    r2, r4 = parallel_sampling_saving(2, num_requests=20), parallel_sampling_saving(4, num_requests=20)
    assert 0 < r2.saved_fraction < r4.saved_fraction < 0.3
    assert r2.cow_copies <= 20 and r4.cow_copies <= 60  # at most n - 1 copies of the partial prompt block
    assert parallel_sampling_saving(1, num_requests=5).saved_fraction == 0


def test_beam_search_saves_more_than_parallel_sampling():
    b2 = beam_search_saving(2, num_requests=8)
    b4 = beam_search_saving(4, num_requests=8)
    assert b4.saved_fraction > b2.saved_fraction > parallel_sampling_saving(4, num_requests=8).saved_fraction
    assert b2 == beam_search_saving(2, num_requests=8)  # seeded


def test_shared_prefix_saving_counts_whole_cached_blocks():
    r = shared_prefix_saving(80, num_requests=10, block_size=16)
    assert r.prefill_off - r.prefill_on == 9 * 80  # 80 = 5 full blocks, cached for requests 2..10
    assert r.prefill_ratio > r.work_ratio > 1 and r.memory_ratio > 1
    r5 = shared_prefix_saving(341, num_requests=10, block_size=16)
    assert r5.prefill_off - r5.prefill_on == 9 * 336  # only the 21 full blocks of the 341-token prefix
    assert r5.prefill_ratio > r.prefill_ratio


def test_paper_table_puts_ours_beside_the_papers_numbers():
    par, beam, shots = paper_sharing_results(parallel_requests=5, beam_requests=3)
    table = format_paper_table(par, beam, shots)
    for paper in ("6.1 % – 9.8 %", "37.6 % – 55.2 %", "1.67×", "3.58×"):
        assert paper in table
    assert f"{par[0].saved_fraction:.1%}" in table and f"{shots[1].prefill_ratio:.2f}×" in table


def test_naive_evictor_damage_shows_wrong_logits_after_b_arrives_and_ours_never(model):
    rng = np.random.default_rng(3)
    a, b = list(map(int, rng.integers(0, 97, 10))), list(map(int, rng.integers(0, 97, 12)))
    d = demo_evictor_damage(model, a, b, block_size=4, max_new_tokens=7, b_arrives_after=3)
    assert d.naive_evicted_in_use and d.naive_overwritten
    assert max(d.naive_logit_error[:3]) < 1e-4 and min(d.naive_logit_error[3:]) > 1e-2
    assert max(d.ours_logit_error) < 1e-4 and d.ours_b_refused
    assert d.ours_ids == d.reference_ids == tuple(dense_greedy(model, a, 7))

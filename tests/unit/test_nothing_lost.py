"""Nothing lost: under a KV budget of ~10 % of what the requests need at once, every request finishes, and each
output is exactly what that request gives when generated alone — however often it was preempted (its KV freed,
its prompt + generated-so-far recomputed later), whatever it was batched with.

At two budgets and two block sizes, with prefix caching on and off, greedy and seeded sampling. Each test also
asserts preemptions actually happened (a budget that never preempts would prove nothing) and checks every
scheduler / KV-manager invariant after every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from minienv.engine import InferenceEngine, required_kv_tokens
from minienv.generate import generate_ids
from minienv.kv.block_table import cdiv
from minienv.model import LlamaConfig, LlamaModel, random_weights
from minienv.request import InvalidRequestError
from minienv.sampling import SamplingParams
from minienv.tokenizer import BPETokenizer

NUM_REQUESTS = 24


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaModel(cfg, random_weights(cfg, seed=7, scale=0.3))


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return BPETokenizer([])


@pytest.fixture(scope="module")
def workload():
    """24 requests, prompts of 4..40 tokens (some sharing a 16-token prefix), 8..24 output tokens each."""
    rng = np.random.default_rng(42)
    shared = list(map(int, rng.integers(0, 256, 16)))
    prompts, params = [], []
    for i in range(NUM_REQUESTS):
        own = list(map(int, rng.integers(0, 256, int(rng.integers(4, 25)))))
        prompts.append(shared + own if i % 3 == 0 else own)
        params.append(SamplingParams(max_tokens=int(rng.integers(8, 25)), temperature=0))
    return prompts, params


@pytest.fixture(scope="module")
def reference(model, tok, workload):
    """Each request generated alone (``minienv.generate``: a contiguous cache, one request, no scheduler)."""
    prompts, params = workload
    return [list(generate_ids(model, p, sp, eos_token_id=tok.eos_token_id))
            for p, sp in zip(prompts, params, strict=True)]


def budget_for(workload, fraction: float, block_size: int) -> int:
    prompts, params = workload
    need = required_kv_tokens([len(p) for p in prompts], [sp.max_tokens for sp in params], block_size)
    largest = max(cdiv(len(p) + sp.max_tokens, block_size) * block_size for p, sp in zip(prompts, params, strict=True))
    budget = max(int(need * fraction) // block_size * block_size, largest)  # a lone request must always fit
    assert budget <= need * (fraction + 0.05)
    return budget


def serve(model, tok, prompts, params, **kw) -> tuple[InferenceEngine, list]:
    e = InferenceEngine(model, tok, **kw)
    ids = [e.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while e.has_unfinished_requests():
        e.step()
        e.check_invariants()
    return e, [e.output(i) for i in ids]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("fraction", [0.10, 0.15])
@pytest.mark.parametrize("caching", [True, False])
def test_tight_budget_preempts_yet_every_greedy_output_equals_alone(model, tok, workload, reference, block_size,
                                                                    fraction, caching):
    prompts, params = workload
    budget = budget_for(workload, fraction, block_size)
    e, outs = serve(model, tok, prompts, params, kv_budget_tokens=budget, block_size=block_size,
                    enable_prefix_caching=caching, max_num_seqs=8, max_num_batched_tokens=32)
    assert e.stats.num_preemptions > 0, "the budget was not tight enough to preempt: this run proves nothing"
    assert all(o.finished for o in outs)
    for i, (o, ref) in enumerate(zip(outs, reference, strict=True)):
        assert list(o.token_ids) == ref, f"request {i} (preempted {o.num_preemptions}x) differs from alone"
    assert sum(o.num_preemptions for o in outs) == e.stats.num_preemptions
    s = e.stats
    assert s.num_blocks_in_use == 0 and s.num_running == s.num_waiting == 0
    if caching:
        assert s.prefix_cache_hits_tokens > 0  # resumes (and the shared prefix) were served from the cache


def test_unconstrained_engine_agrees_too(model, tok, workload, reference):
    prompts, params = workload
    e, outs = serve(model, tok, prompts, params, kv_budget_tokens=1 << 14, block_size=16, max_num_seqs=NUM_REQUESTS,
                    max_num_batched_tokens=2048)
    assert e.stats.num_preemptions == 0
    assert [list(o.token_ids) for o in outs] == reference


def test_seeded_sampling_survives_preemption(model, tok, workload):
    """A preempted request keeps its sampler (and its generator's state): sampled outputs are identical too."""
    prompts, _ = workload
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=100 + i) for i in range(len(prompts))]
    _, loose = serve(model, tok, prompts, params, kv_budget_tokens=1 << 14, block_size=4, max_num_seqs=NUM_REQUESTS,
                     max_num_batched_tokens=2048)
    e, tight = serve(model, tok, prompts, params, kv_budget_tokens=budget_for((prompts, params), 0.10, 4),
                     block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    assert e.stats.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in loose]


@pytest.mark.parametrize("static_padding", [True, False], ids=["padded", "charitable"])
def test_static_batching_under_pressure_loses_nothing_either(model, tok, workload, reference, static_padding):
    prompts, params = workload
    e, outs = serve(model, tok, prompts, params, kv_budget_tokens=budget_for(workload, 0.10, 4), block_size=4,
                    max_num_seqs=8, max_num_batched_tokens=32, scheduling="static", static_padding=static_padding)
    assert e.stats.num_preemptions > 0
    assert (e.stats.num_padding_tokens > 0) == static_padding
    assert [list(o.token_ids) for o in outs] == reference


def test_a_request_that_can_never_fit_is_rejected_and_the_rest_finish(model, tok, workload, reference):
    prompts, params = workload
    budget = budget_for(workload, 0.10, 4)
    e = InferenceEngine(model, tok, kv_budget_tokens=budget, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    ids = []
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        ids.append(e.add_request(p, sp))
        if i == 5:
            with pytest.raises(InvalidRequestError, match="can never fit"):
                e.add_request([1] * (budget - 3), SamplingParams(max_tokens=4))
            e.step()  # interleave: requests already running keep going
    e.run()
    assert [list(e.output(i).token_ids) for i in ids] == reference


@pytest.mark.parametrize("policy", ["oldest_candidate", "most_tokens"])
def test_any_victim_policy_loses_nothing(model, tok, workload, reference, policy):
    """The victim rule changes who waits, never what anyone generates (notebook 07's exercise swaps it)."""
    prompts, params = workload
    pick = {"oldest_candidate": lambda c: c[0], "most_tokens": lambda c: max(c, key=lambda r: r.num_tokens)}[policy]
    e, outs = serve(model, tok, prompts, params, kv_budget_tokens=budget_for(workload, 0.10, 4), block_size=4,
                    max_num_seqs=8, max_num_batched_tokens=32, victim_policy=pick)
    assert e.stats.num_preemptions > 0
    assert [list(o.token_ids) for o in outs] == reference


def test_a_victim_policy_must_pick_a_candidate(model, tok, workload):
    prompts, params = workload
    outsider = []
    e = InferenceEngine(model, tok, kv_budget_tokens=budget_for(workload, 0.10, 4), block_size=4, max_num_seqs=8,
                        max_num_batched_tokens=32, victim_policy=lambda c: outsider[0])
    for p, sp in zip(prompts, params, strict=True):
        e.add_request(p, sp)
    outsider.append(object())
    with pytest.raises(ValueError, match="not one of its candidates"):
        e.run()


def test_property_random_workloads_and_engine_shapes_lose_nothing(model, tok):
    """Hypothesis: random prompts (with shared prefixes), lengths, block sizes, budgets from one request's worth
    up, step budgets, batch caps, both policies, cache on/off — every output equals the request generated alone."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cache: dict[tuple, list[int]] = {}

    def alone(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            sp = SamplingParams(max_tokens=max_tokens, temperature=0)
            cache[key] = list(generate_ids(model, prompt, sp, eos_token_id=tok.eos_token_id))
        return cache[key]

    base = list(map(int, np.random.default_rng(3).integers(0, 256, 24)))

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        reqs=st.lists(st.tuples(st.integers(0, 24), st.integers(1, 12), st.integers(1, 12), st.integers(0, 255)),
                      min_size=1, max_size=8),
        block_size=st.sampled_from([1, 3, 4, 8]),
        slack=st.integers(0, 40),
        max_num_seqs=st.integers(1, 6),
        extra=st.integers(0, 24),
        static=st.booleans(),
        caching=st.booleans(),
    )
    def check(reqs, block_size, slack, max_num_seqs, extra, static, caching):
        prompts = [base[:shared] + [(salt + 7 * j) % 256 for j in range(own)] for shared, own, _, salt in reqs]
        max_tokens = [m for _, _, m, _ in reqs]
        largest = max(cdiv(len(p) + m, block_size) * block_size for p, m in zip(prompts, max_tokens, strict=True))
        e, outs = serve(model, tok, prompts, [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens],
                        kv_budget_tokens=largest + slack, block_size=block_size, enable_prefix_caching=caching,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs + extra,
                        scheduling="static" if static else "continuous")
        for p, m, o in zip(prompts, max_tokens, outs, strict=True):
            assert list(o.token_ids) == alone(p, m)
        assert e.stats.num_blocks_in_use == 0

    check()


def test_property_aborts_mid_run_never_disturb_the_others(model, tok):
    """Hypothesis: abort random requests at random steps (waiting, prefilling, decoding, preempted) under a tight
    budget; the aborted ones free their blocks at once, every other output still equals the request alone."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(0, 256, int(n)))) for n in rng.integers(3, 30, 10)]
    params = [SamplingParams(max_tokens=int(m), temperature=0) for m in rng.integers(4, 14, 10)]
    reference = [list(generate_ids(model, p, sp, eos_token_id=tok.eos_token_id))
                 for p, sp in zip(prompts, params, strict=True)]

    @settings(max_examples=25, deadline=None)
    @given(aborts=st.dictionaries(st.integers(0, 9), st.integers(0, 40), max_size=5),
           block_size=st.sampled_from([2, 4]))
    def check(aborts, block_size):
        e = InferenceEngine(model, tok, kv_budget_tokens=48, block_size=block_size, max_num_seqs=4,
                            max_num_batched_tokens=16)
        ids = [e.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        step = 0
        while e.has_unfinished_requests():
            for i, at in aborts.items():
                if at == step and ids[i] in e.scheduler.requests:
                    e.abort(ids[i])
                    assert not e.kv_cache_manager.has_request(ids[i])
            e.step()
            e.check_invariants()
            step += 1
        for i, (rid, ref) in enumerate(zip(ids, reference, strict=True)):
            out = e.output(rid)
            if out.finish_reason == "abort":
                assert i in aborts and list(out.token_ids) == ref[:len(out.token_ids)]
            else:
                assert list(out.token_ids) == ref
        assert e.stats.num_blocks_in_use == 0

    check()

"""Speculative decoding inside the engine: greedy output identical to plain decoding, the sampled distribution
exactly the target's, KV rolled back with exact refcounts, and bad configurations refused."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine_harness import FlakyModel, bundled
from minienv import InferenceEngine, SamplingParams
from minienv.sampling import Sampler

PROMPTS = [
    "ROMEO:",
    "To be, or not to be, that is the question:",
    "O Romeo, Romeo, wherefore art thou Romeo? O Romeo, Romeo, wherefore art thou",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "the the the the the the the the",
    "JULIET:\nGood night, good night! parting is such sweet sorrow,\nThat I shall say good night",
]


@pytest.fixture(scope="module")
def model():
    return bundled()[0]


@pytest.fixture(scope="module")
def tok():
    return bundled()[1]


@pytest.fixture(scope="module")
def plain(model, tok):
    """Greedy outputs of the plain engine (no speculation, a roomy budget): the reference."""
    def run(max_tokens):
        e = InferenceEngine(model, tok, kv_budget_tokens=4096, block_size=16)
        return [o.token_ids for o in e.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0))]
    return {n: run(n) for n in (24,)}


def check_speculation_state(engine) -> None:
    """After a step: invariants hold, and the KV of every running request holds only its real, computed tokens —
    no draft survives a step, so no block holding an unverified token can have been hashed."""
    engine.check_invariants()
    kv = engine.kv_cache_manager
    B = kv.block_size
    for req in engine.scheduler.running:
        table = kv.request(req.request_id)
        assert table.num_tokens == req.num_computed_tokens, (req.request_id, table.num_tokens,
                                                             req.num_computed_tokens)
        for j, block_hash in enumerate(table.block_hashes):  # every block hashed holds the request's real tokens
            entry = kv.index.entry_for_hash(block_hash)
            if entry is not None and entry.block_id == table.block_ids[j]:
                assert entry.key.token_ids == tuple(req.all_token_ids[j * B:(j + 1) * B]), \
                    f"{req.request_id}: block {j} was hashed with a draft token"


def run_stepwise(engine, prompts, sp) -> list[list[int]]:
    ids = [engine.add_request(p, sp) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        check_speculation_state(engine)
    return [done[i] for i in ids]


CONFIGS = [
    # (method, k, block_size, kv_budget_tokens, max_num_batched_tokens)
    ("draft", 1, 1, 4096, 512),
    ("draft", 3, 4, 4096, 512),
    ("draft", 5, 16, 4096, 512),
    ("ngram", 3, 2, 4096, 512),
    ("ngram", 5, 8, 4096, 512),
    ("draft", 4, 4, 72, 512),  # tight: preemption
    ("ngram", 4, 4, 72, 512),
    ("draft", 3, 4, 4096, 12),  # chunked prefill, drafts trimmed to the token budget
    ("draft", 2, 8, 72, 24),  # tight and chunked
]


@pytest.mark.parametrize("method, k, block_size, budget, max_batched", CONFIGS)
def test_greedy_speculation_is_token_identical_to_plain_decoding(model, tok, plain, method, k, block_size, budget,
                                                                  max_batched):
    e = InferenceEngine(model, tok, kv_budget_tokens=budget, block_size=block_size,
                        max_num_batched_tokens=max_batched, max_num_seqs=4, enable_prefix_caching=True,
                        speculative_config={"method": method, "num_speculative_tokens": k})
    out = run_stepwise(e, PROMPTS, SamplingParams(max_tokens=24, temperature=0))
    assert out == plain[24]
    stats = e.speculator.stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)  # position i needs i-1 kept
    assert e.kv_cache_manager.stats().num_in_use == 0  # every block returned once the requests finished
    if budget <= 256:
        assert e.stats.num_preemptions > 0, "the tight budget was meant to preempt"


def test_speculation_saves_target_calls(model, tok, plain):
    e = InferenceEngine(model, tok, kv_budget_tokens=4096, block_size=16,
                        speculative_config={"method": "draft", "num_speculative_tokens": 4})
    out = [o.token_ids for o in e.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))]
    assert out == plain[24]
    assert e.stats.num_steps < 24 - 1  # plain decoding needs one step per token after the first


def test_a_failed_speculative_step_rolls_back_and_resuming_is_identical(model, tok, plain):
    flaky = FlakyModel(model, {4: RuntimeError, 9: KeyboardInterrupt})
    e = InferenceEngine(flaky, tok, kv_budget_tokens=512, block_size=4,
                        speculative_config={"method": "draft", "num_speculative_tokens": 3})
    sp = SamplingParams(max_tokens=24, temperature=0)
    ids = [e.add_request(p, sp) for p in PROMPTS]
    done: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        try:
            outs = e.step()
        except (RuntimeError, KeyboardInterrupt):
            check_speculation_state(e)
            continue
        done.update({o.request_id: o.token_ids for o in outs if o.finished})
        check_speculation_state(e)
    assert flaky.failures == 2
    assert [done[i] for i in ids] == plain[24]


def test_seeded_sampling_with_speculation_is_reproducible(model, tok):
    def run():
        e = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=4,
                            speculative_config={"method": "draft", "num_speculative_tokens": 3})
        return [o.token_ids for o in e.generate(PROMPTS, [SamplingParams(max_tokens=16, temperature=0.8, seed=i)
                                                          for i in range(len(PROMPTS))])]
    assert run() == run()


# ------------------------------------------------------------------------ the distribution, end to end
def _exact_joint(model, prompt_ids, sp, length):
    """P(next ``length`` tokens) under the target with ``sp``'s temperature / top-k, by enumeration."""
    sampler = Sampler(sp)
    joint = {}
    frontier = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, prob in frontier.items():
            logits = model.forward(np.array(prompt_ids + list(seq)))[-1][:2048]
            p = sampler.probs(logits)
            for t in np.flatnonzero(p > 0):
                nxt[seq + (int(t),)] = prob * p[t]
        frontier = nxt
    joint.update(frontier)
    return joint


def engine_chi_square(model, tok, method: str, n: int = 1500) -> tuple[float, float, list]:
    """3 tokens at temperature 1, top-k 3: token 1 comes from the prefill, tokens 2-3 from one verification
    (k = 1 draft + the bonus or the resampled token). Pearson's chi-square of ``n`` seeded engine samples over the
    27 outcomes vs the exact joint; returns (statistic, critical value at alpha = 0.001, samples outside the
    target's support)."""
    from minienv.lab.speculation import chi_square_critical, pearson_statistic

    prompt = "ROMEO:\nO, she doth teach the torches to burn"
    joint = _exact_joint(model, tok.encode(prompt), SamplingParams(max_tokens=3, temperature=1.0, top_k=3), 3)
    e = InferenceEngine(model, tok, kv_budget_tokens=8192, block_size=16, max_num_seqs=64,
                        speculative_config={"method": method, "num_speculative_tokens": 1}, history_size=0)
    outs = e.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s)
                                     for s in range(n)])
    assert e.speculator.stats.num_drafts > 0.5 * n  # the samples did go through verification
    counts = {seq: 0 for seq in joint}
    outside = [tuple(o.token_ids) for o in outs if tuple(o.token_ids) not in counts]
    for o in outs:
        if tuple(o.token_ids) in counts:
            counts[tuple(o.token_ids)] += 1
    stat, dof = pearson_statistic(counts, joint, n)
    return stat, chi_square_critical(dof, 0.001), outside


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_engine_speculative_samples_follow_the_target_distribution(model, tok, method):
    stat, critical, outside = engine_chi_square(model, tok, method)
    assert not outside, f"{len(outside)} samples the target gives probability 0, e.g. {outside[0]}"
    assert stat <= critical, (stat, critical)


def _coupled_always_accept(drafts, target, noise):
    from minienv.spec_decode.rejection import VerifyResult

    best = np.argmax(target / noise, axis=-1).tolist()
    return VerifyResult(list(drafts) + [best[len(drafts)]], len(drafts), len(drafts))


def _coupled_bonus_from_last_draft_position(drafts, target, noise):
    from minienv.spec_decode.rejection import verify_coupled

    r = verify_coupled(drafts, target, noise)
    if r.num_accepted == len(drafts) and drafts:
        best = np.argmax(target / noise, axis=-1).tolist()
        return type(r)(list(drafts) + [best[len(drafts) - 1]], r.num_draft_tokens, r.num_accepted)
    return r


def _coupled_target_noise_not_shared(drafts, target, noise):
    """Judges each draft against a sample with *other* noise than the draft's: keeps drafts the target's own sample
    would not have chosen."""
    from minienv.spec_decode.rejection import verify_coupled

    return verify_coupled(drafts, target, np.roll(noise, 1, axis=-1))


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("bug", [_coupled_always_accept, _coupled_bonus_from_last_draft_position],
                         ids=["always_accept", "bonus_from_last_draft_position"])
def test_engine_chi_square_catches_planted_bugs(model, tok, monkeypatch, method, bug):
    """The engine verifies sampled drafts with the drafter-invariant rule (``verify_coupled``); planted bugs in it
    move the samples off the target's distribution, and the chi-square sees it. (Rejection sampling's own planted
    bugs are caught in ``test_spec_decode.py``, where :func:`verify` is tested directly.)"""
    import minienv.spec_decode.speculator as speculator

    monkeypatch.setattr(speculator, "verify_coupled", bug)
    stat, critical, outside = engine_chi_square(model, tok, method)
    assert outside or stat > critical, f"{bug.__name__} with {method} proposals passed: chi-square {stat:.1f} <= " \
                                       f"{critical:.1f}"


def test_seeded_text_is_the_same_whatever_the_proposer_and_shared_noise_is_what_keeps_drafts(model, tok,
                                                                                            monkeypatch):
    """Drafter invariance: a seeded request's text does not depend on the proposer or on k. Sharing each
    position's noise between draft and target is what makes drafts *kept*: judged with other noise, the text is
    the same but far fewer drafts survive."""
    import minienv.spec_decode.speculator as speculator

    sps = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(len(PROMPTS))]

    def run(cfg):
        e = InferenceEngine(model, tok, kv_budget_tokens=4096, block_size=16, speculative_config=cfg)
        return [o.token_ids for o in e.generate(PROMPTS, sps)], e.speculator.stats.acceptance_rate

    draft = {"method": "draft", "num_speculative_tokens": 3}
    text, shared = run(draft)
    assert run({"method": "ngram", "num_speculative_tokens": 3})[0] == text
    assert run({"method": "draft", "num_speculative_tokens": 1})[0] == text
    monkeypatch.setattr(speculator, "verify_coupled", _coupled_target_noise_not_shared)
    unshared_text, unshared = run(draft)
    assert unshared < 0.6 * shared, (unshared, shared)


# ------------------------------------------------------------------------ bad configurations
@pytest.mark.parametrize("config, message", [
    ({"method": "draft", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an int >= 1"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be 'draft' or 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, r"unknown keys \['lookahead'\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "assets/draft"}, "uses no draft model"),
    ({"method": "draft", "num_speculative_tokens": 64}, r"\+ 1 must fit max_num_batched_tokens \(32\)"),
    ("ngram", "must be a SpeculativeConfig, a dict or None"),
    ({"method": "draft", "num_speculative_tokens": 3, "draft_kv_budget_tokens": 2}, "smaller than one block"),
])
def test_bad_speculative_configs_are_refused(model, tok, config, message):
    with pytest.raises(ValueError, match=message):
        InferenceEngine(model, tok, kv_budget_tokens=256, block_size=4, max_num_batched_tokens=32,
                        speculative_config=config)


def test_drafts_beyond_the_kv_budget_or_the_context_are_refused(model, tok):
    with pytest.raises(ValueError, match=r"\+ 1 exceeds the KV budget \(16 tokens\)"):
        InferenceEngine(model, tok, kv_budget_tokens=16, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 20})
    with pytest.raises(ValueError, match=r"must be below the model's context \(1024 positions\)"):
        InferenceEngine(model, tok, kv_budget_tokens=4096, block_size=16, max_num_batched_tokens=2048,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 1024})


def test_static_scheduling_does_not_speculate(model, tok):
    with pytest.raises(ValueError, match="speculative decoding needs scheduling='continuous'"):
        InferenceEngine(model, tok, kv_budget_tokens=256, block_size=4, scheduling="static",
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_draft_with_another_vocabulary_is_refused(model, tok):
    import dataclasses

    from minienv.model import LlamaModel
    from minienv.model.checkpoint import random_weights

    cfg = dataclasses.replace(bundled_draft_config(), vocab_size=1024, bos_token_id=None, eos_token_id=None)
    draft = LlamaModel(cfg, random_weights(cfg))
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(1024 ids\) differs from the target's \(2048\)"):
        InferenceEngine(model, tok, kv_budget_tokens=256, block_size=4,
                        speculative_config={"method": "draft", "num_speculative_tokens": 2, "draft_model": draft})


def test_a_draft_with_another_tokenizer_is_refused(model, tok):
    from minienv.tokenizer import BPETokenizer

    other = BPETokenizer(tok.merges[:-1] + [tok.merges[-1][::-1]], special_tokens=tuple(tok.special_tokens))
    assert other.vocab_size == tok.vocab_size
    with pytest.raises(ValueError, match="the draft's tokenizer differs from the target's"):
        InferenceEngine(model, tok, kv_budget_tokens=256, block_size=4,
                        speculative_config={"method": "draft", "num_speculative_tokens": 2, "draft_tokenizer": other})
    # the same tokenizer is accepted
    InferenceEngine(model, tok, kv_budget_tokens=256, block_size=4,
                    speculative_config={"method": "draft", "num_speculative_tokens": 2, "draft_tokenizer": tok})


def bundled_draft_config():
    from minienv.model import LlamaConfig
    from minienv.paths import assets_dir

    return LlamaConfig.from_json(assets_dir() / "draft" / "config.json")

"""Differential proof: prefix caching changes how much is computed, never what is generated.

Many requests sharing system prompts are served greedily by the engine (``minienv.lab.serving.serve_greedy`` drives
:class:`~minienv.engine.InferenceEngine`: batched steps through the paged attention backend, blocks from the KV cache
manager) with the prefix cache on and off, with an ample budget and with budgets small enough that cached blocks are
evicted between requests. Every output must equal the dense reference (the whole sequence recomputed each token, no cache at all).

It also guards against a bug seen in small engines: a prefix hit that shares the blocks while attention never
reads them. A hit must feed the *cached* K/V to attention. With the cache on,
the hit tokens are never run through the model again, so if attention did not read their cached K/V the outputs
would differ; and poisoning a cached block's K/V must change the output of a request that hits it.

Under the tight budgets the engine preempts as well as evicts; outputs must not change either way.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minienv.generate import dense_greedy
from minienv.kv import KVPool, PagedAttentionBackend, PagedAttentionMetadata
from minienv.kv.block_table import cdiv
from minienv.kv.interface import KVRequest
from minienv.kv.kv_cache_manager import KVCacheManager
from minienv.model import LlamaConfig, LlamaModel, random_weights
from minienv.lab.serving import serve_greedy


BUNDLED = Path(__file__).resolve().parents[2] / "assets" / "target"  # committed with the repository


def small_model(seed: int = 0) -> LlamaModel:
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    return LlamaModel(cfg, random_weights(cfg, seed=seed, scale=0.3))


def serve(model, prompts, max_new_tokens, *, block_size, num_blocks, caching, max_running=3, poison=None):
    """Greedy serving through the engine, with every invariant checked after each step."""
    return serve_greedy(model, prompts, max_new_tokens, block_size=block_size, num_blocks=num_blocks,
                        caching=caching, max_running=max_running, before_admit=poison, check_invariants=True)


def shared_prefix_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Two system prompts (21 and 16 tokens), each followed by short questions; some prompts repeat exactly."""
    rng = np.random.default_rng(seed)
    systems = [list(map(int, rng.integers(0, vocab, 21))), list(map(int, rng.integers(0, vocab, 16)))]
    prompts = []
    for i in range(10):
        question = list(map(int, rng.integers(0, vocab, int(rng.integers(1, 7)))))
        prompts.append(systems[i % 2] + question)
    prompts.append(list(prompts[0]))  # an exact repeat: fully cached but for its last token (nano-vllm #144)
    prompts.append(list(systems[1]))  # exactly the system prompt: a multiple of some block sizes
    return prompts


MAX_NEW = 5


@pytest.fixture(scope="module")
def model():
    return small_model()


@pytest.fixture(scope="module")
def prompts(model):
    return shared_prefix_prompts(model.config.vocab_size)


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [dense_greedy(model, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("block_size", [1, 4, 8])
@pytest.mark.parametrize("budget", ["ample", "tight"])
def test_prefix_cache_on_off_equal_dense(model, prompts, reference, block_size, budget):
    per_request = max(cdiv(len(p) + MAX_NEW, block_size) for p in prompts)
    num_blocks = 64 * per_request if budget == "ample" else 2 * per_request + 1
    off = serve(model, prompts, MAX_NEW, block_size=block_size, num_blocks=num_blocks, caching=False)
    on = serve(model, prompts, MAX_NEW, block_size=block_size, num_blocks=num_blocks, caching=True)
    assert off.outputs == reference
    assert on.outputs == reference
    s = on.manager.stats()
    assert s.prefix_hits_tokens > 0 and on.prefill_tokens_computed < off.prefill_tokens_computed
    assert off.prefill_tokens_computed == sum(len(p) for p in prompts)
    assert on.prefill_tokens_computed == sum(len(p) for p in prompts) - sum(on.cached_tokens_per_request)
    # the engine preempts under a tight budget (and a resume hits the cache too): first admissions' hits + resumes'
    resume_hits = s.prefix_hits_tokens - sum(on.cached_tokens_per_request)
    assert resume_hits == 0 if on.engine.stats.num_preemptions == 0 else resume_hits >= 0
    assert all(h < len(p) for h, p in zip(on.cached_tokens_per_request, prompts, strict=True))  # never the whole prompt
    if budget == "tight":
        assert on.evicted_blocks > 0, "the tight budget must force evictions"
    assert s.num_in_use == 0


def test_prefix_hit_reads_the_cached_kv(model, prompts, reference):
    """Poison the K/V of every cached-free block before a request is admitted: a hit must change the output."""

    def poison(mgr, kv, rid):
        if rid == 2:  # request 2 shares request 0's system prompt, whose blocks are cached by now
            for bid, cached in mgr.free_queue():
                if cached:
                    kv.kv_cache[:, :, bid] = 3.0

    res = serve(model, prompts, MAX_NEW, block_size=4, num_blocks=400, caching=True, max_running=1, poison=poison)
    assert res.cached_tokens_per_request[2] > 0
    assert res.outputs[2] != reference[2], "attention ignored the cached K/V of the prefix hit"
    assert res.outputs[1] == reference[1]


def test_fork_copy_on_write_through_the_model(model):
    """Parallel continuations of one prompt: children fork, each appends a different token (CoW on the shared
    partial block), and each continues exactly as the dense model does on its own sequence."""
    block_size = 4
    prompt = list(map(int, np.random.default_rng(5).integers(0, 97, 10)))  # 10 tokens: last block half full
    kv = KVPool.for_model(model.config, 64 * block_size, block_size)
    mgr = KVCacheManager(64, block_size)  # bookkeeping only: this step applies the copies it asks for
    backend = PagedAttentionBackend(kv)

    reqs = {"p": KVRequest("p", list(prompt))}  # each sequence's tokens and progress (the manager reads them)

    def append(rid, token):
        reqs[rid].all_token_ids.append(token)
        return mgr.append_slots(reqs[rid], 1)

    def step(rids, allocs):
        kv.copy_blocks(pair for a in allocs for pair in a.blocks_to_copy)
        meta = PagedAttentionMetadata.from_block_tables([mgr.request(r) for r in rids],
                                                        [a.num_new_tokens for a in allocs])
        backend.set_metadata(meta)
        toks = [t for r, a in zip(rids, allocs) for t in reqs[r].all_token_ids[a.start:a.start + a.num_new_tokens]]
        out = model.forward_step(toks, meta.positions, backend, logits_indices=meta.query_start_loc[1:] - 1)
        for r in rids:
            reqs[r].num_computed_tokens = len(reqs[r].all_token_ids)
            mgr.commit(reqs[r])
        return [int(np.argmax(row)) for row in out]

    step(["p"], [mgr.allocate(reqs["p"])])
    children = [f"c{i}" for i in range(3)]
    mgr.fork(reqs["p"], children)
    reqs.update((c, KVRequest(c, list(prompt), len(prompt))) for c in children)
    forced = [11, 22, 33]
    allocs = [append(c, t) for c, t in zip(children, forced, strict=True)]
    # every child writes into the shared half-full block, so each copies it (the parent still holds the original)
    assert all(len(a.blocks_to_copy) == 1 for a in allocs), "the shared half-full block is copied on write"
    nxt = step(children, allocs)
    for _ in range(3):
        nxt = step(children, [append(c, t) for c, t in zip(children, nxt, strict=True)])
    for c, t in zip(children, nxt, strict=True):
        reqs[c].all_token_ids.append(t)
    for c, t in zip(children, forced, strict=True):
        assert reqs[c].all_token_ids == prompt + [t] + dense_greedy(model, prompt + [t], 4)
    # the parent's own K/V were never overwritten: it continues as if nothing happened
    alloc_p = append("p", 44)
    assert alloc_p.blocks_to_copy == (), "the parent is now the block's only holder: it writes in place"
    nxt_p = step(["p"], [alloc_p])
    assert nxt_p[0] == dense_greedy(model, prompt + [44], 1)[0]
    mgr.check_invariants()


SYSTEM_PROMPT = ("You are a courteous scholar of the old plays. Answer each question plainly, in the manner of "
                 "Shakespeare, and keep your answer short. ")
QUESTIONS = ["What is love?", "Who was Hamlet?", "Tell me of the sea.", "What is love?", "Why do we sleep?",
             "Describe a storm.", "Who is the king?", "What is love?"]


@pytest.mark.parametrize("budget", ["ample", "tight"])
def test_prefix_cache_on_off_equal_dense_on_the_bundled_model(budget):
    from minienv.model import load_model
    from minienv.tokenizer import load_tokenizer

    model = load_model(BUNDLED)
    tok = load_tokenizer(BUNDLED.parent / "tokenizer.json")
    prompts = [tok.encode(SYSTEM_PROMPT + q) for q in QUESTIONS]
    block_size = 8
    per_request = max(cdiv(len(p) + MAX_NEW, block_size) for p in prompts)
    num_blocks = 64 * per_request if budget == "ample" else 2 * per_request + 1
    ref = [dense_greedy(model, p, MAX_NEW) for p in prompts]
    off = serve(model, prompts, MAX_NEW, block_size=block_size, num_blocks=num_blocks, caching=False)
    on = serve(model, prompts, MAX_NEW, block_size=block_size, num_blocks=num_blocks, caching=True)
    assert off.outputs == ref and on.outputs == ref
    assert on.manager.stats().prefix_hits_tokens > 0
    if budget == "tight":
        assert on.evicted_blocks > 0

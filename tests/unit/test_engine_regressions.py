"""Regression tests for the engine contract D1-D5 (the engine rewrite), each on the bundled model and tokenizer.

* **D1** a step is a transaction: an exception from ``forward_step`` (``KeyboardInterrupt`` included) re-raises
  and leaves the engine as if the step never started; resuming gives every request its alone output.
* **D2** token ids of string prompts are range-checked against the model's vocabulary at ``add_request`` /
  ``generate`` (``InvalidRequestError``, nothing queued, the others unaffected).
* **D3** a tokenizer smaller than the model's vocabulary is accepted and ids past it are never sampled; a failure
  that belongs to one request (its token's decode raising) finishes that request with ``finish_reason ==
  "error"`` and an ``error`` message, frees its blocks, and every other request gets its alone output.
* **D4** outputs are routed per consumer: ``generate``, several ``stream`` generators and ``step`` (for
  ``add_request`` requests) interleave freely; each consumer gets every token of its own requests exactly once
  and one final output per request.
* **D5** memory is bounded: ``history_size`` bounds ``engine.history``; ``finished_retention`` bounds the finished
  requests kept for ``engine.output(id)``.

"Alone" is :func:`minienv.generate.generate_ids` (one request, contiguous cache, no engine), see
``engine_harness.py``. The wrappers are plain classes delegating to the real model / tokenizer.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_harness import (FlakyModel, HalfwayFlakyModel, Received, TokenizerProxy, alone, assert_rolled_back,
                            diff_fingerprints, fingerprint)
from minienv.engine import InferenceEngine
from minienv.request import InvalidRequestError, RequestNotFoundError
from minienv.sampling import SamplingParams

PROMPTS = ["To be, or not to be", "ROMEO:", "O Romeo, Romeo"]
GREEDY20 = SamplingParams(max_tokens=20, temperature=0)


def ref(model, tok, prompt, sp):
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return alone(model, ids, sp, tok.eos_token_id)


def step_until_done(engine, rec: Received | None = None, max_steps: int = 10_000) -> None:
    n = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if rec is not None:
            rec.take_all(outs)
        engine.check_invariants()
        n += 1
        assert n < max_steps, "the engine did not finish its requests"


# ================================================================================================ D1
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("fail_call", [1, 3, 7])
@pytest.mark.parametrize("wrapper", [FlakyModel, HalfwayFlakyModel], ids=["before", "after-kv-written"])
def test_d1_failed_step_changes_nothing_and_resuming_equals_alone(model, tok, exc, fail_call, wrapper):
    """add_request x3, step; forward_step call ``fail_call`` raises: step() re-raises, the engine's state is
    exactly what it was before that step, and stepping on delivers every request's alone output."""
    flaky = wrapper(model, {fail_call: exc})
    e = InferenceEngine(flaky, tok, kv_budget_tokens=1024, block_size=4, max_num_batched_tokens=16)
    ids = [e.add_request(p, GREEDY20) for p in PROMPTS]
    rec = Received("step()")
    raised = 0
    while e.has_unfinished_requests():
        before = fingerprint(e) if flaky.next_call_fails() else None
        try:
            rec.take_all(e.step())
        except exc:
            raised += 1
            assert before is not None
            assert_rolled_back(before, e)
        e.check_invariants()
        assert e.scheduler.num_steps < 500
    assert raised == 1
    rec.check(ids)
    for rid, p in zip(ids, PROMPTS):
        assert rec.final[rid].token_ids == ref(model, tok, p, GREEDY20), f"{p!r} differs from alone after resuming"
        assert rec.final[rid].finish_reason == "length"
    assert e.stats.num_blocks_in_use == 0


def test_d1_interrupted_generate_then_run_equals_alone(model, tok):
    """The brief's reproduction: generate() interrupted by KeyboardInterrupt on the 3rd model call; the requests
    stay queued (consistent), run() finishes them with their alone outputs (read with output(id)), and a fresh
    generate() of the same prompts equals alone too."""
    flaky = FlakyModel(model, {3: KeyboardInterrupt})
    e = InferenceEngine(flaky, tok, kv_budget_tokens=1024, block_size=4, max_num_batched_tokens=16)
    with pytest.raises(KeyboardInterrupt):
        e.generate(PROMPTS, GREEDY20)
    e.check_invariants()
    snap = e.snapshot()
    pending = {v.request_id: v.prompt for v in snap.waiting + snap.running}
    assert sorted(pending.values()) == sorted(PROMPTS), "the interrupted generate's requests must stay queued"
    e.run()
    e.check_invariants()
    for rid, p in pending.items():
        out = e.output(rid)
        assert out.finished and out.token_ids == ref(model, tok, p, GREEDY20), f"{p!r} differs from alone"
    outs = e.generate(PROMPTS, GREEDY20)
    assert [o.token_ids for o in outs] == [ref(model, tok, p, GREEDY20) for p in PROMPTS]
    assert e.stats.num_blocks_in_use == 0


def test_d1_a_failed_step_under_preemption_and_prefix_caching(model, tok):
    """A tight budget (preemptions, evictions of cached blocks) and a failure every 5th model call, K/V already
    written: every failed step is a no-op, every output equals alone."""
    prompts = [PROMPTS[i % 3] + " " + w for i, w in enumerate("and the sea was calm that night".split())]
    sp = SamplingParams(max_tokens=12, temperature=0)
    flaky = HalfwayFlakyModel(model, {k: RuntimeError for k in range(5, 400, 5)})
    e = InferenceEngine(flaky, tok, kv_budget_tokens=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    ids = [e.add_request(p, sp) for p in prompts]
    rec = Received("step()")
    while e.has_unfinished_requests():
        before = fingerprint(e) if flaky.next_call_fails() else None
        try:
            rec.take_all(e.step())
        except RuntimeError:
            assert_rolled_back(before, e)
        e.check_invariants()
        assert e.scheduler.num_steps < 2000
    assert flaky.failures > 3 and e.stats.num_preemptions > 0
    rec.check(ids)
    for rid, p in zip(ids, prompts):
        assert rec.final[rid].token_ids == ref(model, tok, p, sp), f"{p!r} differs from alone"


# ================================================================================================ D2
class OutOfRangeEncode(TokenizerProxy):
    """Encodes "BAD" to an id past the model's vocabulary (2048 + 5); everything else as the real tokenizer."""

    def encode(self, text):
        ids = list(self._tok.encode(text))
        return ids + [2048 + 5] if "BAD" in text else ids


def test_d2_string_prompt_ids_are_range_checked_and_nothing_is_queued(model, tok):
    e = InferenceEngine(model, OutOfRangeEncode(tok), kv_budget_tokens=1024, block_size=4)
    good = e.add_request(PROMPTS[0], GREEDY20)
    e.step()
    before = fingerprint(e)
    with pytest.raises(InvalidRequestError):
        e.add_request("a BAD prompt", GREEDY20)
    assert not diff_fingerprints(before, fingerprint(e)), "a rejected add_request must queue nothing"
    with pytest.raises(InvalidRequestError) as info:
        e.generate([PROMPTS[1], "BAD", PROMPTS[2]], GREEDY20)
    assert info.value.index == 1
    assert not diff_fingerprints(before, fingerprint(e)), "a rejected generate must queue nothing"
    with pytest.raises(InvalidRequestError):  # at the call (today) or at the first next() (a lazy stream)
        next(e.stream(["BAD too"], GREEDY20))
    assert not diff_fingerprints(before, fingerprint(e)), "a rejected stream must queue nothing"
    outs = e.generate([PROMPTS[1], PROMPTS[2]], GREEDY20)
    assert [o.token_ids for o in outs] == [ref(model, tok, p, GREEDY20) for p in PROMPTS[1:]]
    step_until_done(e)
    assert e.output(good).token_ids == ref(model, tok, PROMPTS[0], GREEDY20)


# ================================================================================================ D3
class SmallVocab(TokenizerProxy):
    """The real tokenizer claiming only ``n`` ids (and no end-of-text: the real one, 2047, is past them)."""

    eos_token_id = None

    def __init__(self, tokenizer, n: int):
        super().__init__(tokenizer)
        self.vocab_size = n


class MaskedModel:
    """The reference for D3: the real model with every logit from ``n`` on at -inf."""

    def __init__(self, model, n: int):
        self.model, self.config, self.n = model, model.config, n

    def forward_step(self, *args, **kwargs):
        out = np.array(self.model.forward_step(*args, **kwargs), copy=True)
        out[..., self.n:] = -np.inf
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


D3_VOCAB = 300


def small_vocab_prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [list(map(int, rng.integers(0, D3_VOCAB, int(n)))) for n in rng.integers(2, 12, 8)]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_d3_a_smaller_tokenizer_is_accepted_and_its_vocab_never_exceeded(model, tok, sampling):
    prompts = small_vocab_prompts()
    params = [SamplingParams(max_tokens=16, temperature=0) if sampling == "greedy" else
              SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=i) for i in range(len(prompts))]
    unmasked = [alone(model, p, sp, None) for p, sp in zip(prompts, params)]
    assert any(t >= D3_VOCAB for o in unmasked for t in o), "the test needs the unmasked model to pick ids >= 300"
    e = InferenceEngine(model, SmallVocab(tok, D3_VOCAB), kv_budget_tokens=2048, block_size=4,
                        max_num_batched_tokens=32)
    outs = e.generate(prompts, params)
    masked = MaskedModel(model, D3_VOCAB)
    for p, sp, o in zip(prompts, params, outs):
        assert all(t < D3_VOCAB for t in o.token_ids), f"sampled an id >= tokenizer.vocab_size: {o.token_ids}"
        assert o.token_ids == alone(masked, p, sp, None), "differs from the alone output with logits >= 300 masked"


class DecodeFailsOn(TokenizerProxy):
    """The real tokenizer, except that decoding ``bad`` (``id_to_bytes`` or any ``decode`` containing it) raises."""

    def __init__(self, tokenizer, bad: int):
        super().__init__(tokenizer)
        self.bad = bad

    def id_to_bytes(self, i):
        if i == self.bad:
            raise ValueError(f"cannot decode token {i}")
        return self._tok.id_to_bytes(i)

    def decode(self, ids):
        if self.bad in list(ids):
            raise ValueError(f"cannot decode token {self.bad}")
        return self._tok.decode(ids)


D3_PROMPTS = ["To be, or not to be", "ROMEO:", "O Romeo, Romeo", "Now is the winter", "KING RICHARD:",
              "Friends, Romans, countrymen"]


def poison_token(model, tok, sp):
    """A token that occurs in exactly one prompt's alone output (and in no prompt): (victim index, token)."""
    refs = [ref(model, tok, p, sp) for p in D3_PROMPTS]
    prompt_ids = {t for p in D3_PROMPTS for t in tok.encode(p)}
    for i, r in enumerate(refs):
        for t in r[2:]:  # a few tokens in: the victim has produced output before it fails
            if t not in prompt_ids and all(t not in o for j, o in enumerate(refs) if j != i):
                return i, t, refs
    pytest.fail("no token unique to one request's output; change D3_PROMPTS")


@pytest.mark.parametrize("consumer", ["step", "generate"])
def test_d3_a_failure_of_one_request_finishes_only_that_request_with_error(model, tok, consumer):
    sp = SamplingParams(max_tokens=20, temperature=0)
    victim, bad, refs = poison_token(model, tok, sp)
    e = InferenceEngine(model, DecodeFailsOn(tok, bad), kv_budget_tokens=512, block_size=4,
                        max_num_batched_tokens=16)
    if consumer == "step":
        ids = [e.add_request(p, sp) for p in D3_PROMPTS]
        rec = Received("step()")
        step_until_done(e, rec)
        rec.check(ids)
        outs = [rec.final[i] for i in ids]
    else:
        outs = e.generate(D3_PROMPTS, sp)
        ids = [o.request_id for o in outs]
        e.check_invariants()
    for i, (o, r) in enumerate(zip(outs, refs)):
        if i == victim:
            assert o.finished and o.finish_reason == "error", f"the victim finished with {o.finish_reason!r}"
            assert isinstance(o.error, str) and o.error, "a request finished by an error needs an error message"
            assert not e.kv_cache_manager.has_request(o.request_id), "the failed request's blocks were not freed"
        else:
            assert o.finish_reason != "error" and getattr(o, "error", None) is None
            assert o.token_ids == r, f"request {i} ({D3_PROMPTS[i]!r}) differs from alone"
    assert e.stats.num_blocks_in_use == 0


# ================================================================================================ D4
def check_against_alone(model, tok, rec: Received, prompts: list[str], sp: SamplingParams,
                        ids: list[str] | None = None) -> None:
    """The consumer got exactly the requests of ``prompts`` (by id when known, else by their prompts), each
    token once, one final output each, and each final output is the request's alone output."""
    got = {rid: o.prompt for rid, o in rec.first.items()}
    if ids is not None:
        assert sorted(got) == sorted(ids), f"{rec.name} got outputs of {sorted(got)}, owns {sorted(ids)}"
    assert sorted(got.values()) == sorted(prompts), f"{rec.name} got outputs for prompts {sorted(got.values())}"
    rec.check(got)
    for rid, p in got.items():
        r = ref(model, tok, p, sp)
        assert rec.final[rid].token_ids == r, f"{rec.name}: {p!r} differs from alone"
        assert rec.final[rid].text == tok.decode(list(r)), f"{rec.name}: {p!r}: final text != decode(alone ids)"


def test_d4_two_interleaved_streams_each_get_all_their_tokens(model, tok):
    """Today's bug: two streams consumed alternately each got 6 of 12 tokens."""
    sp = SamplingParams(max_tokens=12, temperature=0)
    e = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=4, max_num_batched_tokens=32)
    live = {"stream A": e.stream([PROMPTS[0]], sp), "stream B": e.stream([PROMPTS[1]], sp)}
    recs = {name: Received(name) for name in live}
    while live:
        for name in list(live):
            try:
                recs[name].take(next(live[name]))
            except StopIteration:
                del live[name]
    check_against_alone(model, tok, recs["stream A"], [PROMPTS[0]], sp)
    check_against_alone(model, tok, recs["stream B"], [PROMPTS[1]], sp)
    e.check_invariants()


def test_d4_a_stream_paused_across_a_generate_still_gets_everything(model, tok):
    """Today's bug: a stream resumed after a generate() call got 1 of 12 tokens and never saw finished."""
    sp = SamplingParams(max_tokens=12, temperature=0)
    e = InferenceEngine(model, tok, kv_budget_tokens=1024, block_size=4, max_num_batched_tokens=32)
    s = e.stream([PROMPTS[0]], sp)
    rs = Received("stream")
    rs.take(next(s))  # one token, then another consumer drives the engine to the end of everything
    outs = e.generate([PROMPTS[1], PROMPTS[2]], sp)
    assert [o.token_ids for o in outs] == [ref(model, tok, p, sp) for p in PROMPTS[1:]]
    for out in s:
        rs.take(out)
    check_against_alone(model, tok, rs, [PROMPTS[0]], sp)


@pytest.mark.parametrize("order_seed", range(6))
def test_d4_step_generate_and_streams_interleaved_each_consumer_gets_its_own(model, tok, order_seed):
    """add_request (the step() consumer), two streams (the second opened midway) and a generate (midway), driven
    in a seeded random order under a tight budget (preemptions): each consumer receives exactly its own requests'
    tokens, each once, one final output per request; step() never returns another consumer's request."""
    sp = SamplingParams(max_tokens=10, temperature=0)
    more = ["Now is the winter", "KING RICHARD:", "Friends, Romans, countrymen", "HAMLET:", "My lord,"]
    e = InferenceEngine(model, tok, kv_budget_tokens=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=12)
    step_rec = Received("step()")
    step_ids = [e.add_request(p, sp) for p in PROMPTS]
    s1, rec1 = e.stream(more[:2], sp), Received("stream 1")
    s2, rec2, s2_opened = None, Received("stream 2"), False
    gen_done = False
    rng = np.random.default_rng(order_seed)
    rounds = 0
    while s1 is not None or s2 is not None or not s2_opened or not gen_done or len(step_rec.final) < len(step_ids):
        action = int(rng.integers(0, 4))
        if action == 0 and s1 is not None:
            try:
                rec1.take(next(s1))
            except StopIteration:
                s1 = None
        elif action == 1 and not s2_opened:
            s2, s2_opened = e.stream(more[2:4], sp), True
        elif action == 1 and s2 is not None:
            try:
                rec2.take(next(s2))
            except StopIteration:
                s2 = None
        elif action == 2 and not gen_done and step_rec.tokens:
            gen_done = True
            outs = e.generate([more[4], PROMPTS[2]], sp)
            for o, p in zip(outs, [more[4], PROMPTS[2]]):
                assert o.finished and o.token_ids == ref(model, tok, p, sp), f"generate: {p!r} differs from alone"
        else:
            outs = e.step()
            foreign = [o.request_id for o in outs if o.request_id not in step_ids]
            assert not foreign, f"step() returned outputs of requests it does not own: {foreign}"
            step_rec.take_all(outs)
        e.check_invariants()
        rounds += 1
        assert rounds < 5000, (f"the consumers never finished: step() consumer has finals for "
                               f"{sorted(step_rec.final)} of {step_ids}")
    check_against_alone(model, tok, step_rec, PROMPTS, sp, ids=step_ids)
    check_against_alone(model, tok, rec1, more[:2], sp)
    check_against_alone(model, tok, rec2, more[2:4], sp)
    assert e.stats.num_preemptions > 0


# ================================================================================================ D5
@pytest.mark.parametrize("history_size,retention", [(8, 4), (0, 0)])
def test_d5_history_and_finished_requests_are_bounded(model, tok, history_size, retention):
    sp = SamplingParams(max_tokens=3, temperature=0)
    e = InferenceEngine(model, tok, kv_budget_tokens=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                        history_size=history_size, finished_retention=retention)
    prompts = [f"{w} {i}" for i, w in enumerate(["ROMEO:", "HAMLET:", "My lord,", "O"] * 15)]
    first = None
    for k in range(0, len(prompts), 6):
        chunk = prompts[k:k + 6]
        if k % 18 == 0:
            for o in e.generate(chunk, sp):
                assert o.finished
        elif k % 18 == 6:
            for _ in e.stream(chunk, sp):
                pass
        else:
            ids = [e.add_request(p, sp) for p in chunk]
            first = first or ids[0]
            step_until_done(e)
        unfinished = e.stats.num_waiting + e.stats.num_running
        assert len(e.history) <= history_size, f"history has {len(e.history)} records > history_size"
        assert len(e.requests) <= unfinished + retention, (
            f"{len(e.requests)} requests kept with {unfinished} unfinished and finished_retention={retention}")
    assert e.stats.num_finished == len(prompts)
    if retention:
        e.add_request(prompts[0], sp, request_id="last")
        step_until_done(e)
        assert e.output("last").token_ids == ref(model, tok, prompts[0], sp), "a retained request is looked up"
    with pytest.raises(RequestNotFoundError):
        e.output(first)  # released long ago


def test_d5_retention_and_history_arguments_are_validated(model, tok):
    for kw in (dict(history_size=-1), dict(finished_retention=-1)):
        with pytest.raises(ValueError, match="history_size|finished_retention"):
            InferenceEngine(model, tok, kv_budget_tokens=256, block_size=4, **kw)

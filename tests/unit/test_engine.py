"""InferenceEngine: the public API (generate / add_request / step / abort / stream), outputs, stop conditions,
one batched model call per step, metrics, stats, snapshots, and bad input that never breaks the other requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minienv.engine import EngineSnapshot, InferenceEngine, RequestOutput
from minienv.generate import generate_ids
from minienv.kv.errors import KVBudgetError
from minienv.model import LlamaConfig, LlamaModel, random_weights
from minienv.request import InvalidRequestError, RequestNotFoundError
from minienv.sampling import SamplingParams
from minienv.tokenizer import BPETokenizer

ASSETS = Path(__file__).resolve().parents[2] / "assets"
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=96, tie_word_embeddings=True)
    return LlamaModel(cfg, random_weights(cfg, seed=1, scale=0.3))


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return BPETokenizer([])  # byte-level, no merges: 256 bytes + <|endoftext|> (id 256)


def engine(model, tok, **kw) -> InferenceEngine:
    kw = {"kv_budget_tokens": 1024, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64} | kw
    return InferenceEngine(model, tok, **kw)


def alone(model, tok, prompt, params):
    ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    return list(generate_ids(model, ids, params, eos_token_id=tok.eos_token_id, decode=tok.decode))


PROMPTS = ["The quick brown fox", "To be, or not", "a", "Once upon a time, in a land far away, there", "xyz" * 5]


# ------------------------------------------------------------------------------------------------ generate
def test_generate_returns_one_output_per_prompt_in_order_equal_to_each_alone(model, tok):
    e = engine(model, tok)
    outs = e.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS
    for p, o in zip(PROMPTS, outs, strict=True):
        assert isinstance(o, RequestOutput) and o.finished
        assert list(o.token_ids) == alone(model, tok, p, GREEDY)
        assert o.finish_reason in ("length", "eos")
        assert o.text == tok.decode(list(o.token_ids))
        assert o.prompt_token_ids == tuple(tok.encode(p))
    e.check_invariants()
    s = e.stats
    assert s.num_running == s.num_waiting == 0 and s.num_blocks_in_use == 0 and s.num_finished == len(PROMPTS)
    assert s.num_generated_tokens == sum(len(o.token_ids) for o in outs)


def test_token_id_prompts_single_prompt_and_per_prompt_params(model, tok):
    e = engine(model, tok)
    ids = tok.encode("hello there")
    (one,) = e.generate(ids, GREEDY)  # a single token-id prompt
    (same,) = e.generate("hello there", GREEDY)
    assert one.token_ids == same.token_ids and one.prompt is None
    outs = e.generate(["ab", "cd"], [SamplingParams(max_tokens=2, temperature=0),
                                     SamplingParams(max_tokens=5, temperature=0)])
    assert [len(o.token_ids) for o in outs] == [2, 5] or outs[0].finish_reason == "eos" or outs[1].finish_reason == "eos"


def test_all_tokens_of_a_step_go_through_one_batched_model_call(model, tok, monkeypatch):
    e = engine(model, tok, max_num_batched_tokens=16)
    calls = []
    real = model.forward_step

    def counting(token_ids, positions, backend, logits_indices=None):
        calls.append(len(token_ids))
        return real(token_ids, positions, backend, logits_indices)

    monkeypatch.setattr(model, "forward_step", counting)
    e.generate(PROMPTS, GREEDY)
    assert len(calls) == e.stats.num_steps  # exactly one model call per engine step
    assert max(calls) > 1 and max(calls) <= 16
    assert sum(calls) == e.stats.num_computed_tokens
    assert [r.scheduler_output.num_scheduled_tokens for r in e.history] == calls


def test_seeded_sampling_does_not_depend_on_batching(model, tok):
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234)
    (solo,) = engine(model, tok).generate(["seeded"], p)
    outs = engine(model, tok, max_num_batched_tokens=8).generate(
        ["noise one", "seeded", "more noise here", "z"], [SamplingParams(max_tokens=7, seed=i) for i in (1,)] + [p] +
        [SamplingParams(max_tokens=9, seed=5), SamplingParams(max_tokens=3, temperature=0)])
    assert outs[1].token_ids == solo.token_ids


def test_stop_string_ends_and_trims_and_eos_ends(model, tok):
    e = engine(model, tok)
    base = e.generate(["The quick brown fox"], SamplingParams(max_tokens=30, temperature=0))[0]
    text = base.text
    assert len(text) >= 6
    stop = text[3:5]
    (o,) = e.generate(["The quick brown fox"], SamplingParams(max_tokens=30, temperature=0, stop=[stop, "\x00never"]))
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == text[:text.find(stop)]
    assert stop in tok.decode(list(o.token_ids))  # the token completing the stop string is kept in token_ids
    # eos: find a prompt whose greedy continuation hits <|endoftext|> (id 256) with this random model
    eos_model_outs = e.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0))
    for o in eos_model_outs:
        if o.finish_reason == "eos":
            assert tok.eos_token_id not in o.token_ids and len(o.token_ids) < 40


def test_streaming_deltas_add_up_to_the_final_output(model, tok):
    e = engine(model, tok, max_num_batched_tokens=8)
    finals = {o.request_id: o for o in engine(model, tok).generate(PROMPTS, GREEDY)}
    texts: dict[str, str] = {}
    toks: dict[str, list[int]] = {}
    finished = []
    params = SamplingParams(max_tokens=12, temperature=0, stop=["\x01\x02"])  # holds back 1 char while running
    for out in e.stream(PROMPTS, params):
        texts[out.request_id] = texts.get(out.request_id, "") + out.delta_text
        toks.setdefault(out.request_id, []).extend(out.delta_token_ids)
        assert out.text == texts[out.request_id]
        if out.finished:
            finished.append(out.request_id)
    assert len(finished) == len(PROMPTS)
    ref = list(finals.values())
    got = [(texts[i], tuple(toks[i])) for i in finished]
    assert sorted(got) == sorted((o.text, o.token_ids) for o in ref)


def test_closing_a_stream_early_aborts_its_requests(model, tok):
    e = engine(model, tok)
    it = e.stream(PROMPTS, GREEDY)
    next(it)
    it.close()
    assert not e.has_unfinished_requests()
    assert e.stats.num_blocks_in_use == 0


# ------------------------------------------------------------------------------------------------ stepwise
def test_add_request_step_abort(model, tok):
    e = engine(model, tok)
    a = e.add_request("first request", GREEDY)
    b = e.add_request([5, 6, 7], SamplingParams(max_tokens=50, temperature=0), request_id="mine")
    assert b == "mine"
    outs = e.step()
    assert {o.request_id for o in outs} == {a, b}
    assert all(len(o.token_ids) == 1 for o in outs)
    aborted = e.abort("mine")
    assert aborted.finished and aborted.finish_reason == "abort"
    assert not e.kv_cache_manager.has_request("mine")
    with pytest.raises(RequestNotFoundError, match="mine"):
        e.abort("mine")  # already finished
    with pytest.raises(RequestNotFoundError, match="nope"):
        e.abort("nope")
    with pytest.raises(InvalidRequestError, match="already used"):
        e.add_request("x", request_id="mine")
    e.run()
    assert e.output(a).finished and list(e.output(a).token_ids) == alone(model, tok, "first request", GREEDY)
    e.check_invariants()


def test_abort_a_waiting_request(model, tok):
    e = engine(model, tok, max_num_seqs=1, max_num_batched_tokens=8)
    a = e.add_request("run me", GREEDY)
    b = e.add_request("wait for it", GREEDY)
    e.step()
    assert e.snapshot().waiting[0].request_id == b
    e.abort(b)
    e.run()
    assert e.output(a).finish_reason in ("length", "eos") and e.output(b).finish_reason == "abort"


# ------------------------------------------------------------------------------------------------ bad input
BAD = [
    ("", GREEDY, "empty"),
    ([], GREEDY, "empty"),
    ("x" * 200, GREEDY, "max_position_embeddings"),
    ([1, 2, 999], GREEDY, "out of range"),
    (b"bytes", GREEDY, "str or a sequence"),
    ("fine", "not params", "SamplingParams"),
]


@pytest.mark.parametrize("prompt,params,msg", BAD)
def test_bad_request_is_rejected_before_queueing_and_the_engine_keeps_serving(model, tok, prompt, params, msg):
    e = engine(model, tok)
    good = e.add_request("a good request", GREEDY)
    e.step()
    before = e.kv_cache_manager.snapshot()
    with pytest.raises(InvalidRequestError, match=msg):
        e.add_request(prompt, params)
    assert e.kv_cache_manager.snapshot() == before and e.stats.num_waiting == 0
    e.run()
    assert list(e.output(good).token_ids) == alone(model, tok, "a good request", GREEDY)


@pytest.mark.parametrize("kw,msg", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params_are_clear_errors(model, tok, kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)  # rejected where they are written
    p = SamplingParams()
    for k, v in kw.items():
        setattr(p, k, v)  # ... and if mutated afterwards, rejected by the engine
    e = engine(model, tok)
    with pytest.raises(InvalidRequestError, match=msg):
        e.add_request("hello", p)


def test_a_request_that_can_never_fit_is_rejected_others_proceed(model, tok):
    e = engine(model, tok, kv_budget_tokens=32, block_size=4)
    ok = e.add_request("short", SamplingParams(max_tokens=8, temperature=0))
    with pytest.raises(InvalidRequestError, match="can never fit in the KV budget of 32 tokens"):
        e.add_request("a prompt of thirty bytes......", SamplingParams(max_tokens=8, temperature=0))
    e.run()
    assert e.output(ok).finished


def test_generate_names_the_bad_prompt_index_and_queues_nothing(model, tok):
    e = engine(model, tok)
    with pytest.raises(InvalidRequestError, match="prompt 2: ") as info:
        e.generate(["fine", "also fine", "", "fine"], GREEDY)
    assert info.value.index == 2
    assert not e.has_unfinished_requests() and e.requests == {}
    with pytest.raises(InvalidRequestError, match="2 prompts but 3 sampling params"):
        e.generate(["a", "b"], [GREEDY] * 3)
    assert len(e.generate(["fine"], GREEDY)) == 1  # and it still works


def test_bad_engine_configuration(model, tok):
    with pytest.raises(KVBudgetError, match="smaller than one block"):
        InferenceEngine(model, tok, kv_budget_tokens=3, block_size=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        InferenceEngine(model, tok, kv_budget_tokens=64, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="scheduling"):
        InferenceEngine(model, tok, kv_budget_tokens=64, scheduling="round-robin")
    big = BPETokenizer.train("abcabcabd" * 50, 300)
    with pytest.raises(ValueError, match="tokenizer has"):
        InferenceEngine(model, big, kv_budget_tokens=64)


# ------------------------------------------------------------------------------------------------ observing
def test_metrics_are_consistent(model, tok):
    e = engine(model, tok, max_num_seqs=2, max_num_batched_tokens=8)
    outs = e.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    for o in outs:
        m = o.metrics
        assert 0 < m.ttft <= m.e2e_latency and m.tpot >= 0
        assert 1 <= m.ttft_steps <= m.e2e_steps
        if len(o.token_ids) > 1 and o.num_preemptions == 0:
            assert m.tpot_steps >= 1.0
    waited = [o.metrics.ttft_steps for o in outs]
    assert max(waited) > min(waited)  # max_num_seqs=2: later requests queue before their first token


def test_prefix_cache_stats_on_a_shared_prefix(model, tok):
    system = "You are a helpful assistant. Answer briefly.\n"
    questions = ["Q: sky?", "Q: sea?", "Q: grass?", "Q: snow?"]
    on = engine(model, tok, block_size=4)
    on.generate([system + questions[0]], GREEDY)
    outs = on.generate([system + q for q in questions[1:]], GREEDY)
    assert len(outs) == 3 and all(o.num_cached_tokens >= 40 for o in outs)
    s = on.stats
    assert s.prefix_cache_hits_tokens >= 3 * 40 and 0 < s.prefix_cache_hit_rate < 1
    off = engine(model, tok, block_size=4, enable_prefix_caching=False)
    outs_off = off.generate([system + q for q in questions], GREEDY)
    assert off.stats.prefix_cache_hits_tokens == 0
    assert [o.token_ids for o in outs_off[1:]] == [o.token_ids for o in outs]  # caching never changes outputs
    assert on.stats.num_computed_tokens < off.stats.num_computed_tokens


def test_snapshot_for_a_dashboard(model, tok):
    e = engine(model, tok, kv_budget_tokens=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    for p in PROMPTS[:4]:
        e.add_request(p, SamplingParams(max_tokens=6, temperature=0))
    snaps: list[EngineSnapshot] = []
    while e.has_unfinished_requests():
        e.step()
        snaps.append(e.snapshot())
        e.check_invariants()
    for snap in snaps:
        refs = [0] * e.num_blocks
        for view in snap.running:
            assert len(view.block_ids) == -(-view.num_computed_tokens // 4)
            assert view.block_refcounts == tuple(snap.block_refcounts[b] for b in view.block_ids)
            for b in view.block_ids:
                refs[b] += 1
        assert list(snap.block_refcounts) == refs  # no forks here: refcount = number of tables holding the block
        free = {b for b, _ in snap.free_queue}
        assert free == {b for b, r in enumerate(snap.block_refcounts) if r == 0}
        assert [s == "cached-free" for s in (snap.block_states[b] for b, _ in snap.free_queue)] == \
               [c for _, c in snap.free_queue]
        st = snap.stats
        assert st.num_blocks_in_use + st.num_cached_free_blocks + st.num_free_empty_blocks == st.num_blocks
        assert snap.last_step is not None and snap.last_step.step == snap.step - 1
        assert all(isinstance(v.text, str) for v in snap.running + snap.waiting + snap.finished)
    assert len(snaps[-1].finished) == 4 and all(v.text is not None for v in snaps[-1].finished)
    states = {t.state for t in e.timeline()}
    assert {"waiting", "prefill", "decode", "finished"} <= states


def test_step_listener_and_history(model, tok):
    e = engine(model, tok, history_size=0)
    seen = []
    e.add_step_listener(seen.append)
    e.generate(PROMPTS[:2], GREEDY)
    assert list(e.history) == [] and len(seen) == e.stats.num_steps
    assert any(ev.kind == "cache" for r in seen for ev in r.kv_events)
    assert all(set(r.sampled) <= set(e.retained) for r in seen)


def test_peak_kv_usage_is_a_counter_not_read_from_the_history_ring(model, tok):
    """The peak comes early (all prompts at once) and the ring keeps only the last step: the counter still has it."""
    e = engine(model, tok, history_size=1, kv_budget_tokens=256)
    usage = []
    e.add_step_listener(lambda r: usage.append(r.stats.kv_usage))
    e.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    assert len(usage) > 2 and e.stats.peak_kv_usage == max(usage) > e.history[-1].stats.kv_usage
    assert max(usage) > usage[-1] and e.stats.peak_kv_usage > e.stats.kv_usage


# ------------------------------------------------------------------------------------------------ bundled model
@pytest.mark.parametrize("which", ["target", "draft"])
def test_bundled_model_16_prompts_batched_equal_alone(which):
    from minienv.model import load_model
    from minienv.tokenizer import load_tokenizer

    model, tokz = load_model(ASSETS / which), load_tokenizer()
    prompts = ["ROMEO.\n", "To be, or not to be", "KING.\nWhat news", "The king"] * 4
    prompts = [p + " " * (i // 4) for i, p in enumerate(prompts)]
    params = SamplingParams(max_tokens=16, temperature=0)
    for budget in (4096, 192):  # ample, and tight enough to preempt
        e = InferenceEngine(model, tokz, kv_budget_tokens=budget, max_num_seqs=16, max_num_batched_tokens=128)
        outs = e.generate(prompts, params)
        for p, o in zip(prompts, outs, strict=True):
            assert list(o.token_ids) == alone(model, tokz, p, params)
        assert any(o.text.strip() for o in outs)
    assert e.stats.num_preemptions > 0


def test_incremental_detokenizer_equals_decoding_everything(tok):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from minienv.engine import IncrementalDetokenizer

    class DecodeOnly:  # a tokenizer without id_to_bytes: the engine falls back to decoding pending tokens
        def __init__(self, t):
            self.decode = t.decode

    utf8 = st.text(min_size=0, max_size=12).map(lambda s: list(s.encode("utf-8")))
    junk = st.lists(st.integers(0, 255), max_size=6)  # arbitrary bytes: invalid UTF-8 included
    tokens = st.lists(st.integers(0, tok.vocab_size - 1), max_size=6)  # any token: merged, special, partial

    @settings(max_examples=400, deadline=None)
    @given(st.lists(st.one_of(utf8, junk, tokens), max_size=6))
    def check(parts):
        ids = [i for p in parts for i in p]
        for d in (IncrementalDetokenizer(tok), IncrementalDetokenizer(DecodeOnly(tok))):
            text = "".join(d.push(i) for i in ids) + d.flush()
            assert text == tok.decode(ids)

    check()


def test_detokenizer_table_is_id_to_bytes(tok):
    """The detokenizer's unchecked table gives ``id_to_bytes`` of every id (special tokens included); ids outside
    it — out of range, negative, not an int — still meet the tokenizer's own checks and errors."""
    from minienv.engine import IncrementalDetokenizer

    assert list(tok.token_bytes) == [tok.id_to_bytes(i) for i in range(tok.vocab_size)]
    d = IncrementalDetokenizer(tok)
    eos = tok.eos_token_id
    assert d.push(eos) + d.flush() == tok.decode([eos]) and d.push(np.int64(65)) == tok.decode([65])
    for bad, error in ((tok.vocab_size, ValueError), (-1, ValueError), (True, TypeError), ("7", TypeError)):
        with pytest.raises(error):
            d.push(bad)


def test_continuous_batching_needs_at_least_2x_fewer_steps_than_static_on_mixed_lengths(model, tok):
    """Steps are deterministic (no timing): the must-show ratio, checked in the suite. Same outputs both ways."""
    from minienv.lab.workload import LengthDistribution, WorkloadConfig, generate_workload

    mixed = WorkloadConfig("mixed", LengthDistribution(12.0, 0.5), LengthDistribution(20.0, 1.0))
    specs = generate_workload(48, mixed, max_len=80, seed=0)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, s.prompt_len))) for s in specs]
    params = [SamplingParams(max_tokens=s.output_len, temperature=0) for s in specs]
    runs = {}
    for mode in ("static", "continuous"):
        e = engine(model, tok, kv_budget_tokens=4096, max_num_seqs=6, max_num_batched_tokens=128, scheduling=mode)
        e.eos_token_id = None  # every request generates exactly its workload length
        runs[mode] = (e.generate(prompts, params), e.stats)
    (s_out, s_stats), (c_out, c_stats) = runs["static"], runs["continuous"]
    assert [o.token_ids for o in s_out] == [o.token_ids for o in c_out]
    assert s_stats.num_generated_tokens == c_stats.num_generated_tokens == sum(s.output_len for s in specs)
    assert s_stats.num_steps >= 2 * c_stats.num_steps, (s_stats.num_steps, c_stats.num_steps)
    mean_ttft = {k: np.mean([o.metrics.ttft_steps for o in v[0]]) for k, v in runs.items()}
    assert mean_ttft["continuous"] < mean_ttft["static"]


def test_static_padding_computes_discarded_tokens_and_leaves_outputs_unchanged(model, tok):
    """The faithful static baseline really computes a finished member's row until its batch ends: more tokens go
    through the model than come out, the waste is exactly what a hand count gives, and no output changes."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]
    lens = [2, 5, 3, 4]  # batch 1 = the first three (max_num_seqs=3), batch 2 = the last alone
    params = [SamplingParams(max_tokens=m, temperature=0) for m in lens]
    runs = {}
    for name, kw in (("padded", dict(scheduling="static")),
                     ("charitable", dict(scheduling="static", static_padding=False)),
                     ("continuous", dict(scheduling="continuous"))):
        e = engine(model, tok, max_num_seqs=3, **kw)
        e.eos_token_id = None
        runs[name] = (e, e.generate(prompts, params))
        e.check_invariants()
        assert e.kv_cache_manager.pool.num_used_blocks == 0  # padding slots freed their blocks at the batch's end
    outs = {k: [o.token_ids for o in v[1]] for k, v in runs.items()}
    assert outs["padded"] == outs["charitable"] == outs["continuous"]
    assert [len(t) for t in outs["padded"]] == lens
    pad, cha = runs["padded"][0].stats, runs["charitable"][0].stats
    # by hand: batch 1 lasts 5 steps; the member of 2 tokens pads 3 steps, the member of 3 tokens pads 2
    assert pad.num_padding_tokens == (5 - 2) + (5 - 5) + (5 - 3) == 5 and cha.num_padding_tokens == 0
    live = sum(map(len, prompts)) + sum(m - 1 for m in lens)  # prompts + every decode but the first token's
    assert cha.num_computed_tokens == live and pad.num_computed_tokens == live + 5
    assert pad.num_computed_tokens > pad.num_prompt_tokens + pad.num_generated_tokens
    assert pad.num_steps == cha.num_steps == 5 + 4 and pad.num_generated_tokens == cha.num_generated_tokens
    # every padded step of batch 1 carried its three rows: one model call, three sequences
    rows = [len(r.scheduler_output.scheduled) for r in runs["padded"][0].history]
    assert rows == [3] * 5 + [1] * 4
    assert "static_padding=False" in repr(runs["charitable"][0]) and "static_padding" not in repr(runs["padded"][0])
    # the timeline shows requests' own work only: padding is not a request's decode
    assert [t for t in runs["padded"][0].timeline()] == [t for t in runs["charitable"][0].timeline()]


def test_static_padding_holds_kv_until_the_batch_ends_and_abort_frees_at_once(model, tok):
    e = engine(model, tok, max_num_seqs=2, scheduling="static")
    e.eos_token_id = None
    short = e.add_request([1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    long = e.add_request([4, 5, 6], SamplingParams(max_tokens=6, temperature=0))
    e.step()
    assert e.output(short).finished and e.kv_cache_manager.has_request(short)  # finished, still in its row
    assert e.scheduler.padding_slots == [short]
    e.step()
    assert e.history[-1].scheduler_output.num_padding_tokens == 1 and e.stats.num_padding_tokens == 1
    e.abort(long)  # the batch's last member leaves: the padding slot goes with it
    assert e.scheduler.padding_slots == [] and e.kv_cache_manager.pool.num_used_blocks == 0
    e.check_invariants()

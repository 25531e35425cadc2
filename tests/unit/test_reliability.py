"""Regression tests of issue #32's eight defects, each through public interfaces only, and the four rules they
broke (docs/ARCHITECTURE.md, "Reliability rules"):

(a) a request id names one request instance — nothing staged for it survives its abort;
(b) whatever a tier returns is untrusted input (a bad record is a counted miss, never an exception);
(c) a failure is charged to the request it belongs to; only an engine-wide failure ends others;
(d) every step, plain or speculative, emits exactly one record to history and listeners, or is rolled back;
and a seeded request's draws are a function of (seed, position): speculation, preemption and batching never
change its text.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import warnings

import numpy as np
import pytest

from engine_harness import FlakyModel, bundled
from test_engine_regressions import DecodeFailsOn
from minienv import InferenceEngine, SamplingParams
from minienv.kv_tier import TierWarning
from minienv.model import load_model
from minienv.paths import assets_dir

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _ids(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(5, 2000, n)]


def _drive(engine: InferenceEngine) -> dict[str, list[int]]:
    """Step to the end; the final token ids of every request of ``add_request``, by id."""
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        engine.check_invariants()
    return done


def _alone(prompt, sp, **kw) -> list[int]:
    model, tok = bundled()
    return list(InferenceEngine(model, tok, **kw).generate([prompt], sp)[0].token_ids)


# ------------------------------------------------------------------------------------------ #1 (rule a)
def test_1_a_reused_request_id_never_loads_the_aborted_prompts_tier_kv(tmp_path):
    """Defect 1: "X" staged p1's blocks from the tier while waiting for memory, was aborted and reused for p2 (same
    length, same local hit): the stale staging was loaded and X continued p1's text."""
    model, tok = bundled()
    p1, p2, blocker = _ids(100, 1), _ids(100, 2), _ids(180, 3)
    InferenceEngine(model, tok, kv_tier=tmp_path).generate([p1], GREEDY)  # p1's blocks are in the tier
    e = InferenceEngine(model, tok, kv_tier=tmp_path, kv_budget_tokens=256, finished_retention=0)
    e.add_request(blocker, SamplingParams(max_tokens=40, temperature=0))
    e.step()
    e.add_request(p1, GREEDY, request_id="X")
    e.step()  # X is staged from the tier and waits for memory
    assert e.requests["X"].num_computed_tokens == 0 and e.kv_tier.stats.lookups >= 1
    e.abort("X")
    e.add_request(p2, GREEDY, request_id="X")
    done = _drive(e)
    assert done["X"] == _alone(p2, GREEDY), "X continued another prompt's KV"
    assert done["X"] != _alone(p1, GREEDY)


# ------------------------------------------------------------------------------------------ #2 / #3 (rule b)
@pytest.mark.parametrize("value", ["'x'", "42"])
def test_2_a_sqlite_record_that_is_not_a_blob_is_a_counted_miss(tmp_path, value):
    model, tok = bundled()
    p1 = _ids(100, 1)
    InferenceEngine(model, tok, kv_tier=tmp_path).generate([p1], GREEDY)
    db = sqlite3.connect(tmp_path / "kv_tier.sqlite3")
    db.execute(f"UPDATE blocks SET record={value}")
    db.commit()
    db.close()
    e = InferenceEngine(model, tok, kv_tier=tmp_path)
    out = e.generate([p1], GREEDY)[0]
    assert list(out.token_ids) == _alone(p1, GREEDY)
    s = e.kv_tier.stats
    assert s.hit_tokens == 0 and s.record_errors == 1, s


def test_3_another_process_deleting_the_meta_rows_fails_no_lookup(tmp_path):
    model, tok = bundled()
    p1, p2 = _ids(100, 1), _ids(100, 2)
    e = InferenceEngine(model, tok, kv_tier=tmp_path)
    e.generate([p1], GREEDY)
    db = sqlite3.connect(tmp_path / "kv_tier.sqlite3")
    db.execute("DELETE FROM meta")
    db.commit()
    db.close()
    e.reset_prefix_cache()  # p1 again must ask the tier
    outs = e.generate([p1, p2], GREEDY)
    assert [list(o.token_ids) for o in outs] == [_alone(p1, GREEDY), _alone(p2, GREEDY)]
    assert all(o.finish_reason == "length" for o in outs)
    assert e.kv_tier.stats.hit_tokens == 96  # the store repaired its clock and still serves p1's blocks
    e.kv_tier.store.check_invariants()


# ------------------------------------------------------------------------------------------ #4 (seeded draws)
SPEC = {"ngram": {"method": "ngram", "num_speculative_tokens": 3},
        "draft": {"method": "draft", "num_speculative_tokens": 3}}
SPEC_PROMPTS = ["ROMEO:", "To be, or not to be, that is the question:",
                "O Romeo, Romeo, wherefore art thou Romeo? O Romeo, Romeo, wherefore art thou",
                "KING RICHARD III:\nNow is the winter of our discontent", "the the the the the the the the",
                "JULIET:\nGood night, good night! parting is such sweet sorrow,\nThat I shall say good night",
                "First Citizen:\nBefore we proceed any further, hear me speak.", "All the world's a stage"]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_4_seeded_sampled_output_with_speculation_does_not_depend_on_memory_pressure(method):
    model, tok = bundled()
    sps = [SamplingParams(max_tokens=24, temperature=0.8, seed=10 + i) for i in range(len(SPEC_PROMPTS))]
    e = InferenceEngine(model, tok, kv_budget_tokens=192, block_size=16, speculative_config=SPEC[method])
    ids = [e.add_request(p, sp) for p, sp in zip(SPEC_PROMPTS, sps, strict=True)]
    done = _drive(e)
    assert e.stats.num_preemptions >= 3 and e.speculator.stats.num_drafts > 0
    alone = [_alone(p, sp, speculative_config=SPEC[method]) for p, sp in zip(SPEC_PROMPTS, sps, strict=True)]
    differ = [i for i, (rid, a) in enumerate(zip(ids, alone, strict=True)) if done[rid] != a]
    assert not differ, f"{len(differ)} of {len(ids)} seeded requests differ from the same request alone: {differ}"


# ------------------------------------------------------------------------------------------ #5 (rule d)
def test_5_an_exception_in_the_draft_model_is_rolled_back_and_every_step_is_recorded():
    """The draft runs after the step's tokens are committed (its drafts are for the next step): a draft that
    raises leaves no drafts and no draft KV behind, the step keeps its one record, the interrupt reaches the caller
    after it (as a Ctrl-C during bookkeeping does), and the seeded text is the text alone."""
    model, tok = bundled()
    flaky = FlakyModel(load_model(assets_dir() / "draft"), {5: KeyboardInterrupt})
    cfg = {"method": "draft", "num_speculative_tokens": 3}
    sp = SamplingParams(max_tokens=20, temperature=0.8, seed=7)
    e = InferenceEngine(model, tok, speculative_config={**cfg, "draft_model": flaky})
    seen = []
    e.add_step_listener(seen.append)
    rid = e.add_request(SPEC_PROMPTS[1], sp)
    out: list[int] = []
    interrupted = 0
    while e.has_unfinished_requests():
        try:
            for o in e.step():
                out = list(o.token_ids)
        except KeyboardInterrupt:
            interrupted += 1
            assert all(not r.spec_token_ids for r in e.scheduler.running)  # the failed round left no drafts
            assert not e.speculator.draft.kv.request_ids()  # ... and no draft KV
        e.check_invariants()
        assert len(seen) == len(e.history) == e.stats.num_steps, "a step without exactly one record"
        assert [r.step for r in seen] == list(range(e.stats.num_steps))
    assert interrupted == 1 and flaky.failures == 1
    assert e.speculator.stats.num_failed_proposals == 1 and e.stats.num_failed_steps == 0  # nothing to roll back
    assert out == _alone(SPEC_PROMPTS[1], sp, speculative_config={**cfg, "draft_model": flaky.model}), rid


# ------------------------------------------------------------------------------------------ #6 (HTTP 400)
@pytest.fixture(scope="module")
def http_server():
    from serving_harness import make_engine, running_server

    with running_server(make_engine, http_port=0) as srv:
        yield srv


@pytest.mark.parametrize("body", [b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                  b'{"model": "minienv", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"],
                         ids=["nested-100000", "5000-digit-int"])
def test_6_malformed_json_bodies_are_400_in_openais_error_shape(http_server, body):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{http_server.http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400
    err = json.loads(info.value.read())["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"], err


# ------------------------------------------------------------------------------------------ #7 (TTFT)
def test_7_ttft_counts_no_request_that_produced_no_token():
    pytest.importorskip("prometheus_client")
    from minienv.metrics import metrics_of

    model, tok = bundled()
    first = _alone("ROMEO:", GREEDY)[0]
    e = InferenceEngine(model, DecodeFailsOn(tok, first))
    m = metrics_of(e)  # observing from the start
    out = e.generate(["ROMEO:"], GREEDY)[0]
    assert out.finish_reason == "error" and not out.token_ids
    assert m.value("vllm:time_to_first_token_seconds_count") == 0
    assert e.output(out.request_id).metrics.first_token_time is None


# ------------------------------------------------------------------------------------------ #8 (rule c, served)
class _BrokenStore:
    """A tier store whose reads raise an exception no store is documented to raise (a bug in a third-party
    store): the request that asked is served without the tier; nobody else notices."""

    kind = "broken"

    def __init__(self, inner):
        self.inner = inner

    def contains_prefix(self, keys):
        return len(keys)

    def get_many(self, keys):
        raise TypeError("injected: this store's reader is broken")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_8_a_tier_failure_over_grpc_and_http_fails_neither_its_request_nor_an_unrelated_one(tmp_path):
    import urllib.request

    from minienv.kv_tier import SQLiteStore
    from minienv.serving import Client
    from serving_harness import kv_idle, make_engine, running_server

    prompt = " ".join(["To be, or not to be, that is the question"] * 6)
    with running_server(lambda: make_engine(kv_tier=_BrokenStore(SQLiteStore(tmp_path))), max_waiting=64,
                        http_port=0) as srv:
        with Client(srv.address) as client:
            long_stream = client.stream("Friends, Romans, countrymen", max_tokens=60)
            chunks = iter(long_stream)
            first = next(chunks)  # in flight
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TierWarning)
                short = client.generate(prompt, max_tokens=4)
                body = json.dumps({"model": srv.model_name, "prompt": prompt + " again",
                                   "max_tokens": 4}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{srv.http_port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    http_out = json.loads(resp.read())
            rest = list(chunks)
        assert short.finish_reason == "length" and len(short.token_ids) == 4
        assert http_out["choices"][0]["finish_reason"] == "length" and http_out["usage"]["completion_tokens"] == 4
        ids = list(first.token_ids) + [t for c in rest for t in c.token_ids]
        assert len(ids) == 60, "the unrelated in-flight request was ended by another request's tier failure"
        assert kv_idle(srv) == 0
        assert srv.call(lambda e: e.kv_tier.stats.backend_errors) >= 1


def test_b_a_store_that_keeps_misbehaving_is_switched_off_after_three_with_one_warning(tmp_path):
    from minienv.kv_tier import SQLiteStore

    model, tok = bundled()
    prompts = [_ids(60, 10 + i) for i in range(5)]
    InferenceEngine(model, tok, kv_tier=tmp_path).generate(prompts, GREEDY)  # every prompt is in the store
    e = InferenceEngine(model, tok, kv_tier=_BrokenStore(SQLiteStore(tmp_path)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [e.generate([p], GREEDY)[0] for p in prompts]  # one admission each: 5 lookups
    assert [list(o.token_ids) for o in outs] == [_alone(p, GREEDY) for p in prompts]
    tier_warnings = [w for w in caught if issubclass(w.category, TierWarning)]
    assert len(tier_warnings) == 1 and "switched off" in str(tier_warnings[0].message)
    assert not e.kv_tier.enabled and e.kv_tier.stats.backend_errors == 3 and "TypeError" in e.kv_tier.disabled_reason


def test_d_a_draft_model_exception_is_counted_warned_once_and_changes_no_text():
    model, tok = bundled()
    flaky = FlakyModel(load_model(assets_dir() / "draft"), {3: RuntimeError, 6: RuntimeError})
    cfg = {"method": "draft", "num_speculative_tokens": 3}
    sp = SamplingParams(max_tokens=20, temperature=0.8, seed=3)
    e = InferenceEngine(model, tok, speculative_config={**cfg, "draft_model": flaky})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = e.generate([SPEC_PROMPTS[2]], sp)[0]
    assert flaky.failures == 2 and e.speculator.stats.num_failed_proposals == 2
    assert len([w for w in caught if "proposer failed" in str(w.message)]) == 1
    assert len(e.history) == e.stats.num_steps and e.stats.num_failed_steps == 0
    assert list(out.token_ids) == _alone(SPEC_PROMPTS[2], sp, speculative_config={**cfg, "draft_model": flaky.model})


class _DownStore(_BrokenStore):
    """A store that is down: every call is a documented, transient failure."""

    def _down(self, *args, **kw):
        from minienv.kv_tier import TierBackendError

        raise TierBackendError("injected: the server does not answer")

    contains_prefix = get_many = put = _down


def test_b_a_store_that_stays_down_is_retried_with_one_warning_per_outage(tmp_path):
    from minienv.kv_tier import SQLiteStore

    model, tok = bundled()
    prompts = [_ids(60, 20 + i) for i in range(5)]
    InferenceEngine(model, tok, kv_tier=tmp_path).generate(prompts, GREEDY)
    e = InferenceEngine(model, tok, kv_tier=_DownStore(SQLiteStore(tmp_path)))
    e.kv_tier.retry_interval_s = 0.0  # retried at every admission
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [e.generate([p], GREEDY)[0] for p in prompts]
    assert [list(o.token_ids) for o in outs] == [_alone(p, GREEDY) for p in prompts]
    assert len([w for w in caught if issubclass(w.category, TierWarning)]) == 1
    assert e.kv_tier.enabled and e.kv_tier.stats.backend_errors >= 5  # transient: still retried


def test_1_over_grpc_a_client_chosen_id_reused_after_an_abort_gets_its_own_prompts_text(tmp_path):
    """Defect 1 as the adversary found it: over gRPC, with client-chosen ids (3 of 3 attempts loaded the aborted
    prompt's K/V before the fix)."""
    import time

    from minienv.serving import Client
    from serving_harness import kv_idle, make_engine, running_server

    model, tok = bundled()
    p1, p2, blocker = _ids(100, 1), _ids(100, 2), _ids(180, 3)
    InferenceEngine(model, tok, kv_tier=tmp_path).generate([p1], GREEDY)
    factory = lambda: make_engine(kv_tier=tmp_path, kv_budget_tokens=256, finished_retention=0)  # noqa: E731
    with running_server(factory, max_waiting=64) as srv, Client(srv.address) as client:
        for attempt in range(3):
            rid, bid = f"X{attempt}", f"B{attempt}"
            started, staged_evt = threading.Event(), threading.Event()
            gate: dict = {}

            def hold() -> None:
                """Hold the engine thread (inside a step's listener) until the test's next command is queued: that
                command then runs before the next step, whatever the host's load."""
                deadline = time.monotonic() + 10
                while srv.engine_thread._inbox.empty() and time.monotonic() < deadline:
                    time.sleep(0.001)

            def gatekeeper(record, e=srv.engine_thread.engine, gate=gate, started=started, evt=staged_evt):
                """Two holds, so that nothing races the blocker's decodes. (1) After the step that prefilled the
                blocker, until p1's request is queued: p1 then arrives while the blocker holds most of the memory.
                (2) After the step that looked p1 up in the tier (staged, waiting), until the Abort is queued."""
                if "lookups" not in gate:
                    blocker = e.scheduler.requests.get(bid)
                    if blocker is None or not blocker.num_computed_tokens:
                        return
                    gate["lookups"] = e.kv_tier.stats.lookups
                    started.set()
                    hold()
                elif not evt.is_set() and e.kv_tier.stats.lookups > gate["lookups"]:
                    assert rid in e.scheduler.requests and not e.output(rid).token_ids, "p1 ran before the abort"
                    evt.set()
                    hold()

            srv.call(lambda e: e.add_step_listener(gatekeeper))
            held = client.stream(blocker, max_tokens=40, request_id=bid)  # runs and holds most of the memory
            assert started.wait(10), "the blocker was never prefilled"
            staged = client.stream(p1, max_tokens=GREEDY.max_tokens, request_id=rid)
            assert staged_evt.wait(10), "p1 was never looked up"
            client.abort(rid)
            out = client.generate(p2, max_tokens=GREEDY.max_tokens, request_id=rid)
            assert list(out.token_ids) == _alone(p2, GREEDY), f"attempt {attempt}: {rid} continued p1's KV"
            held.cancel()
            staged.cancel()
            assert kv_idle(srv) == 0

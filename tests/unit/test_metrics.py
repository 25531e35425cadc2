"""minienv.metrics: vLLM's names, types and buckets; series that agree with engine.stats; golden relations between
the histograms; one registry per engine; the /metrics server and its errors; the extra being optional."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.metrics import (  # noqa: E402
    FINISHED_REASON, ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, SERIES, TTFT_BUCKETS, EngineMetrics, MetricsServerError,
    metrics_of, request_tokens_buckets, serve_metrics, stored_series_names, token_slots_in_use)
from minienv.model import LlamaConfig, LlamaModel, random_weights  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.tokenizer import BPETokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "To be, or not", "a", "Once upon a time, in a land far away, there", "xyz" * 5,
           "The quick brown fox jumps", "To be, or not to be"]


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=96, tie_word_embeddings=True)
    return LlamaModel(cfg, random_weights(cfg, seed=1, scale=0.3))


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return BPETokenizer([])


def make(model, tok, **kw) -> InferenceEngine:
    kw = {"kv_budget_tokens": 1024, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64} | kw
    return InferenceEngine(model, tok, **kw)


def tight(model, tok) -> InferenceEngine:
    """Small enough to preempt and to evict cached-free blocks on PROMPTS."""
    return make(model, tok, kv_budget_tokens=64, max_num_seqs=4, max_num_batched_tokens=32)


def params(n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


PULLED = {  # stored name -> EngineStats field (or function of it)
    "vllm:num_requests_running": lambda s: s.num_running,
    "vllm:num_requests_waiting": lambda s: s.num_waiting,
    "vllm:kv_cache_usage_perc": lambda s: s.kv_usage,
    "vllm:prefix_cache_queries_total": lambda s: s.prefix_cache_queries_tokens,
    "vllm:prefix_cache_hits_total": lambda s: s.prefix_cache_hits_tokens,
    "vllm:num_preemptions_total": lambda s: s.num_preemptions,
    "vllm:prompt_tokens_total": lambda s: s.num_prompt_tokens,
    "vllm:generation_tokens_total": lambda s: s.num_generated_tokens,
    "minienv:kv_cache_cached_free_blocks": lambda s: s.num_cached_free_blocks,
    "minienv:kv_cache_evicted_blocks_total": lambda s: s.evicted_blocks,
    "minienv:kv_cache_evicted_tokens_total": lambda s: s.evicted_tokens,
}


def _all_samples(m: EngineMetrics) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in m.registry.collect() for s in fam.samples
            if not s.name.endswith("_created")}


# ------------------------------------------------------------------------------------------------ names and types
def test_every_series_is_exported_with_vllm_type_and_labels(model, tok):
    e = make(model, tok)
    e.generate(PROMPTS[:2], params(3))
    families = {f.name: f for f in metrics_of(e).registry.collect()}
    assert not any(s.feature and s.name in families for s in SERIES)  # a plain engine: no feature series
    for s in (s for s in SERIES if s.feature is None):
        base = s.name  # prometheus-client strips _total from a counter family's name
        assert base in families, s.name
        assert families[base].type == s.type, (s.name, families[base].type)
        names = {x.name for x in families[base].samples if not x.name.endswith("_created")}
        assert names == set(s.stored_names), (s.name, names)
        for x in families[base].samples:
            assert x.labels["model_name"] == "minienv" and x.labels["engine"] == "0"
    assert stored_series_names(()) >= {"vllm:generation_tokens_total", "vllm:request_success_total",
                                       "vllm:time_to_first_token_seconds_bucket", "vllm:num_requests_running"}


def test_spec_decode_and_kv_tier_series_equal_their_stats(model, tok, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    texts = ["abcabcabcabcabc", "xyzxyzxyzxyz", "The quick brown fox. The quick brown fox."]
    first = make(model, tok, speculative_config=spec, kv_tier=tmp_path)
    metrics_of(first)  # noqa: B018
    first.generate(texts, params(16))
    second = make(model, tok, speculative_config=spec, kv_tier=tmp_path)  # the tier outlives the first engine
    m = metrics_of(second)
    second.generate(texts, params(16))
    st, tier = second.speculator.stats, second.kv_tier.stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0 and tier.hit_tokens > 0  # the workload bites
    assert m.value("vllm:spec_decode_num_drafts_total") == st.num_drafts
    assert m.value("vllm:spec_decode_num_draft_tokens_total") == st.num_draft_tokens
    assert m.value("vllm:spec_decode_num_accepted_tokens_total") == st.num_accepted_tokens
    per_pos = [m.value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert per_pos == st.accepted_per_pos and sum(per_pos) == st.num_accepted_tokens
    assert m.value("vllm:external_prefix_cache_queries_total") == tier.queried_tokens
    assert m.value("vllm:external_prefix_cache_hits_total") == tier.hit_tokens <= tier.queried_tokens
    assert m.value("minienv:kv_tier_loaded_blocks_total") == tier.loads > 0
    assert m.value("minienv:kv_tier_stored_blocks_total") == tier.stores
    assert m.value("minienv:kv_tier_refused_records_total") == tier.record_errors == 0
    assert m.value("minienv:kv_tier_backend_errors_total") == tier.backend_errors == 0
    names = {x.name for f in m.registry.collect() for x in f.samples if not x.name.endswith("_created")}
    assert names == stored_series_names(), names ^ stored_series_names()


def test_histograms_have_vllm_buckets(model, tok):
    m = metrics_of(make(model, tok))
    les = lambda name: [le for le, _ in m.histogram_buckets(name)][:-1]  # noqa: E731 - +Inf last
    assert les("vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert les("vllm:inter_token_latency_seconds") == list(ITL_BUCKETS)
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "request_inference_time"):
        assert les(f"vllm:{name}_seconds") == list(REQUEST_LATENCY_BUCKETS)
    # vLLM v0.11.0's lists, written out here once more so a typo in either copy fails
    assert TTFT_BUCKETS[:4] == (0.001, 0.005, 0.01, 0.02) and TTFT_BUCKETS[-3:] == (160.0, 640.0, 2560.0)
    assert len(TTFT_BUCKETS) == 22 and len(ITL_BUCKETS) == 19 and len(REQUEST_LATENCY_BUCKETS) == 21
    assert REQUEST_LATENCY_BUCKETS[-2:] == (1920.0, 7680.0)
    assert request_tokens_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert request_tokens_buckets(96) == (1, 2, 5, 10, 20, 50)
    assert les("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50]  # the model's max_position_embeddings = 96
    with pytest.raises(KeyError, match="no histogram named"):
        m.histogram_buckets("vllm:num_requests_running")


# ------------------------------------------------------------------------------------------------ golden relations
def test_pulled_series_equal_engine_stats_and_idle_usage_is_zero(model, tok):
    e = tight(model, tok)
    m = metrics_of(e)
    e.generate(PROMPTS, params())
    s = e.stats
    assert s.num_preemptions > 0 and s.evicted_blocks > 0 and s.prefix_cache_hits_tokens > 0  # the workload bites
    for name, field in PULLED.items():
        assert m.value(name) == pytest.approx(field(s)), name
    assert m.value("vllm:kv_cache_usage_perc") == 0 and m.value("minienv:kv_cache_token_usage_perc") == 0
    assert m.value("vllm:num_requests_running") == 0 and m.value("vllm:num_requests_waiting") == 0
    assert m.value("vllm:prefix_cache_hits_total") <= m.value("vllm:prefix_cache_queries_total")


def test_counters_and_histogram_counts_never_go_down_and_track_every_step(model, tok):
    e = tight(model, tok)
    m = metrics_of(e)
    for p in PROMPTS:
        e.add_request(p, params())
    before = _all_samples(m)
    steps = 0
    while e.has_unfinished_requests():
        e.step()
        steps += 1
        now = _all_samples(m)
        for key, value in now.items():
            name = key[0]
            if name.endswith(("_total", "_count", "_bucket", "_sum")):
                assert value >= before.get(key, 0), (key, before.get(key), value)
        for name, field in PULLED.items():  # gauges and counters are the stats of the step just run
            assert m.value(name) == pytest.approx(field(e.history[-1].stats)), (name, steps)
        assert m.value("vllm:prefix_cache_hits_total") <= m.value("vllm:prefix_cache_queries_total")
        before = now
    assert steps > 5


def test_ttft_count_is_requests_with_a_token_and_e2e_is_queue_plus_prefill_plus_decode(model, tok):
    e = tight(model, tok)
    m = metrics_of(e)
    ids = [e.add_request(p, params(1 + i % 5)) for i, p in enumerate(PROMPTS)]
    e.step()
    late = e.add_request("never scheduled", params())
    e.abort(late)  # aborted while waiting: no token, no queue time; counted as success{abort} and in e2e
    e.run()
    outs = [e.output(i) for i in ids]
    with_token = [o for o in outs if o.metrics.first_token_time is not None]
    assert len(with_token) == len(PROMPTS)
    assert m.value("vllm:time_to_first_token_seconds_count") == len(with_token)
    assert m.value("vllm:time_to_first_token_seconds_sum") == pytest.approx(sum(o.metrics.ttft for o in outs))
    assert m.value("vllm:e2e_request_latency_seconds_count") == len(PROMPTS) + 1
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert m.value(f"vllm:request_{name}_seconds_count") == len(PROMPTS), name
    e2e_of_token_requests = sum(o.metrics.e2e_latency for o in outs)
    parts = sum(m.value(f"vllm:request_{p}_seconds_sum") for p in ("queue_time", "prefill_time", "decode_time"))
    assert parts == pytest.approx(e2e_of_token_requests, rel=1e-9, abs=1e-9)
    inference = m.value("vllm:request_inference_time_seconds_sum")
    assert inference == pytest.approx(m.value("vllm:request_prefill_time_seconds_sum")
                                      + m.value("vllm:request_decode_time_seconds_sum"), rel=1e-9)
    # ITL: one sample per sampled token after a request's first (an EOS that ends a request included)
    sampled = sum(len(r.sampled) for r in e.history)
    assert len(e.history) == e.stats.num_steps  # the ring kept every step
    assert m.value("vllm:inter_token_latency_seconds_count") == sampled - len(with_token)
    # one clock: a request's inter-token latencies add up to its decode time exactly
    assert m.value("vllm:inter_token_latency_seconds_sum") == pytest.approx(
        m.value("vllm:request_decode_time_seconds_sum"), rel=1e-9, abs=1e-9)
    assert m.value("vllm:request_generation_tokens_sum") == sum(len(o.token_ids) for o in outs)
    assert m.value("vllm:request_prompt_tokens_count") == len(PROMPTS) + 1


def test_request_success_by_finished_reason_including_aborts(model, tok):
    eos_tok = BPETokenizer([])
    e = make(model, eos_tok)
    m = metrics_of(e)
    a = e.add_request(PROMPTS[0], params(3))  # length
    b = e.add_request(PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, stop=[PROMPTS[1][0]]))
    c = e.add_request(PROMPTS[2], params(30))
    e.step()
    e.step()
    e.abort(c)  # running, then aborted between steps
    for out in e.stream(PROMPTS[3:4], params(30)):
        break  # closing the stream early aborts its request
    del out
    e.run()
    reasons = [e.output(a).finish_reason, e.output(b).finish_reason, "abort", "abort"]
    expected = {r: 0 for r in set(FINISHED_REASON.values())}
    for r in reasons:
        expected[FINISHED_REASON[r]] += 1
    got = {r: m.value("vllm:request_success_total", finished_reason=r) for r in expected}
    assert got == expected and expected["abort"] == 2
    assert sum(got.values()) == e.stats.num_finished
    assert m.value("vllm:num_requests_running") == e.stats.num_running == 0  # the aborts refreshed the gauges


def test_an_abort_between_steps_refreshes_the_gauges(model, tok):
    e = make(model, tok)
    m = metrics_of(e)
    rid = e.add_request(PROMPTS[3], params(20))
    e.step()
    assert m.value("vllm:num_requests_running") == 1 and m.value("vllm:kv_cache_usage_perc") > 0
    e.abort(rid)
    assert m.value("vllm:num_requests_running") == 0 and m.value("vllm:kv_cache_usage_perc") == 0
    assert m.value("minienv:kv_cache_token_usage_perc") == 0


def test_token_usage_counts_slots_not_blocks(model, tok):
    """Differential: the formula against counting every physical slot by hand, at every step."""
    e = tight(model, tok)
    m = metrics_of(e)
    for p in PROMPTS:
        e.add_request(p, params())
    bs = e.block_size
    seen_partial = False
    while e.has_unfinished_requests():
        e.step()
        mgr = e.kv_cache_manager
        fill: dict[int, int] = {}
        for rid in mgr.request_ids():
            r = mgr.request(rid)
            for j, b in enumerate(r.block_ids):
                fill[b] = max(fill.get(b, 0), min(bs, r.num_tokens - j * bs))
        assert token_slots_in_use(e) == sum(fill.values())
        token_usage = m.value("minienv:kv_cache_token_usage_perc")
        assert token_usage == pytest.approx(sum(fill.values()) / e.kv_budget_tokens)
        assert token_usage <= m.value("vllm:kv_cache_usage_perc") + 1e-12
        seen_partial |= token_usage < m.value("vllm:kv_cache_usage_perc")
    assert seen_partial  # block-based usage overstated it at least once


def test_preemptions_and_evictions_equal_engine_stats(model, tok):
    e = tight(model, tok)
    m = metrics_of(e)
    e.generate(PROMPTS, params(16))
    e.generate(PROMPTS[::-1], params(16))
    s = e.stats
    assert s.num_preemptions > 0 and s.evicted_blocks > 0
    assert m.value("vllm:num_preemptions_total") == s.num_preemptions
    assert m.value("minienv:kv_cache_evicted_blocks_total") == s.evicted_blocks
    assert m.value("minienv:kv_cache_evicted_tokens_total") == s.evicted_tokens == s.evicted_blocks * e.block_size


def test_metrics_do_not_change_outputs(model, tok):
    plain = tight(model, tok).generate(PROMPTS, params())
    e = tight(model, tok)
    metrics_of(e)  # noqa: B018 - attaching is the point
    observed = e.generate(PROMPTS, params())
    assert [o.token_ids for o in observed] == [o.token_ids for o in plain]


# ------------------------------------------------------------------------------------------------ registries
def test_two_engines_and_a_recreated_engine_register_cleanly(model, tok):
    e1, e2 = make(model, tok), make(model, tok)
    m1, m2 = metrics_of(e1), metrics_of(e2)
    assert metrics_of(e1) is m1 and m1.registry is not m2.registry
    assert m1.registry is not prometheus_client.REGISTRY
    e1.generate(PROMPTS[:3], params(4))
    assert m1.value("vllm:request_success_total", finished_reason="length") == 3
    assert m2.value("vllm:request_success_total", finished_reason="length") == 0
    for _ in range(2):  # a notebook cell run twice: a new engine, new metrics, no "Duplicated timeseries" error
        e1 = make(model, tok)
        e1.generate(PROMPTS[:1], params(2))  # before its metrics exist:
        assert metrics_of(e1).value("vllm:generation_tokens_total") == e1.stats.num_generated_tokens > 0  # totals
        assert metrics_of(e1).value("vllm:request_success_total", finished_reason="length") == 0  # events: from now
    extra = EngineMetrics(e2, model_name="other", engine_label="7")  # a second view of the same engine
    e2.generate(PROMPTS[:1], params(2))
    assert extra.value("vllm:request_success_total", finished_reason="length") == 1
    assert metrics_of(e2).value("vllm:request_success_total", finished_reason="length") == 1
    assert 'model_name="other"' in extra.exposition() and 'engine="7"' in extra.exposition()
    with pytest.raises(ValueError, match="model_name"):
        EngineMetrics(e2, model_name="")


# ------------------------------------------------------------------------------------------------ the server
def _get(url: str, accept: str | None = None) -> tuple[str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.headers["Content-Type"], r.read().decode()


PROMETHEUS_2_42_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                          "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_served_metrics_keep_the_colon_names_whatever_the_scraper_accepts(model, tok):
    e = make(model, tok)
    e.generate(PROMPTS[:2], params(3))
    with serve_metrics(e, 0) as srv:
        assert srv.url.startswith("http://127.0.0.1:") and srv.port > 0
        for accept in (None, PROMETHEUS_2_42_ACCEPT, "application/openmetrics-text; version=1.0.0"):
            ctype, body = _get(srv.url, accept)
            assert ctype.startswith("text/plain; version=0.0.4"), (accept, ctype)
            assert "\nvllm:generation_tokens_total{" in body and "vllm_generation_tokens_total" not in body
            assert f'vllm:generation_tokens_total{{engine="0",model_name="minienv"}} {e.stats.num_generated_tokens}.0' \
                   in body
    assert not srv.running
    # what prometheus-client itself would have answered Prometheus 2.42 (the trap this server avoids)
    from prometheus_client.exposition import choose_encoder
    encoder, _ = choose_encoder(PROMETHEUS_2_42_ACCEPT)
    assert "vllm_generation_tokens_total" in encoder(metrics_of(e).registry).decode()


def test_bad_ports_and_hosts_give_clear_errors_and_leave_nothing_running(model, tok):
    e = make(model, tok)
    for bad in (-1, 65536, "9100", True, 9100.0, None):
        with pytest.raises(ValueError, match=r"metrics port must be an int in \[0, 65535\]"):
            serve_metrics(e, bad)
    with pytest.raises(ValueError, match="metrics host"):
        serve_metrics(e, 0, host="")
    with pytest.raises(MetricsServerError, match="cannot serve metrics on host 'no-such-host.invalid'"):
        serve_metrics(e, 0, host="no-such-host.invalid")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        with pytest.raises(MetricsServerError, match=f"127.0.0.1:{port}: the port is in use") as info:
            serve_metrics(e, port)
        assert isinstance(info.value, OSError)
    finally:
        busy.close()
    assert metrics_of(e).server is None
    with serve_metrics(e, 0) as srv:  # and serving still works afterwards
        with pytest.raises(RuntimeError, match="already serves its metrics"):
            serve_metrics(e, 0)
        assert _get(srv.url)[1].count("vllm:num_requests_running{") == 1
    with serve_metrics(e, 0) as again:  # once closed, it can serve again
        assert again.running


def test_without_the_extra_minienv_imports_and_metrics_say_what_to_install():
    """A real interpreter where prometheus_client cannot be imported (None in sys.modules blocks the import)."""
    code = """
import sys
sys.modules["prometheus_client"] = None
import minienv, minienv.engine
from minienv.engine import InferenceEngine
from minienv.model import LlamaConfig, LlamaModel, random_weights
from minienv.tokenizer import BPETokenizer
from minienv.metrics import MetricsUnavailableError, metrics_of, serve_metrics
from minienv.sampling import SamplingParams
cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)
e = InferenceEngine(LlamaModel(cfg, random_weights(cfg, seed=1)), BPETokenizer([]), kv_budget_tokens=64, block_size=4)
# seeded: an unseeded draw can pick end-of-text first and answer with no tokens (it did once, in CI)
print(len(e.generate(["ab"], SamplingParams(max_tokens=4, seed=0))[0].token_ids) == 4)
for call in (lambda: metrics_of(e), lambda: serve_metrics(e, 0)):
    try:
        call()
    except MetricsUnavailableError as exc:
        assert isinstance(exc, ImportError)
        print(exc)
"""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "True" and len(lines) == 3
    assert all("pip install 'minienv[metrics]'" in line for line in lines[1:])


# ------------------------------------------------------------------------------------------------ the dashboard
DASHBOARD = REPO / "assets" / "grafana" / "minienv.json"
SERIES_NAME = r"\b(?:vllm|minienv)[:_][a-z0-9_:]+"


def dashboard_queries() -> list[str]:
    import json

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"]]
    return exprs


def test_every_dashboard_query_names_only_series_minienv_exports():
    import json
    import re

    dash = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]  # Grafana's import format asks for one
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dash["panels"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]) >= 10
    exported = stored_series_names()
    used = set()
    for expr in dashboard_queries():
        names = set(re.findall(SERIES_NAME, expr))
        assert names, f"a query names no series: {expr}"
        assert names <= exported, f"{expr}: not exported: {names - exported}"
        used |= names
    # every metric family the issue asks for is on the dashboard
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert {s.name for s in SERIES} <= families, {s.name for s in SERIES} - families


def test_the_dashboard_check_catches_a_wrong_name(tmp_path):
    """The check above must fail on the names a vLLM dashboard got wrong: the stored-name trap, a renamed metric."""
    import re

    exported = stored_series_names()
    for bad in ("rate(vllm_generation_tokens_total[1m])", "vllm:gpu_cache_usage_perc",
                "histogram_quantile(0.9, rate(vllm:time_per_output_token_seconds_bucket[1m]))"):
        assert not set(re.findall(SERIES_NAME, bad)) <= exported, bad


def test_an_engine_with_metrics_is_freed_when_dropped(model, tok):
    """No reference cycle engine <-> metrics: the KV pool goes when the engine does, not at the next cyclic GC."""
    import gc
    import weakref

    gc.disable()
    try:
        e = make(model, tok)
        m = metrics_of(e)
        e.generate(PROMPTS[:2], params(3))
        total = e.stats.num_generated_tokens
        ref = weakref.ref(e)
        del e
        assert ref() is None
        assert m.value("vllm:generation_tokens_total") == total  # the last values stay readable
        with pytest.raises(ReferenceError, match="is gone"):
            m.engine  # noqa: B018
    finally:
        gc.enable()

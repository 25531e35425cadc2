"""The prometheus tier: a real Prometheus scrapes the engine's /metrics, and what it *stores* is checked.

Needs Debian's ``prometheus`` binary (``apt-get install -y prometheus``; the package does not start a server by
itself here). Each test module run starts its own server on 127.0.0.1 with a free port, a temporary storage
directory and a scrape config pointed at the engine, and stops it afterwards. Without the binary the tests skip,
unless MINIENV_REQUIRE_TIERS=1 (CI), where they fail saying what to install.

Why a real server: the text of /metrics can be right while the stored names are wrong. With prometheus-client 0.26
and Prometheus 2.42 the scrape negotiates OpenMetrics, and the stock exposition then escapes ``:`` to ``_`` in
sample names (``vllm_generation_tokens_total``), so every ``vllm:`` query of a vLLM dashboard comes back empty.
The second scrape job below serves the same registry the stock way, to show the trap is real and still there.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.prometheus
prometheus_client = pytest.importorskip("prometheus_client")

from minienv.engine import InferenceEngine  # noqa: E402
from minienv.metrics import metrics_of, serve_metrics, stored_series_names  # noqa: E402
from minienv.model import LlamaConfig, LlamaModel, random_weights  # noqa: E402
from minienv.sampling import SamplingParams  # noqa: E402
from minienv.tokenizer import BPETokenizer  # noqa: E402

SCRAPE_INTERVAL = "250ms"


def _prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        msg = "the prometheus tier needs Debian's prometheus server binary (apt-get install -y prometheus)"
        if os.environ.get("MINIENV_REQUIRE_TIERS") == "1":
            pytest.fail(f"MINIENV_REQUIRE_TIERS=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read().decode())


class Prometheus:
    """A Prometheus server process scraping the given targets (job name -> host:port)."""

    def __init__(self, binary: str, workdir: Path, targets: dict[str, str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs = "".join(f"""
  - job_name: {job}
    scrape_interval: {SCRAPE_INTERVAL}
    scrape_timeout: 200ms
    static_configs:
      - targets: ["{target}"]
""" for job, target in targets.items())
        config = workdir / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: {SCRAPE_INTERVAL}\nscrape_configs:{jobs}")
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.logfile = workdir / "prometheus.log"
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.logfile.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after 30 s: {self.logfile.read_text()[-2000:]}")
            time.sleep(0.1)

    def query(self, promql: str) -> list[dict]:
        data = _get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert data["status"] == "success", data
        return data["data"]["result"]

    def names(self) -> list[str]:
        return _get_json(f"{self.url}/api/v1/label/__name__/values")["data"]

    def wait_for(self, promql: str, expected: float, timeout: float = 30.0) -> None:
        """Until the newest stored sample of ``promql`` equals ``expected`` (a scrape after the workload)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            res = self.query(promql)
            last = [r["value"][1] for r in res]
            if len(res) == 1 and float(res[0]["value"][1]) == expected:
                return
            time.sleep(0.1)
        raise AssertionError(f"{promql}: expected {expected}, Prometheus has {last}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=96, tie_word_embeddings=True)
    return LlamaModel(cfg, random_weights(cfg, seed=1, scale=0.3))


@pytest.fixture(scope="module")
def scraped(model, tmp_path_factory):
    """(engine, prometheus): an engine serving /metrics, scraped by a real Prometheus as job "minienv"; the same
    registry also served by prometheus-client's stock server as job "stock". The engine speculates (n-gram) and
    has a persistent KV tier, so every series minienv can export is there."""
    binary = _prometheus_binary()
    engine = InferenceEngine(model, BPETokenizer([]), kv_budget_tokens=64, block_size=4, max_num_seqs=4,
                             max_num_batched_tokens=32, kv_tier=tmp_path_factory.mktemp("kv_tier"),
                             speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    server = serve_metrics(engine, 0)
    stock_port = _free_port()
    stock_httpd, stock_thread = prometheus_client.start_http_server(stock_port, "127.0.0.1",
                                                                    registry=metrics_of(engine).registry)
    prom = Prometheus(binary, tmp_path_factory.mktemp("prometheus"),
                      {"minienv": f"127.0.0.1:{server.port}", "stock": f"127.0.0.1:{stock_port}"})
    try:
        yield engine, prom
    finally:
        prom.close()
        server.close()
        stock_httpd.shutdown()
        stock_httpd.server_close()


PROMPTS = ["The quick brown fox", "To be, or not", "a", "Once upon a time, in a land far away, there", "xyz" * 5,
           "The quick brown fox jumps", "To be, or not to be"]


def test_prometheus_stores_the_vllm_names_and_they_agree_with_engine_stats(scraped):
    engine, prom = scraped
    engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    engine.generate(PROMPTS[::-1], SamplingParams(max_tokens=16, temperature=0))
    s = engine.stats
    assert s.num_preemptions > 0 and s.evicted_blocks > 0 and s.prefix_cache_hits_tokens > 0
    job = '{job="minienv"}'
    prom.wait_for(f"vllm:generation_tokens_total{job}", s.num_generated_tokens)
    prom.wait_for(f"vllm:e2e_request_latency_seconds_count{job}", s.num_finished)
    expected = {
        "vllm:num_requests_running": s.num_running, "vllm:num_requests_waiting": s.num_waiting,
        "vllm:kv_cache_usage_perc": s.kv_usage, "minienv:kv_cache_token_usage_perc": 0.0,
        "vllm:prefix_cache_queries_total": s.prefix_cache_queries_tokens,
        "vllm:prefix_cache_hits_total": s.prefix_cache_hits_tokens,
        "vllm:num_preemptions_total": s.num_preemptions, "vllm:prompt_tokens_total": s.num_prompt_tokens,
        "vllm:generation_tokens_total": s.num_generated_tokens,
        "minienv:kv_cache_cached_free_blocks": s.num_cached_free_blocks,
        "minienv:kv_cache_evicted_blocks_total": s.evicted_blocks,
        "minienv:kv_cache_evicted_tokens_total": s.evicted_tokens,
        "vllm:time_to_first_token_seconds_count": s.num_finished,
    }
    for name, value in expected.items():
        res = prom.query(f"{name}{job}")
        assert len(res) == 1, (name, res)
        assert res[0]["metric"]["model_name"] == "minienv" and res[0]["metric"]["engine"] == "0"
        assert float(res[0]["value"][1]) == pytest.approx(value), name
    success = {r["metric"]["finished_reason"]: float(r["value"][1])
               for r in prom.query(f"vllm:request_success_total{job}")}
    assert sum(success.values()) == s.num_finished
    st, tier = engine.speculator.stats, engine.kv_tier.stats
    assert st.num_accepted_tokens > 0 and tier.hit_tokens > 0
    features = {"vllm:spec_decode_num_drafts_total": st.num_drafts,
                "vllm:spec_decode_num_draft_tokens_total": st.num_draft_tokens,
                "vllm:spec_decode_num_accepted_tokens_total": st.num_accepted_tokens,
                "vllm:external_prefix_cache_queries_total": tier.queried_tokens,
                "vllm:external_prefix_cache_hits_total": tier.hit_tokens,
                "minienv:kv_tier_loaded_blocks_total": tier.loads, "minienv:kv_tier_stored_blocks_total": tier.stores}
    for name, value in features.items():
        assert float(prom.query(f"{name}{job}")[0]["value"][1]) == value, name
    per_pos = {int(r["metric"]["position"]): float(r["value"][1])
               for r in prom.query(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{job}")}
    assert [per_pos[i] for i in range(3)] == st.accepted_per_pos

    names = prom.names()
    ours = sorted(n for n in names if n.startswith(("vllm:", "minienv:")) and not n.endswith("_created"))
    print("\nseries stored by Prometheus (job minienv):\n  " + "\n  ".join(ours))
    assert set(ours) == stored_series_names(), set(ours) ^ stored_series_names()


def test_the_stock_exposition_would_have_stored_underscored_names(scraped):
    """The trap, shown on the real server: prometheus-client's own server, same registry, negotiated OpenMetrics."""
    engine, prom = scraped
    prom.wait_for('count(up{job="stock"} == 1)', 1)
    prom.wait_for('vllm_generation_tokens_total{job="stock"}', engine.stats.num_generated_tokens)
    assert prom.query('vllm:generation_tokens_total{job="stock"}') == []
    assert prom.query('vllm_generation_tokens_total{job="minienv"}') == []


def test_promql_rates_and_quantiles_work_on_the_stored_series(scraped):
    engine, prom = scraped
    engine.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0))
    prom.wait_for('vllm:generation_tokens_total{job="minienv"}', engine.stats.num_generated_tokens)
    p90 = prom.query('histogram_quantile(0.9, sum by (le) (vllm:time_to_first_token_seconds_bucket{job="minienv"}))')
    assert len(p90) == 1 and 0 < float(p90[0]["value"][1]) <= 2560
    hit_rate = prom.query('vllm:prefix_cache_hits_total{job="minienv"} '
                          '/ vllm:prefix_cache_queries_total{job="minienv"}')
    s = engine.stats
    assert float(hit_rate[0]["value"][1]) == pytest.approx(s.prefix_cache_hit_rate)
    rate = prom.query('rate(vllm:generation_tokens_total{job="minienv"}[1m])')
    assert len(rate) == 1 and float(rate[0]["value"][1]) >= 0


def test_every_dashboard_query_returns_data_from_the_real_server(scraped):
    """Each query of assets/grafana/minienv.json, as Grafana would send it, evaluated by the real Prometheus."""
    dash = json.loads((Path(__file__).resolve().parents[2] / "assets" / "grafana" / "minienv.json").read_text())
    engine, prom = scraped
    engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    engine.abort(engine.add_request("aborted", SamplingParams(max_tokens=8)))
    prom.wait_for('vllm:generation_tokens_total{job="minienv"}', engine.stats.num_generated_tokens)
    prom.wait_for('vllm:e2e_request_latency_seconds_count{job="minienv"}', metrics_of(engine).value(
        "vllm:e2e_request_latency_seconds_count"))
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$model_name", ".*").replace("$__rate_interval", "1m")
            res = prom.query(expr)
            assert res, f"{panel['title']}: {expr} returned nothing"
    reasons = {r["metric"]["finished_reason"] for r in prom.query(
        'sum by (finished_reason) (rate(vllm:request_success_total{job="minienv"}[1m])) > 0')}
    assert "abort" in reasons

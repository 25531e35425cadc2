"""Prometheus metrics for an :class:`~minienv.engine.InferenceEngine`, under vLLM's names, and a ``/metrics`` server.

Readers go on to run vLLM; the series they learn here are the ones they will watch there, and a dashboard or an
alert written for vLLM works on minienv unchanged. Names, types, units, label names (``model_name``, ``engine``)
and histogram buckets follow **vLLM v0.11.0** (``vllm/v1/metrics/loggers.py``; later releases moved the same
bucket lists into ``vllm/v1/metrics/buckets.py``). What minienv teaches and vLLM does not export has a
``minienv:`` prefix. Every series, with its type and meaning, is listed in :data:`SERIES`.

How it is fed, without slowing the engine:

* **Pulled at scrape time** (a custom collector): gauges and counters are read from the :class:`EngineStats` the
  engine builds after every step for its history ring and step listeners (``StepRecord.stats``), or re-read after
  an abort between steps. Nothing is counted twice, and the counters equal ``engine.stats`` by construction.
* **Pushed per event** (prometheus-client histograms and one counter): time to first token and inter-token latency
  from the step listener; end-to-end, queue, prefill, decode and inference time, token counts and
  ``vllm:request_success{finished_reason}`` from the finish listener, once per finished request — aborted ones
  included (vLLM, as of v0.13, does not count those: vllm-project/vllm#31503).

An inter-token latency is one sample per request per step, the gap between its outputs: with speculative decoding a
step can emit several of a request's tokens at once, and — as in vLLM — they share one sample (the acceptance
counters say how many tokens each verification gave).

So pulled counters are the engine's totals since it was built, while the pushed series count from the moment the
metrics were attached (:func:`metrics_of` attaches on first use): attach before the workload you want to see.

The engine knows nothing of this module: metrics subscribe to it from outside, through its public step and finish
listeners (``metrics_of(engine)``), so the engine path never imports Prometheus or anything above it.

Invariants:

1. One :class:`prometheus_client.CollectorRegistry` per :class:`EngineMetrics`, never the process-global one: two
   engines in one process, or a notebook cell run twice, never collide on a name.
2. Gauges and counters describe the engine as of the end of its last step (or abort): a scrape from another
   thread never reads the engine mid-step.
3. Counters never decrease (they are the engine's own monotonic totals); ``hits <= queries``.
4. For every finished request that produced a token, e2e = queue + prefill + decode exactly, and its inter-token
   latencies add up to its decode time (one clock, ``time.perf_counter``: arrival, first scheduled, first token,
   each step's tokens — ``StepRecord.token_time`` — and finished).

**The stored-name trap.** prometheus-client 0.26 answers a scraper that accepts OpenMetrics (Prometheus 2.42 asks
for it first) with sample names escaped for *label* names, so ``vllm:generation_tokens_total`` is stored as
``vllm_generation_tokens_total`` and every ``vllm:`` query of a vLLM dashboard finds nothing. :meth:`serve`
therefore always answers in the classic text format 0.0.4, whatever the ``Accept`` header asks; the
``prometheus`` test tier checks the names a real Prometheus stores.
"""

from __future__ import annotations

import errno
import socket
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

try:  # the optional extra: `import minienv` never needs it, EngineMetrics does
    import prometheus_client as _prom
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer, make_wsgi_app
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    _prom = None
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

if TYPE_CHECKING:
    from minienv.engine.core import InferenceEngine
    from minienv.engine.observe import EngineStats, StepRecord
    from minienv.request import Request

VLLM_RELEASE = "v0.11.0"
LABEL_NAMES = ("model_name", "engine")

#: vLLM's time-to-first-token buckets (seconds): 1 ms prefill of a tiny prompt up to a 40-minute worst case
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
#: vLLM's inter-token-latency buckets (seconds)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
#: vLLM's request-latency buckets (seconds), shared by e2e, queue, prefill, decode and inference time
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)

#: minienv's finish reasons -> vLLM's ``finished_reason`` label values (vLLM's "stop" covers EOS and stop strings)
FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to ``max_model_len`` (token-count histograms): 1, 2, 5, 10, 20, 50, ..."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class Series:
    """One exported metric: its name as Prometheus stores it (counters get ``_total``; a histogram's samples are
    ``_bucket`` / ``_sum`` / ``_count``), its type, and what it means here."""

    name: str
    type: str
    help: str
    extra_labels: tuple[str, ...] = ()
    #: exported only by an engine with this feature ("spec_decode": speculative_config; "kv_tier": kv_tier)
    feature: str | None = None

    @property
    def stored_names(self) -> tuple[str, ...]:
        if self.type == "counter":
            return (f"{self.name}_total",)
        if self.type == "histogram":
            return tuple(f"{self.name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.name,)


SERIES: tuple[Series, ...] = (
    # -- pulled from EngineStats (vLLM's scheduler stats)
    Series("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    Series("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed (preempted included)."),
    Series("vllm:kv_cache_usage_perc", "gauge",
           "KV-cache usage in blocks: 1 means 100 percent (a partly filled block counts as used)."),
    Series("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens."),
    Series("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    Series("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."),
    Series("vllm:prompt_tokens", "counter", "Number of prefill tokens processed (each request's prompt once)."),
    Series("vllm:generation_tokens", "counter", "Number of generation tokens processed (EOS not counted)."),
    Series("minienv:kv_cache_token_usage_perc", "gauge",
           "KV-cache usage in token slots holding K/V: 1 means 100 percent of the budget's slots."),
    Series("minienv:kv_cache_cached_free_blocks", "gauge",
           "Blocks with no holder that keep their K/V for prefix hits (reclaimable, evicted LRU first)."),
    Series("minienv:kv_cache_evicted_blocks", "counter", "Cached-free blocks evicted (reused for new K/V)."),
    Series("minienv:kv_cache_evicted_tokens", "counter",
           "Tokens of K/V lost to eviction (evicted blocks x block size)."),
    # -- pushed per request / per token
    Series("vllm:request_success", "counter", "Count of finished requests, by finished_reason (aborts included).",
           ("finished_reason",)),
    Series("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds."),
    Series("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds."),
    Series("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds."),
    Series("vllm:request_queue_time_seconds", "histogram", "Histogram of time spent in WAITING phase for request."),
    Series("vllm:request_prefill_time_seconds", "histogram", "Histogram of time spent in PREFILL phase for request."),
    Series("vllm:request_decode_time_seconds", "histogram", "Histogram of time spent in DECODE phase for request."),
    Series("vllm:request_inference_time_seconds", "histogram",
           "Histogram of time spent in RUNNING phase for request."),
    Series("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed, per finished request."),
    Series("vllm:request_generation_tokens", "histogram",
           "Number of generation tokens processed, per finished request."),
    # -- speculative decoding (vLLM's SpecDecodingProm names), pulled from engine.speculator.stats
    Series("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts (verified proposals).",
           feature="spec_decode"),
    Series("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.", feature="spec_decode"),
    Series("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.", feature="spec_decode"),
    Series("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.",
           ("position",), feature="spec_decode"),
    # -- the persistent KV tier (the KV-connector prefix-cache names of vLLM releases after v0.11.0 + minienv's),
    #    from engine.kv_tier.stats
    Series("vllm:external_prefix_cache_queries", "counter",
           "External prefix cache queries from the KV tier, in tokens (asked beyond the local prefix cache).",
           feature="kv_tier"),
    Series("vllm:external_prefix_cache_hits", "counter",
           "External prefix cache hits from the KV tier, in tokens (loaded instead of computed).", feature="kv_tier"),
    Series("minienv:kv_tier_loaded_blocks", "counter", "Blocks of K/V loaded from the KV tier.", feature="kv_tier"),
    Series("minienv:kv_tier_stored_blocks", "counter", "Blocks of K/V written to the KV tier.", feature="kv_tier"),
    Series("minienv:kv_tier_refused_records", "counter",
           "Records refused on load (corrupt, another model or layout, another format): each a miss, recomputed.",
           feature="kv_tier"),
    Series("minienv:kv_tier_backend_errors", "counter", "Store operations that failed (server down, disk full).",
           feature="kv_tier"),
)
_HELP = {s.name: s.help for s in SERIES}


def stored_series_names(features: tuple[str, ...] = ("spec_decode", "kv_tier")) -> set[str]:
    """Every sample name a Prometheus scraping minienv stores (``*_created`` companions aside), for an engine with
    the given optional features (all of them by default; ``()``: a plain engine)."""
    return {n for s in SERIES if s.feature is None or s.feature in features for n in s.stored_names}


_TIER_SERIES = ("vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits",
                "minienv:kv_tier_loaded_blocks", "minienv:kv_tier_stored_blocks", "minienv:kv_tier_refused_records",
                "minienv:kv_tier_backend_errors")


def _feature_counters(engine: "InferenceEngine") -> tuple[tuple | None, tuple | None]:
    """Copies of the speculator's and the KV tier's counters (plain ints: a scrape never sees a half-done step)."""
    spec = tier = None
    speculator = getattr(engine, "speculator", None)
    if speculator is not None:
        st = speculator.stats
        spec = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, tuple(st.accepted_per_pos))
    kv_tier = getattr(engine, "kv_tier", None)
    if kv_tier is not None:
        t = kv_tier.stats
        tier = (t.queried_tokens, t.hit_tokens, t.loads, t.stores, t.record_errors, t.backend_errors)
    return spec, tier


class MetricsUnavailableError(ImportError):
    """Metrics were asked for but prometheus-client, an optional extra, is not installed."""


class MetricsServerError(OSError):
    """The ``/metrics`` server could not start (port in use, unknown host); nothing was started."""


def _require_prometheus() -> None:
    if _prom is None:
        raise MetricsUnavailableError(
            "engine metrics need prometheus-client, an optional extra of minienv: pip install 'minienv[metrics]' "
            f"(the lab and test extras include it); importing it failed: {_IMPORT_ERROR}")


def token_slots_in_use(engine: "InferenceEngine") -> int:
    """KV token slots that hold (or are reserved for) a token's K/V, each physical slot counted once.

    Block-based usage counts the unfilled tail of each request's last block as used; this counts tokens. A block
    shared by several tables is full (only full blocks are indexed for prefix hits; the engine never forks), so the
    only unfilled slots are the tails of the requests' own last blocks: ``in_use_blocks * B - sum(tails)``.
    """
    mgr = engine.kv_cache_manager
    bs = mgr.block_size
    tails = 0
    for rid in mgr.request_ids():
        r = mgr.request(rid)
        tails += len(r.block_ids) * bs - r.num_tokens
    return max(0, mgr.pool.num_used_blocks * bs - tails)


class _StatsCollector:
    """The pulled half: gauges and counters from the last :class:`EngineStats` snapshot, built at scrape time."""

    def __init__(self, metrics: "EngineMetrics"):
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        s, token_usage, spec, tier = self.metrics._snapshot
        lv = list(self.metrics.label_values)

        def gauge(name: str, value: float) -> Any:
            g = GaugeMetricFamily(name, _HELP[name], labels=LABEL_NAMES)
            g.add_metric(lv, value)
            return g

        def counter(name: str, value: float) -> Any:
            c = CounterMetricFamily(name, _HELP[name], labels=LABEL_NAMES)
            c.add_metric(lv, value)
            return c

        yield gauge("vllm:num_requests_running", s.num_running)
        yield gauge("vllm:num_requests_waiting", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", s.kv_usage)
        yield counter("vllm:prefix_cache_queries", s.prefix_cache_queries_tokens)
        yield counter("vllm:prefix_cache_hits", s.prefix_cache_hits_tokens)
        yield counter("vllm:num_preemptions", s.num_preemptions)
        yield counter("vllm:prompt_tokens", s.num_prompt_tokens)
        yield counter("vllm:generation_tokens", s.num_generated_tokens)
        yield gauge("minienv:kv_cache_token_usage_perc", token_usage)
        yield gauge("minienv:kv_cache_cached_free_blocks", s.num_cached_free_blocks)
        yield counter("minienv:kv_cache_evicted_blocks", s.evicted_blocks)
        yield counter("minienv:kv_cache_evicted_tokens", s.evicted_tokens)
        if spec is not None:
            drafts, draft_tokens, accepted, per_pos = spec
            yield counter("vllm:spec_decode_num_drafts", drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", accepted)
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    _HELP["vllm:spec_decode_num_accepted_tokens_per_pos"],
                                    labels=LABEL_NAMES + ("position",))
            for pos, n in enumerate(per_pos):
                c.add_metric(lv + [str(pos)], n)
            yield c
        if tier is not None:
            for name, value in zip(_TIER_SERIES, tier, strict=True):
                yield counter(name, value)


class _SilentHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes every few seconds must not fill a notebook with access logs."""


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (prometheus-client's threading WSGI server on a daemon thread)."""

    host: str
    port: int
    _httpd: Any = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _classic_text_app(registry: Any) -> Any:
    """prometheus-client's WSGI app, always answering in text format 0.0.4 (see the module docstring's trap)."""
    app = make_wsgi_app(registry)

    def classic(environ: dict, start_response: Any) -> Any:
        environ = dict(environ, HTTP_ACCEPT=CONTENT_TYPE_PLAIN_0_0_4.split(";")[0] + "; version=0.0.4")
        return app(environ, start_response)

    return classic


def _check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be an int in [0, 65535] (0 picks a free port), got {port!r}")
    return port


class EngineMetrics:
    """Prometheus metrics of one engine, in a registry of their own.

    ``EngineMetrics(engine)`` registers its listeners on the engine and is ready; :func:`metrics_of` makes one per
    engine on first use and :func:`serve_metrics` serves it. Reading the metrics in-process needs no server:
    ``metrics.registry`` is a normal :class:`~prometheus_client.CollectorRegistry` (``get_sample_value``,
    ``generate_latest``), and :meth:`exposition` is the text a scrape gets.

    Args:
        engine: the engine to observe (its finished requests, steps and stats).
        model_name, engine_label: the ``model_name`` and ``engine`` label values (vLLM: the served model name and
            the engine index).
    """

    def __init__(self, engine: "InferenceEngine", *, model_name: str = "minienv", engine_label: str = "0"):
        _require_prometheus()
        for name, value in (("model_name", model_name), ("engine_label", engine_label)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        # NOTE: a weak reference. The engine holds this object (its listeners are our bound methods); a strong
        # reference back would make a cycle, and an engine dropped with its metrics attached (a KV pool of
        # megabytes) would wait for the cyclic garbage collector instead of being freed at once.
        self._engine = weakref.ref(engine)
        self.label_values = (model_name, engine_label)
        self.registry = _prom.CollectorRegistry(auto_describe=True)
        self.server: MetricsServer | None = None
        self._snapshot: tuple[EngineStats, float, tuple | None, tuple | None] = self._read_stats()
        self._last_token_at: dict[str, float] = {}  # request id -> perf_counter when its last token came out

        def histogram(name: str, buckets: tuple[float, ...]) -> Any:
            h = _prom.Histogram(name, _HELP[name], LABEL_NAMES, registry=self.registry, buckets=buckets)
            return h.labels(*self.label_values)

        max_len = int(engine.model.config.max_position_embeddings)
        self.ttft = histogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", request_tokens_buckets(max_len))
        self.generation_tokens = histogram("vllm:request_generation_tokens", request_tokens_buckets(max_len))
        success = _prom.Counter("vllm:request_success", _HELP["vllm:request_success"],
                                LABEL_NAMES + ("finished_reason",), registry=self.registry)
        self.request_success = {r: success.labels(*self.label_values, r) for r in sorted(set(FINISHED_REASON.values()))}
        self.registry.register(_StatsCollector(self))
        engine.add_step_listener(self._on_step)
        engine.add_finish_listener(self._on_finish)

    @property
    def engine(self) -> "InferenceEngine":
        engine = self._engine()
        if engine is None:
            raise ReferenceError("the engine these metrics observed is gone (the last values stay readable)")
        return engine

    # ------------------------------------------------------------------ feeding
    def _read_stats(self, stats: "EngineStats | None" = None) -> tuple["EngineStats", float, tuple | None, tuple | None]:
        """What a scrape reads, taken between steps: the stats, token-slot usage, and the features' counters."""
        engine = self.engine
        stats = engine.stats if stats is None else stats
        return (stats, token_slots_in_use(engine) / stats.kv_budget_tokens, *_feature_counters(engine))

    def _on_step(self, record: "StepRecord") -> None:
        """After each step: TTFT of first tokens, ITL of later ones, and the stats snapshot scrapes read."""
        now = record.token_time  # the engine's clock for this step's tokens: ITLs add up to the decode time
        last = self._last_token_at
        requests = self.engine.requests  # a step's requests are still there while its listeners run
        for rid in record.sampled:
            prev = last.get(rid)
            if prev is not None:
                self.itl.observe(now - prev)
            else:
                m = requests[rid].metrics
                if m.first_token_step == record.step + 1 and m.ttft is not None:  # not a request seen mid-flight
                    self.ttft.observe(m.ttft)
            last[rid] = now
        for rid in record.finished:
            last.pop(rid, None)
        self._snapshot = self._read_stats(record.stats)

    def _on_finish(self, req: "Request") -> None:
        """Once per finished request, whatever ended it: the success counter and the per-request histograms."""
        m = req.metrics
        self.request_success[FINISHED_REASON[req.finish_reason]].inc()
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
                self.decode_time.observe(m.finished_time - m.first_token_time)
                self.inference_time.observe(m.finished_time - m.first_scheduled_time)
        self.prompt_tokens.observe(req.num_prompt_tokens)
        self.generation_tokens.observe(req.num_output_tokens)
        if req.finish_reason == "abort":  # between steps: no step record will refresh the gauges
            self._last_token_at.pop(req.request_id, None)
            self._snapshot = self._read_stats()

    # ------------------------------------------------------------------ reading
    def value(self, name: str, **labels: str) -> float | None:
        """One sample's current value by its stored name (``vllm:prompt_tokens_total``), with this engine's labels."""
        full = dict(zip(LABEL_NAMES, self.label_values, strict=True), **labels)
        return self.registry.get_sample_value(name, full)

    def values(self) -> dict[str, float]:
        """Every sample of this engine without extra labels, by stored name, from one pass over the registry (a
        dashboard reading many values per step; :meth:`value` collects the whole registry per call)."""
        own = dict(zip(LABEL_NAMES, self.label_values, strict=True))
        return {s.name: s.value for family in self.registry.collect() for s in family.samples if s.labels == own}

    def histogram_buckets(self, name: str) -> list[tuple[float, float]]:
        """A histogram's cumulative buckets ``[(le, count), ...]``, ``+Inf`` last, as Prometheus stores them."""
        out = []
        for family in self.registry.collect():
            if family.name != name:
                continue
            for s in family.samples:
                if s.name == f"{name}_bucket" and all(s.labels.get(k) == v for k, v in
                                                       zip(LABEL_NAMES, self.label_values, strict=True)):
                    out.append((float(s.labels["le"]), s.value))
        if not out:
            raise KeyError(f"no histogram named {name!r}; histograms: "
                           f"{sorted(s.name for s in SERIES if s.type == 'histogram')}")
        return sorted(out)

    def exposition(self) -> str:
        """The text a scrape of ``/metrics`` returns (format 0.0.4)."""
        return _prom.generate_latest(self.registry).decode()

    # ------------------------------------------------------------------ serving
    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; return the running server (``.url``, ``.close()``).

        Always the classic text format 0.0.4, so a Prometheus stores the ``vllm:`` names (module docstring).

        Raises:
            ValueError: ``port`` is not an int in [0, 65535], or ``host`` is not a non-empty str.
            MetricsServerError: the port is in use, or the host cannot be bound; nothing is left running.
            RuntimeError: this engine already serves its metrics (close that server first).
        """
        port = _check_port(port)
        if not isinstance(host, str) or not host:
            raise ValueError(f"metrics host must be a non-empty str such as '127.0.0.1', got {host!r}")
        if self.server is not None and self.server.running:
            raise RuntimeError(f"this engine already serves its metrics at {self.server.url}; "
                               "call .close() on it (metrics_of(engine).server) before serving again")
        try:
            family, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][::4]
        except socket.gaierror as exc:
            raise MetricsServerError(errno.EADDRNOTAVAIL, f"cannot serve metrics on host {host!r}: {exc}") from None

        class _Server(ThreadingWSGIServer):
            address_family = family

        try:
            httpd = make_server(addr[0], port, _classic_text_app(self.registry), _Server,
                                                 handler_class=_SilentHandler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsServerError(
                    errno.EADDRINUSE, f"cannot serve metrics on {host}:{port}: the port is in use (another server, "
                    "or an earlier engine's serve_metrics still running: close() it, or pass port=0 for a free "
                    "port)") from None
            raise MetricsServerError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
        thread = threading.Thread(target=httpd.serve_forever, name=f"minienv-metrics-{port}", daemon=True)
        thread.start()
        self.server = MetricsServer(host, httpd.server_address[1], httpd, thread)
        return self.server


#: each engine's metrics made by :func:`metrics_of` (weak keys: an engine is freed when dropped; its metrics hold
#: it weakly too)
_ATTACHED: "weakref.WeakKeyDictionary[Any, EngineMetrics]" = weakref.WeakKeyDictionary()


def metrics_of(engine: "InferenceEngine") -> EngineMetrics:
    """The engine's Prometheus metrics: an :class:`EngineMetrics` made (and subscribed to the engine's listeners)
    on the first call, the same one after. Needs the ``metrics`` extra (:class:`MetricsUnavailableError`)."""
    metrics = _ATTACHED.get(engine)
    if metrics is None:
        metrics = _ATTACHED[engine] = EngineMetrics(engine)
    return metrics


def serve_metrics(engine: "InferenceEngine", port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve :func:`metrics_of` ``(engine)`` at ``http://host:port/metrics`` from a daemon thread (port 0: a free
    one)."""
    return metrics_of(engine).serve(port, host)

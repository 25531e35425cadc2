"""``MetricsPanel``: an engine's Prometheus metrics over time, read from its registry — a Grafana in one cell.

    panel = MetricsPanel(metrics_of(engine))
    panel                      # live: a plotly FigureWidget with five charts, updated in place
    while engine.has_unfinished_requests():
        engine.step()
        panel.update()         # one sample per call, read from the registry (what a scrape would return)
    panel.attach(metrics_of(new_engine))   # a reset: the same charts, emptied, now watching another engine
    with panel.batch(): ...    # a run driven from code: samples every step, one redraw at the end
    panel.static()             # the same five charts as one SVG, for readers without a kernel

The charts: requests running / waiting; KV usage in blocks (``vllm:kv_cache_usage_perc``) and in token slots
(``minienv:kv_cache_token_usage_perc``); the prefix-cache hit rate over the last ``window`` samples — what PromQL's
``rate(hits[w]) / rate(queries[w])`` computes; preemptions and evicted blocks so far; and the time-to-first-token
histogram, one bar per vLLM bucket. Nothing here reads the engine: only the registry, as a scraper would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from . import _style as S
from ._view import View

TITLES = ("requests running / waiting", "KV usage: blocks vs token slots", "prefix hit rate (window)",
          "preemptions, evicted blocks (total)", "time to first token (bucket counts)")
LINE_COLORS = ("#4e79a7", "#f28e2b")


@dataclass(frozen=True)
class MetricsSample:
    """One reading of the registry. ``hit_rate`` is None when no prompt token was looked up in the window."""

    index: int
    running: float
    waiting: float
    kv_blocks: float
    kv_tokens: float
    hits: float
    queries: float
    hit_rate: float | None
    preemptions: float
    evicted_blocks: float


def _bucket_label(le: float) -> str:
    if le == float("inf"):
        return "+Inf"
    return f"{le * 1e3:g}ms" if le < 1 else f"{le:g}s"


class MetricsPanel(View):
    """Five live charts of one :class:`~minienv.metrics.EngineMetrics`; ``update()`` takes one sample."""

    def __init__(self, metrics: Any, *, window: int = 8, redraw_every: int = 1, live: bool = True,
                 title: str = "engine metrics") -> None:
        for name, value in (("window", window), ("redraw_every", redraw_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (samples), got {value!r}")
        self.metrics, self.window, self.redraw_every, self.title = metrics, window, redraw_every, title
        self.samples: list[MetricsSample] = []
        self.widget: Any = None
        if not live:  # samples and the static picture only (no plotly figure to keep in sync)
            return
        go = S.require("plotly.graph_objects")
        subplots = S.require("plotly.subplots")
        fig = subplots.make_subplots(rows=2, cols=3, subplot_titles=TITLES, horizontal_spacing=0.08,
                                     vertical_spacing=0.18)
        lines = [(1, 1, "running", 0), (1, 1, "waiting", 1), (1, 2, "blocks", 0), (1, 2, "token slots", 1),
                 (1, 3, "hit rate", 0), (2, 1, "preemptions", 0), (2, 1, "evicted blocks", 1)]
        for row, col, name, c in lines:
            fig.add_trace(go.Scatter(x=[], y=[], name=name, mode="lines", line={"color": LINE_COLORS[c]},
                                     legendgroup=f"{row}{col}"), row=row, col=col)
        fig.add_trace(go.Bar(x=[], y=[], name="TTFT requests", marker={"color": "#59a14f"}), row=2, col=2)
        fig.update_yaxes(range=[0, 1.05], row=1, col=2)
        fig.update_yaxes(range=[0, 1.05], row=1, col=3)
        fig.update_layout(height=480, width=980, title=title, margin={"t": 70, "l": 40, "r": 20, "b": 40},
                          legend={"orientation": "h", "y": -0.12}, bargap=0.1)
        self.widget = go.FigureWidget(fig)
        S.quiet_config(self.widget)

    # ------------------------------------------------------------------ reading the registry
    def read(self) -> MetricsSample:
        """The registry now (the same numbers a scrape of ``/metrics`` would carry)."""
        v = self.metrics.values().__getitem__  # one pass over the registry
        hits, queries = v("vllm:prefix_cache_hits_total"), v("vllm:prefix_cache_queries_total")
        past = self.samples[-self.window] if len(self.samples) >= self.window else None
        d_hits, d_queries = (hits - past.hits, queries - past.queries) if past else (hits, queries)
        return MetricsSample(
            index=len(self.samples), running=v("vllm:num_requests_running"), waiting=v("vllm:num_requests_waiting"),
            kv_blocks=v("vllm:kv_cache_usage_perc"), kv_tokens=v("minienv:kv_cache_token_usage_perc"), hits=hits,
            queries=queries, hit_rate=d_hits / d_queries if d_queries else None,
            preemptions=v("vllm:num_preemptions_total"), evicted_blocks=v("minienv:kv_cache_evicted_blocks_total"))

    def ttft_bars(self) -> tuple[list[str], list[float]]:
        """Per-bucket TTFT counts (the cumulative ``_bucket`` series differenced), up to the last non-empty one."""
        buckets = self.metrics.histogram_buckets("vllm:time_to_first_token_seconds")
        counts = [c - (buckets[i - 1][1] if i else 0) for i, (_, c) in enumerate(buckets)]
        last = max((i for i, c in enumerate(counts) if c), default=0)
        upto = min(len(counts), max(last + 2, 4))
        return [_bucket_label(le) for le, _ in buckets[:upto]], counts[:upto]

    def attach(self, metrics: Any, *, title: str | None = None) -> None:
        """Watch another registry from now on (a reset: a new engine behind the same charts). The samples start
        again and the live figure is emptied in place — the same widget, so a view already on screen (and its
        controls) stays where it is."""
        self.metrics, self.samples = metrics, []
        if title is not None:
            self.title = title
        if self.widget is not None:
            self.widget.layout.title.text = self.title
            self.redraw()

    @contextmanager
    def batch(self) -> Iterator["MetricsPanel"]:
        """Take samples without drawing each one; draw them all once on the way out (like plotly's
        ``batch_update``). For a run driven from code: a notebook's Run All redraws once, not once per step."""
        every, self.redraw_every = self.redraw_every, 2**62
        try:
            yield self
        finally:
            self.redraw_every = every
            if self.widget is not None:
                self.redraw()

    def update(self) -> MetricsSample:
        """Take one sample (and redraw the live charts every ``redraw_every`` samples); return the sample."""
        sample = self.read()
        self.samples.append(sample)
        if self.widget is not None and len(self.samples) % self.redraw_every == 0:
            self.redraw()
        return sample

    def redraw(self) -> None:
        """Draw every sample taken so far on the live charts (``update`` does it every ``redraw_every`` samples)."""
        if self.widget is None:
            raise ValueError("this panel was made with live=False: it has no live figure (use static())")
        xs = [s.index for s in self.samples]
        series = [[s.running for s in self.samples], [s.waiting for s in self.samples],
                  [s.kv_blocks for s in self.samples], [s.kv_tokens for s in self.samples],
                  [s.hit_rate for s in self.samples], [s.preemptions for s in self.samples],
                  [s.evicted_blocks for s in self.samples]]
        labels, counts = self.ttft_bars()
        ranges = self._ranges(counts)
        with self.widget.batch_update():
            for trace, ys in zip(self.widget.data[:7], series, strict=True):
                trace.x, trace.y = xs, ys
            self.widget.data[7].x, self.widget.data[7].y = labels, counts
            for axis, rng in ranges.items():
                self.widget.layout[axis].range = rng

    def _ranges(self, counts: list[float]) -> dict[str, list[float]]:
        """Every axis range, from the samples alone (the SVG's scales too).

        NOTE: set, not left to plotly's autorange — with no data (after ``attach``) autorange keeps the previous
        range, so the same samples would draw differently depending on what was drawn before."""
        n = max(1, len(self.samples) - 1)
        most_requests = max([1.0] + [max(s.running, s.waiting) for s in self.samples])
        most_events = max([1.0] + [max(s.preemptions, s.evicted_blocks) for s in self.samples])
        # make_subplots numbers the axes row by row: (1,1) xaxis, (1,2) xaxis2, (1,3) xaxis3, (2,1) xaxis4, (2,2) 5
        return {"xaxis": [0, n], "xaxis2": [0, n], "xaxis3": [0, n], "xaxis4": [0, n],
                "yaxis": [0, 1.05 * most_requests], "yaxis4": [0, 1.05 * most_events],
                "yaxis5": [0, 1.1 * max([1.0] + list(counts))]}

    # ------------------------------------------------------------------ static picture
    def to_svg(self) -> str:
        """The five charts as one SVG (no JavaScript): what GitHub and nbviewer readers see."""
        W, H, pw, ph = 980, 490, 290, 160
        body = [S.svg_text(12, 16, self.title, size=13, anchor="start", bold=True)]
        origins = [(40, 52), (360, 52), (680, 52), (40, 290), (360, 290)]
        xs = [s.index for s in self.samples]
        ymax_req = max([1.0] + [max(s.running, s.waiting) for s in self.samples])
        ymax_ev = max([1.0] + [max(s.preemptions, s.evicted_blocks) for s in self.samples])
        lines = [
            ([[s.running for s in self.samples], [s.waiting for s in self.samples]], ("running", "waiting"),
             ymax_req),
            ([[s.kv_blocks for s in self.samples], [s.kv_tokens for s in self.samples]], ("blocks", "token slots"),
             1.0),
            ([[s.hit_rate for s in self.samples]], ("hit rate",), 1.0),
            ([[s.preemptions for s in self.samples], [s.evicted_blocks for s in self.samples]],
             ("preemptions", "evicted blocks"), ymax_ev),
        ]
        for (x0, y0), title, (ys_list, names, ymax) in zip(origins, TITLES, lines, strict=False):
            body += self._axes(x0, y0, pw, ph, title, ymax)
            n = max(1, len(xs) - 1)
            for c, (ys, name) in enumerate(zip(ys_list, names, strict=True)):
                pts = [(x0 + pw * x / n, y0 + ph - ph * y / ymax) for x, y in zip(xs, ys, strict=True) if y is not None]
                if len(pts) > 1:
                    path = " ".join(f"{px:.1f},{py:.1f}" for px, py in pts)
                    body.append(f'<polyline points="{path}" fill="none" stroke="{LINE_COLORS[c]}" stroke-width="2"/>')
                body.append(S.svg_text(x0 + 6 + 120 * c, y0 + ph + 28, f"— {name}", size=10, color=LINE_COLORS[c],
                                       anchor="start"))
            body.append(S.svg_text(x0 + pw, y0 + ph + 12, f"sample {xs[-1] if xs else 0}", size=9, anchor="end"))
        labels, counts = self.ttft_bars()
        x0, y0 = origins[4]
        cmax = max([1.0] + counts)
        body += self._axes(x0, y0, pw, ph, TITLES[4], cmax)
        bw = pw / max(1, len(counts))
        every = -(-len(counts) // 7)  # at most 7 bucket labels, so they never overlap
        for i, (label, c) in enumerate(zip(labels, counts, strict=True)):
            h = ph * c / cmax
            body.append(S.svg_rect(x0 + i * bw + 1, y0 + ph - h, bw - 2, h, "#59a14f", rx=1,
                                   tip=f"le {label}: {c:g} requests"))
            if i % every == 0:
                body.append(S.svg_text(x0 + (i + 0.5) * bw, y0 + ph + 12, f"≤{label}", size=9))
        body.append(S.svg_text(x0 + pw, y0 + ph + 28, "bar = requests whose TTFT is in (previous, le]", size=9,
                               anchor="end"))
        return S.svg_doc(W, H, body, title=self.title)

    @staticmethod
    def _axes(x0: float, y0: float, w: float, h: float, title: str, ymax: float) -> list[str]:
        return [S.svg_text(x0, y0 - 10, title, size=11, anchor="start", bold=True),
                f'<line x1="{x0}" y1="{y0 + h}" x2="{x0 + w}" y2="{y0 + h}" stroke="#999"/>',
                f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 + h}" stroke="#999"/>',
                S.svg_text(x0 - 4, y0, f"{ymax:g}", size=9, anchor="end"),
                S.svg_text(x0 - 4, y0 + h, "0", size=9, anchor="end")]

    def to_html(self) -> str:
        return f'<div class="minienv-view">{self.to_svg()}</div>'

    def static(self):
        """A static picture of the current state for readers without a kernel (GitHub, nbviewer)."""
        return S.require("IPython.display").SVG(data=self.to_svg())

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        if self.widget is None:
            return {"image/svg+xml": self.to_svg(), "text/plain": repr(self)}
        return super()._repr_mimebundle_(include=include, exclude=exclude, **kwargs)

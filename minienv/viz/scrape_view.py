"""``ScrapeView``: what one scrape of ``/metrics`` carries, and what changed since the previous scrape.

    view = ScrapeView(metrics_of(engine))   # takes a first scrape now: the baseline
    view                                    # live: an ipywidgets.HTML redrawn in place
    engine.step(); view.update()            # one scrape, compared with the previous one; returns a caption
    view.changes                            # {sample: (before, after)} for every sample that moved
    view.static()                           # the same picture as SVG, for readers without a kernel

A time-series dashboard (:class:`~minienv.viz.metrics_panel.MetricsPanel`) shows where the numbers went; this view
shows what they *are*, one scrape at a time, so a student stepping the engine sees the structure change:

* left, the gauges and counters a scrape carries, one row per sample (``name{labels}`` as Prometheus stores it):
  its type, its value now and its change since the last scrape, a changed row highlighted. A counter's change is
  never negative; a gauge goes both ways.
* right, one histogram as Prometheus stores it: the cumulative ``_bucket{le=...}`` counts, with what this scrape
  added drawn on top. An observation adds 1 to its own bucket *and to every bucket above it*, up to ``+Inf``: that
  is what "cumulative" means, and why ``+Inf`` always equals ``_count``.

Nothing here reads the engine: only the registry, as a scraper would.
"""

from __future__ import annotations

import math
from typing import Any

from . import _style as S
from ._view import View

ENGINE_LABELS = ("model_name", "engine")  # on every sample of one engine (minienv.metrics.LABEL_NAMES)

#: the rows of the left table: (sample name as stored, type), in the order an operator reads them
ROWS = (
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("minienv:kv_cache_token_usage_perc", "gauge"),
    ("vllm:prompt_tokens_total", "counter"),
    ("vllm:generation_tokens_total", "counter"),
    ("vllm:prefix_cache_queries_total", "counter"),
    ("vllm:prefix_cache_hits_total", "counter"),
    ("vllm:num_preemptions_total", "counter"),
    ("minienv:kv_cache_evicted_blocks_total", "counter"),
    ('vllm:request_success_total{finished_reason="length"}', "counter"),
    ('vllm:request_success_total{finished_reason="stop"}', "counter"),
)
CHANGED, ADDED, HELD = "#fff3bf", "#f28e2b", "#59a14f"


def scrape(metrics: Any) -> dict[str, float]:
    """Every sample of one engine's registry, keyed as Prometheus stores it: ``name`` or ``name{label="value"}``
    (the engine's own ``model_name``/``engine`` labels left out; ``_created`` timestamps skipped)."""
    own = dict(zip(ENGINE_LABELS, metrics.label_values, strict=True))
    out: dict[str, float] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name.endswith("_created") or any(s.labels.get(k) != v for k, v in own.items()):
                continue
            extra = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in own)
            out[f"{s.name}{{{extra}}}" if extra else s.name] = s.value
    return out


def _le_text(le: float) -> str:
    return "+Inf" if le == math.inf else (f"{le * 1e3:g}ms" if le < 1 else f"{le:g}s")


class ScrapeView(View):
    """One engine's scrape, the changes since the previous one, and one histogram's cumulative buckets."""

    def __init__(self, metrics: Any, *, histogram: str = "vllm:time_to_first_token_seconds", live: bool = True,
                 title: str = "one scrape of /metrics") -> None:
        self.histogram, self.title = histogram, title
        self.widget: Any = None
        self.attach(metrics)
        if live:
            self.widget = S.require("ipywidgets").HTML(value=self.to_html())

    # ------------------------------------------------------------------ scraping
    def attach(self, metrics: Any, *, title: str | None = None) -> None:
        """Watch another registry from now on (a reset); its scrape now is the new baseline."""
        self.metrics = metrics
        if not any(k.startswith(f"{self.histogram}_bucket{{") for k in scrape(metrics)):
            raise ValueError(f"{self.histogram!r} is not a histogram of this registry")
        self.title = self.title if title is None else title
        self.now = self.before = scrape(metrics)
        self.scrapes = 0
        if self.widget is not None:
            self.widget.value = self.to_html()

    def update(self) -> str:
        """Take one scrape, keep the previous one to compare with, redraw; return :meth:`caption`."""
        self.before, self.now = self.now, scrape(self.metrics)
        self.scrapes += 1
        if self.widget is not None:
            self.widget.value = self.to_html()
        return self.caption()

    @property
    def changes(self) -> dict[str, tuple[float, float]]:
        """``{sample: (previous scrape, this scrape)}`` for every sample whose value moved."""
        return {k: (self.before.get(k, 0.0), v) for k, v in self.now.items() if self.before.get(k, 0.0) != v}

    def delta(self, sample: str) -> float:
        """This scrape's value of ``sample`` minus the previous scrape's (0 for a sample neither carries)."""
        return self.now.get(sample, 0.0) - self.before.get(sample, 0.0)

    def buckets(self) -> list[tuple[float, float, float]]:
        """The histogram's cumulative buckets as stored, ``[(le, count before, count now), ...]``, ``+Inf`` last."""
        prefix = f'{self.histogram}_bucket{{le="'
        les = sorted(float(k[len(prefix):-2]) for k in self.now if k.startswith(prefix))
        key = lambda le: f'{prefix}{"+Inf" if le == math.inf else repr(le)}"}}'  # noqa: E731 - as stored
        return [(le, self.before.get(key(le), 0.0), self.now[key(le)]) for le in les]

    def caption(self) -> str:
        """This scrape in words: what the engine did since the previous one, read off the counters' changes."""
        d = self.delta
        parts = [f"{d(name):+.0f} {what}" for name, what in (
            ("vllm:prompt_tokens_total", "prompt tokens"), ("vllm:generation_tokens_total", "generated tokens"),
            ("vllm:prefix_cache_hits_total", "prefix-cache hit tokens"), ("vllm:num_preemptions_total", "preemptions"),
            ("minienv:kv_cache_evicted_blocks_total", "evicted blocks")) if d(name)]
        observed = d(f"{self.histogram}_count")
        if observed:
            low = min(le for le, before, now in self.buckets() if now > before)
            parts.append(f"{observed:.0f} observed by {self.histogram.split(':')[-1]}: every bucket from "
                         f"le={_le_text(low)} up grew, +Inf by {observed:.0f}")
        finished = sum(v for k, v in ((k, d(k)) for k in self.now) if k.startswith("vllm:request_success_total"))
        if finished:
            parts.append(f"{finished:.0f} finished")
        return f"scrape {self.scrapes}: " + ("; ".join(parts) if parts else "no counter moved")

    # ------------------------------------------------------------------ picture
    def to_svg(self) -> str:
        W, row_h, top = 980, 19, 58
        rows = [(name, kind) for name, kind in ROWS if name in self.now]
        body = [S.svg_text(12, 16, self.title, size=13, anchor="start", bold=True)]
        line, lines = "", []
        for part in self.caption().split("; "):  # the caption, wrapped at its parts
            if line and len(line) + len(part) > 150:
                lines.append(line + ";")
                line = ""
            line = f"{line}; {part}" if line else part
        for i, text in enumerate(lines + [line]):
            body.append(S.svg_text(12, 34 + 15 * i, text, size=11, anchor="start", color="#444"))
        top += 15 * len(lines)
        H = max(top + row_h * len(rows) + 40, top + 300)
        # left: the table
        cols = (14, 350, 420, 500)
        for x, head in zip(cols, ("sample (as stored)", "type", "value", "Δ since last"), strict=True):
            body.append(S.svg_text(x, top, head, size=10, anchor="start", bold=True, color="#555"))
        for i, (name, kind) in enumerate(rows):
            y = top + 8 + i * row_h
            change = self.delta(name)
            if change:
                body.append(S.svg_rect(10, y, 560, row_h - 2, CHANGED, stroke="none", rx=2,
                                       tip=f"{name}: {self.before.get(name, 0.0):g} → {self.now[name]:g}"))
            value = self.now[name]
            shown = f"{value:.2f}" if kind == "gauge" and value != int(value) else f"{value:.0f}"
            for x, text in zip(cols, (name, kind, shown, f"{change:+.2f}" if change and kind == "gauge" and
                                      change != int(change) else (f"{change:+.0f}" if change else "")), strict=True):
                body.append(S.svg_text(x, y + row_h - 6, text, size=10, anchor="start"))
        # right: the histogram's cumulative buckets
        x0, y0, pw, ph = 620, top + 24, 340, 190
        buckets = self.buckets()
        # the last bucket that holds an observation of its own (cumulative counts only grow with le)
        last = max((i for i, (_, _, now) in enumerate(buckets) if now > (buckets[i - 1][2] if i else 0)), default=0)
        shown_b = buckets[:min(len(buckets) - 1, max(last + 2, 4))] + buckets[-1:]  # ... then +Inf
        total = buckets[-1][2]
        cmax = max(1.0, total)
        body.append(S.svg_text(x0, top, f"{self.histogram}_bucket (cumulative)", size=10, anchor="start",
                               bold=True, color="#555"))
        body.append(f'<line x1="{x0}" y1="{y0 + ph}" x2="{x0 + pw}" y2="{y0 + ph}" stroke="#999"/>')
        bw = pw / len(shown_b)
        every = -(-len(shown_b) // 7)
        for i, (le, before, now) in enumerate(shown_b):
            held_h, added_h = ph * before / cmax, ph * (now - before) / cmax
            x = x0 + i * bw + 2
            body.append(S.svg_rect(x, y0 + ph - held_h, bw - 4, held_h, HELD, stroke="none",
                                   tip=f"le={_le_text(le)}: {before:g} before this scrape"))
            if added_h:
                body.append(S.svg_rect(x, y0 + ph - held_h - added_h, bw - 4, added_h, ADDED, stroke="none",
                                       tip=f"le={_le_text(le)}: +{now - before:g} this scrape"))
            body.append(S.svg_text(x + (bw - 4) / 2, y0 + ph - held_h - added_h - 3, f"{now:g}", size=9))
            if le == math.inf or (i % every == 0 and i < len(shown_b) - 2):
                body.append(S.svg_text(x + (bw - 4) / 2, y0 + ph + 12, f"≤{_le_text(le)}" if le != math.inf
                                       else "+Inf", size=9))
        sum_now = self.now.get(f"{self.histogram}_sum", 0.0)
        body.append(S.svg_text(x0, y0 + ph + 30, f"_count {total:g} ({self.delta(f'{self.histogram}_count'):+g})"
                               f"   _sum {sum_now:.3g}", size=10, anchor="start"))
        body.append(S.svg_rect(x0, y0 + ph + 41, 10, 10, HELD, stroke="none", rx=1))
        body.append(S.svg_text(x0 + 14, y0 + ph + 46, "before this scrape", size=9, anchor="start"))
        body.append(S.svg_rect(x0 + 120, y0 + ph + 41, 10, 10, ADDED, stroke="none", rx=1))
        body.append(S.svg_text(x0 + 134, y0 + ph + 46, "added by this scrape", size=9, anchor="start"))
        return S.svg_doc(W, H, body, title=self.title)

    def to_html(self) -> str:
        return f'<div class="{self.css_class}">{self.to_svg()}</div>'

    def static(self):
        """The current scrape as SVG, for readers without a kernel (GitHub, nbviewer)."""
        return S.require("IPython.display").SVG(data=self.to_svg())

    def __repr__(self) -> str:
        return f"ScrapeView({self.histogram!r}, scrape {self.scrapes}, {len(self.changes)} samples changed)"

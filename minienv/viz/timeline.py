"""``RequestTimeline``: one row per request, one column per engine step, coloured by what the request did.

A scheduler is easiest to understand as a picture of time: who waited, who prefilled (and in which chunks), who
decoded, who was preempted. This view draws exactly that from per-step records — the engine's
``engine.timeline()`` (``TimelineEntry(request_id, step, state, num_tokens)``) or any records with those four
attributes, or plain ``(request_id, step, state, num_tokens)`` tuples. It knows nothing of the engine class.

    tl = RequestTimeline(title="continuous batching")
    tl.update(engine.timeline(), num_steps=engine.stats.num_steps)
    tl.segments            # merged runs: Segment(request_id, state, start, end, num_tokens, finished)
    tl.state_at("3", 7)    # what request "3" did in step 7 ("decode", "waiting", ... or None)
    tl                     # the live view (a plotly FigureWidget, updated in place)
    tl.static()            # the same picture as SVG, for readers without a kernel

States (the engine's vocabulary): ``waiting`` (queued, holds no KV), ``prefill`` (a chunk of prompt — or of a
resume after preemption — was computed; each chunk is its own segment, labelled with its token count),
``decode`` (one token), ``paused`` (running, holds KV, but the step's token budget had nothing left for its
prefill chunk), ``preempted`` (this step freed its KV; it is back at the front of the waiting queue). The engine
marks a request's last step ``finished``; the view draws that step as the work it did (a decode, or a prefill
chunk that sampled) and puts an end mark on the row.

``live="figure"`` (default) makes the live view a plotly ``FigureWidget``; ``live="html"`` an ``ipywidgets.HTML``
holding the SVG (for pages that already have a FigureWidget, e.g. the engine dashboard).
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from . import _style as S
from ._view import SvgView

#: Drawing order and legend order.
STATES = ("waiting", "prefill", "decode", "paused", "preempted")
STATE_COLORS = {
    "waiting": "#e3e3e3",
    "prefill": "#f28e2b",
    "decode": "#4e79a7",
    "paused": "#edc948",
    "preempted": "#e15759",
}
_INPUT_STATES = set(STATES) | {"finished"}


@dataclass(frozen=True)
class Segment:
    """A run of steps ``[start, end)`` in which one request was in one state.

    ``num_tokens`` is the tokens computed over the run (prefill chunk size; number of decodes); ``finished`` marks
    the request's last segment when its last token came out of it.
    """

    request_id: Hashable
    state: str
    start: int
    end: int
    num_tokens: int = 0
    finished: bool = False

    @property
    def length(self) -> int:
        return self.end - self.start


def _as_entry(e: Any) -> tuple[Hashable, int, str, int]:
    if isinstance(e, tuple):
        if len(e) == 3:
            rid, step, state = e
            n = 0
        elif len(e) == 4:
            rid, step, state, n = e
        else:
            raise ValueError(f"a timeline entry tuple is (request_id, step, state[, num_tokens]), got {e!r}")
    else:
        try:
            rid, step, state, n = e.request_id, e.step, e.state, getattr(e, "num_tokens", 0)
        except AttributeError:
            raise ValueError(f"expected a timeline entry (request_id, step, state, num_tokens), got {e!r}") from None
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if state not in _INPUT_STATES:
        raise ValueError(f"state must be one of {sorted(_INPUT_STATES)}, got {state!r}")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"num_tokens must be an integer >= 0, got {n!r}")
    if not isinstance(rid, Hashable):
        raise ValueError(f"request_id must be hashable, got {rid!r}")
    return rid, int(step), str(state), int(n)


def timeline_segments(entries: Iterable[Any]) -> tuple[list[Hashable], list[Segment]]:
    """Merge per-step entries into segments; return ``(rows, segments)`` (rows in first-seen order).

    Consecutive steps in the same state merge, except prefill: every chunk is its own segment. A ``finished``
    entry becomes the work it did: a decode when the request was already running and computed one token, else a
    prefill chunk (a request that sampled its only token in its first chunk, or a resume).
    """
    parsed = [_as_entry(e) for e in entries]
    rows: list[Hashable] = []
    per: dict[Hashable, list[tuple[int, str, int]]] = {}
    for rid, step, state, n in parsed:
        if rid not in per:
            rows.append(rid)
            per[rid] = []
        per[rid].append((step, state, n))
    segments: list[Segment] = []
    for rid in rows:
        items = sorted(per[rid], key=lambda t: t[0])
        steps = [s for s, _, _ in items]
        if len(set(steps)) != len(steps):
            raise ValueError(f"request {rid!r} has two entries for one step: {steps}")
        out: list[Segment] = []
        prev_state: str | None = None
        for step, state, n in items:
            finished = state == "finished"
            if finished:
                running_before = prev_state in ("prefill", "decode", "paused")
                state = "decode" if (running_before and n == 1) else "prefill"
            last = out[-1] if out else None
            if (last is not None and not finished and state != "prefill" and last.state == state
                    and last.end == step and not last.finished):
                out[-1] = Segment(rid, state, last.start, step + 1, last.num_tokens + n)
            elif (last is not None and finished and state == "decode" and last.state == "decode"
                  and last.end == step):
                out[-1] = Segment(rid, state, last.start, step + 1, last.num_tokens + n, True)
            else:
                out.append(Segment(rid, state, step, step + 1, n, finished))
            prev_state = state
        segments.extend(out)
    return rows, segments


class RequestTimeline(SvgView):
    """A live request timeline (rows = requests, x = engine steps), updated in place.

    Parameters
    ----------
    title:    text above the chart; ``update(..., caption=...)`` appends a per-step caption.
    step_px:  width of one step in the static SVG (shrunk so the picture stays under ``max_width``).
    row_px:   height of one request row.
    live:     ``"figure"`` (plotly FigureWidget) or ``"html"`` (the SVG in an ``ipywidgets.HTML``).
    max_width: the widest the SVG may be, in pixels.
    """

    css_class = "minienv-timeline"
    _FIGURE_PLOT_PX = 780  # width of the live figure's plot area (860 px wide, margins 60 + 20)

    def __init__(self, *, title: str = "request timeline", step_px: int = 16, row_px: int = 22,
                 live: str = "figure", max_width: int = 900) -> None:
        if live not in ("figure", "html"):
            raise ValueError(f"live must be 'figure' or 'html', got {live!r}")
        for name, v in (("step_px", step_px), ("row_px", row_px), ("max_width", max_width)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.title = title
        self.step_px, self.row_px, self.max_width = int(step_px), int(row_px), int(max_width)
        self.live = live
        self._rows: list[Hashable] = []
        self._segments: list[Segment] = []
        self._grid: dict[tuple[Hashable, int], str] = {}
        self._num_steps = 0
        self._caption = ""
        self.updates = 0
        if live == "figure":
            self.fig = self._make_figure()
            self.widget = self.fig
        else:
            self.fig = None
            self.widget = S.require("ipywidgets").HTML(value=self.to_svg(), _dom_classes=(self.css_class,))

    # ------------------------------------------------------------------ state
    @property
    def rows(self) -> list[Hashable]:
        """Request ids, one per row, top to bottom (first seen first)."""
        return list(self._rows)

    @property
    def segments(self) -> list[Segment]:
        return list(self._segments)

    @property
    def num_steps(self) -> int:
        """Steps drawn (the x range)."""
        return self._num_steps

    @property
    def caption(self) -> str:
        return self._caption

    def state_at(self, request_id: Hashable, step: int) -> str | None:
        """What the request did in ``step`` (a drawn state), or None if it has no entry there."""
        return self._grid.get((request_id, step))

    def row(self, request_id: Hashable) -> list[str | None]:
        """The request's state in every step ``0 .. num_steps - 1``."""
        return [self._grid.get((request_id, s)) for s in range(self._num_steps)]

    def count(self, state: str, request_id: Hashable | None = None) -> int:
        """How many (request, step) cells are in ``state`` (for one request, or all)."""
        return sum(1 for (r, _), st in self._grid.items() if st == state and (request_id is None or r == request_id))

    def finish_step(self, request_id: Hashable) -> int | None:
        """The step whose output finished the request (None if it has not finished)."""
        ends = [s.end - 1 for s in self._segments if s.request_id == request_id and s.finished]
        return ends[-1] if ends else None

    # ------------------------------------------------------------------ updating
    def update(self, entries: Iterable[Any], *, num_steps: int | None = None, caption: str | None = None) -> None:
        """Draw new per-step entries (the whole history so far). Bad input raises ValueError, view unchanged."""
        rows, segments = timeline_segments(entries)
        last = max((s.end for s in segments), default=0)
        if num_steps is not None:
            if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < last:
                raise ValueError(f"num_steps must be an integer >= {last} (the last step drawn + 1), got {num_steps!r}")
            last = int(num_steps)
        grid = {}
        for s in segments:
            for step in range(s.start, s.end):
                grid[(s.request_id, step)] = s.state
        self._rows, self._segments, self._grid, self._num_steps = rows, segments, grid, last
        if caption is not None:
            self._caption = str(caption)
        self.updates += 1
        self._redraw()

    def reset(self, *, caption: str = "") -> None:
        self._rows, self._segments, self._grid, self._num_steps = [], [], {}, 0
        self._caption = caption
        self.updates = 0
        self._redraw()

    # ------------------------------------------------------------------ drawing
    def _title_text(self) -> str:
        return " — ".join(p for p in (self.title, self._caption) if p)

    def _hover(self, s: Segment) -> str:
        # counted from 1, like every caption of the series: the step with index 0 is "step 1"
        steps = f"step {s.start + 1}" if s.length == 1 else f"steps {s.start + 1}–{s.end}"
        what = {"prefill": f"prefill chunk of {s.num_tokens} tokens", "decode": f"{s.num_tokens} decode step(s)",
                "waiting": "waiting (no KV held)", "paused": "running, no budget left for its chunk",
                "preempted": "preempted: KV freed, back to the front of the queue"}[s.state]
        return f"request {s.request_id}<br>{steps}: {what}" + ("<br>finished" if s.finished else "")

    def _traces_data(self) -> dict[str, dict[str, list]]:
        data = {st: dict(x=[], y=[], base=[], text=[], hovertext=[]) for st in STATES}
        for s in self._segments:
            d = data[s.state]
            d["x"].append(s.length)
            d["y"].append(str(s.request_id))
            d["base"].append(s.start)
            d["text"].append(str(s.num_tokens) if s.state == "prefill" else "")
            d["hovertext"].append(self._hover(s))
        return data

    def step_ticks(self, step_px: float) -> list[int]:
        """The x-axis ticks: a tick every 1, 2, 5, 10, 20 ... steps, whatever keeps ``step_px``-wide steps' labels
        apart (the live figure and the SVG use the same ticks)."""
        n = max(self._num_steps, 1)
        every = next(k for k in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10**9) if k * step_px >= 26)
        return list(range(0, n + 1, every))

    def _layout_update(self) -> dict:
        # Ticks and ranges are set explicitly from the current rows and steps: left to plotly, an emptied figure
        # (after a reset) keeps the categories and ticks of the last data it drew.
        rows = [str(r) for r in self._rows]
        n = max(self._num_steps, 1)
        return dict(
            title=dict(text=self._title_text(), x=0.01, xanchor="left", font=dict(size=13)),
            height=max(160, len(rows) * self.row_px + 110),
            yaxis=dict(categoryorder="array", categoryarray=rows, autorange=False,
                       range=[max(len(rows), 1) - 0.5, -0.5], tickmode="array", tickvals=rows, ticktext=rows,
                       title="request", type="category"),
            xaxis=dict(range=[0, n], autorange=False, tickmode="array",
                       tickvals=self.step_ticks(self._FIGURE_PLOT_PX / n), title="engine step"),
        )

    def _make_figure(self):
        go = S.require("plotly.graph_objects")
        S.require("anywidget")
        data = self._traces_data()
        traces = [go.Bar(name=st, orientation="h", marker=dict(color=STATE_COLORS[st], line=dict(width=0.5,
                                                                                                   color="#ffffff")),
                         textposition="inside", insidetextanchor="middle", textfont=dict(size=9),
                         hoverinfo="text", **data[st]) for st in STATES]
        ends = [s for s in self._segments if s.finished]
        traces.append(go.Scatter(name="finished", mode="markers", x=[s.end for s in ends],
                                 y=[str(s.request_id) for s in ends],
                                 marker=dict(symbol="line-ns-open", size=14, color="#111111", line=dict(width=3)),
                                 hoverinfo="skip"))
        fig = go.FigureWidget(data=traces, layout=go.Layout(
            barmode="overlay", bargap=0.25, plot_bgcolor="#ffffff", paper_bgcolor="#ffffff", width=860,
            margin=dict(l=60, r=20, t=40, b=40), legend=dict(orientation="h", y=-0.18, x=0),
            font=dict(size=11), **self._layout_update()))
        fig.update_xaxes(showgrid=True, gridcolor="#f0f0f0")
        S.quiet_config(fig)
        fig.add_class(self.css_class)  # before any display: the page can tell which view this figure is
        return fig

    def _redraw(self) -> None:
        if self.fig is None:
            self.widget.value = self.to_svg()
            return
        data = self._traces_data()
        ends = [s for s in self._segments if s.finished]
        with self.fig.batch_update():
            for trace, st in zip(self.fig.data, STATES):
                d = data[st]
                trace.x, trace.y, trace.base, trace.text, trace.hovertext = (d["x"], d["y"], d["base"], d["text"],
                                                                             d["hovertext"])
            self.fig.data[-1].x = [s.end for s in ends]
            self.fig.data[-1].y = [str(s.request_id) for s in ends]
            self.fig.update_layout(**self._layout_update())

    def figure(self):
        """A plain (non-widget) plotly ``go.Figure`` of the current state."""
        go = S.require("plotly.graph_objects")
        return go.Figure(self.fig if self.fig is not None else self._make_figure())

    def to_svg(self) -> str:
        """The current state as a standalone SVG string (what ``static()`` shows)."""
        n = max(self._num_steps, 1)
        left, pad, top = 64, 8, 30
        step_px = max(2.0, min(float(self.step_px), (self.max_width - left - pad) / n))
        rh = self.row_px
        axis_y = top + len(self._rows) * rh + 4
        width = left + n * step_px + pad + 4
        body = [S.svg_text(pad, 15, self._title_text(), size=13, anchor="start", bold=True)]
        index = {r: i for i, r in enumerate(self._rows)}
        for r, i in index.items():
            body.append(S.svg_text(left - 6, top + i * rh + rh / 2, r, size=11, anchor="end"))
        for s in self._segments:
            x = left + s.start * step_px
            y = top + index[s.request_id] * rh + 3
            w = s.length * step_px
            fill = STATE_COLORS[s.state]
            body.append(S.svg_rect(x, y, max(w - 0.6, 1.0), rh - 6, fill, stroke="#ffffff", width=0.5, rx=1.5,
                                   tip=self._hover(s).replace("<br>", " · ")))
            if s.state == "prefill" and w >= 7 * len(str(s.num_tokens)) + 2:
                body.append(S.svg_text(x + w / 2, y + (rh - 6) / 2, s.num_tokens, size=9,
                                       color=S.text_color(fill)))
            if s.finished:
                xe = x + w
                body.append(f'<line x1="{xe:.1f}" y1="{y - 1:.1f}" x2="{xe:.1f}" y2="{y + rh - 5:.1f}" '
                            'stroke="#111111" stroke-width="2.5"/>')
        # x axis: a tick every 1, 5, 10, 20 ... steps, whatever keeps labels apart
        body.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + n * step_px:.1f}" y2="{axis_y}" stroke="#999"/>')
        for t in self.step_ticks(step_px):
            x = left + t * step_px
            body.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#999"/>')
            body.append(S.svg_text(x, axis_y + 12, t, size=9, color="#555555"))
        body.append(S.svg_text(left + n * step_px / 2, axis_y + 26, "engine step", size=10, color="#555555"))
        lx, ly = pad, axis_y + 44
        for st in STATES + ("finished",):
            if st == "finished":
                body.append(f'<line x1="{lx + 6}" y1="{ly - 7}" x2="{lx + 6}" y2="{ly + 7}" stroke="#111111" '
                            'stroke-width="2.5"/>')
            else:
                body.append(S.svg_rect(lx, ly - 6, 12, 12, STATE_COLORS[st], stroke="#d0d0d0", rx=2))
            label = st + (" (tokens)" if st == "prefill" else "")
            body.append(S.svg_text(lx + 16, ly, label, size=11, anchor="start"))
            lx += 16 + 7 * len(label) + 14
        width = max(width, lx + pad, 360)
        return S.svg_doc(width, ly + 14, body, title=self._title_text() or "request timeline")

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        inner = "fig=FigureWidget(...)" if self.fig is not None else "html"
        return f"RequestTimeline(rows={len(self._rows)}, steps={self._num_steps}, {inner})"


__all__ = ["STATES", "STATE_COLORS", "RequestTimeline", "Segment", "timeline_segments"]

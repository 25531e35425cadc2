"""``EngineDashboard``: the whole engine behind one widget — step or play through engine steps and watch it work.

    dash = EngineDashboard(lambda: InferenceEngine(model, tok, kv_budget_tokens=256, block_size=8, max_num_seqs=3,
                                                   max_num_batched_tokens=32),
                           [(prompt, SamplingParams(max_tokens=16, temperature=0)) for prompt in prompts])
    dash                  # the live widget: controls, KV pool, free queue, queues, block tables, stats, text
    dash.step(); dash.run(); dash.reset()      # the same from code (Step / ▶ / Reset do exactly this)
    dash.snapshot         # the engine's EngineSnapshot the views were drawn from
    dash.static()         # everything as static SVG/HTML, for readers without a kernel

What it shows after every step, each view updated in place (one widget for the dashboard's lifetime):

* **controls** (:class:`~minienv.viz.Stepper`) and a caption of the step: who decoded, which prefill chunks ran,
  who was admitted, preempted, finished;
* the **KV pool** (:class:`~minienv.viz.BlockGrid` via :class:`~minienv.viz.kv_views.ManagerView`): every physical
  block, coloured by the request(s) holding it, ``·rcN`` = its refcount, cached-free blocks pale blue; and the
  **free queue** in LRU order (head = evicted / allocated next), evictions drawn leaving it;
* the **running** list (admission order: the last one is preempted first) and the **waiting** queue (head is
  admitted next; a preempted request re-enters at the head);
* every running request's **block table** (:class:`~minienv.viz.BlockTableView`): logical → physical blocks with
  refcounts and fill;
* the **stats** (:class:`~minienv.viz.StatsView`): budget use as fill bars, prefix-cache hits, evictions,
  preemptions, tokens computed;
* each request's **text**, streaming in (this step's new text highlighted);
* optionally the **request timeline** (:class:`~minienv.viz.timeline.RequestTimeline`, as SVG).

Reset builds a fresh engine with ``make_engine()`` and queues the same requests (ids ``r0``, ``r1``, ...), so a
replay shows the same thing. Only the block grid is a plotly ``FigureWidget``; every other part is a plain HTML
widget, so the page stays light. The dashboard only reads the engine (``snapshot()``, ``history``,
``timeline()``) and calls ``add_request`` / ``step``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import _style as S
from ._view import View
from .block_table import BlockTableView
from .kv_views import ManagerView
from .queue_view import QueueView
from .stats_view import StatsView
from .stepper import Stepper
from .timeline import RequestTimeline


def step_caption(record: Any) -> str:
    """One line describing an engine step from its ``StepRecord`` (plan + finished).

    Steps are counted from 1, like the stepper's counter and the "steps run" stat: the caption after the first
    step says "step 1" (``plan.step`` is the 0-based index of the step).
    """
    plan = record.scheduler_output
    decodes = [s.request_id for s in plan.scheduled if s.kind == "decode"]
    prefills = [f"{s.request_id} ({s.num_new_tokens} tok" + (f", {s.num_cached_tokens} cached" if s.num_cached_tokens
                                                               else "") + ")"
                for s in plan.scheduled if s.kind == "prefill"]
    parts = [f"step {plan.step + 1}: {plan.num_scheduled_tokens}/{plan.max_num_batched_tokens} tokens"]
    if decodes:
        parts.append("decode " + " ".join(decodes))
    if prefills:
        parts.append("prefill " + ", ".join(prefills))
    if plan.admitted:
        parts.append("admitted " + " ".join(plan.admitted))
    if plan.preempted:
        parts.append("PREEMPTED " + " ".join(plan.preempted))
    if record.finished:
        parts.append("finished " + " ".join(f"{r} ({why})" for r, why in record.finished.items()))
    return "; ".join(parts)


class EngineDashboard(View):
    """One live widget over an engine: Stepper + BlockGrid + free queue + queues + block tables + stats + text.

    Parameters
    ----------
    make_engine: builds a fresh engine (called now and on every reset).
    requests:    ``(prompt, SamplingParams)`` pairs queued on every reset, as ``r0``, ``r1``, ...
    title:       heading of the dashboard.
    columns, cell_px: layout of the KV pool grid.
    interval_ms: time between steps while playing.
    timeline:    also draw the request timeline (SVG).
    text_chars:  show at most this many characters of each request's text (the tail).
    """

    def __init__(self, make_engine: Callable[[], Any], requests: Sequence[tuple[Any, Any]], *,
                 title: str = "minienv engine", columns: int | None = None, cell_px: int = 54,
                 interval_ms: int = 700, timeline: bool = True, text_chars: int = 240) -> None:
        if not callable(make_engine):
            raise ValueError(f"make_engine must be callable (it builds a fresh engine), got {make_engine!r}")
        requests = list(requests)
        for i, pair in enumerate(requests):
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"requests[{i}] must be a (prompt, SamplingParams) pair, got {pair!r}")
        w = S.require("ipywidgets")
        self.make_engine = make_engine
        self.requests = requests
        self.title = title
        self.text_chars = int(text_chars)
        self.engine = make_engine()
        mgr = self.engine.kv_cache_manager
        self.request_ids = [f"r{i}" for i in range(len(requests))]
        self.kv = ManagerView(mgr, title=f"KV pool: {mgr.num_blocks} blocks × {mgr.block_size} tokens",
                              columns=columns, cell_px=cell_px, max_queue_items=48)
        self.grid = self.kv.grid
        self.free_queue = self.kv.queue
        self.free_queue.tail_label = "tail"  # short: the head label is long, a long tail label would overlap it
        self.running_view = QueueView(title="running", head_label="oldest first; the last is preempted first",
                                      tail_label="", default_kind="owner", colors_from=self.grid, item_px=58)
        self.waiting_view = QueueView(title="waiting queue", head_label="head → admitted next", default_kind="owner",
                                      colors_from=self.grid, item_px=58)
        self.tables = BlockTableView(title="block tables", block_size=mgr.block_size,
                                     num_blocks=mgr.num_blocks, colors_from=self.grid, cell_px=50, min_columns=6)
        self.stats_view = StatsView(title="engine stats")
        self.text_view = w.HTML(value="")
        self.timeline = RequestTimeline(title="request timeline", live="html", step_px=12) if timeline else None
        for rid in self.request_ids:  # fix the colours: r0 gets the first palette colour, and so on
            self.grid.owner_color(rid)
        self.header = w.HTML(value=f"<h3 style='margin:2px 0'>{S.esc(title)}</h3>")
        self.stepper = Stepper(self._on_step, self._on_reset, n_steps=None, interval_ms=interval_ms,
                               description="engine step")
        self.snapshot = None
        self.texts: dict[str, str] = {}
        self.new_text: dict[str, str] = {}
        self.captions: list[str] = []
        left = w.VBox([self.grid.widget, self.free_queue.widget])
        right = w.VBox([self.stats_view.widget, self.running_view.widget, self.waiting_view.widget])
        parts = [self.header, self.stepper.widget, w.HBox([left, right]), self.tables.widget, self.text_view]
        if self.timeline is not None:
            parts.append(self.timeline.widget)
        self.widget = w.VBox(parts)
        self.stepper.reset()

    # ------------------------------------------------------------------ driving
    def step(self) -> bool:
        """One engine step (False when every request has finished)."""
        return self.stepper.step()

    def run(self, max_steps: int | None = None) -> int:
        """Step until every request has finished (or ``max_steps``); return the steps taken."""
        return self.stepper.run(max_steps)

    def reset(self) -> None:
        """A fresh engine with the same requests, at step 0."""
        self.stepper.reset()

    @property
    def done(self) -> bool:
        return self.stepper.done

    def _on_reset(self) -> None:
        if self.snapshot is not None:  # not the first time: a fresh engine
            self.engine = self.make_engine()
            self.kv.attach(self.engine.kv_cache_manager)
        # Every view starts over, so nothing of the previous run ("left the queue this step: r0 ...", changed
        # stats, old tables) survives: the picture after Reset is the picture of a new dashboard.
        for view in (self.running_view, self.waiting_view, self.tables, self.timeline):
            if view is not None:
                view.reset()
        self.stats_view.reset()
        for rid, (prompt, params) in zip(self.request_ids, self.requests):
            self.engine.add_request(prompt, params, request_id=rid)
        self.texts = {rid: "" for rid in self.request_ids}
        self.new_text = {}
        self.captions = []
        self._refresh("queued: " + " ".join(self.request_ids))

    def _on_step(self, index: int) -> Any:
        if not self.engine.has_unfinished_requests():
            return False
        self.engine.step()
        caption = step_caption(self.engine.history[-1]) if self.engine.history else f"step {index}"
        self.captions.append(caption)
        self._refresh(caption)
        return caption

    # ------------------------------------------------------------------ drawing
    def _refresh(self, caption: str) -> None:
        snap = self.engine.snapshot()
        self.snapshot = snap
        short = caption.split(":")[0]
        self.kv.update(caption=short)
        running = [v.request_id for v in snap.running]
        running_notes, waiting_notes = self._queue_notes(snap)
        self.running_view.update(running, labels={v.request_id: f"{v.num_tokens} tok" for v in snap.running},
                                 notes=running_notes, caption=short)
        self.waiting_view.update([v.request_id for v in snap.waiting],
                                 labels={v.request_id: ("resume" if v.num_preemptions else "new")
                                         for v in snap.waiting}, notes=waiting_notes, caption=short)
        self.tables.update({v.request_id: list(v.block_ids) for v in snap.running},
                           refcounts=list(snap.block_refcounts),
                           tokens={v.request_id: v.num_computed_tokens for v in snap.running}, caption=short)
        s = snap.stats
        step = snap.last_step
        scheduled = step.scheduler_output.num_scheduled_tokens if step else 0
        values = {
            "steps run": s.num_steps,
            "running / waiting / finished": f"{s.num_running} / {s.num_waiting} / {s.num_finished}",
            "KV blocks in use": f"{s.num_blocks_in_use} / {s.num_blocks}",
            "cached-free blocks": s.num_cached_free_blocks,
            "free-empty blocks": s.num_free_empty_blocks,
            "tokens this step": f"{scheduled} / {self.engine.max_num_batched_tokens}",
            "prefix-cache hits (tokens)": f"{s.prefix_cache_hits_tokens} / {s.prefix_cache_queries_tokens}",
            "evicted blocks": s.evicted_blocks,
            "preemptions": s.num_preemptions,
            "tokens computed": s.num_computed_tokens,
            "tokens generated": s.num_generated_tokens,
        }
        bars = {"KV blocks in use": (s.num_blocks_in_use, s.num_blocks),
                "cached-free blocks": (s.num_cached_free_blocks, s.num_blocks),
                "tokens this step": (scheduled, self.engine.max_num_batched_tokens)}
        self.stats_view.update(values, bars=bars, caption=short)
        views = {v.request_id: v for v in (*snap.running, *snap.waiting, *snap.finished)}
        new = {}
        for rid in self.request_ids:
            v = views.get(rid)
            text = v.text if v is not None else ""
            old = self.texts.get(rid, "")
            new[rid] = text[len(old):] if text.startswith(old) else text
            self.texts[rid] = text
        self.new_text = {r: t for r, t in new.items() if t}
        self.text_view.value = self._text_html(views)
        if self.timeline is not None:
            self.timeline.update(self.engine.timeline(), num_steps=s.num_steps, caption=short)

    def _queue_notes(self, snap: Any) -> tuple[dict[str, str], dict[str, str]]:
        """Why each request joined or left the running list and the waiting queue in the last step."""
        step = snap.last_step
        if step is None:
            return {}, {}
        plan = step.scheduler_output
        before_run = set(self.running_view.items)
        before_wait = set(self.waiting_view.items)
        now_run = {v.request_id: v for v in snap.running}
        now_wait = {v.request_id for v in snap.waiting}
        running, waiting = {}, {}
        for rid in before_run - set(now_run):
            running[rid] = ("preempted" if rid in plan.preempted else
                            "finished" if rid in step.finished else "left")
        for rid, v in now_run.items():
            if rid not in before_run:
                running[rid] = "resumed" if v.num_preemptions else "admitted"
        for rid in before_wait - now_wait:
            waiting[rid] = "admitted" if rid in now_run else "finished" if rid in step.finished else "left"
        for rid in now_wait - before_wait:
            waiting[rid] = "preempted" if rid in plan.preempted else "queued"
        return running, waiting

    def _text_html(self, views: dict) -> str:
        rows = []
        for rid in self.request_ids:
            v = views.get(rid)
            status = v.status if v is not None else "?"
            if v is not None and v.finish_reason:
                status = f"done ({v.finish_reason})"
            text = self.texts.get(rid, "")
            fresh = self.new_text.get(rid, "")
            old = text[: len(text) - len(fresh)]
            if len(old) > self.text_chars:
                old = "…" + old[-self.text_chars:]
            prompt = (v.prompt or f"[{v.num_prompt_tokens} prompt tokens]") if v is not None else ""
            if len(prompt) > 60:
                prompt = prompt[:59] + "…"
            color = self.grid.owner_color(rid)
            rows.append(
                f"<tr><td style='padding:2px 6px;vertical-align:top'><span style='background:{color};"
                f"color:{S.text_color(color)};padding:1px 5px;border-radius:3px;font-weight:bold'>{S.esc(rid)}</span>"
                f"</td><td style='padding:2px 6px;vertical-align:top;color:#555;white-space:nowrap'>{S.esc(status)}"
                f"</td><td style='padding:2px 6px;font-family:{S.esc(S.FONT)}'><span style='color:#888'>"
                f"{S.esc(prompt)}</span> {S.esc(old)}<span style='background:#fff3c4;font-weight:bold'>"
                f"{S.esc(fresh)}</span></td></tr>")
        return ("<div class='minienv-texts'><div style='font-weight:bold;margin:4px 0'>text, streaming in "
                "(grey: prompt; highlighted: new this step)</div>"
                f"<table style='border-collapse:collapse;font-size:12px'>{''.join(rows)}</table></div>")

    # ------------------------------------------------------------------ static rendering
    def to_html(self) -> str:
        """Every part as static SVG/HTML, laid out like the live dashboard."""
        caption = self.captions[-1] if self.captions else "step 0"
        left = self.grid.to_html() + self.free_queue.to_html()
        right = self.stats_view.to_html() + self.running_view.to_html() + self.waiting_view.to_html()
        parts = [f"<h3 style='margin:2px 0'>{S.esc(self.title)}</h3>",
                 f"<div style='font-size:12px;color:#444'>{S.esc(caption)}</div>",
                 f"<div style='display:flex;gap:16px;align-items:flex-start'><div>{left}</div><div>{right}</div></div>",
                 self.tables.to_svg(), self.text_view.value]
        if self.timeline is not None:
            parts.append(self.timeline.to_html())
        return "<div class='minienv-dashboard'>" + "".join(f"<div>{p}</div>" for p in parts) + "</div>"

    def parts(self) -> list[View]:
        views = [self.kv, self.stepper, self.running_view, self.waiting_view, self.tables, self.stats_view,
                 self.timeline]
        return [self] + [p for v in views if v is not None for p in v.parts()]

    def __repr__(self) -> str:
        step = self.snapshot.step if self.snapshot is not None else 0
        parts = ", ".join(repr(v) for v in (self.grid, self.free_queue, self.running_view, self.waiting_view,
                                            self.tables, self.timeline) if v is not None)
        return f"EngineDashboard(requests={len(self.requests)}, step={step}, done={self.done}, {parts})"


__all__ = ["EngineDashboard", "step_caption"]

"""``QueueView``: an ordered queue (a free queue in LRU order, a waiting queue), head marked, changes highlighted.

The live view is an ``ipywidgets.HTML`` whose value is replaced in place on every ``update`` (one plain widget,
no re-created output). Its picture is an SVG, so ``static()`` shows exactly the same thing to readers without
a kernel.

    q = QueueView(title="free queue", head_label="head → allocated next")
    q.update([3, 4, 5, 6])
    change = q.update([5, 6, 3], evicted=[4])   # 4 left the queue as an eviction, 3 moved to the tail
    change.removed, change.evicted, change.added  # ((4,), (4,), ())
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import _style as S
from ._view import SvgView

KINDS = ("free", "cached", "used", "owner")


@dataclass(frozen=True)
class QueueChange:
    """What one update did, in queue order: items that joined, that left, and which of those were evicted."""

    added: tuple = ()
    removed: tuple = ()
    evicted: tuple = ()
    moved: tuple = ()  # items still queued whose relative position changed (e.g. re-freed to the tail)


class QueueView(SvgView):
    """A live picture of an ordered queue, head first.

    Parameters
    ----------
    title:       text above the queue; ``update(..., caption=...)`` appends a per-step caption.
    head_label:  the marker over the head item, e.g. "head → evicted next" or "head → allocated next".
    tail_label:  the marker over the last item.
    default_kind: how items are coloured when ``kinds`` does not say: "free" (grey), "cached" (pale blue),
                 "used" (dark grey) or "owner" (the item is an owner id: coloured like in a ``BlockGrid``).
    colors_from: a ``BlockGrid`` whose owner colours to reuse for kind "owner" (so a request is one colour
                 everywhere).
    per_row, max_items, item_px: layout. Queues longer than ``max_items`` show their head and a "+k more".
    """

    css_class = "minienv-queue"

    def __init__(
        self,
        *,
        title: str = "queue",
        head_label: str = "head → evicted next",
        tail_label: str = "tail",
        default_kind: str = "free",
        colors_from: Any = None,
        per_row: int = 16,
        max_items: int = 64,
        item_px: int = 46,
    ) -> None:
        if default_kind not in KINDS:
            raise ValueError(f"default_kind must be one of {KINDS}, got {default_kind!r}")
        for name, v in (("per_row", per_row), ("max_items", max_items), ("item_px", item_px)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.title = title
        self.head_label = head_label
        self.tail_label = tail_label
        self.default_kind = default_kind
        self.per_row, self.max_items, self.item_px = int(per_row), int(max_items), int(item_px)
        self._owner_color = colors_from.owner_color if colors_from is not None else S.OwnerColors()
        self._items: tuple = ()
        self._kinds: dict = {}
        self._labels: dict = {}
        self._change = QueueChange()
        self._gone_labels: dict = {}
        self._notes: dict = {}
        self._caption = ""
        self.updates = 0
        widgets = S.require("ipywidgets")
        self.widget = widgets.HTML(value=self.to_svg(), _dom_classes=(self.css_class,))

    # ------------------------------------------------------------------ state
    @property
    def items(self) -> tuple:
        """The queue, head first."""
        return self._items

    @property
    def head(self) -> Any:
        """The head item (the next one out), or None when the queue is empty."""
        return self._items[0] if self._items else None

    @property
    def last_change(self) -> QueueChange:
        return self._change

    @property
    def added(self) -> tuple:
        return self._change.added

    @property
    def removed(self) -> tuple:
        return self._change.removed

    @property
    def evicted(self) -> tuple:
        return self._change.evicted

    @property
    def caption(self) -> str:
        return self._caption

    def __len__(self) -> int:
        return len(self._items)

    # ------------------------------------------------------------------ updating
    def update(
        self,
        items: Iterable[Hashable],
        *,
        kinds: Mapping[Hashable, str] | None = None,
        labels: Mapping[Hashable, str] | None = None,
        evicted: Iterable[Hashable] = (),
        notes: Mapping[Hashable, str] | None = None,
        caption: str | None = None,
    ) -> QueueChange:
        """Show a new queue state (head first) in place; return what changed.

        kinds:   per-item colour kind ("free", "cached", "used", "owner"); others use ``default_kind``.
        labels:  per-item second line (e.g. a hash prefix or "A[1]").
        evicted: items that left the queue *as evictions* (drawn as such); they must be gone from ``items``.
        notes:   why an item joined or left in this update, written under it instead of the default "new" /
                 "taken" / "evicted" (e.g. "preempted", "resumed"); only for items that joined or left.
        Bad input (duplicates, labels for items not in the queue, evicting an item still queued) raises
        ValueError and leaves the view unchanged.
        """
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise ValueError(f"items must be an iterable of hashable ids, got {items!r}")
        new = tuple(items)
        seen: set = set()
        for it in new:
            if not isinstance(it, Hashable):
                raise ValueError(f"queue items must be hashable, got {it!r}")
            if it in seen:
                raise ValueError(f"item {it!r} appears twice in the queue")
            seen.add(it)
        kinds = dict(kinds or {})
        labels = dict(labels or {})
        for name, mapping in (("kinds", kinds), ("labels", labels)):
            unknown = [k for k in mapping if k not in seen]
            if unknown:
                raise ValueError(f"{name} given for items not in the queue: {unknown!r}")
        bad = {k: v for k, v in kinds.items() if v not in KINDS}
        if bad:
            raise ValueError(f"kinds must be among {KINDS}, got {bad!r}")
        evicted_t = tuple(evicted)
        still = [e for e in evicted_t if e in seen]
        if still:
            raise ValueError(f"evicted items must have left the queue, but {still!r} are still in it")
        old = self._items
        old_set = set(old)
        not_there = [e for e in evicted_t if e not in old_set]
        if not_there:
            raise ValueError(f"evicted items must have been in the queue, {not_there!r} were not")

        added = tuple(it for it in new if it not in old_set)
        removed = tuple(it for it in old if it not in seen)
        notes = {k: str(v) for k, v in (notes or {}).items()}
        stray = [k for k in notes if k not in added and k not in removed]
        if stray:
            raise ValueError(f"notes are for items that joined or left in this update, not for {stray!r}")
        kept_old = [it for it in old if it in seen]
        kept_new = [it for it in new if it in old_set]
        moved = _moved(kept_old, kept_new)
        self._gone_labels = {it: self._labels.get(it) for it in removed}
        self._items = new
        self._kinds = kinds
        self._labels = labels
        self._change = QueueChange(added=added, removed=removed, evicted=evicted_t, moved=moved)
        self._notes = notes
        if caption is not None:
            self._caption = str(caption)
        self.updates += 1
        self._redraw()
        return self._change

    def reset(self, items: Iterable[Hashable] = (), *, caption: str = "", **kw: Any) -> None:
        """Back to ``items`` with nothing highlighted."""
        saved = (self._items, self._kinds, self._labels, self._change, self._caption, self.updates)
        self._items, self._kinds, self._labels = (), {}, {}
        try:
            self.update(items, caption=caption, **kw)
        except ValueError:
            self._items, self._kinds, self._labels, self._change, self._caption, self.updates = saved
            raise
        self._change = QueueChange()
        self._gone_labels = {}
        self._notes = {}
        self.updates = 0
        self._redraw()

    # ------------------------------------------------------------------ drawing
    def _fill(self, item: Hashable, kind: str) -> str:
        if kind == "free":
            return S.FREE
        if kind == "cached":
            return S.CACHED
        if kind == "used":
            return S.UNOWNED
        return self._owner_color(item)

    def _title_text(self) -> str:
        return " — ".join(p for p in (self.title, self._caption) if p)

    def _box(self, x: float, y: float, item: Hashable, label: str | None, fill: str, *, stroke: str, width: float,
             dash: bool = False, note: str | None = None) -> list[str]:
        w = self.item_px - 6
        h = 40
        out = [S.svg_rect(x, y, w, h, fill, stroke=stroke, width=width, dash=dash)]
        color = S.text_color(fill)
        room = S.inner_width(w, 3.5)  # fits inside the thickest outline (an item that just joined or moved)
        name, name_size = S.fit_text(item, room, size=11)
        if label:
            text, size = S.fit_text(label, room, size=9)
            out.append(S.svg_text(x + w / 2, y + 13, name, size=name_size, color=color, bold=True))
            out.append(S.svg_text(x + w / 2, y + 29, text, size=size, color=color))
        else:
            out.append(S.svg_text(x + w / 2, y + h / 2, name, size=name_size, color=color, bold=True))
        if note:
            text, size = S.fit_text(note, self.item_px - 2, size=9)  # below the box: the whole slot is free
            out.append(S.svg_text(x + w / 2, y + h + 9, text, size=size, color=stroke))
        return out

    def to_svg(self) -> str:
        """The current state as a standalone SVG string (what the live widget and ``static()`` show)."""
        pad, cell = 8, self.item_px
        shown = list(self._items[: self.max_items])
        hidden = len(self._items) - len(shown)
        rows = max(1, math.ceil(len(shown) / self.per_row))
        body = [S.svg_text(pad, 14, self._title_text(), size=13, anchor="start", bold=True)]
        y0 = 46
        row_h = 56
        if not shown:
            body.append(S.svg_text(pad, y0 + 20, "(empty)", size=11, anchor="start", color="#777777"))
        added = set(self._change.added)
        moved = set(self._change.moved)
        for i, it in enumerate(shown):
            r, c = divmod(i, self.per_row)
            x, y = pad + c * cell, y0 + r * row_h
            fill = self._fill(it, self._kinds.get(it, self.default_kind))
            if it in added:
                stroke, width, note = S.ADDED, 3.5, self._notes.get(it, "new")
            elif it in moved:
                stroke, width, note = S.CHANGED, 3.5, "moved"
            else:
                stroke, width, note = "#c8c8c8", 1, None
            body += self._box(x, y, it, self._labels.get(it), fill, stroke=stroke, width=width, note=note)
        if shown:
            body.append(S.svg_text(pad, y0 - 12, "▼ " + self.head_label, size=11, anchor="start", bold=True,
                                   color="#c0392b"))
            if len(shown) > 1 and not hidden:
                r, c = divmod(len(shown) - 1, self.per_row)
                tx = pad + c * cell + (cell - 6) / 2 + 5
                if r > 0 or c * cell > 7 * len(self.head_label) + 40:
                    body.append(S.svg_text(tx, y0 + r * row_h - 12, self.tail_label + " ▼", size=11,
                                           color="#555555", anchor="end"))
        y = y0 + rows * row_h
        if hidden:
            body.append(S.svg_text(pad, y, f"… +{hidden} more (length {len(self._items)})", size=11, anchor="start"))
            y += 20
        gone = self._change.removed
        if gone:
            evicted = set(self._change.evicted)
            body.append(S.svg_text(pad, y + 4, "left the queue this step:", size=11, anchor="start", color=S.REMOVED))
            y += 16
            for i, it in enumerate(gone[: self.per_row]):
                note = self._notes.get(it, "evicted" if it in evicted else "taken")
                body += self._box(pad + i * cell, y, it, self._gone_labels.get(it), "#ffffff", stroke=S.REMOVED,
                                  width=2, dash=True, note=note)
            y += row_h
        width = max(pad * 2 + min(max(len(shown), len(gone), 1), self.per_row) * cell, 360)
        body.append(S.svg_text(width - pad, 14, f"length {len(self._items)}", size=11, anchor="end", color="#555555"))
        return S.svg_doc(width, y + 4, body, title=self._title_text() or "queue")

    def _redraw(self) -> None:
        self.widget.value = self.to_svg()

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        head = list(self._items[:6])
        more = ", ..." if len(self._items) > 6 else ""
        return f"QueueView(title={self.title!r}, items={head}{more} (length {len(self._items)}))"


def _moved(before: list, after: list) -> tuple:
    """Items (present in both orders) that are not on a longest common subsequence: the ones that moved."""
    if before == after:
        return ()
    pos = {it: i for i, it in enumerate(before)}
    seq = [pos[it] for it in after]
    # longest increasing subsequence of seq (patience sorting), O(n log n)
    import bisect

    tails: list[int] = []
    tails_idx: list[int] = []
    prev = [-1] * len(seq)
    for i, v in enumerate(seq):
        k = bisect.bisect_left(tails, v)
        if k == len(tails):
            tails.append(v)
            tails_idx.append(i)
        else:
            tails[k] = v
            tails_idx[k] = i
        prev[i] = tails_idx[k - 1] if k else -1
    keep = set()
    i = tails_idx[-1] if tails_idx else -1
    while i >= 0:
        keep.add(i)
        i = prev[i]
    return tuple(it for i, it in enumerate(after) if i not in keep)

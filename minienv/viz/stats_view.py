"""``StatsView``: a small live table of named numbers (KV usage, hits, evictions...), changed values marked.

    stats = StatsView(title="engine stats")
    stats.update({"KV blocks in use": "12 / 16", "prefix hit rate": 0.41, "evictions": 3})
    stats.changed      # the names whose value changed in the last update

The live view is one ``ipywidgets.HTML`` whose value is replaced in place; ``static()`` is the same table.
Optional ``bars={"KV blocks in use": (12, 16)}`` draws a fill bar next to a value (e.g. budget use).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from . import _style as S
from ._view import View


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        return f"{float(value):.3g}" if abs(float(value)) < 1000 else f"{float(value):,.0f}"
    return str(value)


class StatsView(View):
    """A live name → value table; values that changed in the last update are highlighted."""

    def __init__(self, *, title: str = "stats") -> None:
        self.title = title
        self._values: dict[str, Any] = {}
        self._bars: dict[str, tuple[float, float]] = {}
        self._changed: frozenset[str] = frozenset()
        self._caption = ""
        self.updates = 0
        widgets = S.require("ipywidgets")
        self.widget = widgets.HTML(value=self.to_html())

    @property
    def values(self) -> dict[str, Any]:
        return dict(self._values)

    @property
    def changed(self) -> frozenset[str]:
        return self._changed

    @property
    def caption(self) -> str:
        return self._caption

    def update(self, values: Mapping[str, Any], *, bars: Mapping[str, tuple[float, float]] | None = None,
               caption: str | None = None) -> frozenset[str]:
        """Show new values (all of them: names not given disappear); return the names whose value changed.

        bars: name -> (used, total) draws a fill bar beside that value; ``0 <= used <= total``, ``total > 0``.
        Bad input raises ValueError and leaves the view unchanged.
        """
        if not isinstance(values, Mapping):
            raise ValueError(f"values must be a mapping name -> value, got {values!r}")
        new = {str(k): v for k, v in values.items()}
        bar_map: dict[str, tuple[float, float]] = {}
        for name, pair in dict(bars or {}).items():
            if str(name) not in new:
                raise ValueError(f"bar given for {name!r}, which is not among the values")
            try:
                used, total = pair
                used, total = float(used), float(total)
            except (TypeError, ValueError):
                raise ValueError(f"bar for {name!r} must be (used, total), got {pair!r}") from None
            if not (total > 0 and 0 <= used <= total):
                raise ValueError(f"bar for {name!r} needs 0 <= used <= total and total > 0, got {pair!r}")
            bar_map[str(name)] = (used, total)
        changed = frozenset(k for k, v in new.items() if k not in self._values or _fmt(self._values[k]) != _fmt(v))
        self._values, self._bars, self._changed = new, bar_map, changed
        if caption is not None:
            self._caption = str(caption)
        self.updates += 1
        self.widget.value = self.to_html()
        return changed

    def reset(self) -> None:
        self._values, self._bars, self._changed, self._caption, self.updates = {}, {}, frozenset(), "", 0
        self.widget.value = self.to_html()

    def to_html(self) -> str:
        title = " — ".join(p for p in (self.title, self._caption) if p)
        rows = []
        for name, value in self._values.items():
            changed = name in self._changed
            style = "font-weight:bold;background:#fff3c4" if changed else ""
            bar = ""
            if name in self._bars:
                used, total = self._bars[name]
                pct = 100.0 * used / total
                bar = (
                    '<div style="display:inline-block;width:120px;height:10px;background:#eeeeee;'
                    'margin-left:8px;vertical-align:middle;border-radius:2px">'
                    f'<div style="width:{pct:.1f}%;height:10px;background:{S.PALETTE[0]};border-radius:2px">'
                    "</div></div>"
                )
            rows.append(
                f'<tr><td style="padding:1px 12px 1px 0;color:#444">{S.esc(name)}</td>'
                f'<td style="padding:1px 6px;text-align:right;font-family:{S.esc(S.FONT)};{style}">'
                f"{S.esc(_fmt(value))}</td><td>{bar}</td></tr>"
            )
        body = "".join(rows) or '<tr><td style="color:#777">(nothing yet)</td></tr>'
        return (
            f'<div class="minienv-stats"><div style="font-weight:bold;margin-bottom:4px">{S.esc(title)}</div>'
            f'<table style="border-collapse:collapse;font-size:12px">{body}</table></div>'
        )

    def __repr__(self) -> str:
        return f"StatsView(title={self.title!r}, values={self._values!r})"

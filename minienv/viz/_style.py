"""Shared colours, text helpers and the lazy import of the widget stack for ``minienv.viz``.

Every view uses the same vocabulary, so a reader learns it once:

- an *owner* (a request id) gets a colour from a fixed palette, in first-seen order, for the life of the view;
- a block held by several owners at once is *shared* (one dark colour; its label lists the owners);
- *free* blocks are light grey, *cached-free* blocks (refcount 0, contents and hash kept, evictable) pale blue;
- whatever changed in the last update gets a thick dark outline (``CHANGED``).
"""

from __future__ import annotations

import html
import math
from typing import Any, Hashable

# Tableau 10 without its grey (grey means "free" here). Text on each colour is picked by luminance.
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#86bcb6",
)
FREE = "#eeeeee"  # free-empty block: no contents
CACHED = "#cfe0f3"  # cached-free block: refcount 0, K/V and hash kept, evictable
SHARED = "#3b3f5c"  # in use by several owners at once
UNOWNED = "#8c8c8c"  # in use, owner not given
CHANGED = "#111111"  # outline of whatever changed in the last update
EDGE = "#ffffff"  # outline of everything else
REMOVED = "#c0392b"  # items that just left a queue (dashed)
ADDED = "#1e8449"  # items that just joined a queue
FONT = "Menlo, Consolas, 'DejaVu Sans Mono', monospace"
# Advance width of one glyph of FONT, in ems: DejaVu Sans Mono and Menlo 0.602, Consolas 0.55; rounded up, so a
# label measured with it is never wider on screen than measured.
CHAR_EM = 0.62

STATES = ("used", "free", "cached")

_INSTALL_HINT = (
    "minienv.viz needs the notebook extras (ipywidgets, plotly, anywidget). "
    "Install them with:  pip install -e .[lab]   (from the repository root)"
)


def require(module: str) -> Any:
    """Import one module of the widget stack, or fail with an ImportError that says how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT}  (missing: {exc.name or module})") from exc


def text_color(fill: str) -> str:
    """Black or white, whichever reads better on ``fill`` (a ``#rrggbb`` colour)."""
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    luminance = 0.299 * r + 0.587 * g + 0.114 * b
    return "#1a1a1a" if luminance > 150 else "#ffffff"


class OwnerColors:
    """A stable owner → colour map: explicit colours first, then the palette in first-seen order (it cycles)."""

    def __init__(self, fixed: dict[Hashable, str] | None = None) -> None:
        self._map: dict[Hashable, str] = dict(fixed or {})
        self._next = 0

    def __call__(self, owner: Hashable) -> str:
        if owner not in self._map:
            self._map[owner] = PALETTE[self._next % len(PALETTE)]
            self._next += 1
        return self._map[owner]

    def items(self) -> list[tuple[Hashable, str]]:
        return list(self._map.items())


def text_width(text: object, size: float) -> float:
    """Width in pixels of ``text`` drawn in FONT at ``size`` px (an upper bound: see ``CHAR_EM``)."""
    return len(str(text)) * CHAR_EM * size


def fit_text(text: object, room: float, *, size: float = 10, min_size: float = 7) -> tuple[str, float]:
    """``(text, font size)`` such that the text fits in ``room`` pixels: the font shrinks (to ``min_size`` at the
    least, in half-pixel steps), and only then is the text shortened with "…" (hover texts keep it whole)."""
    text = str(text)
    if text_width(text, size) <= room:
        return text, size
    fitted = math.floor(2 * room / (len(text) * CHAR_EM)) / 2
    if fitted >= min_size:
        return text, fitted
    keep = max(1, int(room / (CHAR_EM * min_size)))
    return text[: keep - 1] + "…", min_size


def inner_width(box: float, stroke: float, pad: float = 2.0) -> float:
    """What a label may span inside a box ``box`` px wide whose outline (centred on the edge) is ``stroke`` px
    wide at its thickest: the outline covers ``stroke / 2`` on each side, plus ``pad`` px of air."""
    return box - stroke - 2 * pad


def esc(text: object) -> str:
    """HTML/SVG-escape any value's ``str``."""
    return html.escape(str(text), quote=True)


def svg_rect(x: float, y: float, w: float, h: float, fill: str, *, stroke: str = EDGE, width: float = 1.0,
             dash: bool = False, rx: float = 3.0, tip: str | None = None) -> str:
    """A rectangle; ``tip`` becomes its hover tooltip (an SVG ``<title>``)."""
    dash_attr = ' stroke-dasharray="4 3"' if dash else ""
    head = (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx}" fill="{fill}" '
        f'stroke="{stroke}" stroke-width="{width}"{dash_attr}'
    )
    return head + (f"><title>{esc(tip)}</title></rect>" if tip else "/>")


def svg_text(x: float, y: float, text: object, *, size: float = 11, color: str = "#1a1a1a", anchor: str = "middle",
             bold: bool = False) -> str:
    weight = ' font-weight="bold"' if bold else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-family="{esc(FONT)}" font-size="{size:g}" fill="{color}" '
        f'text-anchor="{anchor}" dominant-baseline="middle"{weight}>{esc(text)}</text>'
    )


def svg_doc(width: float, height: float, body: list[str], *, title: str = "") -> str:
    label = f' aria-label="{esc(title)}"' if title else ""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img"{label}>'
        f'<rect width="100%" height="100%" fill="#ffffff"/>' + "".join(body) + "</svg>"
    )


def quiet_config(fig) -> None:
    """No plotly mode bar or zoom on a view: it is a picture of state, not a chart to explore (hover stays)."""
    fig._config = {**fig._config, "displayModeBar": False, "scrollZoom": False, "doubleClick": False}

"""``BlockTableView``: every request's block table, one row per request, logical block → physical block.

Row ``A`` reads left to right in logical order; each cell shows the physical block id (``p7``), its refcount when
given (``·rc2``) and, when token counts are given, how full that block is (``3/4``). Cells that changed in the
last update (a new block at a block boundary, a copy-on-write replacing a shared block) are outlined. The live
view is one ``ipywidgets.HTML`` holding an SVG, replaced in place on each update (a plain widget: no plotly here,
so a page with many views has only the block grid's FigureWidget to initialise); ``static()`` is the same SVG.
Hover a cell for its details.

    tables = BlockTableView(block_size=4, colors_from=grid)
    tables.update({"A": [0, 1, 2], "C": [0, 5]}, tokens={"A": 10, "C": 6}, refcounts={0: 2})
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from . import _style as S
from ._view import SvgView


class BlockTableView(SvgView):
    """A live picture of block tables (request → physical block ids in logical order).

    Parameters
    ----------
    title:       text above the tables; ``update(..., caption=...)`` appends a per-step caption.
    block_size:  token slots per block; with ``tokens=`` in ``update`` each cell shows its fill ("3/4").
    num_blocks:  size of the pool, to reject block ids outside it (None: no check).
    colors_from: a ``BlockGrid`` whose owner colours to reuse (so a request is one colour everywhere).
    cell_px:     size of one cell in pixels.
    min_columns: draw at least this many logical-block columns (keeps the width steady while tables grow).
    """

    css_class = "minienv-blocktables"

    def __init__(
        self,
        *,
        title: str = "block tables",
        block_size: int | None = None,
        num_blocks: int | None = None,
        colors_from: Any = None,
        cell_px: int = 58,
        min_columns: int = 4,
    ) -> None:
        for name, v in (("block_size", block_size), ("num_blocks", num_blocks)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
        self.title = title
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cell_px = int(cell_px)
        self.min_columns = int(min_columns)
        self._owner_color = colors_from.owner_color if colors_from is not None else S.OwnerColors()
        self._tables: dict[Hashable, tuple[int, ...]] = {}
        self._refcounts: dict[int, int] = {}
        self._tokens: dict[Hashable, int] = {}
        self._changed: frozenset[tuple[Hashable, int]] = frozenset()
        self._caption = ""
        self.updates = 0
        widgets = S.require("ipywidgets")
        self.widget = widgets.HTML(value=self.to_svg(), _dom_classes=(self.css_class,))

    # ------------------------------------------------------------------ state
    @property
    def tables(self) -> dict[Hashable, tuple[int, ...]]:
        return dict(self._tables)

    @property
    def changed(self) -> frozenset[tuple[Hashable, int]]:
        """(request, logical index) of the cells that changed in the last update."""
        return self._changed

    @property
    def caption(self) -> str:
        return self._caption

    # ------------------------------------------------------------------ updating
    def update(
        self,
        tables: Mapping[Hashable, Sequence[int]],
        *,
        refcounts: Mapping[int, int] | Sequence[int] | None = None,
        tokens: Mapping[Hashable, int] | None = None,
        caption: str | None = None,
    ) -> frozenset[tuple[Hashable, int]]:
        """Draw new block tables in place; return the (request, logical index) cells that changed.

        refcounts: per physical block (a mapping, or a sequence indexed by block id); blocks not given show none.
        tokens:    per request, how many tokens its table holds (needs ``block_size``); shows each block's fill.
        Bad input raises ValueError and leaves the view unchanged.
        """
        if not isinstance(tables, Mapping):
            raise ValueError(f"tables must be a mapping request -> block ids, got {tables!r}")
        new: dict[Hashable, tuple[int, ...]] = {}
        for req, table in tables.items():
            if isinstance(table, (str, bytes)) or not isinstance(table, Sequence):
                raise ValueError(f"table of {req!r} must be a sequence of block ids, got {table!r}")
            ids = []
            for b in table:
                if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0:
                    raise ValueError(f"table of {req!r}: block ids are integers >= 0, got {b!r}")
                if self.num_blocks is not None and b >= self.num_blocks:
                    raise ValueError(f"table of {req!r}: unknown block id {b} (pool has {self.num_blocks})")
                ids.append(int(b))
            if len(set(ids)) != len(ids):
                raise ValueError(f"table of {req!r} holds a block twice: {ids}")
            new[req] = tuple(ids)
        rc: dict[int, int] = {}
        if refcounts is not None:
            items = refcounts.items() if isinstance(refcounts, Mapping) else enumerate(refcounts)
            for b, r in items:
                if isinstance(r, bool) or not isinstance(r, numbers.Integral):
                    raise ValueError(f"refcount of block {b} must be an integer, got {r!r}")
                if r < 0:
                    raise ValueError(f"block {b}: negative refcount {r}")
                rc[int(b)] = int(r)
        tok: dict[Hashable, int] = {}
        if tokens is not None:
            if self.block_size is None:
                raise ValueError("tokens= needs the view's block_size")
            for req, n in tokens.items():
                if req not in new:
                    raise ValueError(f"tokens given for {req!r}, which has no table")
                if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
                    raise ValueError(f"tokens of {req!r} must be an integer >= 0, got {n!r}")
                if n > len(new[req]) * self.block_size:
                    raise ValueError(
                        f"{req!r} holds {n} tokens but its {len(new[req])} blocks have room for "
                        f"{len(new[req]) * self.block_size}"
                    )
                tok[req] = int(n)
        old_cells = self._cell_keys(self._tables, self._refcounts, self._tokens)
        new_cells = self._cell_keys(new, rc, tok)
        changed = frozenset(k for k, v in new_cells.items() if old_cells.get(k) != v)
        self._tables, self._refcounts, self._tokens, self._changed = new, rc, tok, changed
        if caption is not None:
            self._caption = str(caption)
        self.updates += 1
        self._redraw()
        return changed

    def reset(self, *, caption: str = "") -> None:
        self._tables, self._refcounts, self._tokens = {}, {}, {}
        self._changed = frozenset()
        self._caption = caption
        self.updates = 0
        self._redraw()

    def _fill(self, req: Hashable, j: int, tokens: Mapping[Hashable, int]) -> int | None:
        if req not in tokens or self.block_size is None:
            return None
        return max(0, min(self.block_size, tokens[req] - j * self.block_size))

    def _cell_keys(self, tables, rc, tokens) -> dict[tuple[Hashable, int], tuple]:
        return {
            (req, j): (b, rc.get(b), self._fill(req, j, tokens))
            for req, table in tables.items()
            for j, b in enumerate(table)
        }

    # ------------------------------------------------------------------ drawing
    def cells(self) -> list[dict]:
        """What is drawn, one dict per cell: row, col, req, block, top, bottom (the two lines), color, changed."""
        return self._cells()

    def _cells(self) -> list[dict]:
        out = []
        for row, (req, table) in enumerate(self._tables.items()):
            for j, b in enumerate(table):
                r = self._refcounts.get(b)
                fill = self._fill(req, j, self._tokens)
                top = f"p{b}" + (f" ·rc{r}" if r is not None else "")
                bottom = f"{fill}/{self.block_size}" if fill is not None else f"[{j}]"
                color = S.SHARED if (r or 0) > 1 else self._owner_color(req)
                out.append(dict(row=row, col=j, req=req, block=b, top=top, bottom=bottom, color=color,
                                changed=(req, j) in self._changed, rc=r, fill=fill))
        return out

    def _columns(self) -> int:
        return max([self.min_columns] + [len(t) for t in self._tables.values()])

    def _title_text(self) -> str:
        return " — ".join(p for p in (self.title, self._caption) if p)

    def _redraw(self) -> None:
        self.widget.value = self.to_svg()

    #: outline width of a changed cell; labels are sized so that even this outline never covers them
    CHANGED_WIDTH = 3.5

    def _label(self, c: dict) -> tuple[str, str, float]:
        """A cell's two lines and one font size at which both fit inside its outline ("p10 ·rc1" in a 50 px cell
        gets a smaller font rather than running over the edge; the hover text keeps everything)."""
        room = S.inner_width(self.cell_px - 6, self.CHANGED_WIDTH)
        size = min(S.fit_text(c["top"], room)[1], S.fit_text(c["bottom"], room)[1])
        return S.fit_text(c["top"], room, size=size)[0], S.fit_text(c["bottom"], room, size=size)[0], size

    # ------------------------------------------------------------------ static rendering
    def to_svg(self) -> str:
        cell, left, top = self.cell_px, 60, 44
        rows = max(1, len(self._tables))
        cols = self._columns()
        width = max(left + cols * cell + 8, 320)
        body = [S.svg_text(8, 15, self._title_text(), size=13, anchor="start", bold=True)]
        for j in range(cols):
            body.append(S.svg_text(left + j * cell + cell / 2, top - 8, f"[{j}]", size=9, color="#777777"))
        for row, req in enumerate(self._tables):
            body.append(S.svg_text(left - 8, top + row * cell + cell / 2, req, size=12, anchor="end", bold=True))
        if not self._tables:
            body.append(S.svg_text(left, top + cell / 2, "(no requests)", size=11, anchor="start", color="#777777"))
        for c in self._cells():
            x0, y0 = left + c["col"] * cell + 3, top + c["row"] * cell + 3
            tip = f"{c['req']}: logical block {c['col']} → physical block {c['block']}" + (
                f"; refcount {c['rc']}" if c["rc"] is not None else "") + (
                f"; {c['fill']}/{self.block_size} slots used" if c["fill"] is not None else "")
            tc = S.text_color(c["color"])
            top_text, bottom_text, size = self._label(c)
            body.append(  # one group per cell, so hovering the text shows the tooltip too
                f"<g><title>{S.esc(tip)}</title>"
                + S.svg_rect(x0, y0, cell - 6, cell - 6, c["color"], stroke=S.CHANGED if c["changed"] else "#d0d0d0",
                             width=self.CHANGED_WIDTH if c["changed"] else 1)
                + S.svg_text(x0 + (cell - 6) / 2, y0 + (cell - 6) * 0.33, top_text, size=size, color=tc, bold=True)
                + S.svg_text(x0 + (cell - 6) / 2, y0 + (cell - 6) * 0.70, bottom_text, size=size, color=tc)
                + "</g>"
            )
        return S.svg_doc(width, top + rows * cell + 8, body, title=self._title_text() or "block tables")

    def __repr__(self) -> str:
        return f"BlockTableView(requests={list(self._tables)})"

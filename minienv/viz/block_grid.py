"""``BlockGrid``: one cell per physical KV block, coloured by owner, labelled with id and refcount.

The grid knows nothing of any engine class. It draws a *snapshot*: ``BlockCell`` records (block id, owner,
refcount, state, label), so the toy allocator of the tour, the block pool of notebook 04 and the whole engine of
notebook 08 all feed it the same way. Each ``update`` mutates one plotly ``FigureWidget`` in place (inside
``fig.batch_update()``), outlines the cells that changed, and can be rendered statically (SVG) for readers who
have no kernel.

    grid = BlockGrid(8, title="KV pool")
    grid.update([BlockCell(0, owner="A", refcount=1), BlockCell(3, owner=("A", "B"), refcount=2)])
    grid.changed          # frozenset({0, 3})
    grid                  # the live widget;  grid.static() -> the same picture as an SVG
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from . import _style as S
from ._view import SvgView


@dataclass(frozen=True)
class BlockCell:
    """What one physical block looks like at one moment.

    block_id: the physical block id, ``0 <= block_id < num_blocks``.
    owner:    the request id holding it (any hashable: "A", 3), a tuple of ids when several requests share it,
              or None. A cached-free block may keep its last owner (shown in the hover text only).
    refcount: how many block tables hold it (>= 0). ``used`` needs >= 1; ``free``/``cached`` need 0.
    state:    "used", "free" (free-empty) or "cached" (cached-free: refcount 0, contents and hash kept).
              None means "used" if refcount > 0 else "free".
    label:    an optional second line for the cell (e.g. "A[2]" for logical block 2 of A, or a hash prefix);
              default: the owner(s), or the state name.
    """

    block_id: int
    owner: Any = None
    refcount: int = 0
    state: str | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        bid, rc = self.block_id, self.refcount
        if isinstance(bid, bool) or not isinstance(bid, numbers.Integral) or bid < 0:
            raise ValueError(f"block_id must be an integer >= 0, got {bid!r}")
        if isinstance(rc, bool) or not isinstance(rc, numbers.Integral):
            raise ValueError(f"block {bid}: refcount must be an integer, got {rc!r}")
        if rc < 0:
            raise ValueError(f"block {bid}: negative refcount {rc}")
        owner = self.owner
        if isinstance(owner, (set, frozenset)):
            owner = tuple(sorted(owner, key=str))  # a set has no order: sort, so pictures are deterministic
        elif isinstance(owner, list):
            owner = tuple(owner)
        if isinstance(owner, tuple):
            if not owner:
                owner = None
            elif len(owner) == 1:
                owner = owner[0]
        if owner is not None and not isinstance(owner, Hashable):
            raise ValueError(f"block {bid}: owner must be hashable, got {owner!r}")
        state = self.state if self.state is not None else ("used" if rc > 0 else "free")
        if state not in S.STATES:
            raise ValueError(f"block {bid}: state must be one of {S.STATES}, got {state!r}")
        if state == "used" and rc < 1:
            raise ValueError(f"block {bid}: a used block needs refcount >= 1, got {rc}")
        if state in ("free", "cached") and rc != 0:
            raise ValueError(f"block {bid}: a {state} block has refcount 0, got {rc}")
        if state == "free" and owner is not None:
            raise ValueError(f"block {bid}: a free block has no owner, got {owner!r}")
        object.__setattr__(self, "block_id", int(bid))
        object.__setattr__(self, "refcount", int(rc))
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "state", state)
        if self.label is not None:
            object.__setattr__(self, "label", str(self.label))

    @property
    def owners(self) -> tuple:
        """The owner(s) as a tuple (empty when there is none)."""
        if self.owner is None:
            return ()
        return self.owner if isinstance(self.owner, tuple) else (self.owner,)

    @property
    def shared(self) -> bool:
        return self.state == "used" and (len(self.owners) > 1 or self.refcount > 1)

    def text(self) -> tuple[str, str]:
        """The cell's two label lines: "7 ·rc2" and the label / owner(s) / state."""
        top = f"{self.block_id} ·rc{self.refcount}" if self.state == "used" else f"{self.block_id}"
        if self.label is not None:
            bottom = self.label
        elif self.state == "used" and self.owners:
            bottom = "+".join(str(o) for o in self.owners)
        else:
            bottom = self.state
        return top, bottom


def block_cells(
    refcounts: Sequence[int],
    owners: Sequence[Any] | None = None,
    states: Sequence[str | None] | None = None,
    labels: Sequence[str | None] | None = None,
) -> list[BlockCell]:
    """Build a full snapshot from parallel per-block arrays (index = block id). Lengths must agree."""
    n = len(refcounts)
    for name, arr in (("owners", owners), ("states", states), ("labels", labels)):
        if arr is not None and len(arr) != n:
            raise ValueError(f"mismatched lengths: {len(refcounts)} refcounts but {len(arr)} {name}")
    return [
        BlockCell(
            i,
            owner=None if owners is None else owners[i],
            refcount=int(refcounts[i]),
            state=None if states is None else states[i],
            label=None if labels is None else labels[i],
        )
        for i in range(n)
    ]


def _as_cell(block_id: int, value: Any) -> BlockCell:
    if value is None:
        return BlockCell(block_id)
    if isinstance(value, BlockCell):
        if value.block_id != block_id:
            raise ValueError(f"key {block_id} holds a BlockCell for block {value.block_id}")
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(BlockCell)}
        extra = set(value) - known
        if extra:
            raise ValueError(f"block {block_id}: unknown BlockCell fields {sorted(extra)}")
        data = dict(value)
        if data.pop("block_id", block_id) != block_id:
            raise ValueError(f"key {block_id} holds fields for block {value['block_id']}")
        return BlockCell(block_id, **data)
    raise ValueError(f"block {block_id}: expected a BlockCell, a mapping of its fields or None, got {value!r}")


class BlockGrid(SvgView):
    """A live grid of ``num_blocks`` physical blocks (plotly ``FigureWidget``, updated in place).

    Parameters
    ----------
    num_blocks: size of the pool drawn.
    columns:    cells per row (default: up to 16).
    title:      text above the grid; ``update(..., caption=...)`` appends a per-step caption.
    cell_px:    size of one cell in pixels.
    owner_colors: fixed colours for some owners (``{"A": "#4e79a7"}``); others get the palette, first seen first.
    """

    css_class = "minienv-blockgrid"

    def __init__(
        self,
        num_blocks: int,
        *,
        columns: int | None = None,
        title: str = "",
        cell_px: int = 58,
        owner_colors: Mapping[Hashable, str] | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        columns = min(16, int(num_blocks)) if columns is None else columns
        if isinstance(columns, bool) or not isinstance(columns, numbers.Integral) or columns < 1:
            raise ValueError(f"columns must be an integer >= 1, got {columns!r}")
        self.num_blocks = int(num_blocks)
        self.columns = int(columns)
        self.rows = math.ceil(self.num_blocks / self.columns)
        self.title = title
        self.cell_px = int(cell_px)
        self._colors = S.OwnerColors(dict(owner_colors or {}))
        self._cells: tuple[BlockCell, ...] = tuple(BlockCell(i) for i in range(self.num_blocks))
        self._changed: frozenset[int] = frozenset()
        self._caption = ""
        self.updates = 0  # how many updates were drawn (reset() sets it back to 0)
        self.fig = self._make_figure()

    # ------------------------------------------------------------------ state
    @property
    def cells(self) -> tuple[BlockCell, ...]:
        """The current snapshot, index = block id."""
        return self._cells

    @property
    def changed(self) -> frozenset[int]:
        """Block ids whose cell changed in the last update (outlined in the picture)."""
        return self._changed

    @property
    def caption(self) -> str:
        return self._caption

    @property
    def widget(self):
        """The live widget (the ``FigureWidget``); put it in a VBox/HBox or just display the grid."""
        return self.fig

    def color_of(self, cell: BlockCell) -> str:
        """The fill colour of a cell (owner colour, shared, free or cached)."""
        if cell.state == "free":
            return S.FREE
        if cell.state == "cached":
            return S.CACHED
        owners = cell.owners
        if len(owners) > 1:
            return S.SHARED
        if not owners:
            return S.UNOWNED
        return self._colors(owners[0])

    def owner_color(self, owner: Hashable) -> str:
        """The colour of one owner (assigned now if the owner is new)."""
        return self._colors(owner)

    # ------------------------------------------------------------------ updating
    def normalize(self, cells: Any, *, partial: bool = False) -> tuple[BlockCell, ...]:
        """Validate a snapshot and return the full tuple of cells it describes (raises ValueError)."""
        new: dict[int, BlockCell] = {}
        if isinstance(cells, Mapping):
            for key, value in cells.items():
                if isinstance(key, bool) or not isinstance(key, numbers.Integral):
                    raise ValueError(f"block ids must be integers, got key {key!r}")
                if not 0 <= key < self.num_blocks:
                    raise ValueError(f"unknown block id {key} (the pool has blocks 0..{self.num_blocks - 1})")
                new[int(key)] = _as_cell(int(key), value)
        elif isinstance(cells, Iterable) and not isinstance(cells, (str, bytes)):
            for cell in cells:
                if not isinstance(cell, BlockCell):
                    raise ValueError(f"expected BlockCell records, got {cell!r}")
                if not 0 <= cell.block_id < self.num_blocks:
                    raise ValueError(
                        f"unknown block id {cell.block_id} (the pool has blocks 0..{self.num_blocks - 1})"
                    )
                if cell.block_id in new:
                    raise ValueError(f"block {cell.block_id} appears twice in one snapshot")
                new[cell.block_id] = cell
        else:
            raise ValueError(f"expected a sequence of BlockCell or a mapping block_id -> cell, got {cells!r}")
        base = self._cells if partial else tuple(BlockCell(i) for i in range(self.num_blocks))
        return tuple(new.get(i, base[i]) for i in range(self.num_blocks))

    def update(self, cells: Any, *, caption: str | None = None, partial: bool = False) -> frozenset[int]:
        """Draw a new snapshot in place; return the ids of the blocks that changed.

        ``cells`` is a sequence of ``BlockCell`` or a mapping ``block_id -> BlockCell | dict of fields | None``.
        Blocks not mentioned are free (``partial=False``) or keep their current cell (``partial=True``).
        Bad input raises ValueError and leaves the view exactly as it was.
        """
        full = self.normalize(cells, partial=partial)
        changed = frozenset(i for i, (a, b) in enumerate(zip(self._cells, full)) if a != b)
        self._cells, self._changed = full, changed
        if caption is not None:
            self._caption = str(caption)
        self.updates += 1
        self._redraw()
        return changed

    def update_arrays(
        self,
        refcounts: Sequence[int],
        owners: Sequence[Any] | None = None,
        states: Sequence[str | None] | None = None,
        labels: Sequence[str | None] | None = None,
        *,
        caption: str | None = None,
    ) -> frozenset[int]:
        """``update`` from parallel per-block arrays of length ``num_blocks`` (see ``block_cells``)."""
        if len(refcounts) != self.num_blocks:
            raise ValueError(f"mismatched lengths: the grid has {self.num_blocks} blocks, got {len(refcounts)} refcounts")
        return self.update(block_cells(refcounts, owners, states, labels), caption=caption)

    def reset(self, *, caption: str = "") -> None:
        """Every block free, nothing highlighted (owner colours are kept so a replay looks the same)."""
        self._cells = tuple(BlockCell(i) for i in range(self.num_blocks))
        self._changed = frozenset()
        self._caption = caption
        self.updates = 0
        self._redraw()

    def resize(self, num_blocks: int, *, columns: int | None = None, caption: str = "") -> None:
        """Change the pool size (e.g. a budget slider) in place: same widget, all blocks free again."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        columns = self.columns if columns is None else columns
        if isinstance(columns, bool) or not isinstance(columns, numbers.Integral) or columns < 1:
            raise ValueError(f"columns must be an integer >= 1, got {columns!r}")
        self.num_blocks, self.columns = int(num_blocks), int(columns)
        self.rows = math.ceil(self.num_blocks / self.columns)
        self._cells = tuple(BlockCell(i) for i in range(self.num_blocks))
        self._changed = frozenset()
        self._caption = caption
        self.updates = 0
        xs, ys = self._xy()
        with self.fig.batch_update():
            self.fig.data[0].x, self.fig.data[0].y = xs, ys
            self.fig.layout.update(self._geometry())
            self._redraw()

    # ------------------------------------------------------------------ drawing
    def _geometry(self) -> dict:
        cell, margin = self.cell_px, dict(l=8, r=8, t=36, b=40)
        width = max(self.columns * cell + margin["l"] + margin["r"], 320)
        x_units = (width - margin["l"] - margin["r"]) / cell  # keep cells square when the figure is wider
        return dict(
            width=width,
            height=self.rows * cell + margin["t"] + margin["b"],
            margin=margin,
            xaxis=dict(range=[-0.5, -0.5 + x_units], visible=False, fixedrange=True),
            yaxis=dict(range=[self.rows - 0.5, -0.5], visible=False, fixedrange=True),
        )

    def _xy(self) -> tuple[list[int], list[int]]:
        ids = range(self.num_blocks)
        return [i % self.columns for i in ids], [i // self.columns for i in ids]

    def _title_text(self) -> str:
        parts = [p for p in (self.title, self._caption) if p]
        return " — ".join(parts)

    def _legend_items(self) -> list[tuple[str, str]]:
        present: list[Hashable] = []
        shared = False
        states = {c.state for c in self._cells}
        for c in self._cells:
            if c.state != "used":
                continue
            if len(c.owners) > 1:
                shared = True
            elif c.owners and c.owners[0] not in present:
                present.append(c.owners[0])
        items = [(self._colors(o), str(o)) for o in present]
        if shared:
            items.append((S.SHARED, "shared"))
        if any(c.state == "used" and not c.owners for c in self._cells):
            items.append((S.UNOWNED, "in use"))
        items.append((S.FREE, "free"))
        if "cached" in states:
            items.append((S.CACHED, "cached-free"))
        return items

    def _legend_html(self) -> str:
        keys = "   ".join(
            f"<span style='color:{c if c != S.FREE else '#d6d6d6'};font-size:16px'>■</span> {S.esc(t)}"
            for c, t in self._legend_items()
        )
        return keys + "   <span style='font-size:16px'>□</span> changed last step"

    #: outline width of a changed cell; labels are sized so that even this outline never covers them
    CHANGED_WIDTH = 4

    def cell_label(self, cell: BlockCell) -> tuple[str, str, float]:
        """The two lines drawn in a cell and their font size: the font shrinks (then the text is shortened with
        "…") until both lines fit inside the cell's thickest outline, so a "changed" outline never covers a
        character (the hover text keeps the label whole)."""
        room = S.inner_width(self.cell_px - 6, self.CHANGED_WIDTH)
        top, bottom = cell.text()
        (top, s1), (bottom, s2) = S.fit_text(top, room), S.fit_text(bottom, room)
        size = min(s1, s2)
        return S.fit_text(top, room, size=size)[0], S.fit_text(bottom, room, size=size)[0], size

    def cell_text(self, cell: BlockCell) -> tuple[str, str]:
        """The two lines drawn in a cell, shortened to fit (see ``cell_label``)."""
        return self.cell_label(cell)[:2]

    def _style_arrays(self) -> dict[str, list]:
        fills, texts, text_colors, hovers, line_colors, line_widths, sizes = [], [], [], [], [], [], []
        for c in self._cells:
            fill = self.color_of(c)
            top, bottom, size = self.cell_label(c)
            sizes.append(size)
            fills.append(fill)
            texts.append(f"<b>{S.esc(top)}</b><br>{S.esc(bottom)}")
            text_colors.append(S.text_color(fill))
            who = "+".join(map(str, c.owners)) if c.owners else "-"
            hovers.append(
                f"block {c.block_id}<br>state: {c.state}<br>owner: {S.esc(who)}<br>refcount: {c.refcount}"
                + (f"<br>{S.esc(c.label)}" if c.label else "")
            )
            changed = c.block_id in self._changed
            line_colors.append(S.CHANGED if changed else S.EDGE)
            line_widths.append(self.CHANGED_WIDTH if changed else 1)
        return dict(
            fills=fills, texts=texts, text_colors=text_colors, hovers=hovers, line_colors=line_colors,
            line_widths=line_widths, sizes=sizes,
        )

    def _make_figure(self):
        go = S.require("plotly.graph_objects")
        S.require("anywidget")
        xs, ys = self._xy()
        st = self._style_arrays()
        fig = go.FigureWidget(
            data=[
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="markers+text",
                    marker=dict(
                        symbol="square",
                        size=self.cell_px - 6,
                        color=st["fills"],
                        line=dict(color=st["line_colors"], width=st["line_widths"]),
                    ),
                    text=st["texts"],
                    textposition="middle center",
                    textfont=dict(family=S.FONT, size=st["sizes"], color=st["text_colors"]),
                    hovertext=st["hovers"],
                    hoverinfo="text",
                    showlegend=False,
                    name="blocks",
                )
            ],
            layout=go.Layout(
                title=dict(text=self._title_text(), x=0.01, xanchor="left", font=dict(size=13)),
                plot_bgcolor="#ffffff",
                paper_bgcolor="#ffffff",
                annotations=[
                    dict(
                        text=self._legend_html(), xref="paper", yref="paper", x=0, y=0, xanchor="left",
                        yanchor="top", yshift=-6, showarrow=False, font=dict(size=11),
                    )
                ],
                **self._geometry(),
            ),
        )
        S.quiet_config(fig)
        fig.add_class(self.css_class)  # before any display: the page can tell which view this figure is
        return fig

    def _redraw(self) -> None:
        st = self._style_arrays()
        fig = self.fig
        with fig.batch_update():
            trace = fig.data[0]
            trace.marker.color = st["fills"]
            trace.marker.line.color = st["line_colors"]
            trace.marker.line.width = st["line_widths"]
            trace.text = st["texts"]
            trace.textfont.color = st["text_colors"]
            trace.textfont.size = st["sizes"]
            trace.hovertext = st["hovers"]
            fig.layout.title.text = self._title_text()
            fig.layout.annotations[0].text = self._legend_html()

    # ------------------------------------------------------------------ static rendering
    def to_svg(self) -> str:
        """The current state as a standalone SVG string (what ``static()`` shows)."""
        cell, pad, top, bottom = self.cell_px, 8, 30, 34
        width = max(self.columns * cell + 2 * pad, 320)
        height = top + self.rows * cell + bottom
        body = [S.svg_text(pad, 15, self._title_text(), size=13, anchor="start", bold=True)]
        xs, ys = self._xy()
        for c, x, y in zip(self._cells, xs, ys):
            fill = self.color_of(c)
            changed = c.block_id in self._changed
            x0, y0 = pad + x * cell + 3, top + y * cell + 3
            body.append(
                S.svg_rect(x0, y0, cell - 6, cell - 6, fill, stroke=S.CHANGED if changed else "#d0d0d0",
                           width=self.CHANGED_WIDTH if changed else 1)
            )
            line1, line2, size = self.cell_label(c)
            color = S.text_color(fill)
            body.append(S.svg_text(x0 + (cell - 6) / 2, y0 + (cell - 6) * 0.33, line1, size=size, color=color,
                                   bold=True))
            body.append(S.svg_text(x0 + (cell - 6) / 2, y0 + (cell - 6) * 0.70, line2, size=size, color=color))
        lx, ly = pad, top + self.rows * cell + 16
        for color, text in self._legend_items() + [("#ffffff", "changed last step")]:
            stroke = S.CHANGED if text == "changed last step" else "#d0d0d0"
            body.append(S.svg_rect(lx, ly - 6, 12, 12, color, stroke=stroke, width=2 if color == "#ffffff" else 1, rx=2))
            body.append(S.svg_text(lx + 16, ly, text, size=11, anchor="start"))
            lx += 16 + 7 * len(text) + 14
        width = max(width, lx + pad)
        return S.svg_doc(width, height, body, title=self._title_text() or "block grid")

    def figure(self):
        """A plain (non-widget) ``go.Figure`` copy of the current state."""
        go = S.require("plotly.graph_objects")
        return go.Figure(self.fig)

    # ------------------------------------------------------------------ display
    def __repr__(self) -> str:
        used = sum(c.state == "used" for c in self._cells)
        return (
            f"BlockGrid(num_blocks={self.num_blocks}, used={used}, changed={sorted(self._changed)}, "
            f"fig=FigureWidget(...))"
        )

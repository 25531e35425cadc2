"""Views of a :class:`~minienv.kv.kv_cache_manager.KVCacheManager`: its blocks, its free queue, its hash chains.

The generic views (:class:`~minienv.viz.BlockGrid`, :class:`~minienv.viz.QueueView`) take plain records; this
module turns a manager's state into those records, so notebooks 05–08 draw a manager the same way:

    view = ManagerView(mgr, title="KV pool")       # a BlockGrid + the free queue (LRU order, head marked)
    a = KVRequest("A", prompt); mgr.allocate(a); a.num_computed_tokens = a.num_tokens; mgr.commit(a)
    view.update(caption="A arrives")                # redraw in place; evictions since the last update highlighted
    view.last_evicted                                # block ids evicted since the previous update
    view                                             # the live widget; view.static() for readers without a kernel

* :func:`manager_cells` — one :class:`BlockCell` per block: owners (every request whose table holds it), refcount,
  state (``used`` / ``cached`` = cached-free / ``free`` = free-empty), a label.
* :func:`free_queue_items` — the free queue head first, with kinds (cached / free) and hash labels.
* :class:`ManagerView` — both, live, listening to the manager's events so each eviction is shown as it happens.
* :func:`hash_chain_svg` — the block-hash chains of several prompts as a tree: a shared block is drawn once,
  spanning the prompts that share it; the column where chains split is where prompts diverge.

Only reads the manager (public methods); never changes it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from minienv.kv.hashing import ROOT_HASH, hash_block_tokens

from . import _style as S
from ._view import View
from .block_grid import BlockCell, BlockGrid
from .queue_view import QueueView


def short_hash(block_hash: bytes | None, n: int = 4) -> str:
    """The first ``n`` hex digits of a block hash, prefixed with ``#`` (``""`` for None)."""
    return "" if block_hash is None else "#" + block_hash.hex()[:n]


def block_owners(mgr) -> dict[int, list[tuple[Hashable, int]]]:
    """``block id -> [(request id, logical block index), ...]`` for every block some table holds."""
    owners: dict[int, list[tuple[Hashable, int]]] = {}
    for rid in mgr.request_ids():
        for j, bid in enumerate(mgr.block_ids(rid)):
            owners.setdefault(bid, []).append((rid, j))
    return owners


def manager_cells(mgr, *, labels: str = "owners") -> list[BlockCell]:
    """The manager's blocks as :class:`BlockCell` records (index = block id).

    ``labels``: ``"owners"`` — used blocks show their holders ("A+B", or "A[2]" for one holder's logical block 2;
    more than three holders collapse to "×N"); ``"hash"`` — every hashed block shows its hash prefix. Cached-free
    blocks always show their hash prefix (that is what keeps them findable).
    """
    if labels not in ("owners", "hash"):
        raise ValueError(f"labels must be 'owners' or 'hash', got {labels!r}")
    owners = block_owners(mgr)
    cells = []
    for block in mgr.pool.blocks:
        bid, rc, h = block.block_id, block.ref_cnt, block.block_hash
        if rc > 0:
            holders = owners.get(bid, [])
            ids = tuple(r for r, _ in holders)
            if labels == "hash" and h is not None:
                label = short_hash(h)
            elif len(holders) == 1:
                label = f"{holders[0][0]}[{holders[0][1]}]"
            elif len(holders) > 3:
                label = f"×{len(holders)}"
            else:
                label = "+".join(str(r) for r in ids)
            cells.append(BlockCell(bid, owner=ids, refcount=rc, state="used", label=label))
        elif h is not None:
            cells.append(BlockCell(bid, refcount=0, state="cached", label=short_hash(h)))
        else:
            cells.append(BlockCell(bid, refcount=0, state="free"))
    return cells


def free_queue_items(mgr) -> tuple[list[int], dict[int, str], dict[int, str]]:
    """The free queue head first: ``(block ids, kinds, labels)`` for :meth:`QueueView.update`.

    Cached-free blocks are kind ``"cached"`` labelled with their hash prefix; free-empty blocks are ``"free"``.
    """
    items, kinds, labels = [], {}, {}
    for bid, cached in mgr.free_queue():
        items.append(bid)
        kinds[bid] = "cached" if cached else "free"
        if cached:
            labels[bid] = short_hash(mgr.pool.blocks[bid].block_hash)
    return items, kinds, labels


class ManagerView(View):
    """A live :class:`BlockGrid` of a manager's pool and a :class:`QueueView` of its free queue (LRU order).

    The view registers a listener on the manager and keeps the events (``evict``, ``cow``, ``hit``, ``cache``,
    ``free``) that happen between two :meth:`update` calls: evicted blocks are drawn leaving the queue (red,
    dashed) and listed in :attr:`last_evicted`; copy-on-write copies in :attr:`last_copies`. :meth:`attach`
    switches to another manager (e.g. on a stepper's reset). The grid gets the whole caption; the queue, whose
    title line is shorter, the part before the first ":" (e.g. "step 3").
    """

    def __init__(self, mgr, *, title: str = "KV pool", columns: int | None = None, cell_px: int = 54,
                 labels: str = "owners", queue: bool = True, queue_title: str = "free queue (LRU order)",
                 max_queue_items: int = 64, owner_colors: Mapping[Hashable, str] | None = None) -> None:
        import ipywidgets as w

        self.labels = labels
        self.grid = BlockGrid(mgr.num_blocks, columns=columns, title=title, cell_px=cell_px, owner_colors=owner_colors)
        self.queue = (QueueView(title=queue_title, head_label="head → evicted / allocated next",
                                tail_label="tail (most recently freed)", max_items=max_queue_items)
                      if queue else None)
        self.widget = w.VBox([self.grid.widget] + ([self.queue.widget] if self.queue is not None else []))
        self.mgr = None
        self._events: list = []
        self.last_events: tuple = ()
        self.evicted_total: list[int] = []
        self.attach(mgr)

    # ------------------------------------------------------------------ wiring
    def _listen(self, event) -> None:
        self._events.append(event)

    def attach(self, mgr, *, caption: str = "") -> None:
        """Show ``mgr`` from now on (same pool size); nothing highlighted."""
        if mgr.num_blocks != self.grid.num_blocks:
            raise ValueError(f"the view draws {self.grid.num_blocks} blocks, the manager has {mgr.num_blocks}")
        if self.mgr is not None:
            self.mgr.remove_listener(self._listen)
        self.mgr = mgr
        mgr.add_listener(self._listen)
        self._events = []
        self.last_events = ()
        self.evicted_total = []
        self.grid.reset(caption=caption)
        self.grid.update(manager_cells(mgr, labels=self.labels), caption=caption)
        if self.queue is not None:
            items, kinds, labels = free_queue_items(mgr)
            self.queue.reset(items, kinds=kinds, labels=labels, caption=caption)

    # ------------------------------------------------------------------ drawing
    @property
    def last_evicted(self) -> tuple[int, ...]:
        """Blocks whose cached contents were evicted between the previous update and the last one."""
        return tuple(e.block_id for e in self.last_events if e.kind == "evict")

    @property
    def last_copies(self) -> tuple[tuple[int, int], ...]:
        """Copy-on-write copies ``(source block, new block)`` between the previous update and the last one."""
        return tuple((e.src_block_id, e.block_id) for e in self.last_events if e.kind == "cow")

    def update(self, caption: str | None = None) -> frozenset[int]:
        """Redraw from the manager's current state; return the block ids whose cell changed."""
        self.last_events = tuple(self._events)
        self._events = []
        self.evicted_total.extend(self.last_evicted)
        changed = self.grid.update(manager_cells(self.mgr, labels=self.labels), caption=caption)
        if self.queue is not None:
            items, kinds, labels = free_queue_items(self.mgr)
            before = set(self.queue.items)
            now = set(items)
            evicted = [b for b in dict.fromkeys(self.last_evicted) if b in before and b not in now]
            short = caption.split(":")[0] if caption else caption  # the queue's title line has less room
            self.queue.update(items, kinds=kinds, labels=labels, evicted=evicted, caption=short)
        return changed

    def to_html(self) -> str:
        parts = [self.grid.to_html()] + ([self.queue.to_html()] if self.queue is not None else [])
        return "<div>" + "".join(f"<div>{p}</div>" for p in parts) + "</div>"

    def parts(self) -> list[View]:
        return [self, *self.grid.parts(), *(self.queue.parts() if self.queue is not None else [])]

    def __repr__(self) -> str:
        queue = f", queue={self.queue!r}" if self.queue is not None else ""
        return f"ManagerView({self.mgr!r}, grid={self.grid!r}{queue})"


# ====================================================================== the hash chain, drawn
def chain_hashes(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"") -> list[bytes]:
    """The chain hash of every full block of ``token_ids`` (same function the manager uses)."""
    out, parent = [], ROOT_HASH
    for j in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, [int(t) for t in token_ids[j * block_size:(j + 1) * block_size]],
                                   extra_key)
        out.append(parent)
    return out


def hash_chain_svg(prompts: Mapping[Hashable, Sequence[int]], block_size: int, *, extra_key: bytes = b"",
                   title: str = "block-hash chains", cell_w: int = 74, row_h: int = 34,
                   show_tokens: Any = None) -> str:
    """An SVG of the prompts' block-hash chains, one row per prompt, one column per logical block.

    A block whose hash several prompts share is drawn **once**, spanning their rows (dark fill, "×n" = how many
    prompts share it); an arrow runs from each block to the next, because each hash is computed *from its parent's
    hash*. The column where a group splits is where the prompts diverge: from there on the split groups never
    share a hash again, even if later tokens happen to agree. A trailing partial block (no hash: only full blocks are hashed) is dashed.
    ``show_tokens`` (a function ``ids -> str``) adds each row's text at the right.
    """
    if not prompts:
        raise ValueError("hash_chain_svg needs at least one prompt")
    names = list(prompts)
    chains = {n: chain_hashes(prompts[n], block_size, extra_key) for n in names}
    names.sort(key=lambda n: tuple(chains[n]))  # prompts sharing a prefix become adjacent rows
    partial = {n: len(prompts[n]) % block_size for n in names}
    ncols = max(len(chains[n]) + (1 if partial[n] else 0) for n in names)
    left, top = 70, 34
    width = left + ncols * cell_w + (260 if show_tokens else 20)
    height = top + len(names) * row_h + 12
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="{S.FONT}" font-size="11">',
           f'<text x="4" y="16" font-size="13" font-weight="bold">{S.esc(title)}</text>']
    for j in range(ncols):
        out.append(f'<text x="{left + j * cell_w + cell_w / 2 - 8}" y="{top - 4}" fill="#666">b{j}</text>')
    for r, n in enumerate(names):
        out.append(f'<text x="4" y="{top + r * row_h + row_h / 2 + 4}">{S.esc(str(n))}</text>')
        if show_tokens:
            x = left + ncols * cell_w + 8
            out.append(f'<text x="{x}" y="{top + r * row_h + row_h / 2 + 4}" fill="#444">'
                       f'{S.esc(str(show_tokens(prompts[n]))[:38])}</text>')
    boxes = {}  # (row, col) -> (x, y0, y1) of the box drawn there (for arrows)
    for j in range(ncols):
        r = 0
        while r < len(names):
            n = names[r]
            if j < len(chains[n]):
                h = chains[n][j]
                r2 = r
                while r2 + 1 < len(names) and j < len(chains[names[r2 + 1]]) and chains[names[r2 + 1]][j] == h:
                    r2 += 1
                shared = r2 > r
                x, y0, y1 = left + j * cell_w + 4, top + r * row_h + 3, top + (r2 + 1) * row_h - 3
                fill, ink = (S.SHARED, "#ffffff") if shared else (S.CACHED, "#111111")
                out.append(f'<rect x="{x}" y="{y0}" width="{cell_w - 16}" height="{y1 - y0}" rx="4" fill="{fill}" '
                           f'stroke="#555"/>')
                ym = (y0 + y1) / 2
                if shared:  # a shared box spans >= 2 rows: hash on one line, "×n" (how many share it) below
                    out.append(f'<text x="{x + 4}" y="{ym - 2}" fill="{ink}">{short_hash(h, 4)}</text>'
                               f'<text x="{x + 4}" y="{ym + 12}" fill="{ink}">×{r2 - r + 1}</text>')
                else:
                    out.append(f'<text x="{x + 4}" y="{ym + 4}" fill="{ink}">{short_hash(h, 4)}</text>')
                for rr in range(r, r2 + 1):
                    boxes[(rr, j)] = (x, y0, y1)
                r = r2 + 1
            elif j == len(chains[n]) and partial[n]:
                x, y0 = left + j * cell_w + 4, top + r * row_h + 3
                out.append(f'<rect x="{x}" y="{y0}" width="{cell_w - 16}" height="{row_h - 6}" rx="4" fill="#ffffff" '
                           f'stroke="#999" stroke-dasharray="4 3"/>')
                out.append(f'<text x="{x + 4}" y="{y0 + row_h / 2 + 1}" fill="#777">{partial[n]}/{block_size}</text>')
                boxes[(r, j)] = (x, y0, y0 + row_h - 6)
                r += 1
            else:
                r += 1
    drawn = set()
    for (r, j), (x, y0, y1) in boxes.items():
        nxt = boxes.get((r, j + 1))
        prev = boxes[(r, j)]
        if nxt is None:
            continue
        key = (prev, nxt)
        if key in drawn:
            continue
        drawn.add(key)
        ya = (max(y0, nxt[1]) + min(y1, nxt[2])) / 2  # the middle of the rows both boxes span
        x1, x2 = x + cell_w - 16, nxt[0]
        out.append(f'<line x1="{x1}" y1="{ya}" x2="{x2 - 3}" y2="{ya}" stroke="#555" stroke-width="1.2"/>'
                   f'<polygon points="{x2 - 3},{ya - 3} {x2},{ya} {x2 - 3},{ya + 3}" fill="#555"/>')
    out.append("</svg>")
    return "".join(out)


def hash_chain_view(prompts: Mapping[Hashable, Sequence[int]], block_size: int, **kwargs):
    """:func:`hash_chain_svg` as an IPython ``HTML`` object (displays in a notebook and on GitHub)."""
    from IPython.display import HTML

    return HTML(hash_chain_svg(prompts, block_size, **kwargs))

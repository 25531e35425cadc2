"""Notebook 00's live views, checked as views: colours, labels, the widget showing its static picture.

The notebook keeps the asserts that are its lesson (the allocator's state, and the views agreeing with it); the
checks below are about how minienv.viz draws that state, so they live here. The demo is notebook 00's: the same
ten-line allocator (``minienv.exercises.tour.ToyPool``), the same actions, the same snapshot of the pool.
"""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")

from minienv.exercises.tour import ACTIONS, ToyPool, apply  # noqa: E402
from minienv.viz import BlockCell, BlockGrid, BlockTableView, QueueView, Stepper  # noqa: E402


def _snapshot(pool: ToyPool) -> list[BlockCell]:
    cells = []
    for block in range(pool.num_blocks):
        holders = tuple(r for r, table in pool.tables.items() if block in table)
        if holders:
            label = "+".join(f"{r}[{pool.tables[r].index(block)}]" for r in holders)
            cells.append(BlockCell(block, owner=holders, refcount=pool.refcount[block], label=label))
    return cells


@pytest.fixture
def demo():
    grid = BlockGrid(8, columns=8, cell_px=66, title="KV pool (8 blocks)")
    tables = BlockTableView(title="block tables", num_blocks=8, colors_from=grid, cell_px=66)
    queue = QueueView(title="free queue", head_label="head → allocated next")
    state = {}

    def on_reset():
        state["pool"] = ToyPool(8)
        grid.reset(caption="empty")
        tables.reset()
        queue.reset(list(state["pool"].free))

    def on_step(i):
        pool = state["pool"]
        apply(pool, ACTIONS[i])
        kind, req = ACTIONS[i][:2]
        caption = f"step {i + 1}: {req} finishes" if kind == "finish" else f"step {i + 1}"
        grid.update(_snapshot(pool), caption=caption)
        tables.update(pool.tables, refcounts={b: rc for b, rc in enumerate(pool.refcount) if rc},
                      caption=f"step {i + 1}")
        queue.update(list(pool.free), caption=f"step {i + 1}")

    stepper = Stepper(on_step, on_reset, n_steps=len(ACTIONS), interval_ms=900)
    stepper.reset()
    return stepper, grid, tables, queue


def test_step_4_is_drawn_as_the_allocator_holds_it(demo):
    stepper, grid, tables, queue = demo
    stepper.go_to(4)  # arrive A, arrive B, C shares A's block, C grows
    assert stepper.position == 4 and stepper.history == [0, 1, 2, 3]
    assert grid.cells[0].owners == ("A", "C") and grid.cells[0].text() == ("0 ·rc2", "A[0]+C[0]")
    trace = grid.fig.data[0]
    assert trace.marker.color[0] != trace.marker.color[1]  # a shared block: its own colour
    assert trace.marker.color[1] == trace.marker.color[2] == grid.owner_color("A")
    assert "0 ·rc2" in trace.text[0]
    assert tables.cells()[0]["top"] == "p0 ·rc2"  # A[0] is physical block 0, shared by two tables
    assert tables.widget.value == tables.to_svg()  # the live widget shows exactly the static picture
    assert "0 ·rc2" in grid.to_svg() and "A[0]+C[0]" in grid.to_svg()
    assert "p0 ·rc2" in tables.to_svg() and ">C<" in tables.to_svg()
    assert "head → allocated next" in queue.to_svg()


def test_the_last_step_is_drawn_with_every_block_free(demo):
    stepper, grid, _, queue = demo
    stepper.run()
    assert "step 9: C finishes" in grid.to_svg()
    assert all(f">{b}<" in grid.to_svg() for b in range(8))
    assert queue.items == (3, 6, 2, 1, 4, 7, 5, 0)

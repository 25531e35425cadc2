"""Notebook 04's block-pool stepper, drawn: what its grid and queue show at step 4 and step 8.

These asserts used to sit in the notebook's proof cells; they test the views, not the lesson (the notebook keeps
the claims about the pool: which blocks each request holds, the free queue's order). The scenario is the
notebook's: a 12-block pool of 4-slot blocks, requests A, B, C prefilled then decoding to fixed lengths.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

from minienv.kv import BlockPool, BlockTable  # noqa: E402
from minienv.viz import BlockCell, BlockGrid, QueueView  # noqa: E402

B, BLOCKS = 4, 12
PROMPTS = {"A": 5, "B": 2, "C": 7}
FINAL = {"A": 17, "B": 14, "C": 10}


def run_demo(steps: int):
    pool, tables = BlockPool(BLOCKS), {}
    grid = BlockGrid(BLOCKS, columns=BLOCKS, title="KV pool")
    queue = QueueView(title="free queue", head_label="head → allocated next")
    queue.reset(pool.free_block_ids())
    for i in range(steps):
        if i == 0:
            for req, n in PROMPTS.items():
                tables[req] = BlockTable(B)
                tables[req].append_tokens(n, pool)
        else:
            for req in list(tables):
                tables[req].append_tokens(1, pool)
                if tables[req].num_tokens == FINAL[req]:
                    tables.pop(req).free(pool)
        cells = [BlockCell(blk, owner=req, refcount=pool.ref_cnt(blk),
                           label=f"{req}[{j}] {min(B, t.num_tokens - j * B)}/{B}")
                 for req, t in tables.items() for j, blk in enumerate(t.block_ids)]
        grid.update(cells, caption=f"step {i + 1}")
        queue.update(pool.free_block_ids(), caption=f"step {i + 1}")
    return pool, tables, grid, queue


def test_step_4_outlines_exactly_what_changed_and_labels_the_fill():
    pool, tables, grid, queue = run_demo(4)
    assert {r: t.block_ids for r, t in tables.items()} == {"A": [0, 1], "B": [2, 6]}
    assert grid.cells[6].text() == ("6 ·rc1", "B[1] 1/4") and grid.cells[3].state == "free"
    assert grid.changed == {1, 3, 4, 5, 6}  # A[1] filled up, C's three blocks freed, B's new block
    assert queue.items == (7, 8, 9, 10, 11, 5, 4, 3) and queue.added == (5, 4, 3)  # C's blocks, tail first


def test_step_8_static_pictures_show_the_tables_and_the_head():
    pool, tables, grid, queue = run_demo(8)
    svg = grid.to_svg()
    for j, blk in enumerate(tables["A"].block_ids):
        assert f"A[{j}]" in svg and grid.cells[blk].owners == ("A",)
    assert "head → allocated next" in queue.to_svg() and len(queue.items) == pool.num_free_blocks

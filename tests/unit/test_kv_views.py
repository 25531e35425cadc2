"""minienv.viz.kv_views: a KVCacheManager drawn as a block grid + free queue, and block-hash chains as SVG."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

from kv_driver import admit, append, child, compute  # noqa: E402
from minienv.kv.kv_cache_manager import KVCacheManager  # noqa: E402
from minienv.viz.kv_views import (  # noqa: E402
    ManagerView,
    block_owners,
    chain_hashes,
    free_queue_items,
    hash_chain_svg,
    manager_cells,
    short_hash,
)

B = 4


def shared_manager() -> KVCacheManager:
    m = KVCacheManager(12, B)
    compute(m, admit(m, "A", list(range(10)))[0])
    compute(m, admit(m, "B", list(range(8)) + [50, 51, 52])[0])
    return m


def test_manager_cells_show_refcounts_owners_and_states():
    m = shared_manager()
    cells = manager_cells(m)
    a, b = m.block_ids("A"), m.block_ids("B")
    assert a[:2] == b[:2]
    for bid in a[:2]:
        assert cells[bid].refcount == 2 and cells[bid].owners == ("A", "B") and cells[bid].shared
        assert cells[bid].text() == (f"{bid} ·rc2", "A+B")
    assert cells[a[2]].text() == (f"{a[2]} ·rc1", "A[2]")
    m.free("A")
    cells = manager_cells(m)
    assert cells[a[2]].state == "free"  # partial block: no hash, free-empty
    assert cells[a[0]].state == "used" and cells[a[0]].refcount == 1
    m.free("B")
    cells = manager_cells(m)
    assert cells[a[0]].state == "cached" and cells[a[0]].label == short_hash(m.pool.blocks[a[0]].block_hash)
    assert block_owners(m) == {}


def test_manager_cells_hash_labels_and_many_owners():
    m = KVCacheManager(8, B)
    for r in "abcd":
        compute(m, admit(m, r, list(range(9)))[0])
    cells = manager_cells(m)
    assert cells[0].label == "×4" and cells[0].refcount == 4
    hashed = manager_cells(m, labels="hash")
    assert hashed[0].label.startswith("#") and len(hashed[0].label) == 5
    with pytest.raises(ValueError, match="labels"):
        manager_cells(m, labels="nope")


def test_free_queue_items_match_the_manager_in_lru_order():
    m = shared_manager()
    for rid in ("A", "B"):  # after A: B still holds 3 of the 12 blocks; after B: all 12 queued
        m.free(rid)
        items, kinds, labels = free_queue_items(m)
        assert items == [b for b, _ in m.free_queue()] and len(items) == (9 if rid == "A" else 12)
        assert all(kinds[b] == ("cached" if c else "free") for b, c in m.free_queue())
        assert set(labels) == {b for b, c in m.free_queue() if c}
    assert len(labels) == 2, "B's two full blocks must show up as cached-free"


def test_manager_view_highlights_evictions_as_they_happen():
    m = KVCacheManager(6, B)
    view = ManagerView(m)
    compute(m, admit(m, "A", list(range(16)))[0])  # 4 full blocks
    view.update("A")
    m.free("A")
    view.update("A done")
    assert view.queue.head == m.free_queue()[0][0] and view.last_evicted == ()
    admit(m, "C", list(range(100, 112)))  # 3 blocks: 2 free-empty, then evicts A's tail block
    view.update("C")
    assert len(view.last_evicted) == 1 and view.last_evicted[0] in m.block_ids("C")
    assert view.queue.evicted == view.last_evicted
    assert view.evicted_total == list(view.last_evicted)
    assert "head" in view.queue.to_svg() and "·rc1" in view.to_html()
    view.update("nothing happened")
    assert view.last_evicted == () and view.queue.evicted == ()


def test_manager_view_reports_copy_on_write_and_reattaches():
    m = KVCacheManager(8, B)
    view = ManagerView(m, queue=False)
    parent, _ = admit(m, "P", list(range(6)))
    compute(m, parent)
    m.fork(parent, ["S"])
    view.update()
    append(m, child(parent, "S"), [9])
    view.update()
    assert view.last_copies == ((m.block_ids("P")[1], m.block_ids("S")[1]),)
    other = KVCacheManager(8, B)
    view.attach(other)
    assert len(view.grid.cells) == 8 and all(c.state == "free" for c in view.grid.cells)
    admit(m, "Z", [1])  # the old manager is no longer listened to
    view.update()
    assert view.last_events == ()
    with pytest.raises(ValueError, match="blocks"):
        view.attach(KVCacheManager(3, B))


def test_hash_chain_svg_draws_shared_blocks_once_and_marks_partial_blocks():
    system = list(range(8))
    prompts = {"x": system + [1, 2, 3, 4, 5], "y": system + [9, 9], "z": [7] * 9}
    svg = hash_chain_svg(prompts, B)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("×2") == 2  # the two system-prompt blocks, drawn once each for x and y
    for name, p in prompts.items():
        for h in chain_hashes(p, B):
            assert short_hash(h) in svg
    assert svg.count("stroke-dasharray") == 3  # x: 1/4, y: 2/4, z: 1/4 partial blocks
    with pytest.raises(ValueError):
        hash_chain_svg({}, B)


def test_chain_hashes_equal_the_managers_index():
    m = KVCacheManager(8, B)
    p = list(range(13))
    compute(m, admit(m, "r", p)[0])
    assert {e.block_hash for e in m.index} == set(chain_hashes(p, B))

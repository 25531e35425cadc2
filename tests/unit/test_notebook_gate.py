"""The notebook gate: every committed notebook has its jupytext pair in sync, outputs, and no widget state.

The first test is the gate itself over notebooks/; the others prove it can fail on each kind of drift."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("nbtool", REPO / "tools" / "nb.py")
nbtool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nbtool)


def test_committed_notebooks_pass_the_gate():
    found = nbtool.check()
    assert not found, "\n".join(found)


def test_every_numbered_notebook_is_collected():
    names = [p.stem for p in nbtool.notebook_paths()]
    assert names, "notebooks/ holds no notebooks"
    assert names == sorted(names) and all(n[:2].isdigit() and n[2] == "_" for n in names), names


def _executed_pair(folder: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = nbtool.KERNELSPEC
    nb.metadata["jupytext"] = {"formats": "ipynb,py:percent"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# A notebook"),
        nbformat.v4.new_code_cell("print(2 + 2)", execution_count=1,
                                  outputs=[nbformat.v4.new_output("stream", name="stdout", text="4\n")]),
    ]
    path = folder / "99_sample.ipynb"
    nbformat.write(nb, path)
    path.with_suffix(".py").write_text(nbtool.export_pair(nbformat.read(path, as_version=4)))
    return path


def test_gate_accepts_a_clean_pair(tmp_path):
    path = _executed_pair(tmp_path)
    assert nbtool.check(tmp_path) == []
    assert path.with_suffix(".py").read_text().count("# %%") == 2


def test_gate_fails_when_the_py_changes_without_the_notebook(tmp_path):
    path = _executed_pair(tmp_path)
    py = path.with_suffix(".py")
    py.write_text(py.read_text().replace("print(2 + 2)", "print(2 + 3)"))
    assert any("differs from its pair" in m for m in nbtool.check(tmp_path))


def test_gate_fails_when_the_notebook_changes_without_the_py(tmp_path):
    path = _executed_pair(tmp_path)
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("a new paragraph"))
    nbformat.write(nb, path)
    assert any("differs from its pair" in m for m in nbtool.check(tmp_path))


@pytest.mark.parametrize("missing", ["py", "ipynb"])
def test_gate_fails_when_half_the_pair_is_missing(tmp_path, missing):
    path = _executed_pair(tmp_path)
    (path.with_suffix(".py") if missing == "py" else path).unlink()
    assert nbtool.check(tmp_path), f"a notebook without its .{missing} passed the gate"


def test_gate_fails_on_a_notebook_without_outputs(tmp_path):
    path = _executed_pair(tmp_path)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, path)
    path.with_suffix(".py").write_text(nbtool.export_pair(nb))
    assert any("never executed" in m for m in nbtool.check(tmp_path))


def test_gate_fails_on_widget_state(tmp_path):
    path = _executed_pair(tmp_path)
    nb = nbformat.read(path, as_version=4)
    nb.metadata["widgets"] = {nbtool.WIDGET_STATE_MIME: {"state": {}, "version_major": 2, "version_minor": 0}}
    nbformat.write(nb, path)
    assert any("widget-state metadata" in m for m in nbtool.check(tmp_path))


def test_strip_widget_state_keeps_the_views(tmp_path):
    path = _executed_pair(tmp_path)
    nb = nbformat.read(path, as_version=4)
    nb.metadata["widgets"] = {"x": 1}
    view = {"model_id": "abc", "version_major": 2, "version_minor": 0}
    nb.cells[1].outputs.append(nbformat.v4.new_output("display_data", data={
        "application/vnd.jupyter.widget-view+json": view, "text/plain": "IntSlider()"}))
    nbtool.strip_widget_state(nb)
    assert "widgets" not in nb.metadata
    assert nb.cells[1].outputs[-1]["data"]["application/vnd.jupyter.widget-view+json"] == view


def _with_figure_output(folder: Path, data: dict, source: str = "show(fig)") -> Path:
    path = _executed_pair(folder)
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(source, execution_count=2, outputs=[
        nbformat.v4.new_output("display_data", data=data)]))
    nbformat.write(nb, path)
    path.with_suffix(".py").write_text(nbtool.export_pair(nbformat.read(path, as_version=4)))
    return path


PLOTLY = {"application/vnd.plotly.v1+json": {"data": [], "layout": {}}}
PNG = {"image/png": "iVBORw0KGgo="}


def test_gate_fails_on_a_plotly_figure_without_an_image(tmp_path):
    _with_figure_output(tmp_path, PLOTLY)
    assert any("no static image" in m for m in nbtool.check(tmp_path))


def test_gate_accepts_a_plotly_figure_with_its_image(tmp_path):
    _with_figure_output(tmp_path, PLOTLY | PNG)
    assert nbtool.check(tmp_path) == []


def test_gate_fails_on_a_figure_widget_without_an_image(tmp_path):
    view = {"application/vnd.jupyter.widget-view+json": {"model_id": "x", "version_major": 2, "version_minor": 0}}
    _with_figure_output(tmp_path, view, source="fig = go.FigureWidget()\nfig")
    assert any("live FigureWidget" in m for m in nbtool.check(tmp_path))
    _with_figure_output(tmp_path, view | PNG, source="fig = go.FigureWidget()\nshow(fig)")
    assert nbtool.check(tmp_path) == []


def test_gate_fails_when_a_figure_cell_is_compared_by_nbval(tmp_path):
    _with_figure_output(tmp_path, PLOTLY | PNG, source="# NBVAL_CHECK_OUTPUT\nshow(fig)")
    assert any("NBVAL_CHECK_OUTPUT on a figure cell" in m for m in nbtool.check(tmp_path))


def test_static_show_displays_the_live_figure_then_its_image(monkeypatch):
    """With the exporter installed (the lab extra) ``show`` displays the live plotly figure, then a PNG of it;
    without one, the live figure alone and no error."""
    go = pytest.importorskip("plotly.graph_objects")
    import base64

    import IPython.display

    from minienv.viz import static

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    static.show(go.Figure(go.Bar(x=[1, 2], y=[3, 4])))
    assert list(shown[0]) == ["application/vnd.plotly.v1+json"]  # the live figure alone: JupyterLab keeps it live
    try:
        import kaleido  # noqa: F401
    except ImportError:
        assert len(shown) == 1
        return
    if len(shown) == 1:
        pytest.skip("kaleido is installed but found no Chromium to export with")
    assert list(shown[1]) == ["image/png"] and base64.b64decode(shown[1]["image/png"]).startswith(b"\x89PNG")


def _figure_cells(nb) -> list[int]:
    """Cells that draw a plotly figure: a plotly output, or a live FigureWidget built in the cell."""
    def is_figure(cell) -> bool:
        plotly = any("application/vnd.plotly.v1+json" in out.get("data", {}) for out in cell.get("outputs", []))
        return plotly or "FigureWidget(" in cell.source
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and is_figure(c)]


@pytest.mark.filterwarnings("ignore:Your element with mimetype")  # the live plotly output: drawn by JavaScript only
@pytest.mark.parametrize("path", nbtool.notebook_paths(), ids=lambda p: p.stem)
def test_every_figure_shows_in_html_without_javascript(path):
    """What a reader without JavaScript gets (nbconvert's HTML, scripts removed): every figure cell draws an image."""
    nbconvert = pytest.importorskip("nbconvert")
    nb = nbformat.read(path, as_version=4)
    assert _figures_without_javascript(nb, nbconvert) == [], f"{path.name}: figure cells blank without JavaScript"


def _figures_without_javascript(nb, nbconvert) -> list[int]:
    import re

    blank = []
    for i in _figure_cells(nb):
        one = nbformat.v4.new_notebook(cells=[nb.cells[i]], metadata=nb.metadata)
        html, _ = nbconvert.HTMLExporter(template_name="basic").from_notebook_node(one)
        html = re.sub(r"<script.*?</script>", "", html, flags=re.S)
        if "<img" not in html:
            blank.append(i)
    return blank


@pytest.mark.filterwarnings("ignore:Your element with mimetype")
def test_a_figure_without_its_image_is_blank_without_javascript():
    """The check above can fail: the committed notebooks before static images had blank figures."""
    nbconvert = pytest.importorskip("nbconvert")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("fig", execution_count=1, outputs=[
        nbformat.v4.new_output("display_data", data=PLOTLY)])])
    assert _figures_without_javascript(nb, nbconvert) == [0]
    nb.cells[0].outputs[0]["data"].update(PNG)
    assert _figures_without_javascript(nb, nbconvert) == []


def test_gate_fails_on_a_printed_table_split_into_several_outputs(tmp_path):
    """A cell whose prints arrive over time stores several stream outputs; GitHub draws a blank gap between them
    (issue #36: tables in 06, 09 and 12 split by stray blank lines). The build joins them; the gate refuses them."""
    path = _executed_pair(tmp_path)
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="row 1\n"),
                           nbformat.v4.new_output("stream", name="stdout", text="row 2\n")]
    nbformat.write(nb, path)
    assert any("several outputs" in m for m in nbtool.problems(path))
    nbtool.merge_streams(nb)
    assert [o.text for o in nb.cells[1].outputs] == ["row 1\nrow 2\n"]
    nbformat.write(nb, path)
    assert not any("several outputs" in m for m in nbtool.problems(path))

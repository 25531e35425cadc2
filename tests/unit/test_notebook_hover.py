"""Hovering a point of a notebook figure says what it is, with units ("4,096 tokens: 3.13 GiB of KV"), not plotly's
default raw numbers (03 showed "0.7326876", 02 "25").

Two views of the same rule: every trace a notebook builds passes a ``hovertemplate`` (read from the notebook's
source, so the live ``FigureWidget``s behind sliders count too), and every figure committed in a notebook's outputs
carries one (so the committed notebooks were rebuilt after the rule)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# The notebooks of the series' first part and the engine dashboard; the others check their own figures.
CHECKED = ["00_tour", "01_tokenizer", "02_model_and_kv_cache", "03_kv_memory", "04_paged_attention", "08_engine"]
TRACE_CALLS = {"Scatter", "Bar", "Histogram", "Heatmap", "Box", "Violin", "add_bar", "add_scatter", "add_histogram",
               "add_heatmap"}
UNIT = re.compile(r"tokens|slots|GiB|ms\b|%|merges|position|requests")


def _code_cells(path: Path) -> list[str]:
    cells, cur, in_code = [], [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# %%"):
            if in_code:
                cells.append("\n".join(cur))
            cur, in_code = [], "[markdown]" not in line
        elif in_code:
            cur.append(line)
    if in_code:
        cells.append("\n".join(cur))
    return cells


def _trace_calls(source: str):
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a cell with IPython syntax (magics) builds no figure here
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in TRACE_CALLS:
                yield node


@pytest.mark.parametrize("name", CHECKED)
def test_every_trace_a_notebook_builds_has_a_hover_template_with_units(name):
    missing = []
    for source in _code_cells(NOTEBOOKS / f"{name}.py"):
        for call in _trace_calls(source):
            kw = {k.arg: k.value for k in call.keywords}
            tmpl = kw.get("hovertemplate")
            text = ast.unparse(tmpl) if tmpl is not None else ""
            if not UNIT.search(text):
                missing.append(f"line {call.lineno}: {ast.unparse(call)[:90]}")
    assert not missing, f"{name}: traces without a hovertemplate naming units:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", CHECKED)
def test_every_committed_figure_carries_its_hover_template(name):
    nb = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            fig = out.get("data", {}).get("application/vnd.plotly.v1+json")
            if fig is None:
                continue
            for trace in fig["data"]:
                assert UNIT.search(trace.get("hovertemplate", "")), (name, trace.get("name"), trace.get("type"))

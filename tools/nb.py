"""Build and check the notebooks: each ``notebooks/NN_name.ipynb`` is paired with a jupytext percent ``.py``.

    python tools/nb.py build notebooks/04_paged_attention.py   # .py -> executed .ipynb (+ canonical .py)
    python tools/nb.py build --all                             # rebuild every notebook
    python tools/nb.py check                                   # the gate the test suite runs

Why: readers on GitHub must see results, so notebooks are committed *with outputs*; reviewers diff the ``.py``;
and neither may drift from the other. ``build`` is the only way a notebook is written, so the pair is in sync by
construction, and ``check`` (clean -> export -> nothing changed, in the spirit of nbdev) catches hand edits.
Widget state is stripped: it is megabytes of JSON that is stale the moment the kernel stops, and GitHub readers
get each view's static rendering instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jupytext
import nbformat

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
PAIR_FORMAT = "py:percent"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
IMAGE_MIMES = ("image/png", "image/svg+xml")
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def _rel(path: Path) -> Path:
    path = path.resolve()
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def notebook_paths(folder: Path = NOTEBOOKS) -> list[Path]:
    return sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))


def strip_widget_state(nb: nbformat.NotebookNode) -> None:
    """Drop saved widget state (notebook metadata and any widget-state outputs), keep the view references."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("widgets", None)
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data is not None:
                data.pop(WIDGET_STATE_MIME, None)


def merge_streams(nb: nbformat.NotebookNode) -> None:
    """Join consecutive stream outputs of the same name into one: a cell that prints a table over time otherwise
    stores several outputs, which GitHub and nbviewer draw as separate blocks with a blank gap between them (a
    table split by stray blank lines). nbval joins them the same way before it compares."""
    for cell in nb.cells:
        merged: list = []
        for out in cell.get("outputs", []):
            prev = merged[-1] if merged else None
            if (out.get("output_type") == "stream" and prev is not None and prev.get("output_type") == "stream"
                    and prev.get("name") == out.get("name")):
                prev["text"] = "".join(prev["text"]) + "".join(out["text"])
            else:
                merged.append(out)
        if "outputs" in cell:
            cell["outputs"] = merged


def _split_streams(cell: nbformat.NotebookNode) -> bool:
    outs = cell.get("outputs", [])
    return any(a.get("output_type") == b.get("output_type") == "stream" and a.get("name") == b.get("name")
               for a, b in zip(outs, outs[1:]))


def export_pair(nb: nbformat.NotebookNode) -> str:
    """The canonical jupytext percent text of a notebook."""
    return jupytext.writes(nb, fmt=PAIR_FORMAT)


def exporter_problem() -> str | None:
    """Why this machine cannot export the figures' PNGs (``minienv.viz.static``), or None."""
    sys.path.insert(0, str(NOTEBOOKS.parent))
    from minienv.viz.static import exporter_problem as problem

    return problem()


def build(py_path: Path, timeout: int = 600) -> float:
    """Convert a percent ``.py`` to a notebook, execute it in a fresh kernel, write both halves of the pair."""
    from nbclient import NotebookClient

    py_path = py_path.resolve()
    if py_path.suffix != ".py" or not py_path.is_file():
        raise SystemExit(f"build: expected an existing notebooks/*.py percent file, got {py_path}")
    nb = jupytext.read(py_path, fmt=PAIR_FORMAT)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata.setdefault("jupytext", {})["formats"] = "ipynb,py:percent"
    start = time.perf_counter()
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(py_path.parent)}})
    client.execute()
    elapsed = time.perf_counter() - start
    notes = [i for i, c in enumerate(nb.cells) for out in c.get("outputs", [])
             if "static images are off" in out.get("text", "")]
    if notes:
        raise SystemExit(f"build: {_rel(py_path)}: the PNG export failed during the run (cell {notes[0]}); "
                         "nothing written")
    strip_widget_state(nb)
    merge_streams(nb)
    ipynb_path = py_path.with_suffix(".ipynb")
    nbformat.write(nb, ipynb_path)
    # Re-read what was written so the .py is exported from exactly the committed notebook.
    py_path.write_text(export_pair(nbformat.read(ipynb_path, as_version=4)))
    print(f"built {_rel(ipynb_path)} in {elapsed:.1f} s")
    return elapsed


def problems(ipynb_path: Path) -> list[str]:
    """Everything wrong with one committed notebook, as messages naming the file."""
    name = _rel(ipynb_path)
    found: list[str] = []
    try:
        nb = nbformat.read(ipynb_path, as_version=4)
    except Exception as exc:  # a malformed notebook is a finding, not a crash of the gate
        return [f"{name}: cannot be read as a notebook ({exc})"]
    py_path = ipynb_path.with_suffix(".py")
    if not py_path.is_file():
        found.append(f"{name}: has no jupytext pair {py_path.name} (run tools/nb.py build)")
    elif export_pair(nb) != py_path.read_text():
        found.append(f"{name}: differs from its pair {py_path.name} (edit the .py, then run tools/nb.py build)")
    if "widgets" in nb.metadata:
        found.append(f"{name}: carries widget-state metadata (run tools/nb.py build, which strips it)")
    code_cells = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    unexecuted = [i for i, c in enumerate(nb.cells) if c in code_cells and c.get("execution_count") is None]
    if unexecuted:
        found.append(f"{name}: code cells {unexecuted} were never executed (commit notebooks with outputs)")
    if code_cells and not any(c.get("outputs") for c in code_cells):
        found.append(f"{name}: has no outputs at all (commit notebooks with outputs)")
    for i, cell in enumerate(nb.cells):
        found.extend(f"{name}: cell {i} {m}" for m in _figure_problems(cell))
        if _split_streams(cell):
            found.append(f"{name}: cell {i} stores its printed text as several outputs, drawn with blank gaps between "
                         "them (run tools/nb.py build, which joins them)")
        for out in cell.get("outputs", []):
            if WIDGET_STATE_MIME in out.get("data", {}):
                found.append(f"{name}: cell {i} stores widget state in an output")
            if out.get("output_type") == "error":
                found.append(f"{name}: cell {i} was committed with an error output ({out.get('ename')})")
    return found


def _figure_problems(cell: nbformat.NotebookNode) -> list[str]:
    """A figure GitHub cannot draw: plotly JSON (or a cell building a ``FigureWidget`` and showing a widget) with
    no PNG / SVG in the same cell — readers without a kernel would see a blank. ``minienv.viz.static.show`` puts
    the image in the figure's own output. A figure cell must not be NBVAL_CHECK_OUTPUT: image bytes are not a
    lesson number, and they differ between exporter versions."""
    if cell.cell_type != "code":
        return []
    datas = [out.get("data", {}) for out in cell.get("outputs", [])]
    has_image = any(mime in data for data in datas for mime in IMAGE_MIMES)
    plotly = any(PLOTLY_MIME in data for data in datas)
    figure_widget = "FigureWidget(" in cell.source and any(WIDGET_VIEW_MIME in data for data in datas)
    found = []
    if (plotly or figure_widget) and not has_image:
        what = "a plotly figure" if plotly else "a live FigureWidget"
        found.append(f"shows {what} with no static image beside it (display it with minienv.viz.static.show)")
    if (plotly or has_image) and "NBVAL_CHECK_OUTPUT" in cell.source:
        found.append("compares a figure's output (NBVAL_CHECK_OUTPUT on a figure cell): check numbers, not images")
    return found


def check(folder: Path = NOTEBOOKS) -> list[str]:
    found: list[str] = []
    for py_path in sorted(folder.glob("*.py")):
        if not py_path.with_suffix(".ipynb").is_file():
            found.append(f"{py_path.name}: has no executed .ipynb pair (run tools/nb.py build {py_path.name})")
    for ipynb_path in notebook_paths(folder):
        found.extend(problems(ipynb_path))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="execute .py percent files into .ipynb notebooks")
    b.add_argument("paths", nargs="*", type=Path)
    b.add_argument("--all", action="store_true", help="rebuild every notebooks/*.py")
    sub.add_parser("check", help="fail if any notebook and its pair differ, lack outputs or keep widget state")
    args = parser.parse_args(argv)
    if args.command == "build":
        paths = sorted(NOTEBOOKS.glob("*.py")) if args.all else args.paths
        if not paths:
            parser.error("build: give notebooks/*.py paths or --all")
        problem = exporter_problem()
        if problem is not None:  # the gate would refuse the result: say so before minutes of executing
            print(f"build: committed notebooks carry a PNG of every figure, and none can be made here: {problem}. "
                  f"Install Chrome or Chromium (Debian: apt-get install chromium) or set BROWSER_PATH.",
                  file=sys.stderr)
            return 2
        times = {p.stem: build(p) for p in paths}
        slow = {k: round(v, 1) for k, v in times.items() if v > 20}
        if slow:
            print(f"warning: over the 20 s Run All budget: {slow}", file=sys.stderr)
        return 0
    found = check()
    for line in found:
        print(line, file=sys.stderr)
    print(f"checked {len(notebook_paths())} notebooks: {'OK' if not found else f'{len(found)} problem(s)'}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

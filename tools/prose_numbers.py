"""Prose numbers tied to printed outputs: a figure in a notebook's text must be one its code cell printed.

A number in a markdown cell followed by the marker ``<!--out-->`` (invisible when rendered, on GitHub and in
JupyterLab) claims to be a value that the code cell next to it printed — the nearest code cell above or below
the markdown cell. ``<!--out:above-->`` (for a summary that recalls a result) widens that to every code cell
above the markdown cell, and ``<!--out:03-->`` (for a figure quoted from an earlier chapter) to every code cell of
notebook 03 — so a chapter that recalls another's result is caught when that result changes. The check reads the
committed ``.ipynb`` (nbval re-runs it in CI, so its outputs are the code's
outputs) and accepts the claim when some number in those outputs, rounded to the decimals the prose shows, equals
it: ``30 %<!--out-->`` agrees with a printed ``30.08``, ``~135×<!--out-->`` does not agree with ``134×``.

Usage: ``python tools/prose_numbers.py [notebooks/NN_x.ipynb ...]`` prints every disagreement (exit 1 if any).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Callable

MARKER = "<!--out-->"
MARKER_ABOVE = "<!--out:above-->"
REPO = Path(__file__).resolve().parents[1]

# a number as prose or a printout writes it: 1,702 · 0.25 · 12.5 · -3 (thousands commas allowed)
_NUMBER = r"[-−]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-−]?\d+(?:\.\d+)?"
_UNIT = r"(?:%|×|x|µs|us|ms|s|KiB|MiB|GB|tokens?)?"
_CLAIM = re.compile(rf"({_NUMBER})\s*{_UNIT}\s*<!--out(?::(above|\d\d))?-->")
_ANY_MARKER = re.compile(r"<!--out(?::[a-z0-9]*)?-->")
_ANY_NUMBER = re.compile(_NUMBER)


def _value(text: str) -> float:
    return float(text.replace(",", "").replace("−", "-"))


def _decimals(text: str) -> int:
    return len(text.split(".", 1)[1]) if "." in text else 0


def claims(markdown: str) -> list[tuple[str, str]]:
    """The numbers a markdown cell ties to an output, as written, each with where it may come from: ``"beside"``
    (the neighbouring code cells), ``"above"`` (any code cell above) or a notebook's number
    (``[("30", "beside"), ("1,702", "above"), ("21.1", "03")]``)."""
    return [(m.group(1), m.group(2) or "beside") for m in _CLAIM.finditer(markdown)]


def output_text(cell: dict) -> str:
    """What a code cell printed: its streams and the plain-text form of its results."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append("".join(out.get("text", "")))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def agrees(claim: str, printed: str) -> bool:
    """Whether a prose number ``claim`` equals some number in ``printed`` rounded to the claim's decimals."""
    want, d = _value(claim), _decimals(claim)
    return any(abs(round(_value(n), d) - want) < 1e-9 for n in _ANY_NUMBER.findall(printed))


def disagreements(cells: list[dict], other: Callable[[str], list[dict]] | None = None) -> tuple[list[str], int]:
    """``(problems, number of claims checked)`` for one notebook's cells (nbformat JSON dicts); ``other(NN)`` gives
    notebook NN's cells, for claims marked ``<!--out:NN-->``."""
    problems, checked = [], 0
    for i, cell in enumerate(cells):
        if cell.get("cell_type") != "markdown":
            continue
        text = "".join(cell.get("source", ""))
        found = claims(text)
        if not found:
            continue
        above = next((c for c in reversed(cells[:i]) if c.get("cell_type") == "code"), None)
        below = next((c for c in cells[i + 1:] if c.get("cell_type") == "code"), None)
        beside = "\n".join(output_text(c) for c in (above, below) if c is not None)
        everything_above = "\n".join(output_text(c) for c in cells[:i] if c.get("cell_type") == "code")
        for claim, scope in found:
            checked += 1
            if scope == "beside":
                printed, where = beside, "neither neighbouring code cell"
            elif scope == "above":
                printed, where = everything_above, "no code cell above"
            else:
                quoted = (other(scope) if other is not None else None) or []
                printed = "\n".join(output_text(c) for c in quoted if c.get("cell_type") == "code")
                where = f"no code cell of notebook {scope}" if quoted else f"notebook {scope}, which was not found"
            if not agrees(claim, printed):
                line = next(ln for ln in text.splitlines() if claim in ln and "<!--out" in ln)
                problems.append(f"markdown cell {i}: {claim!r} is printed by {where} — {line.strip()[:120]}")
    # a marker not right after a number is a typo that would check nothing
    for i, cell in enumerate(cells):
        if cell.get("cell_type") == "markdown":
            text = "".join(cell.get("source", ""))
            if len(_ANY_MARKER.findall(text)) != len(claims(text)):
                problems.append(f"markdown cell {i}: an <!--out--> marker does not follow a number")
    return problems, checked


def _cells(path: Path) -> list[dict]:
    return json.loads(Path(path).read_text(encoding="utf-8"))["cells"]


def check_notebook(path: Path) -> tuple[list[str], int]:
    def other(number: str) -> list[dict]:  # a sibling notebook NN_*.ipynb, or nothing
        found = sorted(Path(path).parent.glob(f"{number}_*.ipynb"))
        return _cells(found[0]) if found else []

    problems, checked = disagreements(_cells(path), other)
    return [f"{Path(path).name}: {p}" for p in problems], checked


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    bad, total = [], 0
    for p in paths:
        problems, checked = check_notebook(p)
        bad += problems
        total += checked
    print("\n".join(bad) if bad else f"{total} prose numbers agree with their cells' outputs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

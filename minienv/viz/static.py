"""Figures a reader without a kernel can see: every plotly figure is displayed with a PNG of itself.

GitHub and nbviewer render no JavaScript, so a figure committed only as ``application/vnd.plotly.v1+json`` (or a
``FigureWidget`` behind a slider) is blank there. ``show(fig)`` displays ONE output whose mime bundle holds both the
live figure and a PNG of it: JupyterLab picks the interactive plotly renderer, a static renderer picks the PNG.
No picture appears twice, and a live session loses nothing. A live widget (a slider with a ``FigureWidget``) is
different: renderers that know the widget mimetype choose it even without a kernel, so its PNG (the figure as it
is when the cell runs: the slider's first position) is a second output right under it.

The PNG comes from plotly's exporter, kaleido 1.x, which drives a headless Chromium (the Debian ``chromium`` the
browser test tier uses). It is optional: without kaleido or a browser, ``show`` displays the live figure alone and
raises nothing — a reader re-running a notebook needs only the ``lab`` extra. The notebook gate
(``tests/unit/test_notebook_gate.py``) makes sure the *committed* notebooks were built with the exporter.

One export server is started per kernel on first use (about 2 s; later images take ~0.1 s) and stopped at exit.
MathJax is switched off (no figure here uses LaTeX, and it would be fetched from a CDN).
"""

from __future__ import annotations

import atexit
import base64
import logging
import warnings
from typing import Any

PNG_MIME = "image/png"
PLOTLY_MIME = "application/vnd.plotly.v1+json"

_server: bool | None = None  # None: not tried yet; False: no exporter here; True: running


def _start_server() -> bool:
    global _server
    if _server is None:
        try:
            import kaleido

            for name in ("kaleido", "choreographer", "logistro"):  # their shutdown chatter is not the reader's
                logging.getLogger(name).setLevel(logging.CRITICAL)
            kaleido.start_sync_server(mathjax=False, silence_warnings=True)
            atexit.register(kaleido.stop_sync_server, silence_warnings=True)
            _server = True
        except Exception:  # noqa: BLE001 - no kaleido, no browser: the live figure alone, as documented
            _server = False
    return _server


def png_bytes(fig: Any, *, width: int | None = None, height: int | None = None, scale: float = 1.0) -> bytes | None:
    """A PNG of ``fig`` (a plotly ``Figure`` or ``FigureWidget``), or ``None`` when no exporter is available.

    Width and height default to the figure's layout, else 900 × 450 (a notebook column).
    """
    if not _start_server():
        return None
    import kaleido

    layout = fig.layout
    opts = {"format": "png", "width": width or layout.width or 900, "height": height or layout.height or 450,
            "scale": scale}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return kaleido.calc_fig_sync(fig.to_dict(), opts=opts)
    except Exception:  # noqa: BLE001 - an export failure must not cost the reader the live figure
        return None


def bundle(fig: Any, live: Any = None, **size: Any) -> dict[str, Any]:
    """The mime bundle ``show`` displays: ``live``'s (default: the figure's own) plus a PNG of ``fig``."""
    import plotly.graph_objects as go
    import plotly.io as pio

    if live is None and not isinstance(fig, go.FigureWidget):
        # a plain Figure: the plotly mimetype JupyterLab draws itself (no CDN, no network)
        data = dict(pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict()))
    else:
        live = fig if live is None else live  # a FigureWidget, or a box holding one: the widget view
        data = live._repr_mimebundle_()
        data = dict(data[0] if isinstance(data, tuple) else data)
    png = png_bytes(fig, **size)
    if png is not None:
        data[PNG_MIME] = base64.b64encode(png).decode("ascii")
    return data


def show(fig: Any, live: Any = None, **size: Any) -> None:
    """Display ``fig`` live, with a PNG of it in the same output for readers without a kernel.

    ``live`` is what to display interactively when it is not the figure itself — e.g. an ``ipywidgets.VBox`` of a
    slider and a ``FigureWidget``: the PNG then shows the figure as it is now (the slider's initial state).
    """
    from IPython.display import display

    if live is None:
        display(bundle(fig, **size), raw=True)
        return
    # A widget view is drawn by JavaScript only, and renderers that know the widget mimetype pick it over any
    # image in the same bundle: the PNG goes in its own output, right under the live view.
    display(live)
    png = png_bytes(fig, **size)
    if png is not None:
        display({PNG_MIME: base64.b64encode(png).decode("ascii")}, raw=True)

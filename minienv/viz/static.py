"""Figures a reader without a kernel can see: every plotly figure is displayed with a PNG of itself.

GitHub and nbviewer render no JavaScript, so a figure committed only as ``application/vnd.plotly.v1+json`` (or a
``FigureWidget`` behind a slider) is blank there. ``show(fig)`` displays the live figure, then a PNG of it as a
second output of the same cell (for a slider: the figure at its first position). Why not one output holding both
mimetypes: JupyterLab ranks ``image/png`` above plotly's mimetype, so a live session would get the flat image
instead of the interactive figure (the browser test tier caught exactly that), and renderers that know the widget
mimetype pick a widget view even where no kernel can draw it. So a reader with a kernel sees the figure twice —
live, then still — and a reader on GitHub sees the still one.

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


def live_bundle(fig: Any) -> dict[str, Any]:
    """The mime bundle of the live figure: plotly's own mimetype, which JupyterLab draws (no CDN, no network)."""
    import plotly.io as pio

    return dict(pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict()))


def image_bundle(fig: Any, **size: Any) -> dict[str, str] | None:
    """``{"image/png": base64}`` of ``fig``, or ``None`` when no exporter is available."""
    png = png_bytes(fig, **size)
    return None if png is None else {PNG_MIME: base64.b64encode(png).decode("ascii")}


def show(fig: Any, live: Any = None, **size: Any) -> None:
    """Display ``fig`` live, then a PNG of it in a second output of the same cell.

    ``live`` is what to display interactively when it is not the figure itself — e.g. an ``ipywidgets.VBox`` of a
    slider and a ``FigureWidget``: the PNG then shows the figure as it is now (the slider's first position).
    """
    from IPython.display import display

    # NOTE: by name, not isinstance(fig, go.FigureWidget): touching go.FigureWidget imports the widget stack,
    # seconds of Run All in a notebook that has no widget.
    is_widget = any(cls.__name__ == "FigureWidget" for cls in type(fig).__mro__)
    if live is not None or is_widget:
        display(fig if live is None else live)
    else:
        display(live_bundle(fig), raw=True)
    image = image_bundle(fig, **size)
    if image is not None:
        display(image, raw=True)

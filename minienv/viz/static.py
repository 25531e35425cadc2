"""Figures a reader without a kernel can see: every plotly figure is displayed with a PNG of itself.

GitHub and nbviewer render no JavaScript, so a figure committed only as ``application/vnd.plotly.v1+json`` (or a
``FigureWidget`` behind a slider) is blank there. ``show(fig)`` displays the live figure, then a PNG of it as a
second output of the same cell (for a slider: the figure at its first position). Why not one output holding both
mimetypes: JupyterLab ranks ``image/png`` above plotly's mimetype, so a live session would get the flat image
instead of the interactive figure (the browser test tier caught exactly that), and renderers that know the widget
mimetype pick a widget view even where no kernel can draw it. So a reader with a kernel sees the figure twice —
live, then still — and a reader on GitHub sees the still one.

The PNG comes from plotly's exporter, kaleido 1.x, which drives a headless Chrome or Chromium. It is optional, and
a student's machine (a Binder image, many laptops) has no browser. So:

1. **Decide up front.** Before anything is started, ``exporter_problem()`` looks for a browser the way kaleido's
   own lookup (choreographer's ``Chromium.find_browser``) does — ``BROWSER_PATH``, then ``chrome``/``chromium``/...
   on ``PATH``, then the usual install paths — and checks that the file is there and executable. No browser: no
   export is attempted at all.
2. **Bound every wait.** The exporter runs on an event loop in a thread of its own; the caller waits for its start
   (``START_TIMEOUT``) and for each image (``EXPORT_TIMEOUT``) with a timeout. kaleido's own synchronous server
   cannot be used for this: when its thread dies (a browser that fails to start), ``calc_fig_sync`` waits on a
   queue forever.
3. **Degrade at once, once.** On any failure — no kaleido, no browser, a browser that does not start, an export
   that errs or times out — ``show`` displays the live figure alone, prints one short note per kernel saying how
   to get static images, and never tries the exporter again in that kernel. Never a hang, never a traceback.

The notebook gate (``tests/unit/test_notebook_gate.py``) makes sure the *committed* notebooks were built with the
exporter. MathJax is switched off (no figure here uses LaTeX, and it would be fetched from a CDN).
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import logging
import os
import signal
import threading
import warnings
from typing import Any

PNG_MIME = "image/png"
PLOTLY_MIME = "application/vnd.plotly.v1+json"

START_TIMEOUT = 30.0  # s: a cold Chromium start on a slow shared machine takes a few seconds; 30 is generous
EXPORT_TIMEOUT = 20.0  # s: one PNG takes ~0.1 s once the browser is up

HOW_TO_GET_IMAGES = ("install Chrome or Chromium (e.g. `apt-get install chromium`, or `plotly_get_chrome`) "
                     "and restart the kernel")


class _Exporter:
    """kaleido's ``Kaleido`` browser, driven on an event loop in a daemon thread owned by this object.

    Invariant: ``problem`` is None while the exporter may be used; once set it never clears (one note per kernel).
    """

    def __init__(self) -> None:
        self.problem: str | None = None
        self.noted = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kaleido: Any = None
        self._started = False
        self._lock = threading.Lock()

    def _run(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the exporter's loop and wait at most ``timeout`` seconds for it."""
        assert self._loop is not None

        async def guarded() -> tuple[bool, Any]:
            # NOTE: every outcome comes back as a value, so an abandoned task never prints "exception was never
            # retrieved" at exit
            try:
                return True, await coro
            except BaseException as exc:  # noqa: BLE001
                return False, exc

        future = asyncio.run_coroutine_threadsafe(guarded(), self._loop)
        try:
            ok, value = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer from the exporter within {timeout:g} s") from None
        if not ok:
            raise value
        return value

    def _start(self) -> None:
        problem = exporter_problem()
        if problem is not None:
            raise RuntimeError(problem)
        import kaleido

        for name in ("kaleido", "choreographer", "logistro"):  # their start-up and shutdown chatter is not the reader's
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="minienv-png-export", daemon=True).start()
        self._kaleido = kaleido.Kaleido(n=1, mathjax=False, timeout=EXPORT_TIMEOUT)
        atexit.register(self.close)
        self._run(self._kaleido.__aenter__(), START_TIMEOUT)
        self._started = True

    def png(self, fig_dict: dict, opts: dict) -> bytes | None:
        with self._lock:
            if self.problem is not None:
                return None
            try:
                if not self._started:
                    self._start()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return self._run(self._kaleido.calc_fig(fig_dict, opts=opts), EXPORT_TIMEOUT)
            except BaseException as exc:  # noqa: BLE001 - any failure costs the reader the still image, never the figure
                if isinstance(exc, KeyboardInterrupt):  # the reader's stop button: no image now, try again later
                    self._abandon()
                    self._started = False
                    raise
                self.problem = _first_line(exc)
                self._abandon()
                return None

    def _abandon(self) -> None:
        """Stop what was started, without waiting on it for long (it may be what hung); no browser left behind."""
        if self._loop is None:
            return
        if self._kaleido is not None:
            if self._started:  # it ran: let it close its tabs and browser, briefly
                try:
                    self._run(self._kaleido.__aexit__(None, None, None), 5.0)
                except BaseException:  # noqa: BLE001 - best effort: the browser may already be gone
                    pass
            _kill(getattr(self._kaleido, "subprocess", None))
            self._kaleido = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop = None

    def close(self) -> None:
        with self._lock:
            self._abandon()


_exporter = _Exporter()


def _kill(process: Any) -> None:
    """Kill a browser process and its children (choreographer starts it as a process-group leader)."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        process.kill()
    try:
        process.wait(timeout=2)
    except Exception:  # noqa: BLE001 - it was sent SIGKILL; nothing more to do
        pass


def _first_line(exc: BaseException) -> str:
    """A short reason: the first line of the exception's first argument (choreographer raises tuples of lines)."""
    text = str(exc.args[0]) if exc.args else ""
    line = text.strip().splitlines()[0].rstrip(".") if text.strip() else type(exc).__name__
    return line


def find_browser() -> str | None:
    """The browser kaleido would start, looked up as kaleido's own lookup does, or None.

    ``BROWSER_PATH`` wins when set (even when it names nothing: kaleido would then fail, so we report that).
    """
    if "BROWSER_PATH" in os.environ:
        path = os.environ["BROWSER_PATH"]
    else:
        try:
            from choreographer.browsers.chromium import Chromium
        except ImportError:
            return None
        try:
            path = Chromium.find_browser(skip_local=False)
        except Exception:  # noqa: BLE001 - a lookup that errs finds nothing
            return None
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return str(path)
    return None


def exporter_problem() -> str | None:
    """Why no PNG can be made here (a short sentence), or None when the exporter may be tried."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return "kaleido is not installed"
    if find_browser() is None:
        where = os.environ.get("BROWSER_PATH")
        return f"no browser at BROWSER_PATH={where!r}" if where is not None else "no Chrome or Chromium found"
    return None


def _note_once() -> None:
    if _exporter.noted or _exporter.problem is None:
        return
    _exporter.noted = True
    print(f"(Figures are drawn live only: static images are off in this kernel — {_exporter.problem}. "
          f"For PNG copies, {HOW_TO_GET_IMAGES}.)")


def png_bytes(fig: Any, *, width: int | None = None, height: int | None = None, scale: float = 1.0) -> bytes | None:
    """A PNG of ``fig`` (a plotly ``Figure`` or ``FigureWidget``), or ``None`` when none can be made here.

    Width and height default to the figure's layout, else 900 × 450 (a notebook column). Returns within
    ``START_TIMEOUT + EXPORT_TIMEOUT`` seconds whatever the machine has; at once when it has no browser.
    """
    layout = fig.layout
    opts = {"format": "png", "width": width or layout.width or 900, "height": height or layout.height or 450,
            "scale": scale}
    return _exporter.png(fig.to_dict(), opts)


def live_bundle(fig: Any) -> dict[str, Any]:
    """The mime bundle of the live figure: plotly's own mimetype, which JupyterLab draws (no CDN, no network)."""
    import plotly.io as pio

    return dict(pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict()))


def image_bundle(fig: Any, **size: Any) -> dict[str, str] | None:
    """``{"image/png": base64}`` of ``fig``, or ``None`` when none can be made here (with one note per kernel)."""
    png = png_bytes(fig, **size)
    if png is None:
        _note_once()
        return None
    return {PNG_MIME: base64.b64encode(png).decode("ascii")}


def show(fig: Any, live: Any = None, **size: Any) -> None:
    """Display ``fig`` live, then a PNG of it in a second output of the same cell.

    ``live`` is what to display interactively when it is not the figure itself — e.g. an ``ipywidgets.VBox`` of a
    slider and a ``FigureWidget``: the PNG then shows the figure as it is now (the slider's first position).
    Without an exporter the live figure alone (and, the first time in a kernel, one line saying why).
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

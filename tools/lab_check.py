"""Run notebooks in a real JupyterLab, in headless Chromium, and check that they render.

This is the engine of the browser tier (`tests/browser/test_notebooks_in_lab.py`); it also runs on its own:

    .venv/bin/python tools/lab_check.py                      # every notebooks/*.ipynb
    .venv/bin/python tools/lab_check.py notebooks/00_tour.ipynb path/to/other_dir

For each notebook it: opens it in JupyterLab (which starts a fresh kernel), clears the committed outputs, runs all
cells (the same as "Restart Kernel and Run All Cells" on a fresh kernel), waits until every cell has run and every
widget/figure has rendered, then reports problems in five groups:

  errors    an error output (a cell raised), or a stderr output holding a Traceback
  unrun     code cells that never ran (Run All stops at the first error)
  widgets   a widget output that is not a rendered live view ("Loading widget...", "Error displaying widget"), or
            fewer rendered widget views than the committed .ipynb has widget outputs, or a minienv view named in
            an output's repr (BlockGrid, QueueView, ...) that the live widget does not draw
  plotly    a plotly output without a rendered `.js-plotly-plot`, or fewer plots than the committed .ipynb has
            plotly figures (static `application/vnd.plotly.v1+json` outputs + FigureWidgets)
  console   JS console errors and uncaught page errors (minus the documented allow-list below)
  controls  a control whose live view does not answer: Step / Reset / ▶ / ■, sliders, text boxes
            (`tools/lab_controls.py`, run after Run All; `--no-controls` skips it)

and saves a screenshot of the whole notebook.

Needs: playwright (Python package; NOT its downloaded browsers) and Debian's chromium at /usr/bin/chromium.
The server runs on 127.0.0.1 with a random token, on a copy of the notebooks (committed files are never
touched), with throwaway Jupyter config/data/runtime/settings/workspace dirs and settings that keep
JupyterLab's news / update prompts and the kernel dialog away.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab_controls import drive_controls  # noqa: E402
# Debian's chromium (apt-get install -y chromium). MINIENV_CHROMIUM points at another Chromium/Chrome binary.
CHROMIUM = os.environ.get("MINIENV_CHROMIUM", "/usr/bin/chromium")
# The background-networking flags matter on a closed network: without them Chromium keeps trying to reach
# Google services and floods the log with refused connections.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
# minienv.viz views (as named in a widget output's text/plain repr) and the CSS class their live widget carries:
# a view named in the repr but missing from the page was dropped from the live widget (05/06 lost their free queue
# that way while the static pictures still showed it).
VIEW_KINDS = [["BlockGrid", "minienv-blockgrid"], ["QueueView", "minienv-queue"],
              ["BlockTableView", "minienv-blocktables"], ["RequestTimeline", "minienv-timeline"]]
VIEWPORT = {"width": 1400, "height": 900}
MAX_SCREENSHOT_HEIGHT = 30000
STABLE_SECONDS = 8.0  # after Run All: no change in rendered views for this long (and none loading) = settled

# User settings for the throwaway JupyterLab (schema ids from jupyterlab 4.6's share/jupyter/lab/schemas).
LAB_SETTINGS = {
    # No "Would you like to get notified about official Jupyter news?" toast, no update check (offline anyway).
    "@jupyterlab/apputils-extension:notification": {
        "fetchNews": "false",
        "checkForUpdates": False,
        "doNotDisturbMode": True,
    },
    # "Restart kernel?" confirmation is skipped (we still accept it if it shows up).
    "@jupyterlab/apputils-extension:sessionDialogs": {"skipKernelRestartDialog": True},
    "@jupyterlab/notebook-extension:tracker": {
        # Attach every cell to the DOM: the default ("contentVisibility") and "full"/"defer" modes render
        # off-screen cells lazily, so widgets and plots below the fold would not exist yet.
        "windowingMode": "none",
        # Start the notebook's kernel without the "Select Kernel" dialog.
        "autoStartDefaultKernel": True,
        "kernelShutdown": True,
        # No blank viewport-high space after the last cell (it would only pad the screenshot).
        "scrollPastEnd": False,
    },
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
}

# Console errors that are not the notebook's fault: (regex on the message, phase it may occur in, why benign).
# Phases: "load" (opening the notebook, kernel start) and "run" (from "Run All" on). Allowed messages are still
# listed in the result summary. On this machine a clean notebook logs nothing while loading (committed widget
# outputs without widget state wait silently for their models) and nothing from JupyterLab itself while running
# (news and update checks are off; the kernel is not restarted, so the debugger's "Could not restore the
# debugger state: Canceled future" race does not happen). Add an entry only with a comment showing it is benign.
CONSOLE_ALLOW: list[tuple[str, str, str]] = [
    # plotly's "notebook_connected" renderer (pio.renderers.default = "plotly_mimetype+notebook_connected", used
    # so that nbviewer/GitHub show the figures) emits a text/html output whose script points require.js at
    # https://cdn.plot.ly/plotly-<version>.min. JupyterLab draws the figure from the application/vnd.plotly.v1+json
    # output with the bundled jupyterlab-plotly extension, so the CDN script is unused there; on a machine
    # without internet the fetch fails with net::ERR_NAME_NOT_RESOLVED (or ERR_CONNECTION_REFUSED etc.). The
    # plots themselves are still asserted (.js-plotly-plot count), so this cannot hide a missing figure.
    (r"^Failed to load resource: net::ERR_[A-Z_]+ @ https://cdn\.plot\.ly/", "run",
     "offline machine: unused plotly CDN script of the notebook_connected renderer"),
    # Committed notebooks carry widget outputs but, by design (`tools/nb.py check`), no widget state. If the
    # widget manager finishes restoring before such a stale output renders, that output logs "widget model not
    # found" (the self-test shows this exact message for a widget output without a model). Only while *loading*:
    # the outputs are cleared before Run All, and in the run phase the same message is a real failure.
    (r"widget model not found", "load", "stale committed widget outputs (no widget state is committed)"),
]


def missing_dependencies() -> list[str]:
    """What the browser tier needs but cannot find, each as an actionable message."""
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the Python package playwright: `.venv/bin/pip install -e '.[browser]'` "
                       "(do NOT run `playwright install`; the tier uses Debian's chromium)")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM}: `apt-get install -y chromium` (Debian/Ubuntu), or set MINIENV_CHROMIUM "
                       "to a Chromium/Chrome binary")
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        missing.append("jupyterlab and the widget stack: `.venv/bin/pip install -e '.[lab]'`")
    return missing


# --------------------------------------------------------------------------------------------------- expectations
@dataclass
class Expected:
    widget_views: int = 0  # widget-view outputs in the committed notebook
    plotly_figures: int = 0  # static plotly outputs + FigureWidgets (counted in the widget outputs' reprs)
    code_cells: int = 0
    kernel_name: str = "python3"


def expected_from_ipynb(path: Path) -> Expected:
    """What the committed (executed) notebook says the live run must show."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    exp = Expected(kernel_name=nb.get("metadata", {}).get("kernelspec", {}).get("name") or "python3")
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        exp.code_cells += 1
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_MIME in data:
                view = data[WIDGET_MIME]
                if isinstance(view, dict) and view.get("model_id", "x") == "":
                    continue  # a hidden (closed) widget renders nothing
                exp.widget_views += 1
                text = data.get("text/plain", "")
                text = "".join(text) if isinstance(text, list) else str(text)
                # A FigureWidget, or a container (VBox, minienv.viz view) holding some: their reprs nest.
                exp.plotly_figures += text.count("FigureWidget(")
            if PLOTLY_MIME in data:
                exp.plotly_figures += 1
    return exp


# --------------------------------------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """JupyterLab on 127.0.0.1, serving a *copy* of the given folders, with throwaway config dirs.

    `folders` maps a name inside the served root to a source folder; "" means the root itself.
    """

    def __init__(self, folders: dict[str, Path], log_path: Path | None = None, startup_timeout: float = 90):
        self.tmp = Path(tempfile.mkdtemp(prefix="minienv-lab-"))
        self.root = self.tmp / "root"
        self.root.mkdir()
        for name, src in sorted(folders.items()):
            dst = self.root / name if name else self.root
            # copy2 keeps mtimes, so jupytext's "paired file is newer" logic sees the pairs as committed.
            shutil.copytree(src, dst, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        self.port = _free_port()
        self.token = secrets.token_hex(24)
        self.base = f"http://127.0.0.1:{self.port}/"
        self.log_path = log_path or (self.tmp / "jupyter.log")
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                         ("IPYTHONDIR", "ipython")]:
            (self.tmp / sub).mkdir(exist_ok=True)
            env[var] = str(self.tmp / sub)
        settings = self.tmp / "config" / "lab" / "user-settings"
        env["JUPYTERLAB_SETTINGS_DIR"] = str(settings)
        for plugin_id, values in LAB_SETTINGS.items():
            package, plugin = plugin_id.split(":")
            f = settings / package / f"{plugin}.jupyterlab-settings"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(values, indent=2))
        env.pop("JUPYTER_TOKEN", None)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self) -> "LabServer":
        cmd = [
            sys.executable, "-m", "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.terminals_enabled=False",
            # window.jupyterapp: lets the checker run commands and read kernel state instead of scraping pixels.
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        self._log = open(self.log_path, "wb")
        atexit.register(self.stop)  # never leave a server behind, even if the caller forgets
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=self._env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("lab"), timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"no HTTP 200 on /lab within {self.startup_timeout}s; log:\n{self.log_tail()}")
            time.sleep(0.25)

    def url(self, path: str, **query: str) -> str:
        q = "&".join([f"{k}={v}" if v != "" else k for k, v in query.items()] + [f"token={self.token}"])
        return f"{self.base}{path.lstrip('/')}?{q}"

    def api(self, method: str, path: str, body: dict | None = None):
        req = urllib.request.Request(self.base + path.lstrip("/"), method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        for s in self.api("GET", "api/sessions") or []:
            try:
                self.api("DELETE", f"api/sessions/{s['id']}")
            except urllib.error.URLError:
                pass

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.api("POST", "api/shutdown")
                self.proc.wait(timeout=15)
            except Exception:
                pass
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# --------------------------------------------------------------------------------------------------- browser
class Browser:
    """One headless Chromium (Debian's) for all notebooks, one browser context (so JupyterLab's static assets
    come from the HTTP cache after the first notebook); each notebook gets a fresh page."""

    def __enter__(self):
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        try:
            self.browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            self.context = self.browser.new_context(viewport=VIEWPORT)
        except Exception:
            self._pw.stop()
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.browser.close()
        finally:
            self._pw.stop()


# --------------------------------------------------------------------------------------------------- checking
@dataclass
class Result:
    name: str
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # open / run / settle / screenshot / close, seconds
    problems: dict[str, list[str]] = field(default_factory=lambda: {
        "errors": [], "unrun": [], "widgets": [], "plotly": [], "console": [], "controls": []})
    counts: dict = field(default_factory=dict)
    expected: Expected | None = None
    screenshot: Path | None = None
    allowed_console: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)  # titles of dialogs that were accepted

    @property
    def ok(self) -> bool:
        return not any(self.problems.values())

    def summary(self) -> str:
        steps = ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items())
        lines = [f"{self.name}: {'OK' if self.ok else 'FAILED'} in {self.seconds:.1f}s ({steps}); "
                 f"seen {self.counts}; expected {self.expected}"]
        for kind, items in self.problems.items():
            for item in items:
                lines.append(f"  [{kind}] {item}")
        for title in self.dialogs:
            lines.append(f"  (accepted dialog) {title}")
        for item in self.allowed_console:
            lines.append(f"  (allowed console message) {item}")
        if self.screenshot:
            lines.append(f"  screenshot: {self.screenshot}")
        return "\n".join(lines)


# Runs in the page. Everything is read from JupyterLab's own model + DOM of the current notebook panel.
_JS_STATE = """
() => {
  const app = window.jupyterapp;
  if (!app || !app.shell) return {ready: false, why: 'no window.jupyterapp'};
  const panel = app.shell.currentWidget;
  if (!panel || !panel.content || !panel.sessionContext) return {ready: false, why: 'no notebook panel'};
  const sc = panel.sessionContext;
  const kernel = sc.session && sc.session.kernel;
  const busyPrompts = [...panel.node.querySelectorAll('.jp-InputArea-prompt')]
      .filter(p => p.textContent.includes('[*]')).length;
  return {
    ready: panel.context.isReady && !!kernel,
    why: kernel ? '' : 'no kernel yet',
    kernel: kernel ? kernel.status : null,
    connection: kernel ? kernel.connectionStatus : null,
    busyPrompts,
    dialogs: document.querySelectorAll('.jp-Dialog').length,
  };
}
"""

_JS_REPORT = """
([widgetMime, plotlyMime, viewKinds]) => {
  const panel = window.jupyterapp.shell.currentWidget;
  const nb = panel.content;
  const txt = (el) => (el.textContent || '').replace(/\\s+/g, ' ').trim();
  const report = {codeCells: 0, unrun: [], errors: [], widgetOutputs: [], plotlyOutputs: [], plots: 0};
  nb.widgets.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    report.codeCells += 1;
    const src = cell.model.sharedModel.getSource();
    const head = src.split('\\n')[0].slice(0, 80);
    if (cell.model.executionCount === null && src.trim() !== '') report.unrun.push(`cell ${i}: ${head}`);
    // The k-th output model is rendered in the k-th direct .jp-OutputArea-child of the cell's output area.
    // (Rendered widget and plotly outputs carry no data-mime-type attribute, so the model tells what they are.)
    const children = [...cell.outputArea.node.children].filter(c => c.classList.contains('jp-OutputArea-child'));
    const outputs = cell.model.outputs;
    for (let k = 0; k < outputs.length; k++) {
      const o = outputs.get(k).toJSON();
      const child = children[k];
      const el = child ? (child.querySelector(':scope > .jp-OutputArea-output') || child) : null;
      if (o.output_type === 'error') {
        report.errors.push(`cell ${i} (${head}): ${o.ename}: ${o.evalue}`);
      } else if (o.output_type === 'stream' && o.name === 'stderr') {
        const t = Array.isArray(o.text) ? o.text.join('') : String(o.text);
        if (t.includes('Traceback')) report.errors.push(`cell ${i} (${head}): stderr traceback: ${t.slice(0, 300)}`);
      }
      const data = o.data || {};
      if (widgetMime in data) {
        const hiddenModel = data[widgetMime] && data[widgetMime].model_id === '';
        const t = el ? txt(el) : '';
        report.widgetOutputs.push({
          cell: i, head, text: t.slice(0, 160),
          hidden: hiddenModel || (el && el.classList.contains('lm-mod-hidden')),
          // A live view is a Lumino widget attached inside the output (ipywidgets, anywidget, FigureWidget).
          rendered: !!(el && el.querySelector('.lm-Widget')),
          plots: el ? el.querySelectorAll('.js-plotly-plot').length : 0,
          // "Error displaying widget" text, or ipywidgets' error view ("Click to show javascript error.").
          error: t.startsWith('Error displaying widget') || !!(el && el.querySelector('.jupyter-widgets-error-widget')),
          loading: t.startsWith('Loading widget'),
          // minienv views: each kind named in the repr (text/plain) must be drawn (its widget carries a class)
          views: viewKinds.map(([name, cls]) => {
            const plain = data['text/plain'];
            const rep = Array.isArray(plain) ? plain.join('') : String(plain || '');
            return {name, want: rep.split(name + '(').length - 1, got: el ? el.querySelectorAll('.' + cls).length : 0};
          }).filter(v => v.want > 0),
        });
      }
      if (plotlyMime in data) {
        const plots = el ? (el.matches('.js-plotly-plot') ? 1 : 0) + el.querySelectorAll('.js-plotly-plot').length : 0;
        report.plotlyOutputs.push({cell: i, head, plots, text: el ? txt(el).slice(0, 120) : '<no output element>'});
      }
    }
  });
  // DOM-level safety net: an error rendering anywhere in the notebook.
  report.domErrors = [...panel.node.querySelectorAll(
      '[data-mime-type="application/vnd.jupyter.error"], [data-mime-type="application/vnd.jupyter.stderr"]')]
      .map(txt).filter(t => t.includes('Traceback')).map(t => t.slice(0, 200));
  report.plots = panel.node.querySelectorAll('.js-plotly-plot').length;
  return report;
}
"""


def _accept_dialogs(page, log: list[str]) -> None:
    """Accept whatever dialog is up ("Select Kernel", "Restart Kernel?") with its default button, and note it."""
    for dialog in page.query_selector_all(".jp-Dialog"):
        try:
            header = dialog.query_selector(".jp-Dialog-header")
            title = (header.inner_text() if header else "").strip() or "(untitled dialog)"
            button = dialog.query_selector(".jp-Dialog-button.jp-mod-accept")
            if button:
                button.click(timeout=2000)
                log.append(title)
        except Exception:
            pass


def _wait(page, predicate, timeout: float, what: str, dialogs: list[str], poll: float = 0.25):
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = page.evaluate(_JS_STATE)
        if state.get("dialogs"):
            _accept_dialogs(page, dialogs)
        elif predicate(state):
            return state
        page.wait_for_timeout(poll * 1000)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; last state {state}")


def check_notebook(browser: Browser, server: LabServer, rel_path: str, expected: Expected,
                   screenshot: Path | None = None, run_timeout: float = 180, settle_timeout: float = 30,
                   prestart_kernel: bool = True, controls: bool = True) -> Result:
    """Open `rel_path` (relative to the server root) on a fresh kernel, run all cells, check what renders; then
    (``controls``) click / slide / type every control and check that its live view answers (`lab_controls`)."""
    res = Result(name=rel_path, expected=expected)
    t0 = time.monotonic()
    console: list[tuple[str, str, str]] = []  # (phase, kind, text)
    phase = {"now": "load"}
    page = browser.context.new_page()

    def on_console(msg):
        if msg.type == "error":
            loc = msg.location or {}
            console.append((phase["now"], "console.error", f"{msg.text} @ {loc.get('url', '')}"))

    page.on("console", on_console)
    page.on("pageerror", lambda err: console.append((phase["now"], "pageerror", f"{err}")))
    try:
        if prestart_kernel:
            # Start the notebook's kernel (a fresh one, through the same REST API the UI uses) while the page
            # boots; JupyterLab finds the session by path and connects to it instead of starting another.
            server.api("POST", "api/sessions", {"path": rel_path, "type": "notebook", "name": Path(rel_path).name,
                                                "kernel": {"name": expected.kernel_name}})
        # `reset`: start from an empty workspace (do not restore tabs of the previous notebook).
        page.goto(server.url(f"lab/tree/{rel_path}", reset=""), wait_until="domcontentloaded", timeout=60000)
        _wait(page, lambda s: s.get("ready") and s.get("kernel") == "idle", 90, "the notebook's kernel to be idle",
              res.dialogs)
        res.timings["open"] = time.monotonic() - t0
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # the whole width for the notebook

        phase["now"] = "run"
        t_run = time.monotonic()
        # The kernel was started for this notebook a moment ago and has run nothing, so "clear all outputs" +
        # "run all cells" is "Restart Kernel and Run All Cells" without the restart. (A restart right after
        # startup races the debugger's state restore, which then logs "Could not restore the debugger state:
        # Canceled future for debug_request" -- noise, not a notebook problem.) Clearing first matters: cells
        # that never run (after an error) must not keep their committed outputs.
        page.evaluate("""() => { window.__labCheck = {done: false};
            const cmds = window.jupyterapp.commands;
            cmds.execute('notebook:clear-all-cell-outputs')
              .then(() => cmds.execute('notebook:run-all-cells'))
              .then(() => { window.__labCheck = {done: true}; },
                    e => { window.__labCheck = {done: true, error: String(e)}; }); }""")
        deadline = time.monotonic() + run_timeout
        while True:
            flag = page.evaluate("() => window.__labCheck")
            state = page.evaluate(_JS_STATE)
            if state.get("dialogs"):
                _accept_dialogs(page, res.dialogs)
            elif flag["done"] and state.get("kernel") == "idle" and state.get("busyPrompts") == 0:
                break
            elif state.get("kernel") in ("dead", "autorestarting", "restarting"):
                raise RuntimeError(f"the kernel died during Run All (status {state['kernel']!r})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Run All did not finish within {run_timeout:.0f}s; last state {state}")
            page.wait_for_timeout(250)
        if flag.get("error"):
            res.problems["errors"].append(f"run-all-cells command failed: {flag['error']}")
        res.timings["run"] = time.monotonic() - t_run
        t_settle = time.monotonic()

        # Widgets and plots render asynchronously after the kernel goes idle: wait until everything expected has
        # rendered, or nothing has changed for `STABLE_SECONDS` with no view still loading (it never will), or
        # `settle_timeout` has passed.
        deadline = time.monotonic() + settle_timeout
        last, last_change = None, time.monotonic()
        while True:
            rep = page.evaluate(_JS_REPORT, [WIDGET_MIME, PLOTLY_MIME, VIEW_KINDS])
            visible = [w for w in rep["widgetOutputs"] if not w["hidden"]]
            # still on its way: a widget output saying "Loading widget...", a plotly output not yet drawn
            loading = sum(w["loading"] for w in visible) + sum(not p["plots"] for p in rep["plotlyOutputs"])
            rendered = sum(w["rendered"] for w in visible)
            settled = (not loading and rendered >= expected.widget_views and rep["plots"] >= expected.plotly_figures
                       and all(p["plots"] for p in rep["plotlyOutputs"]))
            now = time.monotonic()
            seen = (loading, rendered, rep["plots"], len(visible), len(rep["plotlyOutputs"]))
            if seen != last:
                last, last_change = seen, now
            if settled or now > deadline or (not loading and now - last_change > STABLE_SECONDS):
                break
            page.wait_for_timeout(300)
        page.wait_for_timeout(300)  # let a last console error (if any) arrive
        rep = page.evaluate(_JS_REPORT, [WIDGET_MIME, PLOTLY_MIME, VIEW_KINDS])
        _judge(res, rep, expected)
        res.timings["settle"] = time.monotonic() - t_settle

        if screenshot is not None:
            t_shot = time.monotonic()
            _screenshot(page, screenshot)
            res.screenshot = screenshot
            res.timings["screenshot"] = time.monotonic() - t_shot
        if controls:
            t_ctl = time.monotonic()
            found, problems = drive_controls(page)
            res.problems["controls"].extend(problems)
            res.counts["controls"] = {k: sum(c["kind"] == k for c in found) for k in ("stepper", "slider", "text")}
            res.timings["controls"] = time.monotonic() - t_ctl
    except Exception as e:  # a hang or crash is a failure of this notebook, with a screenshot to look at
        res.problems["errors"].append(f"{type(e).__name__}: {e}")
        if screenshot is not None:
            try:
                _screenshot(page, screenshot)
                res.screenshot = screenshot
            except Exception:
                pass
    finally:
        for ph, kind, text in console:
            if _console_allowed(ph, text):
                res.allowed_console.append(f"({ph}) {kind}: {text}")
            else:
                res.problems["console"].append(f"({ph}) {kind}: {text}")
        t_close = time.monotonic()
        page.close()
        try:
            server.shutdown_kernels()
        except Exception:
            pass
        res.timings["close"] = time.monotonic() - t_close
        res.seconds = time.monotonic() - t0
    return res


def _judge(res: Result, rep: dict, expected: Expected) -> None:
    res.problems["errors"].extend(rep["errors"])
    if not rep["errors"]:  # the model saw no error, but the page shows a traceback: still an error
        res.problems["errors"].extend(f"rendered error output: {t}" for t in rep["domErrors"])
    res.problems["unrun"].extend(rep["unrun"])
    visible = [w for w in rep["widgetOutputs"] if not w["hidden"]]
    for w in visible:
        if w["error"] or w["loading"] or not w["rendered"]:
            res.problems["widgets"].append(f"cell {w['cell']} ({w['head']}): widget output is not a live view: "
                                           f"{w['text'] or '<empty>'!r}")
        for v in w.get("views", []):
            if w["rendered"] and v["got"] < v["want"]:
                res.problems["widgets"].append(
                    f"cell {w['cell']} ({w['head']}): the live view draws {v['got']} {v['name']}, its repr names "
                    f"{v['want']}")
    rendered = sum(1 for w in visible if w["rendered"] and not w["error"] and not w["loading"])
    if rendered < expected.widget_views:
        res.problems["widgets"].append(
            f"{rendered} rendered widget views, the committed notebook has {expected.widget_views} widget outputs")
    for p in rep["plotlyOutputs"]:
        if not p["plots"]:
            res.problems["plotly"].append(f"cell {p['cell']} ({p['head']}): plotly output without .js-plotly-plot: "
                                          f"{p['text']!r}")
    if rep["plots"] < expected.plotly_figures:
        res.problems["plotly"].append(
            f"{rep['plots']} rendered .js-plotly-plot, the committed notebook has {expected.plotly_figures} figures")
    res.counts = {"code_cells": rep["codeCells"], "widget_views": rendered, "plotly_plots": rep["plots"]}


def _console_allowed(phase: str, text: str) -> bool:
    return any(re.search(pattern, text) and phase == only_phase for pattern, only_phase, _why in CONSOLE_ALLOW)


def _screenshot(page, path: Path) -> None:
    """The whole notebook, not just the viewport: grow the viewport to the notebook's scroll height."""
    path.parent.mkdir(parents=True, exist_ok=True)
    height = page.evaluate("""() => {
        const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        const outer = panel && panel.node.querySelector('.jp-WindowedPanel-outer');
        return outer ? outer.scrollHeight : document.body.scrollHeight; }""")
    extra = VIEWPORT["height"] - page.evaluate("""() => {
        const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        const outer = panel && panel.node.querySelector('.jp-WindowedPanel-outer');
        return outer ? outer.clientHeight : 0; }""")
    page.set_viewport_size({"width": VIEWPORT["width"],
                            "height": int(min(MAX_SCREENSHOT_HEIGHT, max(VIEWPORT["height"], height + extra + 40)))})
    page.wait_for_timeout(300)
    # Run All leaves the last cell active and scrolled into view: show the notebook from its first cell.
    page.evaluate("""() => {
        const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        if (panel && panel.content) panel.content.activeCellIndex = 0;
        const outer = panel && panel.node.querySelector('.jp-WindowedPanel-outer');
        if (outer) outer.scrollTop = 0; }""")
    page.wait_for_timeout(500)  # plotly relayouts on resize
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(VIEWPORT)


# --------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="notebooks or folders (default: notebooks/)")
    ap.add_argument("--screenshots", type=Path, default=REPO / "tests" / "browser" / "screenshots")
    ap.add_argument("--no-controls", action="store_true", help="do not drive the controls after Run All")
    args = ap.parse_args(argv)
    missing = missing_dependencies()
    if missing:
        print("browser check needs:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 2
    paths = args.paths or [REPO / "notebooks"]
    notebooks = []
    for p in paths:
        notebooks += sorted(p.glob("*.ipynb")) if p.is_dir() else [p]
    if not notebooks:
        print("no notebooks to check", file=sys.stderr)
        return 0
    folders = {f"d{i}": d for i, d in enumerate(sorted({nb.resolve().parent for nb in notebooks}))}
    where = {v: k for k, v in folders.items()}
    failed = 0
    t0 = time.monotonic()
    with LabServer(folders) as server, Browser() as browser:
        print(f"JupyterLab up in {time.monotonic() - t0:.1f}s at {server.base}")
        for nb in notebooks:
            rel = f"{where[nb.resolve().parent]}/{nb.name}"
            res = check_notebook(browser, server, rel, expected_from_ipynb(nb),
                                 screenshot=args.screenshots / f"{nb.stem}.png", controls=not args.no_controls)
            res.name = str(nb)
            print(res.summary(), flush=True)
            failed += not res.ok
    print(f"{len(notebooks) - failed}/{len(notebooks)} notebooks OK in {time.monotonic() - t0:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

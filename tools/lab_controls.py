"""Drive every control of a notebook that has run in JupyterLab, and check that its live view answers.

Used by `tools/lab_check.py` after Run All (the browser tier). It finds, in the rendered outputs:

  stepper   a box with a **Step** and a **Reset** button (minienv.viz.Stepper; its ▶ / ■ Play widget too)
  slider    an enabled ipywidgets slider outside a stepper
  text      an enabled text box or text area

(a slider or text box shown beside buttons of its own is a parameter of those buttons and is not driven)

and, for each, checks what the control promises. The *picture* of a control is everything its cell's outputs
draw except the control itself (text, and the shapes and colours of every SVG element: minienv's SVG views and
plotly's figures), so a counter that moves while the views stay still does not count as a change.

  stepper   Reset, then Step changes the picture; Reset gives back the picture of the first Reset; ▶ changes
            it again (the timer runs in the browser); ■ gives back the first picture again
  slider    moving the handle to the other end (keyboard End / Home) changes the picture
  text      typing a new text changes the picture

Every control is waited for (the kernel answers through comm messages, then the browser redraws): a change must
show within `CHANGE_TIMEOUT` seconds, a restored picture must equal the first one within the same time.
"""

from __future__ import annotations

import time

CHANGE_TIMEOUT = 20.0  # read at each call (the checker's self-test shortens it: its dead controls wait it out)
POLL = 0.25

# Marks each control with data-mnv-* attributes (so playwright can click it) and lists them.
_JS_FIND = r"""
() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const found = [];
  let n = 0;
  const head = (cell) => cell.model.sharedModel.getSource().split('\n')[0].slice(0, 60);
  panel.content.widgets.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    const area = cell.outputArea.node;
    const steppers = [];
    area.querySelectorAll('button').forEach(b => {
      if (b.textContent.trim() !== 'Step') return;
      const row = b.parentElement;
      const reset = [...row.querySelectorAll('button')].find(x => x.textContent.trim() === 'Reset');
      if (!reset) return;
      // the Stepper is a VBox of this row and its caption line: leave both out of the picture
      const parent = row.parentElement;
      const root = parent && /(^|\s)(jupyter-)?widget-(vbox|box)(\s|$)/.test(parent.className) ? parent : row;
      const id = `c${n++}`;
      root.dataset.mnvRoot = id; b.dataset.mnvStep = id; reset.dataset.mnvReset = id;
      const play = row.querySelector('.widget-play, .jupyter-widget-play');
      let hasPlay = false;
      if (play) {
        // ipywidgets 8: one play/pause toggle (its icon changes), a stop button, a (hidden) repeat toggle
        const byIcon = (icon) => [...play.querySelectorAll('button')].find(x => x.querySelector(`.fa-${icon}`));
        const start = byIcon('play'), stop = byIcon('stop');
        if (start && stop) { start.dataset.mnvPlay = id; stop.dataset.mnvStop = id; hasPlay = true; }
      }
      steppers.push(root);
      found.push({id, kind: 'stepper', cell: i, head: head(cell), play: hasPlay});
    });
    const inStepper = (el) => steppers.some(s => s.contains(el));
    // A slider or text box beside buttons of their own (not a stepper's) is a parameter of those buttons (e.g.
    // "block to corrupt" + Corrupt): moving it alone promises no change, so it is not driven.
    const output = (el) => el.closest('.jp-OutputArea-output');
    const hasOwnButtons = (el) => [...output(el).querySelectorAll('button.jupyter-button, button.widget-button')]
        .some(b => !inStepper(b) && !b.closest('.widget-play, .jupyter-widget-play'));  // not plotly's mode bar
    area.querySelectorAll('.widget-slider, .jupyter-widget-slider').forEach(s => {
      const handle = s.querySelector('.noUi-handle');
      const target = s.querySelector('.noUi-target');
      if (!handle || inStepper(s) || hasOwnButtons(s) || (target && target.hasAttribute('disabled'))) return;
      const id = `c${n++}`;
      s.dataset.mnvRoot = id; handle.dataset.mnvHandle = id;
      found.push({id, kind: 'slider', cell: i, head: head(cell)});
    });
    area.querySelectorAll('.widget-text input, .widget-textarea textarea').forEach(inp => {
      if (inp.disabled || inStepper(inp) || hasOwnButtons(inp)) return;
      const root = inp.closest('.widget-text, .widget-textarea');
      const id = `c${n++}`;
      root.dataset.mnvRoot = id; inp.dataset.mnvInput = id;
      found.push({id, kind: 'text', cell: i, head: head(cell)});
    });
  });
  return found;
}
"""

# The picture of a control: its cell's outputs without the control (text + SVG shapes with their geometry and
# colours; plotly's hover layer and mode bar are left out, they follow the mouse).
_JS_PICTURE = r"""
(id) => {
  const root = document.querySelector(`[data-mnv-root="${id}"]`);
  if (!root) return null;
  const area = root.closest('.jp-OutputArea');
  const keys = ['x', 'y', 'width', 'height', 'd', 'fill', 'stroke', 'stroke-width', 'points', 'transform', 'style',
                'font-size'];
  const parts = [];
  const walk = (el) => {
    if (el === root) return;
    if (el.nodeType === 3) { const t = el.textContent.trim(); if (t) parts.push(t); return; }
    if (el.nodeType !== 1) return;
    const cls = el.classList;
    if (cls && (cls.contains('hoverlayer') || cls.contains('modebar-container'))) return;
    if (el.namespaceURI === 'http://www.w3.org/2000/svg' && el.tagName !== 'svg') {
      parts.push(el.tagName + '[' + keys.map(k => el.getAttribute(k)).filter(v => v).join(';') + ']');
    }
    for (const c of el.childNodes) walk(c);
  };
  walk(area);
  return parts.join('|');
}
"""

_JS_KERNEL_IDLE = """() => { const p = window.jupyterapp.shell.currentWidget;
  const k = p && p.sessionContext.session && p.sessionContext.session.kernel; return !!k && k.status === 'idle'; }"""

# How many times the kernel has gone busy since the checker started listening (every comm message a control sends
# makes it busy, then idle): a click has been handled once the count rose and the kernel is idle again.
_JS_BUSY_COUNT = """() => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  if (!window.__mnvKernel || window.__mnvKernel.kernel !== k) {
    window.__mnvKernel = {kernel: k, busy: 0};
    k.statusChanged.connect((_, s) => { if (s === 'busy') window.__mnvKernel.busy += 1; });
  }
  return window.__mnvKernel.busy; }"""


def _settle(page, id_: str, timeout: float | None = None) -> str | None:
    """The control's picture once the kernel is idle and the picture has stopped changing."""
    deadline = time.monotonic() + (CHANGE_TIMEOUT if timeout is None else timeout)
    last, stable_since = None, time.monotonic()
    while time.monotonic() < deadline:
        pic = page.evaluate(_JS_PICTURE, id_)
        idle = page.evaluate(_JS_KERNEL_IDLE)
        now = time.monotonic()
        if pic != last:
            last, stable_since = pic, now
        elif idle and now - stable_since >= 0.6:
            return pic
        page.wait_for_timeout(POLL * 1000)
    return last


def _wait_for(page, id_: str, want, timeout: float | None = None) -> tuple[bool, str | None]:
    """Poll the picture until ``want(picture)``; then let it settle. (ok, picture)."""
    deadline = time.monotonic() + (CHANGE_TIMEOUT if timeout is None else timeout)
    pic = None
    while time.monotonic() < deadline:
        pic = page.evaluate(_JS_PICTURE, id_)
        if pic is not None and want(pic):
            return True, _settle(page, id_)
        page.wait_for_timeout(POLL * 1000)
    return False, pic


def _first_difference(a: str | None, b: str | None) -> str:
    a, b = (a or "").split("|"), (b or "").split("|")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"item {i}: {x[:90]!r} vs {y[:90]!r}"
    return f"lengths {len(a)} vs {len(b)}"


def _handled(page, before: int, timeout: float | None = None) -> None:
    """Wait until the kernel has gone busy since ``before`` (the control's message arrived) and is idle again; a
    kernel that never goes busy within a few seconds got nothing to do (then just return)."""
    deadline, started = time.monotonic() + (CHANGE_TIMEOUT if timeout is None else timeout), time.monotonic()
    while time.monotonic() < deadline:
        busy = page.evaluate(_JS_BUSY_COUNT) > before
        if busy and page.evaluate(_JS_KERNEL_IDLE):
            return
        if not busy and time.monotonic() - started > 3:
            return
        page.wait_for_timeout(POLL * 1000)


def _click(page, selector: str) -> None:
    before = page.evaluate(_JS_BUSY_COUNT)
    page.locator(selector).first.click(timeout=CHANGE_TIMEOUT * 1000)
    _handled(page, before)


def check_stepper(page, c: dict) -> list[str]:
    id_, where = c["id"], f"cell {c['cell']} ({c['head']}): stepper"
    problems = []
    _click(page, f'[data-mnv-reset="{id_}"]')
    first = _settle(page, id_)
    _click(page, f'[data-mnv-step="{id_}"]')
    ok, stepped = _wait_for(page, id_, lambda p: p != first)
    if not ok:
        problems.append(f"{where}: Step did not change the live view")
    _click(page, f'[data-mnv-reset="{id_}"]')
    ok, after = _wait_for(page, id_, lambda p: p == first)
    if not ok:
        problems.append(f"{where}: Reset did not restore the first picture ({_first_difference(first, after)})")
    if c.get("play"):
        _click(page, f'[data-mnv-play="{id_}"]')
        ok, _ = _wait_for(page, id_, lambda p: p != first)
        if not ok:
            problems.append(f"{where}: ▶ did not change the live view")
        _click(page, f'[data-mnv-stop="{id_}"]')
        ok, after = _wait_for(page, id_, lambda p: p == first)
        if not ok:
            problems.append(f"{where}: ■ did not restore the first picture ({_first_difference(first, after)})")
    return problems


def check_slider(page, c: dict) -> list[str]:
    id_, where = c["id"], f"cell {c['cell']} ({c['head']}): slider"
    before = _settle(page, id_)
    handle = page.locator(f'[data-mnv-handle="{id_}"]').first
    handle.focus(timeout=5000)
    moved = False
    for key in ("End", "Home"):  # whichever end the handle is not at
        busy = page.evaluate(_JS_BUSY_COUNT)
        handle.press(key)
        _handled(page, busy)
        ok, _ = _wait_for(page, id_, lambda p: p != before, timeout=CHANGE_TIMEOUT / 2)
        if ok:
            moved = True
            break
    return [] if moved else [f"{where}: moving the slider to either end did not change the live view"]


def check_text(page, c: dict) -> list[str]:
    id_, where = c["id"], f"cell {c['cell']} ({c['head']}): text box"
    before = _settle(page, id_)
    box = page.locator(f'[data-mnv-input="{id_}"]').first
    busy = page.evaluate(_JS_BUSY_COUNT)
    box.fill("Alas, poor Yorick! 42", timeout=5000)
    _handled(page, busy)
    ok, _ = _wait_for(page, id_, lambda p: p != before)
    return [] if ok else [f"{where}: typing did not change the live view"]


CHECKS = {"stepper": check_stepper, "slider": check_slider, "text": check_text}


def drive_controls(page) -> tuple[list[dict], list[str]]:
    """Find and drive every control on the current notebook page: (controls found, problems)."""
    controls = page.evaluate(_JS_FIND)
    page.evaluate(_JS_BUSY_COUNT)  # start listening to the kernel's status
    problems = []
    for c in controls:
        try:
            problems += CHECKS[c["kind"]](page, c)
        except Exception as e:  # a control that cannot be clicked / focused is a failure of that control
            problems.append(f"cell {c['cell']} ({c['head']}): {c['kind']}: {type(e).__name__}: {str(e)[:200]}")
    return controls, problems

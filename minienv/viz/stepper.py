"""``Stepper``: step / play / reset controls that drive a callback, clickable and scriptable.

    def on_step(i):            # perform step i (0, 1, 2, ...) and update your views in place
        alloc.apply(actions[i]); grid.update(alloc.cells())
        return actions[i].describe()   # optional: a caption shown next to the controls
    def on_reset():            # back to the initial state
        alloc = Toy(); grid.reset()

    stepper = Stepper(on_step, on_reset, n_steps=len(actions))
    stepper                    # the controls: ▶ play/pause, ■ stop (= reset), Step, Reset, a step counter
    stepper.step(); stepper.run(); stepper.reset()   # the same, from code (notebooks, tests, nbval)

Play is an ``ipywidgets.Play``: the timer runs in the browser (no kernel thread), and each tick reaches the
kernel as a value change that this class turns into ``on_step`` calls, so clicks and ticks go through the same
path as ``step()``. An exception raised by the callback while clicking stops playback and is shown in red under
the controls; from code it propagates.

``on_step`` may return a string (shown as the step's caption) or ``False`` meaning "there is no further step"
(the stepper is then done; the position does not advance) — handy when the number of steps is not known in
advance (``n_steps=None``), e.g. "run the engine until every request finished".
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

from . import _style as S
from ._view import View

_UNBOUNDED = 10**6


class Stepper(View):
    """Step / play / reset controls around ``on_step(step_index)`` and ``on_reset()``.

    Parameters
    ----------
    on_step:     called with the 0-based index of the step to perform.
    on_reset:    called by ``reset()`` (and by Play's stop button and by seeking backwards).
    n_steps:     how many steps there are, or None if ``on_step`` says when it is done (returns False).
    interval_ms: time between two steps while playing.
    description: the word on the counter (e.g. "step", "engine step", "token").
    """

    def __init__(
        self,
        on_step: Callable[[int], Any],
        on_reset: Callable[[], Any] | None = None,
        *,
        n_steps: int | None = None,
        interval_ms: int = 800,
        description: str = "step",
    ) -> None:
        if not callable(on_step):
            raise ValueError(f"on_step must be callable, got {on_step!r}")
        if on_reset is not None and not callable(on_reset):
            raise ValueError(f"on_reset must be callable or None, got {on_reset!r}")
        if n_steps is not None and (isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral)
                                    or n_steps < 0):
            raise ValueError(f"n_steps must be an integer >= 0 or None, got {n_steps!r}")
        if isinstance(interval_ms, bool) or not isinstance(interval_ms, numbers.Integral) or interval_ms < 10:
            raise ValueError(f"interval_ms must be an integer >= 10, got {interval_ms!r}")
        self.on_step = on_step
        self.on_reset = on_reset
        self.n_steps = None if n_steps is None else int(n_steps)
        self.description = description
        self._position = 0
        self._done = self.n_steps == 0
        self._caption = ""
        self._error = ""
        self._syncing = False
        self._play_driving = False
        self.history: list[int] = []  # step indices performed since the last reset, in order

        w = S.require("ipywidgets")
        top = _UNBOUNDED if self.n_steps is None else self.n_steps
        self.play = w.Play(value=0, min=0, max=top, step=1, interval=int(interval_ms), show_repeat=False,
                           description="play", tooltip="play / pause; ■ goes back to the start")
        self.step_button = w.Button(description="Step", icon="step-forward", tooltip="one step",
                                    layout=w.Layout(width="90px"))
        self.reset_button = w.Button(description="Reset", icon="undo", tooltip="back to the start",
                                     layout=w.Layout(width="90px"))
        self.slider = w.IntSlider(value=0, min=0, max=max(top if self.n_steps is not None else 1, 1),
                                  description=description, disabled=True, readout=False,
                                  layout=w.Layout(width="320px"), style={"description_width": "initial"})
        self.counter = w.Label(value=self._counter_text())
        self.status = w.HTML(value="")
        self.widget = w.VBox(
            [w.HBox([self.play, self.step_button, self.reset_button, self.slider, self.counter]), self.status]
        )
        self.step_button.on_click(lambda _b: self._ui(self.step))
        self.reset_button.on_click(lambda _b: self._ui(self.reset))
        self.play.observe(self._on_play_value, names="value")

    # ------------------------------------------------------------------ state
    @property
    def position(self) -> int:
        """How many steps have been taken since the last reset."""
        return self._position

    @property
    def done(self) -> bool:
        """True when there is no further step."""
        return self._done

    @property
    def caption(self) -> str:
        """The caption returned by the last step (or "")."""
        return self._caption

    # ------------------------------------------------------------------ driving
    def step(self) -> bool:
        """Perform the next step; return False (and do nothing) when already done."""
        if self._done:
            return False
        index = self._position
        result = self.on_step(index)
        if result is False:
            self._done = True
            self._sync()
            return False
        self._position += 1
        self.history.append(index)
        self._caption = result if isinstance(result, str) else ""
        if self.n_steps is not None and self._position >= self.n_steps:
            self._done = True
        self._sync()
        return True

    def run(self, max_steps: int | None = None) -> int:
        """Step until done (or ``max_steps`` steps); return how many steps were taken."""
        taken = 0
        while (max_steps is None or taken < max_steps) and self.step():
            taken += 1
        return taken

    def reset(self) -> None:
        """Call ``on_reset()`` and go back to step 0."""
        if self.on_reset is not None:
            self.on_reset()
        self._position = 0
        self._done = self.n_steps == 0
        self._caption = ""
        self._error = ""
        self.history = []
        self._sync()

    def go_to(self, position: int) -> None:
        """Reset, then step until ``position`` steps have been taken (or the stepper is done)."""
        if isinstance(position, bool) or not isinstance(position, numbers.Integral) or position < 0:
            raise ValueError(f"position must be an integer >= 0, got {position!r}")
        if position < self._position:
            self.reset()
        while self._position < position and self.step():
            pass

    # ------------------------------------------------------------------ widgets
    def _counter_text(self) -> str:
        total = "?" if self.n_steps is None else str(self.n_steps)
        return f"{self.description} {self._position} / {total}" + ("  (done)" if self._done else "")

    def _sync(self) -> None:
        """Mirror the position into the widgets without triggering their observers."""
        self._syncing = True
        try:
            if not self._play_driving:  # while Play drives, the browser owns its value: don't echo it back
                self.play.value = min(self._position, self.play.max)
            if self._done:
                self.play.playing = False
            if self.n_steps is None and self._position > self.slider.max:
                self.slider.max = self._position
            self.slider.value = self._position
            self.counter.value = self._counter_text()
            if self._error:
                self.status.value = f'<span style="color:#c0392b">error: {S.esc(self._error)}</span>'
            else:
                self.status.value = S.esc(self._caption)
            self.step_button.disabled = self._done
        finally:
            self._syncing = False

    def _ui(self, action: Callable[[], Any]) -> None:
        """Run an action from a click or a tick: never raise into the widget machinery, show the error."""
        try:
            self._error = ""
            action()
        except Exception as exc:  # noqa: BLE001 - shown to the user under the controls
            self._error = f"{type(exc).__name__}: {exc}"
            self.play.playing = False
            self._sync()

    def _on_play_value(self, change: dict) -> None:
        if self._syncing:
            return
        target = int(change["new"])
        self._play_driving = True
        try:
            self._ui(lambda: self.go_to(target))
        finally:
            self._play_driving = False
        if self._position != target:
            # done early (or an error): put the Play widget back where we are, and stop it
            self._syncing = True
            try:
                self.play.playing = False
                self.play.value = min(self._position, self.play.max)
            finally:
                self._syncing = False

    def to_html(self) -> str:
        """A one-line static rendering: where the stepper stands."""
        return f"<p><b>{S.esc(self._counter_text())}</b> {S.esc(self._caption)}</p>"

    def __repr__(self) -> str:
        return f"Stepper(position={self._position}, n_steps={self.n_steps}, done={self._done})"

"""Notebook 14's live widget on the student's own class: the contract's calls stepped through a script, drawn by
the same :class:`~minienv.viz.kv_views.ManagerView` that showed minienv's manager, each step compared with what
minienv's manager holds after the same calls.

Why the student's class as soon as it is written, not only once it passes: a student whose grading fails learns
most from watching *their* pool next to the caption that names the first step where it stops matching minienv's
(which blocks a table holds, what the free queue holds, what is still cached). Until the class is written (a
method still raises ``NotImplementedError``) minienv's manager stands in, and the caption says so, so the page
renders for every reader. An exception from the student's code, or an invariant it breaks, stops the replay
with the error in the caption: never a traceback out of the widget.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from minienv.exercises.capstone_plug import plug
from minienv.kv.kv_cache_manager import KVCacheManager

Script = Sequence[tuple[str, Callable[[Any], Any]]]


def pool_state(m: Any) -> dict[str, Any]:
    """What the view draws, comparable between two managers: each block table, refcount and the free queue."""
    return {"tables": {rid: list(m.block_ids(rid)) for rid in sorted(m.request_ids(), key=str)},
            "refcounts": [m.ref_cnt(b) for b in range(m.num_blocks)],
            "free queue (block, cached)": list(m.free_queue())}


def _difference(mine: dict[str, Any], ref: dict[str, Any]) -> str:
    for key in ref:
        if mine[key] != ref[key]:
            return f"{key}: yours {mine[key]}, minienv's {ref[key]}"
    return ""


class ScriptWatch:
    """A :class:`~minienv.viz.Stepper` and a :class:`~minienv.viz.kv_views.ManagerView` stepping ``script`` on
    ``student_class`` (plugged: the view reads the same protocol as minienv's manager), or on minienv's manager
    while the class is a stub.

    ``script``: ``[(caption, call(manager)), ...]``; ``reset()`` forgets the caller's request objects (run before
    each pass). After each step :attr:`matches` says whether the pool equals minienv's after the same calls;
    :attr:`first_difference` names the first step that did not, :attr:`error` the exception that stopped it.
    """

    def __init__(self, student_class: type, script: Script, reset: Callable[[], None], *, num_blocks: int = 6,
                 block_size: int = 4, interval_ms: int = 1200) -> None:
        import ipywidgets as widgets

        from minienv.viz import Stepper
        from minienv.viz.kv_views import ManagerView

        self.script, self._reset_requests = list(script), reset
        self.num_blocks, self.block_size = num_blocks, block_size
        self.reference = self._replay(lambda: KVCacheManager(num_blocks, block_size))
        self.yours = self._written(student_class)
        self._make = ((lambda: plug(student_class)(num_blocks, block_size, True)) if self.yours
                      else (lambda: KVCacheManager(num_blocks, block_size)))
        who = ("your MyKVCacheManager" if self.yours else "minienv's KVCacheManager (yours once it is written)"
               if self.build_error is None else f"minienv's KVCacheManager (building yours raised {self.build_error})")
        self.manager = self._make()
        self.view = ManagerView(self.manager, title=f"{who}: {num_blocks} blocks of {block_size} tokens",
                                columns=num_blocks)
        self.stepper = Stepper(self._step, self._reset, n_steps=len(self.script), interval_ms=interval_ms,
                               description="call")
        self.widget = widgets.VBox([self.stepper.widget, self.view.widget])
        self.stepper.reset()

    # ------------------------------------------------------------------ the two passes
    def _replay(self, make: Callable[[], Any]) -> list[dict[str, Any]]:
        self._reset_requests()
        m, states = make(), []
        for _, call in self.script:
            call(m)
            states.append(pool_state(m))
        return states

    def _written(self, student_class: type) -> bool:
        """Whether the class's methods run (no ``NotImplementedError`` on the script); a class that raises anything
        else is written — its error is shown at its step. One that cannot even be built is not drawn: minienv's
        manager stands in, and :attr:`build_error` (in the title) says why."""
        self.build_error = None
        try:
            plug(student_class)(self.num_blocks, self.block_size, True)
        except Exception as err:  # noqa: BLE001 - NotImplementedError: the stub; anything else: shown in the title
            if not isinstance(err, NotImplementedError):
                self.build_error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            return False
        try:
            self._replay(lambda: plug(student_class)(self.num_blocks, self.block_size, True))
        except NotImplementedError:
            return False
        except Exception:  # noqa: BLE001 - written, but wrong: the stepper shows where
            return True
        return True

    # ------------------------------------------------------------------ the stepper's callbacks
    def _reset(self) -> None:
        self._reset_requests()
        self.manager = self._make()
        self.view.attach(self.manager)
        self.matches: bool | None = None
        self.first_difference: str | None = None
        self.error: str | None = None

    def _step(self, i: int) -> str | bool:
        caption, call = self.script[i]
        if self.error is not None:
            return False  # stopped at the step that raised
        try:
            call(self.manager)
            self.manager.check_invariants()
        except Exception as err:  # noqa: BLE001 - the student's bug (or a broken invariant), shown, never raised
            self.error = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            self.matches = False
            self.first_difference = self.first_difference or f"step {i + 1} raised {self.error}"
            stopped = f"step {i + 1}: {caption} — stopped: {self.error}"
            try:
                self.view.update(caption=stopped)
            except Exception:  # noqa: BLE001 - the pool cannot be read (e.g. a table of the wrong length)
                self.view.grid.update({}, caption=stopped, partial=True)  # keep the last picture, say why
            return f"stopped: {self.error}"
        diff = _difference(pool_state(self.manager), self.reference[i])
        self.matches = not diff
        if diff and self.first_difference is None:
            self.first_difference = f"step {i + 1}: {diff}"
        verdict = "same pool as minienv's" if not diff else f"differs from minienv's ({diff})"
        self.view.update(caption=f"step {i + 1}: {caption} — {verdict}")
        return verdict

    def static(self) -> Any:
        return self.view.static()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any) -> dict:
        return self.widget._repr_mimebundle_(include=include, exclude=exclude, **kwargs)

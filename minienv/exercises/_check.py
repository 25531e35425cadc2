"""The machinery every exercise check shares: stub detection, rule-naming failures, one output format."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any



class Verdict(str):
    """What a check returns: ``PASSED`` or ``NOT_IMPLEMENTED``. The check has already printed its sentence, so a
    notebook cell ending in ``check_x(x)`` shows nothing more (no ``Out[...]`` echo)."""

    def _ipython_display_(self) -> None:
        pass


PASSED = Verdict("passed")
NOT_IMPLEMENTED = Verdict("not implemented")


class ExerciseFailed(AssertionError):
    """A wrong answer. The first line of the message is ``✗ <rule>``; the rest shows the case that broke it."""

    def __init__(self, rule: str, detail: str = "") -> None:
        self.rule = rule
        self.detail = detail
        super().__init__(f"✗ {rule}" + (f"\n  {detail}" if detail else ""))


class _NotYet(BaseException):
    """Raised inside a check when the student's function is still the stub."""


def _mark(err: BaseException, attempt: "Attempt", args: tuple, kwargs: dict) -> None:
    err._minienv_student = (attempt.rule, attempt._describe(args, kwargs))  # type: ignore[attr-defined]


def _short(value: Any, limit: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fail(rule: str, detail: str = "") -> None:
    """Stop the check: the answer broke ``rule`` (the sentence the notebook states), shown by ``detail``."""
    raise ExerciseFailed(rule, detail)


def require(ok: bool, rule: str, detail: str = "") -> None:
    """``fail(rule, detail)`` unless ``ok``."""
    if not ok:
        fail(rule, detail)


class Attempt:
    """The student's function, wrapped so that the stub is recognised wherever the check calls it.

    The stub raises ``NotImplementedError``, or returns ``None`` on the first call. ``None`` on a later call is a
    wrong answer, not a stub, when ``none_ok`` is false: the check reports it as such. With ``none_ok`` (an
    exercise whose answer may be ``None``, or a function called for its effect) only ``NotImplementedError``
    marks the stub.
    """

    def __init__(self, fn: Callable[..., Any], none_ok: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"a check takes your function, got {type(fn).__name__}")
        self.fn = fn
        self.none_ok = none_ok
        self.calls = 0
        #: the rule the check is testing right now; an exception from the student's code is reported as breaking it
        self.rule: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = self.fn(*args, **kwargs)
        except NotImplementedError as err:
            if self.calls == 0:
                raise _NotYet from err
            _mark(err, self, args, kwargs)
            raise
        except Exception as err:
            # The student's exception goes on as it is (a check may expect it, or catch it to name its rule); marked,
            # so that one escaping the check becomes a "✗ rule" line instead of the student's traceback.
            _mark(err, self, args, kwargs)
            raise
        if out is None and not self.none_ok and self.calls == 0:
            raise _NotYet
        self.calls += 1
        return out

    def _describe(self, args: tuple, kwargs: dict) -> str:
        name = getattr(self.fn, "__name__", "your function")
        shown = [_short(a) for a in args] + [f"{k}={_short(v)}" for k, v in kwargs.items()]
        return f"{name}({', '.join(shown)})"


def exercise(todo: str, *, none_ok: bool = False) -> Callable:
    """Turn ``body(attempt, ...) -> str`` into a check with the series' contract (see the package docstring).

    ``todo`` is what the student should do, printed while the stub is in place. ``body`` gets the wrapped
    function, raises ``ExerciseFailed`` on a wrong answer and returns the sentence printed after ``✓``.
    """

    def wrap(body: Callable[..., str]) -> Callable[..., str]:
        @functools.wraps(body)
        def check(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Verdict:
            attempt = Attempt(fn, none_ok=none_ok)
            try:
                message = body(attempt, *args, **kwargs)
            except _NotYet:
                print(f"not implemented yet — {todo}")
                return NOT_IMPLEMENTED
            except ExerciseFailed:
                raise
            except Exception as err:
                if not hasattr(err, "_minienv_student"):
                    raise  # the check's own bug: its traceback is the useful report
                rule, call = err._minienv_student
                rule = rule or "your function must give an answer for every case the rules allow"
                raise ExerciseFailed(rule, f"your code raised {type(err).__name__}: {err}\n  "
                                           f"while the check called {call}") from None
            print(f"✓ {message}")
            return PASSED

        check.todo = todo  # type: ignore[attr-defined]
        return check

    return wrap

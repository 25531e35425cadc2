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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = self.fn(*args, **kwargs)
        except NotImplementedError as err:
            raise _NotYet from err
        if out is None and not self.none_ok and self.calls == 0:
            raise _NotYet
        self.calls += 1
        return out


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
            print(f"✓ {message}")
            return PASSED

        check.todo = todo  # type: ignore[attr-defined]
        return check

    return wrap

"""The contract every exercise check keeps, over every check in ``minienv.exercises`` at once.

A student's exception never escapes a check as their own traceback: it becomes ``ExerciseFailed`` whose first
line is ``✗ <rule>`` and whose detail shows the student's error and the call that raised it (issue #36: four
wrong answers crashed their checks that way, in 06 and the capstone)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import minienv.exercises as exercises_pkg
from minienv.exercises import ExerciseFailed
from minienv.exercises._check import exercise


def _checks():
    for info in pkgutil.iter_modules(exercises_pkg.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"minienv.exercises.{info.name}")
        for name in sorted(dir(module)):
            if name.startswith("check_") and callable(getattr(module, name)):
                yield pytest.param(getattr(module, name), id=f"{info.name}.{name}")


CHECKS = list(_checks())


@pytest.mark.parametrize("check", CHECKS)
def test_every_check_uses_the_shared_contract(check):
    assert hasattr(check, "todo"), "a check not built with _check.exercise cannot keep the contract"


@pytest.mark.parametrize("check", CHECKS)
def test_a_student_exception_becomes_a_named_rule_not_a_traceback(check, capsys):
    def crashes(*args, **kwargs):
        return {}["no such key"]  # a KeyError from the student's own code, on every call

    with pytest.raises(ExerciseFailed) as caught:
        check(crashes)
    first, *rest = str(caught.value).splitlines()
    assert first.startswith("✗ ") and len(first) > 10
    assert "KeyError" in str(caught.value), "the student's error is shown"


def test_the_rule_being_checked_names_the_failure_and_the_call_is_shown():
    @exercise("write f(x)")
    def check_f(fn):
        fn.rule = "rule 1: f(0) is 0"
        assert fn(0) == 0
        fn.rule = "rule 2: f(x) is x for a negative x"
        for x in (-1, -2):
            if fn(x) != x:
                raise ExerciseFailed(fn.rule, f"f({x})")
        return "done"

    def student(x):
        if x < 0:
            raise ValueError("negative")
        return x

    with pytest.raises(ExerciseFailed) as caught:
        check_f(student)
    text = str(caught.value)
    assert text.startswith("✗ rule 2: f(x) is x for a negative x")
    assert "ValueError: negative" in text and "student(-1)" in text


def test_a_stub_is_still_a_stub_and_a_later_not_implemented_is_a_wrong_answer(capsys):
    @exercise("write g(x)")
    def check_g(fn):
        fn(1)
        fn(2)
        return "done"

    def stub(x):
        raise NotImplementedError

    assert check_g(stub) == "not implemented"
    calls = []

    def half_done(x):
        calls.append(x)
        if len(calls) > 1:
            raise NotImplementedError("the second case")
        return x

    with pytest.raises(ExerciseFailed, match="NotImplementedError"):
        check_g(half_done)


def test_a_bug_in_the_check_itself_is_not_blamed_on_the_student():
    @exercise("write h(x)")
    def check_h(fn):
        fn(1)
        return {}["the check's own bug"]

    with pytest.raises(KeyError):
        check_h(lambda x: x)

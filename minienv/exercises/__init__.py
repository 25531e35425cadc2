"""Self-checks for the notebooks' exercises: one module per notebook, one ``check_*`` per exercise.

Why here and not in the notebooks: the test suite runs every check against its reference solution
(``solutions/NN_name.py``, which must pass), against wrong answers (each must fail with the rule it breaks) and
against the stub each notebook ships (which must say "not implemented yet"). A check pasted into a notebook
could not be tested that way.

The contract every check keeps (``_check.exercise`` enforces it):

1. the stub a notebook ships (raises ``NotImplementedError``, or returns ``None``) → the check prints
   ``not implemented yet — <what to do>`` and returns ``NOT_IMPLEMENTED``; it never raises, so re-running a
   notebook with the exercise unsolved does not fail;
2. a wrong answer → ``ExerciseFailed`` (an ``AssertionError``) whose first line is ``✗ <the rule broken>``,
   followed by the case that showed it; never a silent ``False``;
3. a right answer → prints ``✓ <what it proves>`` and returns ``PASSED``.
"""

from minienv.exercises._check import NOT_IMPLEMENTED, PASSED, ExerciseFailed

__all__ = ["NOT_IMPLEMENTED", "PASSED", "ExerciseFailed"]

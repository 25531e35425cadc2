"""Ctrl-C and the engine: an interrupt never lands halfway through the engine's bookkeeping.

A step changes refcounts, block tables, queues and counters in several calls; a ``KeyboardInterrupt`` between two
of them would leave the engine in a state no step produces. So the engine's bookkeeping runs inside
:meth:`CtrlC.deferred`: a Ctrl-C (SIGINT) that arrives there is held and raised at its end, once the structures
agree again. Outside it (the model call) a Ctrl-C lands at once, as usual, and the step is rolled back.

The SIGINT handler that does this is installed once per public call (:meth:`CtrlC.handling`: ``run()``,
``generate()``, a ``step()``, one step of a ``stream()``, an ``abort()``), not once per region: a handler swap is
two ``signal.signal`` calls, and a step has two regions, so installing it per region cost more than the step's
scheduling of a small batch. Per region the engine only flips a flag the handler reads.

Only in the main thread, and only when SIGINT has Python's default handler (what JupyterLab's stop button and a
terminal deliver): a program that installed its own handler keeps it, and other threads never receive signals.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class CtrlC:
    """One engine's SIGINT handling: ``handling()`` around a public call, ``deferred()`` around bookkeeping."""

    def __init__(self) -> None:
        self.installed = False  # our handler is SIGINT's handler now (inside a public call, main thread)
        self.deferring = False  # inside a bookkeeping region: a SIGINT is held
        self.caught = False  # a SIGINT arrived while deferring

    def _handler(self, signum: int, frame: object) -> None:
        if self.deferring:
            self.caught = True
        else:
            raise KeyboardInterrupt

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Install the handler for the duration of one public call. Nested calls (a listener that aborts a
        request, ``run()`` stepping) reuse the installed one; other threads, or a program's own SIGINT handler,
        leave SIGINT alone (then bookkeeping is not protected, as a signal cannot reach it from there anyway)."""
        if (self.installed or threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
            yield
            return
        previous = signal.signal(signal.SIGINT, self._handler)
        self.installed = True
        try:
            yield
        finally:
            self.installed = False
            signal.signal(signal.SIGINT, previous)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold a Ctrl-C that arrives inside the block until its end, then raise ``KeyboardInterrupt`` (unless the
        block raised: its exception propagates). A region inside another is part of the outer one."""
        if self.deferring or not self.installed:
            yield
            return
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
            caught, self.caught = self.caught, False
        if caught:
            raise KeyboardInterrupt

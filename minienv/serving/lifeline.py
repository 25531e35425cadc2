"""A server that dies with the process that started it: ``python -m minienv serve --parent-pid PID``.

A notebook that starts a server stops it at ``atexit`` — but ``atexit`` does not run when the kernel is killed
(a Restart that times out, a CI timeout, SIGKILL), and the server then runs on for as long as the machine does.
So the child watches its parent instead: a daemon thread checks ``os.getppid()`` every ``interval`` seconds, and
when the parent is gone (the child has been re-parented to init or a subreaper) it calls ``on_gone`` — the
server's own SIGTERM path, so it drains for ``--grace`` seconds and exits like any stopped server.

Why not ``prctl(PR_SET_PDEATHSIG)``: Linux sends that signal when the parent *thread* that forked the child exits,
not the parent process — a server started from a worker thread (a test's thread pool, a widget callback) would
be killed while its parent lives on. Comparing ``getppid()`` is about the process, works on macOS too, and a
zombie parent (dead, not yet reaped) already counts as gone, because re-parenting happens at its exit.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


class ParentPidError(ValueError):
    """``--parent-pid`` names a process that is not this process's parent (or it is gone already)."""


def watch_parent(parent_pid: int, on_gone: Callable[[], None], interval: float = 0.25) -> threading.Thread:
    """Call ``on_gone()`` once, from a daemon thread, when ``parent_pid`` is no longer this process's parent.

    Raises :class:`ParentPidError` at once if it is not the parent now: a server whose parent died while it
    started must not start serving at all.
    """
    if isinstance(parent_pid, bool) or not isinstance(parent_pid, int) or parent_pid < 1:
        raise ParentPidError(f"--parent-pid must be a process id >= 1, got {parent_pid!r}")
    if os.getppid() != parent_pid:
        raise ParentPidError(f"--parent-pid {parent_pid} is not this process's parent (that is {os.getppid()}): "
                             "the process that started the server is gone, or the pid is wrong")

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(interval)
        on_gone()

    thread = threading.Thread(target=watch, name="minienv-parent-watch", daemon=True)
    thread.start()
    return thread

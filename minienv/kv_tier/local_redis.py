"""Start a private ``redis-server`` on 127.0.0.1 for tests, the benchmark and notebook 11 — and stop it.

The server listens on a free port chosen here, keeps its files in a directory of the caller's, persists nothing
(``--save "" --appendonly no``: a restart starts empty, like a cache node that lost its memory) and is ended by
:meth:`LocalRedis.stop` (or :meth:`LocalRedis.kill`, SIGKILL, for the fault tests). Debian's ``redis-server``
package provides the binary; :func:`redis_server_binary` says whether it is there.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LocalRedis", "free_port", "redis_server_binary"]


def redis_server_binary() -> str | None:
    """Path of ``redis-server``, or None when it is not installed (``apt-get install redis-server``)."""
    return shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalRedis:
    """One ``redis-server`` process. ``start()`` returns once it answers; ``url`` is its address."""

    directory: Path
    port: int = field(default_factory=free_port)
    maxmemory: str | None = None  # e.g. "2mb" with noeviction: writes past it fail with OOM (a "full" store)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "LocalRedis":
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "redis.log"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.directory}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

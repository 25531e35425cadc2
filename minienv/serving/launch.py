"""Start and stop local ``python -m minienv serve`` processes: the instances that tests, benchmarks and notebooks
put behind a :class:`~minienv.serving.client.Client`.

Each instance is its own process (own engine thread, own KV cache — as N machines would be), on a free loopback
port it picks itself (``--port 0``; it prints the port once its model is loaded, and we read it from its log, so
no two instances ever race for one port). An instance counts as up when its health service says ``SERVING``.
Stopping is SIGTERM (the server drains for its ``--grace`` seconds), then SIGKILL if it is still alive after a
timeout; :meth:`ServerProcess.kill` is the crash, for failover experiments.

Two details keep the parent safe: children start with ``start_new_session=True`` (a Ctrl-C in a notebook does not
reach them, and no Python code runs between fork and exec, which is what breaks processes that hold live gRPC
channels), and with ``GRPC_ENABLE_FORK_SUPPORT=0`` in their environment.

Invariant: :func:`launch` either returns every instance SERVING or stops the ones it started and raises.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

_READY = re.compile(r"serving minienv\.v1\.MinienvEngine on (\S+:\d+)")


@dataclass
class ServerProcess:
    """One ``python -m minienv serve`` child: its address once ready, its process, its log file."""

    proc: subprocess.Popen
    log_path: Path
    address: str = ""
    _terminated: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM, once: the server drains and exits 0.

        NOTE: never a second SIGTERM. One that arrives while the server's interpreter is already exiting (after
        it has put the default handler back) kills it mid-exit with status -15.
        """
        if self.alive() and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful drain; not again if already sent), SIGKILL after ``timeout`` seconds; returns the
        exit status."""
        self.terminate()
        if self.alive():
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL now — a crash: in-flight calls see the connection drop."""
        if self.alive():
            self.proc.kill()
        return self.proc.wait()


@dataclass
class LocalCluster:
    """The instances :func:`launch` started; a context manager that stops them all on exit."""

    servers: list[ServerProcess] = field(default_factory=list)
    _logdir: tempfile.TemporaryDirectory | None = None

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def stop(self, timeout: float = 15.0) -> None:
        for s in self.servers:
            s.terminate()  # all drain at once, then wait for each
        for s in self.servers:
            s.stop(timeout)
        if self._logdir is not None:
            self._logdir.cleanup()
            self._logdir = None

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _health_status(address: str, timeout: float, tls_ca: bytes | None = None) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (grpc.insecure_channel(address) if tls_ca is None
               else grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_ca)))
    with channel as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def launch(n: int = 1, serve_args: Sequence[str] = (), *, timeout: float = 120.0, python: str | None = None,
           cwd: str | Path | None = None, env: dict[str, str] | None = None) -> LocalCluster:
    """Start ``n`` instances of ``python -m minienv serve --port 0 *serve_args`` on 127.0.0.1, wait until each
    is SERVING, and return them (see the module docstring).

    Args:
        n: instances (>= 1).
        serve_args: more ``serve`` flags, e.g. ``["--kv-budget-tokens", "4096", "--grace", "1"]``; with
            ``--tls-cert``, the readiness check trusts that certificate (a self-signed one, as tests make).
        timeout: seconds for all of them to come up.
        python, cwd, env: the interpreter (default: this one), working directory and extra environment.

    Raises:
        ValueError: a bad ``n``. RuntimeError: an instance exited or did not come up (its log is in the message).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if "--port" in serve_args or any(str(a).startswith("--port=") for a in serve_args):
        raise ValueError("launch picks the ports itself (--port 0); do not pass --port")
    args = [str(a) for a in serve_args]
    # With --tls-cert, the health check speaks TLS and trusts that (self-signed) certificate.
    tls_ca = Path(args[args.index("--tls-cert") + 1]).read_bytes() if "--tls-cert" in args[:-1] else None
    child_env = dict(os.environ)
    child_env.setdefault("OPENBLAS_NUM_THREADS", "1")
    child_env["GRPC_ENABLE_FORK_SUPPORT"] = "0"
    # The children import the same minienv as this process (a worktree, an editable install).
    pkg_root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, child_env.get("PYTHONPATH", "")) if p)
    child_env.update(env or {})
    logdir = tempfile.TemporaryDirectory(prefix="minienv-serve-")
    cluster = LocalCluster(_logdir=logdir)
    try:
        for i in range(n):
            log_path = Path(logdir.name) / f"serve-{i}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    # --parent-pid: the instance stops when this process ends, even by SIGKILL (no atexit runs)
                    [python or sys.executable, "-u", "-m", "minienv", "serve", "--port", "0",
                     "--parent-pid", str(os.getpid()), *args],
                    cwd=cwd, env=child_env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
            cluster.servers.append(ServerProcess(proc, log_path))
        end = time.monotonic() + timeout
        for s in cluster.servers:
            while not s.address:
                m = _READY.search(s.log())
                if m:
                    s.address = m[1]
                elif not s.alive():
                    raise RuntimeError(f"minienv serve exited with status {s.proc.returncode}:\n{s.log()}")
                elif time.monotonic() > end:
                    raise RuntimeError(f"minienv serve did not come up within {timeout} s:\n{s.log()}")
                else:
                    time.sleep(0.05)
            while (status := _health_status(s.address, 2.0, tls_ca)) != "SERVING":
                if time.monotonic() > end or not s.alive():
                    raise RuntimeError(f"{s.address} health is {status}, not SERVING:\n{s.log()}")
                time.sleep(0.05)
    except BaseException:
        cluster.stop(timeout=5)
        raise
    return cluster

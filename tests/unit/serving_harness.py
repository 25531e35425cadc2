"""Real servers for the serving tests: start an :class:`EngineServer` on 127.0.0.1 (free ports), stop it, wait until
its engine is idle, make a throw-away TLS certificate. No mocks: every test talks to a running server over a socket.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from minienv.engine import InferenceEngine
from minienv.serving import EngineServer

ENGINE_KW = dict(kv_budget_tokens=2048, block_size=16, max_num_seqs=4)
PROMPTS = ["To be, or not to be", "Friends, Romans, countrymen", "Now is the winter", "O Romeo, Romeo",
           "All the world's a stage", "Once more unto the breach"]


def make_engine(**kw: Any) -> InferenceEngine:
    """The bundled model with the serving tests' small engine sizes (the in-process reference uses the same)."""
    return InferenceEngine(**{**ENGINE_KW, **kw})


@contextlib.contextmanager
def running_server(engine_factory: Callable[[], InferenceEngine] = make_engine, *, wait: bool = True,
                   **server_kw: Any) -> Iterator[EngineServer]:
    """An :class:`EngineServer` started on 127.0.0.1 (gRPC and, with ``http_port=0``, HTTP on free ports), stopped
    at the end whatever happens."""
    srv = EngineServer(engine_factory, **server_kw).start()
    try:
        if wait:
            srv.wait_until_serving()
        yield srv
    finally:
        srv.stop(grace=0)


def kv_idle(server: EngineServer, timeout: float = 5.0) -> int:
    """Wait until the engine has no request left and return its blocks in use plus its live requests (0 when
    nothing leaked); the engine's invariants are checked on the way out."""
    deadline = time.monotonic() + timeout
    while True:
        used, live = server.call(lambda e: (e.kv_cache_manager.pool.num_used_blocks, len(e.scheduler.requests)))
        if (used == 0 and live == 0) or time.monotonic() > deadline:
            server.call(lambda e: e.check_invariants())
            return used + live
        time.sleep(0.01)


def finish_reason(server: EngineServer, request_id: str, timeout: float = 5.0) -> tuple[str | None, int]:
    """The engine's finish reason and output length for ``request_id`` once it has finished (None if not by
    ``timeout``): what really ended it, read from the engine's retained outputs."""
    deadline = time.monotonic() + timeout
    while True:
        out = server.call(lambda e: e.output(request_id))
        if out.finished or time.monotonic() > deadline:
            return out.finish_reason, len(out.token_ids)
        time.sleep(0.01)


def self_signed_cert(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A fresh self-signed certificate for ``host`` (an IP SAN, so clients verify it against the address they
    dial) and its key, made with the openssl CLI: ``(cert.pem, key.pem)``."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={host}",
                    "-addext", f"subjectAltName=IP:{host}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key

"""A synchronous client for ``minienv.v1.MinienvEngine``: one server, or several behind gRPC's load balancing.

``Client("127.0.0.1:50051")`` talks to one server; ``Client([a, b, c], routing=...)`` to several instances of the
same model:

* ``routing="round_robin"`` — one gRPC channel over every address (target ``ipv4:HOST:P1,HOST:P2``) with a
  *service config* that asks gRPC itself for the ``round_robin`` load-balancing policy and a retry policy for
  ``UNAVAILABLE``. No proxy, no code of ours in the path: the channel keeps one connection per instance, skips the
  ones that are down, and re-sends a call that failed before the server sent anything (an instance that was killed
  or drains), on the next instance.
* ``routing="prefix"`` — :class:`~minienv.serving.router.PrefixRouter` picks the instance by the chain hash of the
  prompt's first full blocks, so requests that share a system prompt meet the same prefix cache; an instance
  that is overloaded gives way to the least-loaded one. Each instance has its own channel; a call refused with
  ``UNAVAILABLE`` before its first message moves to the router's next choice, and the instance that refused is
  *ejected* for a while (Envoy's and gRPC's "outlier detection"): the router ranks it last, so the requests after
  it do not each pay a refused call first. Ejection only reorders — an ejected instance is still tried when the
  others refuse too — and ends after ``eject_seconds`` times the instance's consecutive refusals, or at once when
  it serves a call.

Every RPC error reaches the caller as :class:`ServingError`, carrying the gRPC status code and the server's
message. A stream ends in exactly one of three ways: its :class:`Completion`, a :class:`ServingError`, or — after
:meth:`Stream.cancel` — quietly, with ``stream.cancelled`` set.

Invariants:

1. A request id is chosen here (a uuid) unless the caller gives one, so :meth:`Client.abort` can name any request
   this client started, and every :class:`Completion` names the address that served it.
2. ``Client.in_flight`` counts the calls started and not yet terminated, per address (the router's load signal);
   the gRPC call's done-callback decrements it, so an abandoned iterator cannot leak a count.
3. An address is in ``Client.ejected`` only after it refused a call (``UNAVAILABLE`` before any output) and until
   its ejection time passes or it completes a call; ejection never removes an address from a ranking.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from minienv.serving import minienv_pb2 as pb
from minienv.serving import minienv_pb2_grpc as pb_grpc
from minienv.serving.types import SERVED_BY_KEY, ServingError

#: the server the CLI and ``Client()`` talk to when told nothing else
DEFAULT_ADDRESS = "127.0.0.1:50051"
_SERVICE = pb.DESCRIPTOR.services_by_name["MinienvEngine"].full_name
ROUTINGS = ("round_robin", "prefix")
#: an instance that keeps refusing is ejected for at most this many times ``eject_seconds`` at once
MAX_EJECTIONS = 5


def service_config(max_attempts: int = 4) -> dict:
    """The service config of a round-robin channel: gRPC's ``round_robin`` policy, and up to ``max_attempts``
    attempts of any minienv call that fails with ``UNAVAILABLE`` (the server is down, or drains). gRPC retries a
    call only until it is *committed* — until the server sent its first message — so a stream that already
    delivered tokens is never replayed: it ends with ``UNAVAILABLE`` instead."""
    return {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [{
            "name": [{"service": _SERVICE}],
            "retryPolicy": {
                "maxAttempts": max_attempts,
                "initialBackoff": "0.05s",
                "maxBackoff": "0.5s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }],
    }


@dataclass(frozen=True)
class Chunk:
    """New output since the previous chunk of a stream."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Completion:
    """A finished request, from the server's final message (``token_ids`` = all chunks' ids concatenated)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "length", "stop", "eos", "abort" or "error"
    stop_reason: str
    error: str  # why, when finish_reason is "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the server's prefix cache supplied
    ttft_s: float
    e2e_s: float
    num_preemptions: int
    address: str  # the instance that served it

    @classmethod
    def from_proto(cls, request_id: str, c: pb.GenerateComplete, address: str) -> "Completion":
        return cls(request_id=request_id, token_ids=tuple(c.output_ids), text=c.text, finish_reason=c.finish_reason,
                   stop_reason=c.stop_reason, error=c.error, prompt_tokens=c.prompt_tokens,
                   cached_tokens=c.cached_tokens, ttft_s=c.ttft_s, e2e_s=c.e2e_s, num_preemptions=c.num_preemptions,
                   address=address)


def _served_by(call: Any) -> str:
    """The server's address from the call's trailing metadata ("" if the call never reached a server)."""
    try:
        metadata = call.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - no metadata on a call that never reached a server
        return ""
    return next((v for k, v in metadata if k == SERVED_BY_KEY), "")


class Stream:
    """One ``Generate`` call: iterate for :class:`Chunk` s; then :attr:`completion` is set.

    ``cancel()`` (from any thread) cancels the call — the server aborts the request and frees its blocks — and the
    iteration ends without an error. :meth:`result` drains the stream and returns the completion.
    """

    def __init__(self, request_id: str, start: Callable[[int], tuple[Any, str]], num_candidates: int,
                 report: Callable[[str, bool], None] | None = None):
        self.request_id = request_id
        self.completion: Completion | None = None
        self.cancelled = False
        self.address = ""
        self.attempts = 1  # instances this call was sent to (more than one after a failover)
        self._start = start  # attempt number -> (the gRPC call, the address it was sent to, "" if the balancer's)
        self._num_candidates = num_candidates
        self._report = report  # (address, served) -> the client's ejection bookkeeping; None: nothing to report
        self._lock = threading.Lock()
        self._call, self.address = start(0)
        self._iter: Iterator[Chunk] | None = None

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            self._call.cancel()

    def __iter__(self) -> Iterator[Chunk]:
        if self._iter is None:
            self._iter = self._chunks()
        return self._iter

    def result(self) -> Completion | None:
        """Drain the stream; the :class:`Completion` (None if it was cancelled). Raises :class:`ServingError`."""
        for _ in self:
            pass
        return self.completion

    def _chunks(self) -> Iterator[Chunk]:
        attempt = 0
        while True:
            received = False
            complete: pb.GenerateComplete | None = None
            try:
                for r in self._call:
                    received = True
                    if r.WhichOneof("response") == "chunk":
                        yield Chunk(tuple(r.chunk.token_ids), r.chunk.text)
                    else:
                        complete = r.complete
                self.address = self.address or _served_by(self._call)
                if complete is None:  # the server broke its contract (every stream ends with a final message)
                    raise ServingError(grpc.StatusCode.INTERNAL, "the stream ended without a final message",
                                       request_id=self.request_id, address=self.address)
                self.completion = Completion.from_proto(self.request_id, complete, self.address)
                if self._report is not None and self.address:
                    self._report(self.address, True)
                return
            except grpc.RpcError as exc:
                if self.cancelled and exc.code() == grpc.StatusCode.CANCELLED:
                    return
                # The router's failover: an instance that refused before sending anything -> the next candidate.
                refused = exc.code() == grpc.StatusCode.UNAVAILABLE and not received
                if refused and self._report is not None and self.address:
                    self._report(self.address, False)
                if refused and attempt + 1 < self._num_candidates:
                    attempt += 1
                    self.attempts += 1
                    with self._lock:
                        if self.cancelled:
                            return
                        self._call, self.address = self._start(attempt)
                    continue
                details = exc.details() or ""
                if exc.code() == grpc.StatusCode.UNAVAILABLE and received:
                    details += (" (the instance went away after this stream had delivered output; it is not "
                                "retried elsewhere, which would repeat that output)")
                raise ServingError(exc.code(), details, request_id=self.request_id,
                                   address=self.address or _served_by(self._call)) from None


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"an address is HOST:PORT, e.g. 127.0.0.1:50051; got {address!r}")
    return host.strip("[]"), int(port)


def balanced_target(addresses: Sequence[str]) -> str:
    """The gRPC target naming every instance: ``ipv4:127.0.0.1:50051,127.0.0.1:50052`` or
    ``ipv6:[::1]:50051,[::1]:50052``. gRPC's static-list resolvers take one IP family per target, so host names are
    resolved once, here: to IPv4 when every host has an IPv4 address (``localhost`` does), else to IPv6 when every
    one has an IPv6 address; a list that needs both families raises ``ValueError`` (prefix routing, one channel per
    instance, takes any mix)."""
    resolved: list[tuple[dict[int, str], int, str]] = []
    for a in addresses:
        host, port = _split_address(a)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"cannot resolve the host of {a!r}: {exc.strerror}") from None
        by_family: dict[int, str] = {}
        for family, *_, sockaddr in infos:
            by_family.setdefault(family, sockaddr[0])
        resolved.append((by_family, port, a))
    for family, scheme, form in ((socket.AF_INET, "ipv4", "{}:{}"), (socket.AF_INET6, "ipv6", "[{}]:{}")):
        if all(family in fams for fams, _, _ in resolved):
            return f"{scheme}:" + ",".join(form.format(fams[family], port) for fams, port, _ in resolved)
    kinds = ", ".join(f"{a} ({'/'.join('IPv4' if f == socket.AF_INET else 'IPv6' for f in fams)})"
                      for fams, _, a in resolved)
    raise ValueError(f"round robin balances over one IP family, and these addresses need both: {kinds}; use "
                     f"addresses of one family, or routing='prefix'")


@dataclass
class _Instance:
    address: str
    channel: grpc.Channel
    stub: pb_grpc.MinienvEngineStub
    health: health_pb2_grpc.HealthStub
    in_flight: int = 0
    refusals: int = 0  # consecutive calls it refused (UNAVAILABLE before any output); 0 once it serves one
    ejected_until: float = 0.0  # time.monotonic() until which the router ranks it last


class Client:
    """Talk to one or several ``python -m minienv serve`` instances (see the module docstring).

    Args:
        addresses: ``"HOST:PORT"`` or a list of them (instances of the same model).
        routing: ``"round_robin"`` (gRPC's own balancer and retries) or ``"prefix"`` (prefix-aware routing).
        router: for ``routing="prefix"``, a configured :class:`~minienv.serving.router.PrefixRouter` (default: one
            with its defaults, the bundled tokenizer for text prompts).
        max_attempts: attempts per call under ``UNAVAILABLE`` (gRPC's retry policy / the router's failover).
        eject_seconds: under prefix routing, how long an instance that refused a call is ranked last, per
            consecutive refusal (1, 2, 3 ... times this, at most ``MAX_EJECTIONS`` times); see invariant 3.
        tls_ca: talk TLS, trusting this PEM certificate (a path or its bytes; a self-signed server certificate
            is its own CA). None: plaintext, as a server on loopback without ``--tls-cert`` speaks.

    Raises:
        ValueError: no address, a malformed address, an unknown routing.
    """

    def __init__(self, addresses: str | Sequence[str] = DEFAULT_ADDRESS, *, routing: str = "round_robin",
                 router: Any = None, max_attempts: int = 4, tls_ca: str | Path | bytes | None = None,
                 eject_seconds: float = 2.0):
        addrs = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addrs:
            raise ValueError("Client needs at least one address (HOST:PORT)")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        if len(set(addrs)) != len(addrs):
            raise ValueError(f"duplicate addresses: {addrs}")
        for a in addrs:
            _split_address(a)
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or not 1 <= max_attempts <= 5:
            raise ValueError(f"max_attempts must be an int in [1, 5] (gRPC caps retries at 5), got {max_attempts!r}")
        if isinstance(eject_seconds, bool) or not isinstance(eject_seconds, (int, float)) or not eject_seconds >= 0:
            raise ValueError(f"eject_seconds must be a number of seconds >= 0, got {eject_seconds!r}")
        self.addresses, self.routing, self.max_attempts = addrs, routing, max_attempts
        self.eject_seconds = float(eject_seconds)
        self._lock = threading.Lock()
        self._credentials = None
        if tls_ca is not None:
            pem = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
            self._credentials = grpc.ssl_channel_credentials(root_certificates=pem)
        self._instances = {}
        for a in addrs:
            ch = self._channel(a)
            self._instances[a] = _Instance(a, ch, pb_grpc.MinienvEngineStub(ch), health_pb2_grpc.HealthStub(ch))
        self._balanced: pb_grpc.MinienvEngineStub | None = None
        self._balanced_channel: grpc.Channel | None = None
        if routing == "round_robin":
            options = [("grpc.service_config", json.dumps(service_config(max_attempts))), ("grpc.enable_retries", 1)]
            if self._credentials is not None:  # the certificate names the host, not the "ipv4:" list of addresses
                options.append(("grpc.ssl_target_name_override", _split_address(addrs[0])[0]))
            self._balanced_channel = self._channel(balanced_target(addrs), options)
            self._balanced = pb_grpc.MinienvEngineStub(self._balanced_channel)
            self.router = None
        else:
            from minienv.serving.router import PrefixRouter

            self.router = router if router is not None else PrefixRouter()
        self._where: dict[str, str] = {}  # request id -> the address serving it (for abort), while in flight

    def _channel(self, target: str, options: list | None = None) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, self._credentials, options=options)

    # ---------------------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        for inst in self._instances.values():
            inst.channel.close()
        if self._balanced_channel is not None:
            self._balanced_channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def ejected(self) -> set[str]:
        """The addresses the router ranks last now: each refused a call recently (invariant 3)."""
        now = time.monotonic()
        with self._lock:
            return {a for a, i in self._instances.items() if i.ejected_until > now}

    def _report(self, address: str, served: bool) -> None:
        """A call's outcome on ``address``: served (it completed a call: not ejected any more) or refused (ejected
        for ``eject_seconds`` times its consecutive refusals, at most ``MAX_EJECTIONS`` times)."""
        with self._lock:
            inst = self._instances.get(address)
            if inst is None:
                return
            if served:
                inst.refusals, inst.ejected_until = 0, 0.0
            else:
                inst.refusals += 1
                inst.ejected_until = time.monotonic() + self.eject_seconds * min(inst.refusals, MAX_EJECTIONS)

    @property
    def in_flight(self) -> dict[str, int]:
        """Calls this client started and that have not terminated, per address (prefix routing only counts by
        address; a round-robin call counts under the address gRPC picked once known)."""
        with self._lock:
            return {a: i.in_flight for a, i in self._instances.items()}

    # ---------------------------------------------------------------------------------------------- generation
    def stream(self, prompt: str | Sequence[int], max_tokens: int = 16, *, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop: Sequence[str] = (), request_id: str | None = None, deadline: float | None = None) -> Stream:
        """Start a request and return its :class:`Stream` (nothing is read until you iterate).

        ``prompt`` is text or token ids; ``deadline`` is seconds for the whole call (the server aborts the request
        when it passes; the stream raises ``ServingError(DEADLINE_EXCEEDED)``).
        """
        if isinstance(prompt, str):
            req = pb.GenerateRequest(text=prompt)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("prompt must be a str or a sequence of int token ids")
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
        rid = request_id or uuid.uuid4().hex
        req.request_id = rid
        sp = req.sampling_params
        sp.max_tokens, sp.temperature = max_tokens, temperature
        for name, value in (("top_k", top_k), ("top_p", top_p), ("seed", seed)):
            if value is not None:
                setattr(sp, name, value)
        sp.stop.extend(stop)
        if deadline is not None and not deadline > 0:
            raise ValueError(f"deadline must be a number of seconds > 0, got {deadline!r}")

        if self.routing == "prefix":
            order = self.router.rank(self, prompt)
            candidates = order[:self.max_attempts]
        else:
            candidates = [None]  # the balanced channel: gRPC picks and retries

        def start(attempt: int) -> tuple[Any, str]:
            address = candidates[attempt]
            stub = self._balanced if address is None else self._instances[address].stub
            call = stub.Generate(req, timeout=deadline)
            self._track(rid, address, call)
            return call, address or ""

        return Stream(rid, start, len(candidates), self._report if self.routing == "prefix" else None)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 16, **kw: Any) -> Completion:
        """Run one request to the end (keyword arguments as :meth:`stream`). Raises :class:`ServingError`."""
        completion = self.stream(prompt, max_tokens, **kw).result()
        assert completion is not None  # only a cancelled stream has none
        return completion

    def _track(self, request_id: str, address: str | None, call: Any) -> None:
        """Count the call as in flight on its address until gRPC says it terminated (invariant 2)."""
        counted: list[str] = []
        with self._lock:
            if address is not None:
                self._instances[address].in_flight += 1
                counted.append(address)
                self._where[request_id] = address

        def done(_call: Any) -> None:
            with self._lock:
                for a in counted:
                    self._instances[a].in_flight -= 1
                if self._where.get(request_id) == address:
                    self._where.pop(request_id, None)

        call.add_done_callback(done)

    # ---------------------------------------------------------------------------------------------- control
    def abort(self, request_id: str, *, timeout: float = 5.0) -> None:
        """Abort an unfinished request (its stream ends with ``finish_reason="abort"``). The instance that serves
        it is asked first if known, else every instance. Raises ``ServingError(NOT_FOUND)`` if none has it."""
        with self._lock:
            known = self._where.get(request_id)
        order = [known] if known else list(self._instances)
        errors: list[ServingError] = []
        for a in order:
            try:
                self._instances[a].stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout)
                return
            except grpc.RpcError as exc:
                errors.append(ServingError.from_rpc(exc, request_id=request_id, address=a))
        # An instance that is down (UNAVAILABLE) says more than the others' NOT_FOUND.
        raise next((e for e in errors if e.code != grpc.StatusCode.NOT_FOUND), errors[0])

    def _unary(self, address: str | None, method: str, request: Any, timeout: float) -> Any:
        a = address or self.addresses[0]
        if a not in self._instances:
            raise ValueError(f"{a!r} is not one of this client's addresses {self.addresses}")
        try:
            return getattr(self._instances[a].stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise ServingError.from_rpc(exc, address=a) from None

    def model_info(self, address: str | None = None, *, timeout: float = 5.0) -> pb.GetModelInfoResponse:
        """The served model (name, vocabulary, layers, EOS id) of ``address`` (default: the first)."""
        return self._unary(address, "GetModelInfo", pb.GetModelInfoRequest(), timeout)

    def server_info(self, address: str | None = None, *, timeout: float = 5.0) -> pb.GetServerInfoResponse:
        """Queues, KV blocks in use, block size, draining, of ``address`` (default: the first)."""
        return self._unary(address, "GetServerInfo", pb.GetServerInfoRequest(), timeout)

    def server_infos(self, *, timeout: float = 5.0) -> dict[str, pb.GetServerInfoResponse]:
        return {a: self.server_info(a, timeout=timeout) for a in self.addresses}

    def health(self, address: str | None = None, *, timeout: float = 5.0) -> str:
        """``"SERVING"``, ``"NOT_SERVING"`` (loading or draining), or ``"UNREACHABLE"`` (nothing answers)."""
        a = address or self.addresses[0]
        try:
            status = self._instances[a].health.Check(health_pb2.HealthCheckRequest(service=_SERVICE),
                                                     timeout=timeout).status
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    def wait_until_serving(self, timeout: float = 60.0) -> None:
        """Block until every instance says SERVING and, for round robin, until the balanced channel has served a
        call on each of them.

        The second half matters: gRPC's ``round_robin`` picks only among *connected* instances, and a new channel
        connects to all of them at once — so a burst sent the moment the first connection is up lands entirely on
        that one instance. Tiny probe calls (one token) until each address has answered make the balancer start
        even.
        """
        import time

        end = time.monotonic() + timeout
        for a in self.addresses:
            while self.health(a, timeout=max(0.1, min(2.0, end - time.monotonic()))) != "SERVING":
                if time.monotonic() > end:
                    raise TimeoutError(f"{a} is not SERVING after {timeout} s")
                time.sleep(0.05)
        if self._balanced is None:
            return
        seen: set[str] = set()
        probe = pb.GenerateRequest(text=".", sampling_params=pb.SamplingParams(max_tokens=1))
        while seen != set(self.addresses):
            if time.monotonic() > end:
                raise TimeoutError(f"the balanced channel reached only {sorted(seen)} within {timeout} s")
            call = self._balanced.Generate(probe, timeout=max(0.1, end - time.monotonic()))
            try:
                for _ in call:
                    pass
            except grpc.RpcError as exc:
                raise ServingError.from_rpc(exc) from None
            seen.add(_served_by(call))


__all__ = ["Client", "Completion", "Chunk", "Stream", "ServingError", "DEFAULT_ADDRESS", "service_config",
           "balanced_target"]

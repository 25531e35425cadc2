"""minienv's gRPC server: one :class:`~minienv.engine.InferenceEngine` behind ``minienv.v1.MinienvEngine``.

The engine is not thread-safe, and gRPC runs each call on a thread of its pool. So exactly one thread — the
*engine thread* — ever touches the engine (vLLM's ``EngineCore`` loop, SGLang's scheduler process, in one
process): handlers hand it *commands* through a queue (add this request, abort that one, read the stats), and it
steps the engine whenever a request is unfinished. Every request has its own output queue, registered with the
engine thread when the request is added; after each ``engine.step()`` the engine thread puts each output on its
request's queue, so a handler receives only its own outputs and never waits on another request's client.

Status codes (what a client can act on): ``INVALID_ARGUMENT`` with the engine's message for a bad request;
``RESOURCE_EXHAUSTED`` when ``max_waiting`` requests already wait for admission (back-pressure: the queue is
bounded, not the memory); ``UNAVAILABLE`` while the model loads or the server drains; a cancelled call or an
expired deadline aborts the request in the engine at the next command drain (its blocks are freed before the next
step); ``NOT_FOUND`` for an ``Abort`` of an id the engine has no unfinished request for. The standard
``grpc.health.v1`` service says ``NOT_SERVING`` until the model is loaded and while draining, and server reflection
lists the services.

Invariants:

1. Only the engine thread calls the engine; ``_streams`` (request id -> output queue) is the engine thread's too.
2. Every accepted request ends its stream with exactly one ``complete`` message or a status code; the chunks'
   token ids, concatenated, equal the ``complete`` message's ``output_ids``.
3. A request whose call has ended (finished, cancelled, deadline) is no longer in the engine after the engine
   thread's next command drain: nothing keeps blocks for a client that is gone.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minienv.serving import minienv_pb2 as pb
from minienv.serving import minienv_pb2_grpc as pb_grpc

#: the full name of minienv's service (what reflection lists and health checks name)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MinienvEngine"].full_name
#: trailing metadata key of every Generate call: the address of the instance that served it
SERVED_BY_KEY = "minienv-served-by"
_POLL_S = 0.05  # how often a waiting handler checks that its call is still alive


class ServerBindError(OSError):
    """The gRPC port could not be bound (in use, or a host that is not this machine's); nothing was started."""


@dataclass(frozen=True)
class _Refusal:
    """The engine thread's answer to an add it did not queue: the status code and the message for the client."""

    code: grpc.StatusCode
    message: str


class _EngineThread:
    """The one thread that owns the engine: runs commands from handlers between steps, steps while work is left."""

    def __init__(self, engine_factory: Callable[[], Any], max_waiting: int, on_loaded: Callable[[], None]):
        self._factory = engine_factory
        self.max_waiting = max_waiting
        self._on_loaded = on_loaded
        self._inbox: queue.Queue[Callable[[Any], None]] = queue.Queue()
        self._streams: dict[str, queue.Queue] = {}  # engine thread only (invariant 1)
        self.engine: Any = None  # set once by the engine thread; read by no one else but tests through call()
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="minienv-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def submit(self, command: Callable[[Any], None]) -> None:
        self._inbox.put(command)

    def call(self, fn: Callable[[Any], Any], timeout: float = 10.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; return its result (re-raise its exception)."""
        reply: queue.Queue = queue.Queue(maxsize=1)

        def command(engine: Any) -> None:
            try:
                reply.put((True, fn(engine)))
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                reply.put((False, exc))

        self.submit(command)
        ok, value = reply.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._stop.set()
        self.submit(lambda engine: None)  # wake it

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - reported by health (NOT_SERVING) and the server
            self.load_error = exc
            self.loaded.set()
            return
        self.loaded.set()
        self._on_loaded()
        engine = self.engine
        while not self._stop.is_set():
            busy = engine.has_unfinished_requests()
            try:  # idle: sleep until a command comes (stop() sends one); busy: take what is there and step
                command = self._inbox.get_nowait() if busy else self._inbox.get()
            except queue.Empty:
                command = None
            while command is not None:
                command(engine)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    command = None
            if self._stop.is_set():
                break
            if engine.has_unfinished_requests():
                try:
                    outs = engine.step()
                except Exception as exc:  # noqa: BLE001 - the step rolled back; fail its requests, keep serving
                    self._fail_all(engine, f"the engine step failed: {type(exc).__name__}: {exc}")
                    continue
                for out in outs:
                    self._route(out)
        self._fail_all(engine, "the server stopped")

    def _route(self, out: Any) -> None:
        q = self._streams.get(out.request_id)
        if q is None:
            return
        q.put(out)
        if out.finished:
            del self._streams[out.request_id]

    def _fail_all(self, engine: Any, message: str) -> None:
        for rid, q in list(self._streams.items()):
            if rid in engine.scheduler.requests:
                engine.abort(rid)
            q.put(_Refusal(grpc.StatusCode.UNAVAILABLE, message))
        self._streams.clear()

    def add(self, engine: Any, request_id: str, prompt: Any, params: Any, q: queue.Queue, draining: bool) -> None:
        if draining:
            q.put(_Refusal(grpc.StatusCode.UNAVAILABLE, "the server is draining: it accepts no new requests"))
            return
        num_waiting = len(engine.scheduler.waiting)
        if num_waiting >= self.max_waiting:
            q.put(_Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the waiting queue is full ({num_waiting} requests wait for admission, "
                           f"max_waiting={self.max_waiting}); retry later"))
            return
        try:
            engine.add_request(prompt, params, request_id=request_id)
        except (ValueError, TypeError) as exc:  # InvalidRequestError is a ValueError; nothing was queued
            q.put(_Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        self._streams[request_id] = q
        q.put(request_id)  # accepted

    def abort_if_live(self, engine: Any, request_id: str, q: queue.Queue) -> None:
        """The call of ``q`` ended: if its request is still unfinished, abort it now (frees its blocks)."""
        if self._streams.get(request_id) is q:
            del self._streams[request_id]
            if request_id in engine.scheduler.requests:
                engine.abort(request_id)

    def abort(self, engine: Any, request_id: str) -> bool:
        """The Abort RPC: False if the engine has no unfinished request ``request_id``."""
        if request_id not in engine.scheduler.requests:
            return False
        out = engine.abort(request_id)
        q = self._streams.pop(request_id, None)
        if q is not None:
            q.put(out)
        return True

    def num_streams(self, engine: Any) -> int:
        return len(self._streams)


def _sampling_params(msg: pb.SamplingParams) -> Any:
    """The proto's sampling parameters -> :class:`~minienv.SamplingParams` (unset fields: its defaults)."""
    from minienv.sampling import SamplingParams

    kwargs: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_k", "top_p", "seed"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    return SamplingParams(**kwargs)


def _complete(out: Any) -> pb.GenerateComplete:
    m = out.metrics
    return pb.GenerateComplete(
        output_ids=list(out.token_ids), text=out.text, finish_reason=out.finish_reason or "",
        stop_reason=out.stop_reason or "", error=out.error or "", prompt_tokens=len(out.prompt_token_ids),
        cached_tokens=out.num_cached_tokens, ttft_s=out.ttft or 0.0, e2e_s=out.e2e_latency or 0.0,
        num_preemptions=out.num_preemptions)


class _Servicer(pb_grpc.MinienvEngineServicer):
    def __init__(self, server: "EngineServer"):
        self.server = server

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        srv = self.server
        context.set_trailing_metadata(((SERVED_BY_KEY, srv.address),))  # which instance, for a balanced client
        srv.check_available(context)
        which = request.WhichOneof("prompt")
        if which is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt: set text or token_ids")
        prompt: Any = request.text if which == "text" else list(request.token_ids.ids)
        try:
            params = _sampling_params(request.sampling_params)
        except (ValueError, TypeError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad sampling_params: {exc}")
        rid = request.request_id or uuid.uuid4().hex
        q: queue.Queue = queue.Queue()
        loop = srv.engine_thread
        draining = srv.draining
        loop.submit(lambda engine: loop.add(engine, rid, prompt, params, q, draining))
        # Fires when the call ends for any reason (done, cancelled, deadline): a request still running is aborted.
        context.add_callback(lambda: loop.submit(lambda engine: loop.abort_if_live(engine, rid, q)))
        while True:
            try:
                item = q.get(timeout=_POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if isinstance(item, _Refusal):
                context.abort(item.code, item.message)
            if isinstance(item, str):  # accepted
                continue
            if item.delta_token_ids or item.delta_text:
                yield pb.GenerateResponse(request_id=rid, chunk=pb.GenerateChunk(
                    token_ids=list(item.delta_token_ids), text=item.delta_text))
            if item.finished:
                yield pb.GenerateResponse(request_id=rid, complete=_complete(item))
                return

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        self.server.check_loaded(context)
        loop = self.server.engine_thread
        if not loop.call(lambda engine: loop.abort(engine, request.request_id)):
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no unfinished request with id {request.request_id!r} (finished, aborted or never seen)")
        return pb.AbortResponse()

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        self.server.check_loaded(context)
        engine = self.server.engine_thread.engine
        c = engine.model.config  # immutable after loading: safe to read from any thread
        return pb.GetModelInfoResponse(
            model_name=self.server.model_name, vocab_size=engine.num_sampled_ids, hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers, max_position_embeddings=c.max_position_embeddings,
            eos_token_id=-1 if engine.eos_token_id is None else engine.eos_token_id)

    def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext,
                      ) -> pb.GetServerInfoResponse:
        from minienv import __version__

        srv = self.server
        srv.check_loaded(context)
        s = srv.engine_thread.call(lambda engine: engine.stats)
        return pb.GetServerInfoResponse(
            version=__version__, serving=not srv.draining, draining=srv.draining, num_running=s.num_running,
            num_waiting=s.num_waiting, max_waiting=srv.engine_thread.max_waiting, num_blocks=s.num_blocks,
            num_blocks_in_use=s.num_blocks_in_use, block_size=s.block_size, kv_budget_tokens=s.kv_budget_tokens,
            num_steps=s.num_steps, uptime_s=time.monotonic() - srv.started_at)


class EngineServer:
    """A gRPC server around one engine, built by ``engine_factory`` on the engine thread after the port is bound
    (health says ``NOT_SERVING`` until it returns).

    Args:
        engine_factory: returns the :class:`~minienv.engine.InferenceEngine` to serve (called once).
        host, port: where to listen; loopback by default, port 0 picks a free port (see :attr:`port`).
        max_waiting: most requests waiting for admission; one more gets ``RESOURCE_EXHAUSTED``.
        max_workers: gRPC handler threads (each open ``Generate`` stream holds one).
        model_name: what ``GetModelInfo`` reports.

    Raises:
        ValueError: a bad argument. ServerBindError (from :meth:`start`): the port cannot be bound.
    """

    def __init__(self, engine_factory: Callable[[], Any], *, host: str = "127.0.0.1", port: int = 0,
                 max_waiting: int = 64, max_workers: int = 32, model_name: str = "minienv"):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535] (0 picks a free port), got {port!r}")
        for name, value in (("max_waiting", max_waiting), ("max_workers", max_workers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty str such as '127.0.0.1', got {host!r}")
        self.host, self.model_name = host, model_name
        self.draining = False
        self.started_at = time.monotonic()
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.engine_thread = _EngineThread(engine_factory, max_waiting, self._set_serving)
        # NOTE: gRPC sets SO_REUSEPORT by default, so a second server would silently share a port in use.
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                                 options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_MinienvEngineServicer_to_server(_Servicer(self), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._grpc)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._grpc.add_insecure_port(address)
        except RuntimeError:  # grpcio >= 1.55 raises instead of returning 0
            self.port = 0
        if self.port == 0:
            raise ServerBindError(f"cannot listen on {address}: the port is in use, or {host!r} is not an address "
                                  "of this machine")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "EngineServer":
        """Start serving gRPC (health: NOT_SERVING), then build the engine on the engine thread (then SERVING)."""
        self._grpc.start()
        self.engine_thread.thread.start()
        return self

    def wait_until_serving(self, timeout: float = 30.0) -> None:
        """Block until the engine is built; re-raise the factory's exception if it failed."""
        if not self.engine_thread.loaded.wait(timeout):
            raise TimeoutError(f"the engine was not built within {timeout} s")
        if self.engine_thread.load_error is not None:
            raise self.engine_thread.load_error

    def call(self, fn: Callable[[Any], Any], timeout: float = 10.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (the only safe way to look at the engine)."""
        return self.engine_thread.call(fn, timeout)

    def stop(self, grace: float = 5.0) -> None:
        """Drain: health NOT_SERVING, new requests UNAVAILABLE; in-flight ones get up to ``grace`` seconds to
        finish, then are aborted (their streams end with ``UNAVAILABLE``); then the server and thread stop."""
        self.draining = True
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = self.engine_thread
        if loop.thread.is_alive() and loop.engine is not None:
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and loop.call(loop.num_streams):
                time.sleep(_POLL_S)
        loop.stop()
        if loop.thread.is_alive():
            loop.thread.join(timeout=10)
        self._grpc.stop(grace=1.0).wait()

    def check_loaded(self, context: grpc.ServicerContext) -> None:
        loop = self.engine_thread
        if loop.load_error is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the model failed to load: {loop.load_error}")
        if loop.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry when health says SERVING")

    def check_available(self, context: grpc.ServicerContext) -> None:
        self.check_loaded(context)
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining: it accepts no new requests")

    def _set_serving(self) -> None:
        if not self.draining:
            self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

"""minienv's server: one :class:`~minienv.engine.InferenceEngine` behind ``minienv.v1.MinienvEngine`` (gRPC) and,
optionally, the OpenAI-compatible HTTP API (:mod:`minienv.serving.openai_api`) — both on the same engine thread.

The engine is not thread-safe, so exactly one thread — the *engine thread* — ever touches the engine (vLLM's
``EngineCore`` loop, SGLang's scheduler process, in one process): handlers hand it *commands* through a queue (add
this request, abort that one, read the stats), and it steps the engine whenever a request is unfinished. The gRPC
handlers are coroutines of ``grpc.aio`` on one asyncio loop, in a thread of its own (not a pool thread per stream):
Python runs one thread at a time, and every thread that wakes takes the interpreter lock from the engine thread,
so the fewer wake-ups per step, the less serving costs. Every request has its own output queue (an asyncio queue
of that loop), registered with the engine thread when the request is added; after each ``engine.step()`` the
engine thread hands the step's outputs to the loop in one call, which puts each on its request's queue: a handler
receives only its own outputs and never waits on another request's client, and the loop wakes once per step. Both
front ends go through the same two doors: :meth:`EngineServer.add_request` (admission: availability, the prompt's
length, then the engine's own checks, answered by an accepted id or a :class:`Refusal`) and
:meth:`EngineServer.release` (the call ended: abort what is still running).

Status codes (what a client can act on): ``INVALID_ARGUMENT`` with the engine's message for a bad request;
``RESOURCE_EXHAUSTED`` when ``max_waiting`` requests already wait for admission (back-pressure: the queue is
bounded, not the memory); ``UNAVAILABLE`` while the model loads or the server drains; a cancelled call or an
expired deadline aborts the request in the engine at the next command drain (its blocks are freed before the next
step); ``NOT_FOUND`` for an ``Abort`` of an id the engine has no unfinished request for. The standard
``grpc.health.v1`` service says ``NOT_SERVING`` until the model is loaded and while draining, and server reflection
lists the services.

Limits a client cannot talk the server out of: a message larger than ``max_message_bytes`` is refused before it is
parsed (gRPC's receive limit; HTTP 413); a prompt longer than :class:`PromptLimits` allows is refused on its length
*before* it is tokenized, so a huge prompt costs no tokenizer time; a host other than loopback is served over TLS
(``tls``) unless the caller says otherwise (the CLI's ``--insecure``).

Invariants:

1. Only the engine thread calls the engine; ``_streams`` (request id -> output queue) is the engine thread's too.
2. Every accepted request ends its stream with exactly one ``complete`` message or a status code; the chunks'
   token ids, concatenated, equal the ``complete`` message's ``output_ids``.
3. A request whose call has ended (finished, cancelled, deadline) is no longer in the engine after the engine
   thread's next command drain: nothing keeps blocks for a client that is gone.
"""

from __future__ import annotations

import asyncio
import queue
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minienv.serving import minienv_pb2 as pb
from minienv.serving import minienv_pb2_grpc as pb_grpc
from minienv.serving.types import SERVED_BY_KEY, AsyncSink, OutputSink, Refusal, ServerBindError

#: the full name of minienv's service (what reflection lists and health checks name)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MinienvEngine"].full_name
_POLL_S = 0.05  # how often stop() checks whether in-flight requests have finished
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # gRPC's own default receive limit; the HTTP body limit too


@dataclass(frozen=True)
class PromptLimits:
    """How long a prompt may be, checked on its length alone — before the tokenizer runs.

    A request that cannot fit the model is refused by the engine anyway, but only after tokenizing it, and a
    client could send megabytes of text for the server to tokenize just to hear "too long". These bounds refuse
    such a prompt for the price of ``len()``:

    * token ids: at most ``max_prompt_tokens`` (= the model's ``max_position_embeddings`` - 1: one position is left
      to generate into);
    * text: at most ``max_prompt_chars`` characters. A character is at least one UTF-8 byte and a token covers at
      most ``max_token_bytes`` bytes, so a text with more characters needs more than ``max_prompt_tokens`` tokens
      and can never fit: the bound refuses only prompts that are certainly too long (the engine still checks the
      exact token count of the others). ``None`` when the tokenizer cannot say how long its longest token is.
    """

    max_prompt_tokens: int
    max_prompt_chars: int | None

    @classmethod
    def for_engine(cls, engine: Any) -> "PromptLimits":
        max_tokens = engine.model.config.max_position_embeddings - 1
        tok = engine.tokenizer
        if not hasattr(tok, "id_to_bytes"):
            return cls(max_tokens, None)
        longest = max(len(tok.id_to_bytes(i)) for i in range(tok.vocab_size))
        return cls(max_tokens, max_tokens * longest)

    def check(self, prompt: str | list[int]) -> str | None:
        """None if ``prompt`` may fit; otherwise the message that refuses it (naming the limit)."""
        if isinstance(prompt, str):
            if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
                return (f"the prompt is {len(prompt)} characters long; at most {self.max_prompt_chars} can fit the "
                        f"model's {self.max_prompt_tokens} prompt tokens (refused before tokenizing)")
        elif len(prompt) > self.max_prompt_tokens:
            return (f"the prompt has {len(prompt)} token ids; the model takes at most {self.max_prompt_tokens} "
                    "(its max_position_embeddings minus one to generate)")
        return None


@dataclass(frozen=True)
class TLSConfig:
    """A PEM certificate chain and its private key: both front ends serve TLS with them. Checked when built."""

    cert_file: Path
    key_file: Path

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file"):
            path = Path(getattr(self, name))
            if not path.is_file():
                raise ValueError(f"TLS {name.replace('_file', '')} file {str(path)!r} does not exist")
            object.__setattr__(self, name, path)
        try:  # load them once here: a bad pair is a clear error now, not a failed handshake later
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise ValueError(f"TLS certificate {str(self.cert_file)!r} and key {str(self.key_file)!r} do not load "
                             f"as a PEM pair: {exc}") from None


class _EngineThread:
    """The one thread that owns the engine: runs commands from handlers between steps, steps while work is left."""

    def __init__(self, engine_factory: Callable[[], Any], max_waiting: int, on_loaded: Callable[[], None]):
        self._factory = engine_factory
        self.max_waiting = max_waiting
        self._on_loaded = on_loaded
        self._inbox: queue.Queue[Callable[[Any], None]] = queue.Queue()
        self._streams: dict[str, OutputSink] = {}  # engine thread only (invariant 1)
        self.engine: Any = None  # set once by the engine thread; others read only its immutable chat_template
        self.prompt_limits: PromptLimits | None = None  # set with engine, before `loaded`; immutable
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

    async def call_async(self, fn: Callable[[Any], Any], timeout: float = 10.0) -> Any:
        """:meth:`call` for a coroutine: the event loop is not blocked while the engine thread runs ``fn``."""
        aio_loop = asyncio.get_running_loop()
        reply: asyncio.Future = aio_loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not reply.done():
                reply.set_result(value) if ok else reply.set_exception(value)

        def command(engine: Any) -> None:
            try:
                result = (True, fn(engine))
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                result = (False, exc)
            try:
                aio_loop.call_soon_threadsafe(settle, *result)
            except RuntimeError:  # the loop closed meanwhile: nobody is waiting
                pass

        self.submit(command)
        return await asyncio.wait_for(reply, timeout)

    def stop(self) -> None:
        self._stop.set()
        self.submit(lambda engine: None)  # wake it

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            engine = self._factory()
            self.prompt_limits = PromptLimits.for_engine(engine)
            self.engine = engine
        except BaseException as exc:  # noqa: BLE001 - reported by health (NOT_SERVING) and the server
            self.load_error = exc
            self.loaded.set()
            return
        self._on_loaded()  # health SERVING before `loaded`: whoever waited for the load sees it serving
        self.loaded.set()
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
                self._route(outs)
        self._fail_all(engine, "the server stopped")

    def _route(self, outs: list[Any]) -> None:
        """Put each output on its request's sink. Sinks of an asyncio loop (see :class:`AsyncSink`) get theirs in
        one ``call_soon_threadsafe`` per loop and step: the loop's thread wakes once per step, not once per
        request — each wake-up costs a hand-off of the GIL away from this thread."""
        by_loop: dict[Any, list[tuple[Any, Any]]] = {}
        for out in outs:
            q = self._streams.get(out.request_id)
            if q is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            loop = getattr(q, "loop", None)
            if loop is None:
                q.put(out)
            else:
                by_loop.setdefault(loop, []).append((q.queue, out))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # that loop has closed (its front end stopped): nobody is waiting
                pass

    def _fail_all(self, engine: Any, message: str) -> None:
        for rid, q in list(self._streams.items()):
            if rid in engine.scheduler.requests:
                engine.abort(rid)
            q.put(Refusal(grpc.StatusCode.UNAVAILABLE, message))
        self._streams.clear()

    def add(self, engine: Any, request_id: str, prompt: Any, params: Any, q: OutputSink, draining: bool) -> None:
        if draining:
            q.put(Refusal(grpc.StatusCode.UNAVAILABLE, "the server is draining: it accepts no new requests"))
            return
        num_waiting = len(engine.scheduler.waiting)
        if num_waiting >= self.max_waiting:
            q.put(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the waiting queue is full ({num_waiting} requests wait for admission, "
                           f"max_waiting={self.max_waiting}); retry later"))
            return
        try:
            engine.add_request(prompt, params, request_id=request_id)
        except (ValueError, TypeError) as exc:  # InvalidRequestError is a ValueError; nothing was queued
            q.put(Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        self._streams[request_id] = q
        q.put(request_id)  # accepted

    def abort_if_live(self, engine: Any, request_id: str, q: OutputSink) -> None:
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


def _put_all(pairs: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in pairs:
        q.put_nowait(item)


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


def _chunk(rid: str, outs: list[Any]) -> pb.GenerateResponse:
    """One chunk message with the new token ids and text of ``outs`` (consecutive outputs of request ``rid``):
    a consumer that fell behind sends what it missed as one message, not one per engine step."""
    if len(outs) == 1:
        return pb.GenerateResponse(request_id=rid, chunk=pb.GenerateChunk(token_ids=outs[0].delta_token_ids,
                                                                          text=outs[0].delta_text))
    return pb.GenerateResponse(request_id=rid, chunk=pb.GenerateChunk(
        token_ids=[t for o in outs for t in o.delta_token_ids], text="".join(o.delta_text for o in outs)))


def _complete(out: Any) -> pb.GenerateComplete:
    m = out.metrics
    return pb.GenerateComplete(
        output_ids=list(out.token_ids), text=out.text, finish_reason=out.finish_reason or "",
        stop_reason=out.stop_reason or "", error=out.error or "", prompt_tokens=len(out.prompt_token_ids),
        cached_tokens=out.num_cached_tokens, ttft_s=out.ttft or 0.0, e2e_s=out.e2e_latency or 0.0,
        num_preemptions=out.num_preemptions)


class _Servicer(pb_grpc.MinienvEngineServicer):
    """The RPCs, as coroutines on the server's event loop (one thread for every call; see :class:`EngineServer`)."""

    def __init__(self, server: "EngineServer"):
        self.server = server

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[pb.GenerateResponse]:
        srv = self.server
        context.set_trailing_metadata(((SERVED_BY_KEY, srv.address),))  # which instance, for a balanced client
        refusal = srv.refusal()
        if refusal is not None:
            await context.abort(refusal.code, refusal.message)
        which = request.WhichOneof("prompt")
        if which is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request has no prompt: set text or token_ids")
        prompt: Any = request.text if which == "text" else list(request.token_ids.ids)
        try:
            params = _sampling_params(request.sampling_params)
        except (ValueError, TypeError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad sampling_params: {exc}")
        sink = AsyncSink(asyncio.get_running_loop())
        rid = srv.add_request(prompt, params, sink, request_id=request.request_id or None)
        held: list[Any] = []  # outputs not yet sent: fewer than stream_interval new tokens so far
        try:
            while True:
                for item in await sink.batch():
                    if isinstance(item, str):  # accepted
                        continue
                    if isinstance(item, Refusal):
                        if held:
                            yield _chunk(rid, held)
                        await context.abort(item.code, item.message)
                    held.append(item)
                    if item.finished:
                        break
                done = bool(held) and held[-1].finished
                # a chunk per stream_interval new tokens (and at the end); a handler that fell behind gets all it
                # missed in one batch and sends it as one chunk too
                if done or sum(len(o.delta_token_ids) for o in held) >= srv.stream_interval:
                    if any(o.delta_token_ids or o.delta_text for o in held):
                        yield _chunk(rid, held)
                    if done:
                        yield pb.GenerateResponse(request_id=rid, complete=_complete(held[-1]))
                        return
                    held = []
        finally:  # done, cancelled, deadline (gRPC cancels this coroutine), client gone: abort if still running
            srv.release(rid, sink)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self.server.check_loaded(context)
        loop = self.server.engine_thread
        if not await loop.call_async(lambda engine: loop.abort(engine, request.request_id)):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no unfinished request with id {request.request_id!r} (finished, aborted or never "
                                "seen)")
        return pb.AbortResponse()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext,
                           ) -> pb.GetModelInfoResponse:
        await self.server.check_loaded(context)
        engine = self.server.engine_thread.engine
        c = engine.model.config  # immutable after loading: safe to read from any thread
        return pb.GetModelInfoResponse(
            model_name=self.server.model_name, vocab_size=engine.num_sampled_ids, hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers, max_position_embeddings=c.max_position_embeddings,
            eos_token_id=-1 if engine.eos_token_id is None else engine.eos_token_id)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext,
                            ) -> pb.GetServerInfoResponse:
        from minienv import __version__

        srv = self.server
        await srv.check_loaded(context)
        s = await srv.engine_thread.call_async(lambda engine: engine.stats)
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
        model_name: what ``GetModelInfo`` and ``/v1/models`` report (and what an HTTP request's ``model`` must be).
        http_port: also serve the OpenAI-compatible HTTP API on this port (0 picks a free one; see
            :attr:`http_port`); None (the default) serves gRPC only. Needs Starlette and uvicorn (the serve extra).
        max_message_bytes: the largest request message accepted (gRPC's receive limit -> ``RESOURCE_EXHAUSTED``;
            an HTTP body -> 413).
        tls: serve both APIs over TLS with this certificate and key (None: plaintext).
        stream_interval: a gRPC stream's chunk carries at least this many new tokens (the last one may carry
            fewer): 1 sends every step's token as it comes; more sends fewer, larger messages — less CPU per token
            for the server and the client, later tokens for a reader (SGLang's ``stream_interval``).

    Raises:
        ValueError: a bad argument. ServerBindError (from :meth:`start`): the port cannot be bound.
    """

    def __init__(self, engine_factory: Callable[[], Any], *, host: str = "127.0.0.1", port: int = 0,
                 max_waiting: int = 64, model_name: str = "minienv",
                 http_port: int | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tls: TLSConfig | None = None, stream_interval: int = 1):
        for name, value in (("port", port), ("http_port", 0 if http_port is None else http_port)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be an int in [0, 65535] (0 picks a free port), got {value!r}")
        for name, value in (("max_waiting", max_waiting), ("max_message_bytes", max_message_bytes),
                            ("stream_interval", stream_interval)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty str such as '127.0.0.1', got {host!r}")
        if tls is not None and not isinstance(tls, TLSConfig):
            raise ValueError(f"tls must be a TLSConfig(cert_file, key_file) or None, got {tls!r}")
        self.host, self.model_name = host, model_name
        self.max_message_bytes, self.tls, self.stream_interval = max_message_bytes, tls, stream_interval
        self.draining = False
        self.started_at = time.monotonic()
        self.started_at_wall = time.time()  # what /v1/models reports as `created`
        self.engine_thread = _EngineThread(engine_factory, max_waiting, self._set_serving)
        # Every RPC is a coroutine on one asyncio loop, on a thread of its own: one thread wakes per engine step
        # for all streams (see _EngineThread._route), instead of one pool thread per stream, each taking the GIL
        # from the engine thread in turn.
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="minienv-grpc", daemon=True)
        self._loop_thread.start()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._on_loop(self._build_grpc(address))
        except BaseException:
            self._close_loop()
            raise
        self.http: Any = None
        if http_port is not None:
            from minienv.serving.openai_api import HttpServer  # Starlette + uvicorn: only when asked for

            self.http = HttpServer(self, host, http_port)  # binds now: a busy port fails before anything starts

    @property
    def http_port(self) -> int | None:
        """The HTTP API's port (the one picked when ``http_port=0`` was asked for), or None without HTTP."""
        return None if self.http is None else self.http.port

    @property
    def address(self) -> str:
        """``HOST:PORT`` as clients and gRPC targets write it: an IPv6 host in brackets (``[::1]:50051``)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def _build_grpc(self, address: str) -> int:
        """On the loop: the gRPC server, its services and its port (health NOT_SERVING until the engine loads)."""
        self.health = health_aio.HealthServicer()
        # NOTE: gRPC sets SO_REUSEPORT by default, so a second server would silently share a port in use.
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                              ("grpc.max_receive_message_length", self.max_message_bytes)])
        pb_grpc.add_MinienvEngineServicer_to_server(_Servicer(self), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._grpc)
        await self._set_health_async(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            if self.tls is None:
                port = self._grpc.add_insecure_port(address)
            else:
                creds = grpc.ssl_server_credentials([(self.tls.key_file.read_bytes(),
                                                      self.tls.cert_file.read_bytes())])
                port = self._grpc.add_secure_port(address, creds)
        except RuntimeError:  # grpcio >= 1.55 raises instead of returning 0
            port = 0
        if port == 0:
            raise ServerBindError(f"cannot listen on {address}: the port is in use, or {self.host!r} is not an "
                                  "address of this machine")
        return port

    def _on_loop(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run ``coro`` on the server's loop from another thread; its result (or exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _close_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        if not self._loop_thread.is_alive():
            self._loop.close()

    def start(self) -> "EngineServer":
        """Start serving gRPC (health: NOT_SERVING), then build the engine on the engine thread (then SERVING)."""
        self._on_loop(self._grpc.start())
        if self.http is not None:
            self.http.start()
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
        if self._loop.is_closed():  # stopped already
            return
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
        if self.http is not None:
            self.http.stop()
        self._on_loop(self._grpc.stop(grace=1.0))
        self._close_loop()

    # ------------------------------------------------------------------ the shared path of both front ends
    def refusal(self) -> Refusal | None:
        """Why no request can be accepted now (model loading or failed, draining), or None."""
        loop = self.engine_thread
        if loop.load_error is not None:
            return Refusal(grpc.StatusCode.UNAVAILABLE, f"the model failed to load: {loop.load_error}")
        if loop.engine is None:
            return Refusal(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry when health says SERVING")
        if self.draining:
            return Refusal(grpc.StatusCode.UNAVAILABLE, "the server is draining: it accepts no new requests")
        return None

    def add_request(self, prompt: str | list[int], params: Any, sink: OutputSink, *,
                    request_id: str | None = None) -> str:
        """Hand one request to the engine thread; return its id. What comes on ``sink``: the id (accepted) or one
        :class:`Refusal`, then the request's outputs (see :class:`OutputSink`). The prompt's length is checked here,
        on the caller's thread, before anything tokenizes it; everything else by the engine."""
        rid = request_id or uuid.uuid4().hex
        refusal = self.refusal()
        if refusal is None:
            assert self.engine_thread.prompt_limits is not None  # set before `engine` (see _EngineThread._run)
            message = self.engine_thread.prompt_limits.check(prompt)
            if message is not None:
                refusal = Refusal(grpc.StatusCode.INVALID_ARGUMENT, message)
        if refusal is not None:
            sink.put(refusal)
            return rid
        loop, draining = self.engine_thread, self.draining
        loop.submit(lambda engine: loop.add(engine, rid, prompt, params, sink, draining))
        return rid

    def release(self, request_id: str, sink: OutputSink) -> None:
        """The call that owns ``sink`` ended (finished, cancelled, deadline, client gone): if its request is still
        in the engine, abort it at the engine thread's next command drain (its blocks are freed before the next
        step). Safe to call more than once, and for a refused request."""
        loop = self.engine_thread
        loop.submit(lambda engine: loop.abort_if_live(engine, request_id, sink))

    async def check_loaded(self, context: grpc.aio.ServicerContext) -> None:
        loop = self.engine_thread
        if loop.load_error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the model failed to load: {loop.load_error}")
        if loop.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the model is still loading; retry when health says SERVING")

    def _set_serving(self) -> None:
        if not self.draining:
            self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def _set_health(self, status: int) -> None:
        """From any thread but the loop's: the health service's status, set on the loop (and waited for)."""
        if self._loop.is_closed():  # stopped while the engine was loading
            return
        self._on_loop(self._set_health_async(status))

    async def _set_health_async(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

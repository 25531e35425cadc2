"""The OpenAI-compatible HTTP API beside gRPC: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health`` and ``/metrics``, on Starlette served by uvicorn, in front of the *same* engine thread as gRPC.

It is the convention every vLLM, SGLang and TGI user's client already speaks, so the official ``openai`` Python
client (``base_url="http://127.0.0.1:8000/v1"``) or ``curl`` talks to minienv unchanged. A handler never touches
the engine: it hands its request to :meth:`EngineServer.add_request` with a sink that moves each output from the
engine thread onto this server's event loop (``call_soon_threadsafe``), and awaits them there. Streaming is
server-sent events — ``data: {chunk}`` lines, then ``data: [DONE]`` — as OpenAI's API does.

What is refused, and how (OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``):

* 400 — a bad parameter (the engine's own message when the engine refused it), an unknown parameter, and every
  OpenAI parameter minienv does not implement (``logprobs``, ``echo``, penalties, ``n`` > 1, ``best_of``, …):
  silently ignoring one would hand the client something other than what it asked for;
* 404 — an unknown path or model; 405 — a wrong method; 413 — a body over ``max_message_bytes``;
* 429 — the waiting queue is full (back-pressure); 503 — the model is loading or the server draining.

Invariants:

1. Every accepted request is released exactly once when its HTTP exchange ends — finished, failed, or the client
   gone mid-stream — so a request whose client left is aborted in the engine and its blocks freed
   (:class:`_EngineStream`'s ``finally``, and the non-streaming handler's ``finally``).
2. A refusal is known before the response starts, so it always comes with its real status code; only a server
   that stops mid-stream ends a stream with an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from minienv.serving.types import AsyncSink, Refusal, ServerBindError

#: the :class:`minienv.serving.server.EngineServer` this front end serves (which imports this module when asked
#: for HTTP): annotated loosely so that nothing here imports the server back
EngineServer = Any

#: the HTTP status (and OpenAI error type) of each refusal the engine server gives
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}
#: the engine's finish reasons in OpenAI's words (EOS and a stop string are both "stop" there)
FINISH_REASON = {"length": "length", "stop": "stop", "eos": "stop", "abort": "abort", "error": "error"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions; used for chat too

# Parameters every generation endpoint takes. `top_k` and `return_token_ids` are vLLM's extensions (the openai client
# sends them through `extra_body`); `return_token_ids` adds the generated ids to each choice. `user` (an end-user id for
# the provider's logs) changes no output, so accepting it ignores nothing the client asked of the model.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
           "user", "return_token_ids"}
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
# OpenAI parameters minienv does not implement, each with the test "the client asked for something": a default value
# (None, False, 0, 1, {} — what the openai client sends for "off") is accepted, anything else is a 400.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v is not None and (isinstance(v, bool) or v != 1),
    "best_of": lambda v: v is not None and (isinstance(v, bool) or v != 1),
    "logprobs": lambda v: v not in (None, False),
    "top_logprobs": lambda v: v is not None,
    "echo": lambda v: v not in (None, False),
    "suffix": lambda v: v is not None,
    "presence_penalty": lambda v: v not in (None, 0),
    "frequency_penalty": lambda v: v not in (None, 0),
    "repetition_penalty": lambda v: v not in (None, 1),
    "logit_bias": lambda v: v not in (None, {}),
    "tools": lambda v: v not in (None, []),
    "tool_choice": lambda v: v not in (None, "none"),
    "functions": lambda v: v not in (None, []),
    "function_call": lambda v: v not in (None, "none"),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "parallel_tool_calls": lambda v: v is not None,
}
_CHAT_ROLES = {"system", "user", "assistant"}


class ApiError(Exception):
    """A request the API refuses: HTTP status, message, OpenAI error type, and the parameter at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def from_refusal(cls, refusal: Refusal) -> "ApiError":
        status, kind = HTTP_STATUS.get(refusal.code, (500, "server_error"))
        return cls(status, refusal.message, type=kind, code=refusal.code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# ---------------------------------------------------------------------------------------------- request parsing
@dataclass(frozen=True)
class GenerationRequest:
    """One checked request: the prompt as the engine takes it, its sampling parameters, and how to answer."""

    prompt: str | list[int]
    params: Any  # minienv.SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool


def render_chat(messages: list[dict]) -> str:
    """The chat template of the bundled model, which has read nothing but plays: a conversation is written as one.

    Each message is a speech headed by its speaker in capitals and a period — ``USER.``, ``ASSISTANT.``, or the
    message's ``name`` (``{"role": "user", "name": "Romeo"}`` -> ``ROMEO.``) — as the training text heads speeches
    (``ROMEO.\\nBut soft…``), with a blank line between speeches; a system message is a plain paragraph (a stage
    direction). The prompt ends with the assistant's heading so that the model speaks next.
    """
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(m["content"])
        else:
            parts.append(f"{(m.get('name') or m['role']).upper()}.\n{m['content']}")
    parts.append("ASSISTANT.\n")
    return "\n\n".join(parts)


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with role and content", param=where)
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"{where} has unsupported fields {sorted(extra)} (minienv takes role, content, name)",
                           param=where)
        if m.get("role") not in _CHAT_ROLES:
            raise ApiError(400, f"{where}.role must be one of {sorted(_CHAT_ROLES)}, got {m.get('role')!r}",
                           param=f"{where}.role")
        if not isinstance(m.get("content"), str):
            raise ApiError(400, f"{where}.content must be a string (minienv's model reads text only), got "
                           f"{type(m.get('content')).__name__}", param=f"{where}.content")
        if m.get("name") is not None and not (isinstance(m["name"], str) and m["name"]):
            raise ApiError(400, f"{where}.name must be a non-empty string", param=f"{where}.name")
    return messages


def _check_prompt(prompt: Any) -> str | list[int]:
    """A string or a list of token ids; a list holding exactly one of those is that one (OpenAI's batch form)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"minienv takes one prompt per request, got {len(prompt)}", param="prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids (ints), got "
                   f"{type(prompt).__name__}", param="prompt")


def parse_generation(body: dict, allowed: set[str], prompt: str | list[int]) -> GenerationRequest:
    """Check everything but the prompt's content (the engine does that) and build the sampling parameters."""
    from minienv.sampling import SamplingParams

    for name, value in body.items():
        if name in _UNSUPPORTED and _UNSUPPORTED[name](value):
            raise ApiError(400, f"{name}={value!r} is not supported by minienv (it never ignores a parameter it "
                           "cannot honour)", param=name, code="unsupported_parameter")
        if name not in allowed and name not in _UNSUPPORTED:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name,
                           code="unrecognized_parameter")
    for name in ("stream", "return_token_ids"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise ApiError(400, f"{name} must be a boolean, got {type(body[name]).__name__}", param=name)
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
                options.get("include_usage", False), bool):
            raise ApiError(400, "stream_options must be {\"include_usage\": bool}", param="stream_options")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "user must be a string", param="user")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    kwargs = {"max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed", "stop"):
        if body.get(name) is not None:
            kwargs[name] = body[name]
    try:
        params = SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:  # SamplingParams names the field first: "top_p must be in (0, 1]"
        name = str(exc).split(" ", 1)[0]
        if name == "max_tokens" and "max_completion_tokens" in body:
            name = "max_completion_tokens"
        raise ApiError(400, str(exc), param=name if name in allowed else None) from None
    return GenerationRequest(prompt, params, stream, bool((options or {}).get("include_usage")),
                             bool(body.get("return_token_ids")))


# ---------------------------------------------------------------------------------------------- plumbing
class _EngineStream(StreamingResponse):
    """A streaming response that releases its request when the exchange ends for any reason — including the client
    disconnecting mid-stream, which cancels the body task (invariant 1)."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


def _usage(out: Any) -> dict:
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


async def _last_output(sink: AsyncSink) -> Any:
    """The request's finished output (or the :class:`Refusal` that ended it), skipping the ones before."""
    while True:
        item = await sink.queue.get()
        if isinstance(item, Refusal) or item.finished:
            return item


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body is read, so the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIApi:
    """The Starlette app of one :class:`EngineServer` (``.app``)."""

    def __init__(self, server: EngineServer):
        self.server = server
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error, ApiError: self._api_error,
                                Exception: self._internal_error})

    # ------------------------------------------------------------------ errors
    async def _api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        what = {404: f"no route {request.url.path!r} (see /v1/models, /v1/completions, /v1/chat/completions, "
                     "/health, /metrics)",
                405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return ApiError(exc.status_code, what, code=str(exc.status_code)).response()

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    # ------------------------------------------------------------------ helpers
    async def _json_body(self, request: Request) -> dict:
        """The body as a JSON object, refused with 413 past ``max_message_bytes`` before it is all read."""
        limit = self.server.max_message_bytes
        declared = request.headers.get("content-length")
        too_big = ApiError(413, f"the request body is larger than the server's limit of {limit} bytes "
                           "(max_message_bytes)", code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except RecursionError:  # nesting deeper than the parser's recursion: still the client's body
            raise ApiError(400, "the body is not valid JSON for this server: nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and an integer past Python's digit limit
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            raise ApiError(400, "model is required (see GET /v1/models)", param="model")
        if model != self.server.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.server.model_name}`", param="model", code="model_not_found")

    async def _submit(self, req: GenerationRequest) -> tuple[str, AsyncSink]:
        """Hand the request in and wait for the engine thread's answer: accepted, or an :class:`ApiError`."""
        refusal = self.server.refusal()
        if refusal is not None:
            raise ApiError.from_refusal(refusal)
        sink = AsyncSink(asyncio.get_running_loop())
        rid = self.server.add_request(req.prompt, req.params, sink)
        first = await sink.queue.get()
        if isinstance(first, Refusal):
            raise ApiError.from_refusal(first)
        return rid, sink

    async def _generate(self, request: Request, req: GenerationRequest, chat: bool) -> Response:
        rid, sink = await self._submit(req)
        render = _Renderer(rid, chat, self.server.model_name)
        if req.stream:
            return _EngineStream(render.events(sink, req), lambda: self.server.release(rid, sink))
        collect = asyncio.ensure_future(_last_output(sink))
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:  # not streaming: the whole response, unless the client leaves first (invariant 1)
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return Response(status_code=499)  # nobody reads it; the finally aborts the request
            item = collect.result()
            if isinstance(item, Refusal):
                raise ApiError.from_refusal(item)
            if item.finish_reason == "error":
                raise ApiError(500, f"the request failed in the engine: {item.error}")
            return JSONResponse(render.whole(item, req))
        finally:
            collect.cancel()
            gone.cancel()
            self.server.release(rid, sink)

    # ------------------------------------------------------------------ endpoints
    async def completions(self, request: Request) -> Response:
        body = await self._json_body(request)
        self._check_model(body)
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", param="prompt")
        req = parse_generation(body, _COMPLETION_FIELDS, _check_prompt(body["prompt"]))
        return await self._generate(request, req, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._json_body(request)
        self._check_model(body)
        messages = _check_messages(body.get("messages"))
        # A real model brings its chat template (read-only after the engine thread built the engine); the toy has
        # none and gets render_chat's play script.
        engine = self.server.engine_thread.engine
        if engine is None:
            raise ApiError(503, "the model is still loading; retry when /health says ok", code="model_loading")
        template = getattr(engine, "chat_template", None)
        if template is not None:
            prompt = template.render([{"role": m["role"], "content": m["content"]} for m in messages])
        else:
            prompt = render_chat(messages)
        req = parse_generation(body, _CHAT_FIELDS, prompt)
        return await self._generate(request, req, chat=True)

    async def models(self, request: Request) -> Response:
        refusal = self.server.refusal()
        if refusal is not None and self.server.engine_thread.engine is None:
            raise ApiError.from_refusal(refusal)
        config = self.server.engine_thread.engine.model.config  # immutable once loaded
        return JSONResponse({"object": "list", "data": [{
            "id": self.server.model_name, "object": "model", "created": int(self.server.started_at_wall),
            "owned_by": "minienv", "max_model_len": config.max_position_embeddings}]})

    async def health(self, request: Request) -> Response:
        """200 when serving; 503 while the model loads, after it failed, and while draining (a load balancer's
        readiness check: take this instance out of rotation)."""
        refusal = self.server.refusal()
        if refusal is not None:
            raise ApiError.from_refusal(refusal)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        try:
            from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
        except ImportError:
            raise ApiError(404, "/metrics needs the metrics extra (pip install 'minienv[metrics]')") from None
        if self.server.engine_thread.engine is None:
            raise ApiError.from_refusal(self.server.refusal())
        from minienv.metrics import metrics_of

        # metrics_of(engine) attaches listeners on first use: that, and the scrape, happen on the engine thread
        text = await asyncio.to_thread(self.server.call, lambda engine: metrics_of(engine).exposition())
        return Response(text, media_type=CONTENT_TYPE_PLAIN_0_0_4)


class _Renderer:
    """Turns one request's outputs into OpenAI's JSON: a whole response, or a stream of chunks. The response ``id``
    is the engine's request id behind OpenAI's prefix (``cmpl-<id>``, ``chatcmpl-<id>``), so a log line or the
    engine's own records can be matched to what the client saw."""

    def __init__(self, request_id: str, chat: bool, model: str):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.chat = chat
        self.kind = "chat.completion" if chat else "text_completion"
        self.model, self.created = model, int(time.time())

    def _choice(self, text: str, ids: tuple[int, ...], finish: str | None, req: GenerationRequest, *,
                delta: bool, first: bool = False) -> dict:
        choice: dict[str, Any] = {"index": 0}
        if not self.chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = ({"role": "assistant", "content": text} if first else {"content": text}) \
                if text or first else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        if req.return_token_ids:
            choice["token_ids"] = list(ids)
        return choice

    def _envelope(self, choices: list[dict], *, chunk: bool) -> dict:
        kind = self.kind + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, out: Any, req: GenerationRequest) -> dict:
        body = self._envelope([self._choice(out.text, out.token_ids, FINISH_REASON[out.finish_reason], req,
                                            delta=False)], chunk=False)
        body["usage"] = _usage(out)
        return body

    async def events(self, sink: AsyncSink, req: GenerationRequest) -> AsyncIterator[str]:
        first = True
        while True:
            item = await sink.queue.get()
            if isinstance(item, Refusal):  # the server stopped mid-stream (invariant 2)
                yield _sse(ApiError.from_refusal(item).body())
                return
            finish = FINISH_REASON[item.finish_reason] if item.finished else None
            if item.delta_text or item.delta_token_ids or item.finished or first:
                choice = self._choice(item.delta_text, item.delta_token_ids, finish, req, delta=True, first=first)
                yield _sse(self._envelope([choice], chunk=True))
                first = False
            if item.finished:
                if req.include_usage:
                    yield _sse({**self._envelope([], chunk=True), "usage": _usage(item)})
                yield _sse("[DONE]")
                return


# ---------------------------------------------------------------------------------------------- the server
class HttpServer:
    """uvicorn serving :class:`OpenAIApi` on a thread of its own (with its own event loop), on a socket bound when
    this is built — so a busy port is a :class:`ServerBindError` before anything starts, as for gRPC."""

    def __init__(self, server: EngineServer, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; never two listeners
        try:
            sock.bind((host, port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ServerBindError(f"cannot listen on {host}:{port} for HTTP: the port is in use, or {host!r} is "
                                  f"not an address of this machine ({exc.strerror})") from None
        self.port: int = sock.getsockname()[1]
        self._sock = sock
        tls = server.tls
        config = uvicorn.Config(
            OpenAIApi(server).app, http="h11", lifespan="off", log_level="warning", access_log=False,
            timeout_graceful_shutdown=2, ssl_certfile=None if tls is None else str(tls.cert_file),
            ssl_keyfile=None if tls is None else str(tls.key_file))
        config.load()  # a bad certificate or key fails here, not on the server thread
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, name="minienv-http",
                                        daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._sock.close()

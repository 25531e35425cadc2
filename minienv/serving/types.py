"""What the serving modules share: the errors and values that cross between the server, its HTTP front end, the
client and the router. A module of its own so that each of them imports it and none of them imports another
one's internals (no import circles)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

#: trailing metadata key of every Generate call: the address of the instance that served it
SERVED_BY_KEY = "minienv-served-by"


class ServerBindError(OSError):
    """The gRPC port could not be bound (in use, or a host that is not this machine's); nothing was started."""


@dataclass(frozen=True)
class Refusal:
    """The answer to a request the server did not queue (or ended without output): a gRPC status code — the HTTP
    front end maps it to an HTTP status — and the message for the client."""

    code: grpc.StatusCode
    message: str


class OutputSink(Protocol):
    """Where the engine thread puts one request's items: first its id (accepted) or a :class:`Refusal`, then its
    :class:`~minienv.engine.outputs.RequestOutput` s until a finished one (or a :class:`Refusal` if the server
    stops). ``put`` must not block: it is called on the engine thread. A :class:`queue.Queue` is one."""

    def put(self, item: Any) -> None: ...


class AsyncSink:
    """An :class:`OutputSink` whose items arrive on an asyncio queue of ``loop``. ``put`` (the engine thread, or
    the caller of :meth:`EngineServer.add_request`) never blocks and runs no code of the loop; the engine thread
    delivers a step's outputs for all of one loop's sinks in one go (it looks for ``loop`` and ``queue``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server stopped; nobody is waiting
            pass

    async def batch(self) -> list[Any]:
        """Wait for the next item, then take every item already there: one per step for a handler that keeps
        up, all it missed for one that fell behind."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items


class ServingError(Exception):
    """An RPC failed: ``code`` is the :class:`grpc.StatusCode`, ``details`` the server's (or gRPC's) message."""

    def __init__(self, code: grpc.StatusCode, details: str, *, request_id: str | None = None,
                 address: str | None = None):
        self.code, self.details, self.request_id, self.address = code, details, request_id, address
        where = f" (request {request_id!r}" + (f" on {address}" if address else "") + ")" if request_id else ""
        super().__init__(f"{code.name}: {details}{where}")

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError, **kw: Any) -> "ServingError":
        return cls(exc.code(), exc.details() or "", **kw)

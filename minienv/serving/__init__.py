"""Serving minienv over gRPC (the ``serve`` extra): the ``minienv.v1`` API in ``proto/minienv/v1/minienv.proto``,
its generated stubs (``minienv_pb2``, ``minienv_pb2_grpc``; written by ``tools/gen_proto.py``, never by hand) and
:class:`~minienv.serving.server.EngineServer`, which ``python -m minienv serve`` runs."""

from __future__ import annotations

from minienv.serving.server import SERVICE_NAME, EngineServer, ServerBindError

__all__ = ["SERVICE_NAME", "EngineServer", "ServerBindError"]

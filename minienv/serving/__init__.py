"""Serving minienv over gRPC and the OpenAI-compatible HTTP API (the ``serve`` extra): the ``minienv.v1`` API in
``proto/minienv/v1/minienv.proto``, its generated stubs (``minienv_pb2``, ``minienv_pb2_grpc``; written by
``tools/gen_proto.py``, never by hand), :class:`~minienv.serving.server.EngineServer`, which
``python -m minienv serve`` runs (the HTTP API is :mod:`minienv.serving.openai_api`, imported only when an
``http_port`` is asked for), the :class:`~minienv.serving.client.Client` (one instance, or several behind round
robin or prefix-aware routing), and :func:`~minienv.serving.launch.launch` to start local instances."""

from __future__ import annotations

from minienv.serving.client import Chunk, Client, Completion, ServingError, Stream
from minienv.serving.launch import LocalCluster, ServerProcess, launch
from minienv.serving.router import PrefixRouter
from minienv.serving.server import (SERVICE_NAME, EngineServer, PromptLimits, Refusal, ServerBindError,
                                    TLSConfig)

__all__ = ["SERVICE_NAME", "EngineServer", "ServerBindError", "PromptLimits", "Refusal", "TLSConfig", "Client",
           "Completion", "Chunk", "Stream", "ServingError", "PrefixRouter", "launch", "LocalCluster", "ServerProcess"]

"""``fraud-pipeline gateway``: REST and, when a gRPC port is set, gRPC in one process.

Both serve the same :class:`gateway.rest.Gateway` (one producer, one reply reader,
one rate limiter) on one event loop: the gRPC server starts after the gateway's
clients and stops before them (aiohttp's cleanup contexts run in order, and back).
"""

from __future__ import annotations

import logging

from aiohttp import web

from app.settings import Settings
from gateway.rest import Gateway, build_app

__all__ = ["run"]

log = logging.getLogger(__name__)


def run(settings: Settings, host: str, port: int, grpc_port: int = 0) -> None:
    """Serve until SIGINT/SIGTERM; ``grpc_port`` 0 serves REST only."""
    gateway = Gateway.from_settings(settings)
    app = build_app(gateway)
    if grpc_port:
        from gateway.grpc_server import grpc_lifecycle  # grpcio only where gRPC is served

        app.cleanup_ctx.append(grpc_lifecycle(gateway, host, grpc_port))
    web.run_app(
        app, host=host, port=port, access_log=None,
        print=lambda _: log.info("gateway listening on http://%s:%d (/openapi.json, /review)", host, port),
    )  # fmt: skip

"""How the services open gRPC channels to each other: message-size options, and the
current trace context in every call's metadata while tracing is on."""

from __future__ import annotations

import grpc

from specinfer import tracing
from specinfer.net import GRPC_OPTIONS


def internal_channel(address: str) -> grpc.aio.Channel:
    """A channel from one specinfer service to another (router -> speculator, verifier)."""
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS,
                                     interceptors=tracing.client_interceptors() or None)

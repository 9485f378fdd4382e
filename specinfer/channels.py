"""How the services open gRPC channels to each other: message-size options, mutual TLS
when configured, and the current trace context in every call's metadata while tracing is
on."""

from __future__ import annotations

import grpc

from specinfer import tracing
from specinfer.net import GRPC_OPTIONS
from specinfer.tls import TlsConfig


def internal_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A channel from one specinfer service to another (router -> speculator, verifier);
    with ``tls``, TLS presenting our certificate and checking theirs against its CA."""
    interceptors = tracing.client_interceptors() or None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS,
                                         interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                   options=GRPC_OPTIONS + tls.channel_options(),
                                   interceptors=interceptors)

"""Errors the services raise for bad requests or exhausted capacity; each maps to one gRPC
status code (``grpc_code``) and to an HTTP status in the router's OpenAI API."""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500


class InvalidArgument(ServiceError):
    """A request field is invalid; the message starts with the field's name."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ResourceExhausted(ServiceError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class OutOfRange(ServiceError):
    grpc_code = grpc.StatusCode.OUT_OF_RANGE
    http_status = 400

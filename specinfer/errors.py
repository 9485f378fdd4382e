"""Errors the services raise for bad requests, exhausted capacity or a service not ready;
each maps to one gRPC status code (``grpc_code``) and to an HTTP status in the router's
OpenAI API. Also the one check every service makes of client token ids."""

from __future__ import annotations

from collections.abc import Sequence

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


class NotFound(InvalidArgument):
    """A request names something the service does not hold (e.g. a sequence id)."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class ModelNotFound(NotFound):
    """A request asks for a model this stack does not serve (OpenAI's 404
    ``model_not_found``)."""

    openai_code = "model_not_found"

    def __init__(self, model: str, served: str) -> None:
        super().__init__("model", f"the model {model!r} does not exist; this server serves "
                                  f"{served!r}")


class FailedPrecondition(InvalidArgument):
    """A request that does not fit what the service holds (e.g. a stream's offset for a
    sequence it holds fewer tokens of): resend from the start."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 400


class ResourceExhausted(ServiceError):
    """No capacity now; ``retry_after_s``: when a retry may succeed, if known (sent as
    HTTP ``Retry-After`` and gRPC ``retry-after`` trailing metadata)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OutOfRange(ServiceError):
    grpc_code = grpc.StatusCode.OUT_OF_RANGE
    http_status = 400


class Unauthenticated(ServiceError):
    """No API key, or not one the service knows (HTTP 401, gRPC UNAUTHENTICATED)."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class Unavailable(ServiceError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class DeadlineExceeded(ServiceError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    """Every id in ``[0, vocab_size)``; the error names the first bad one (``field[j]``)."""
    for j, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"{field}[{j}]", f"token id {t} outside the vocabulary "
                                  f"[0, {vocab_size})")

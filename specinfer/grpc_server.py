"""What every specinfer gRPC service shares: server options, health and reflection,
error mapping, and graceful shutdown on SIGTERM/SIGINT (NOT_SERVING, drain, exit)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specinfer import tracing
from specinfer.errors import ServiceError
from specinfer.net import GRPC_OPTIONS

log = logging.getLogger(__name__)


MAX_DETAILS = 2000  # UTF-8 bytes of an error message sent: it may quote a client's input


def _details(exc: Exception) -> str:
    """The error's message, cut short: gRPC drops a status whose details (percent-encoded,
    up to 3 bytes per byte) pass its metadata limits (8 KiB soft, 16 KiB hard) and answers
    RESOURCE_EXHAUSTED instead, losing the code and the field."""
    text = str(exc)
    data = text.encode()
    if len(data) <= MAX_DETAILS:
        return text
    return data[:MAX_DETAILS].decode(errors="ignore") + "... (cut)"


async def abort_on_error(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Turn a service error (or a ValueError from validation) into its gRPC status."""
    if isinstance(exc, ServiceError):
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None:
            context.set_trailing_metadata((("retry-after", str(math.ceil(retry_after))),))
        await context.abort(exc.grpc_code, _details(exc))
    if isinstance(exc, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(exc))
    log.exception("internal error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


class _Malformed:
    """A request payload that is not a valid message of the method's type."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class MalformedRequests(grpc.aio.ServerInterceptor):
    """A request (or a message of a request stream) that does not parse (corrupt wire
    format, bad UTF-8 in a string) is answered INVALID_ARGUMENT naming the request; gRPC
    itself answers UNKNOWN, the status of a server that failed."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None \
                or handler.stream_unary is not None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # DecodeError and kin: the caller's fault
                return _Malformed(exc)

        async def refuse(request, context) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid message ({request.error})")

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                return await inner(request, context)

            return handler._replace(request_deserializer=deserialize, unary_unary=unary)
        if handler.stream_stream is not None:
            inner_both = handler.stream_stream

            async def both(request_iterator, context):
                async def checked():
                    async for request in request_iterator:
                        if isinstance(request, _Malformed):
                            await refuse(request, context)
                        yield request

                async for message in inner_both(checked(), context):
                    yield message

            return handler._replace(request_deserializer=deserialize, stream_stream=both)
        inner_stream = handler.unary_stream
        if inspect.isasyncgenfunction(inner_stream):
            async def stream(request, context):
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                async for message in inner_stream(request, context):
                    yield message
        else:  # a coroutine that writes its messages (health's Watch)
            async def stream(request, context):
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                return await inner_stream(request, context)

        return handler._replace(request_deserializer=deserialize, unary_stream=stream)


class Service:
    """A grpc.aio server with health (NOT_SERVING until ``set_serving``) and reflection;
    each call in a server span of the caller's trace while tracing is on."""

    def __init__(self, name: str, host: str, port: int,
                 credentials: grpc.ServerCredentials | None = None,
                 options: list[tuple[str, int]] | None = None) -> None:
        """``credentials``: serve TLS; ``options``: server options past the defaults."""
        self.name = name
        merged = list((dict(GRPC_OPTIONS) | dict(options or [])).items())  # ours win
        self.server = grpc.aio.server(options=merged, interceptors=[
            *tracing.server_interceptors(), MalformedRequests()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"{host}:{port}"
        self.port = self.server.add_secure_port(self.address, credentials) if credentials \
            else self.server.add_insecure_port(self.address)
        self._services = [health.SERVICE_NAME, reflection.SERVICE_NAME]

    def add(self, full_name: str) -> None:
        self._services.append(full_name)

    async def start(self) -> None:
        reflection.enable_server_reflection(self._services, self.server)
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        log.info("listening", extra={"address": self.address, "port": self.port})

    async def _set(self, status) -> None:
        for name in ("", *self._services[2:]):
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def set_serving(self) -> None:
        await self._set(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"role": self.name})

    async def run_until_signal(self, grace_s: float = 10.0,
                               on_stop: Callable[[], Awaitable[None]] | None = None,
                               drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serve until SIGTERM/SIGINT; then report NOT_SERVING, ``drain()`` (still serving
        calls: e.g. until clients have moved their work elsewhere), stop accepting calls
        and give those in flight ``grace_s``, then ``on_stop()``."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping: NOT_SERVING, draining in-flight requests", extra={"grace_s": grace_s})
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)
        if drain is not None:
            await drain()
        await self.server.stop(grace_s)
        if on_stop is not None:
            await on_stop()
        tracing.shutdown_tracing()  # export the spans still buffered
        log.info("stopped")


async def serve_engine(name: str, servicer, register, full_name: str, build, host: str,
                       port: int, grace_s: float = 10.0, close=None, healthy=None,
                       credentials: grpc.ServerCredentials | None = None,
                       drain: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run a service whose ``servicer`` holds an ``engine`` built by ``build()`` on its
    single worker thread (``servicer.pool``): listen at once (NOT_SERVING), build, report
    SERVING, run until SIGTERM/SIGINT (then ``drain()`` while NOT_SERVING, see
    ``Service.run_until_signal``), then ``close(engine)`` on the worker thread. With
    ``healthy(engine)`` (read every second off the worker thread), the first False turns
    health to NOT_SERVING for good."""
    service = Service(name, host, port, credentials)
    register(servicer, service.server)
    service.add(full_name)
    await service.start()
    loop = asyncio.get_running_loop()
    servicer.engine = await loop.run_in_executor(servicer.pool, build)
    await service.set_serving()

    async def watch() -> None:
        while healthy(servicer.engine):
            await asyncio.sleep(1.0)
        log.error("engine unhealthy: NOT_SERVING", extra={"role": name})
        await service._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    watcher = asyncio.create_task(watch()) if healthy is not None else None

    async def stop() -> None:
        if close is not None:
            await loop.run_in_executor(servicer.pool, close, servicer.engine)

    try:
        await service.run_until_signal(grace_s, on_stop=stop, drain=drain)
    finally:
        if watcher is not None:
            watcher.cancel()

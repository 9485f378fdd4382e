"""Tracing with OpenTelemetry, exported over OTLP (what Jaeger's collector speaks).

``setup_tracing`` runs once per process. Tracing is on when an endpoint is given, by
``--otlp-traces-endpoint`` (vLLM's flag) or the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
/ ``OTEL_EXPORTER_OTLP_ENDPOINT``; off, nothing is installed: no exporter thread, no
interceptors, and every span call below is the API's no-op. The SDK reads the rest of the
standard environment itself (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*``); ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``
chooses OTLP/gRPC (default, port 4317) or OTLP/HTTP (``http/protobuf``, port 4318).

W3C trace context crosses every internal RPC in gRPC metadata: ``client_interceptors``
inject the caller's current span, ``server_interceptors`` open each call's server span as
its child.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from specinfer.config import flag

log = logging.getLogger(__name__)

tracer = trace.get_tracer("specinfer")  # a proxy: real once setup_tracing installs a provider

_provider = None  # the SDK's TracerProvider while tracing is on

PROTOCOLS = ("grpc", "http/protobuf")
# Server-side codes that mean the service failed (OpenTelemetry's gRPC conventions); the
# others are the caller's mistakes and leave a server span's status unset.
_SERVER_ERRORS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                  grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                  grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
_UNTRACED = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class TracingError(ValueError):
    """A tracing setting that cannot work (exit 2, naming it)."""


def endpoint_flag() -> Any:
    """The ``--otlp-traces-endpoint`` field of every service's config."""
    return flag(None, "export traces over OTLP to this collector (Jaeger: http://HOST:4317 "
                "for OTLP/gRPC; with OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf, "
                "http://HOST:4318). Default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                "OTEL_EXPORTER_OTLP_ENDPOINT; with none, tracing is off and costs nothing",
                metavar="URL")


def enabled() -> bool:
    return _provider is not None


def _protocol(environ: Mapping[str, str]) -> str:
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = environ.get(name, "").strip()
        if value:
            if value not in PROTOCOLS:
                raise TracingError(f"{name}={value!r}: supported are {', '.join(PROTOCOLS)}")
            return value
    return "grpc"


def _insecure(scheme: str, environ: Mapping[str, str]) -> bool:
    """Plaintext unless the URL says https, or OTEL_EXPORTER_OTLP[_TRACES]_INSECURE=false
    asks for TLS on a scheme-less (or grpc://) address."""
    if scheme in ("https", "grpcs"):
        return False
    if scheme == "http":
        return True
    for name in ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE"):
        if environ.get(name):
            return environ[name].strip().lower() != "false"
    return True


def exporter_for(endpoint: str | None, environ: Mapping[str, str]):
    """The OTLP span exporter for ``endpoint`` (the flag's), else the environment's; None
    when tracing is off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or \
            environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    source = "--otlp-traces-endpoint"
    if not endpoint:
        for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            if environ.get(name, "").strip():
                source, endpoint = name, environ[name].strip()
                break
    if not endpoint:
        return None
    protocol = _protocol(environ)
    url = urlparse(endpoint if "://" in endpoint else f"//{endpoint}")
    if not url.hostname:
        raise TracingError(f"{source}={endpoint!r}: expected a URL such as http://HOST:4317")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=url.netloc,
                                insecure=_insecure(url.scheme or "", environ))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    scheme = url.scheme if url.scheme in ("http", "https") else "http"
    # A bare collector address gets the signal's path, as OTEL_EXPORTER_OTLP_ENDPOINT does.
    path = url.path if source == "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" or \
        url.path.strip("/") else "/v1/traces"
    return HttpSpanExporter(endpoint=f"{scheme}://{url.netloc}{path}")


def setup_tracing(role: str, endpoint: str | None = None,
                  environ: Mapping[str, str] | None = None) -> bool:
    """Install the SDK for service ``specinfer-<role>`` if tracing is on (see the module);
    returns whether it is."""
    global _provider
    environ = os.environ if environ is None else environ
    exporter = exporter_for(endpoint, environ)
    if exporter is None:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME, when set, wins over the default name (Resource.create reads it).
    name = environ.get("OTEL_SERVICE_NAME") or f"specinfer-{role}"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing on", extra={"service_name": name, "protocol": _protocol(environ)})
    return True


def shutdown_tracing() -> None:
    """Export what is buffered and stop the exporter (at service shutdown)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


# --- spans the services open -------------------------------------------------------------


def request_span(name: str, attributes: dict | None = None) -> Span:
    """A span for a request's whole life, child of the current span (the API call that
    carries it); ended by whoever ends the request."""
    if not enabled():
        return trace.INVALID_SPAN
    return tracer.start_span(name, attributes=attributes)


@contextmanager
def batch_span(name: str, parents: Sequence[Span], attributes: dict | None = None,
               kind: SpanKind = SpanKind.CLIENT) -> Iterator[Span]:
    """A span for one call serving several requests: it belongs to the first one's trace
    and links the others' (a batched RPC has one parent). Current while open, so the call's
    metadata carries it to the service that answers."""
    if not enabled() or not parents:
        yield trace.INVALID_SPAN
        return
    links = [Link(p.get_span_context()) for p in parents[1:]
             if p.get_span_context().is_valid]
    parent = trace.set_span_in_context(parents[0])
    with tracer.start_as_current_span(name, context=parent, kind=kind, links=links,
                                      attributes=attributes) as span:
        yield span


@contextmanager
def within(span: Span) -> Iterator[None]:
    """Make ``span`` current (calls made inside carry it) without ending it."""
    if not enabled():
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


def server_span(name: str, carrier: Mapping[str, str], attributes: dict | None = None):
    """A SERVER span for an incoming call whose headers are ``carrier`` (W3C
    ``traceparent``): a child of the caller's span; a context manager, current while open."""
    # Status comes from the call's gRPC code (``_end_status``), not from the exception an
    # abort raises: INVALID_ARGUMENT is the caller's error, not the server's.
    return tracer.start_as_current_span(name, context=propagate.extract(carrier),
                                        kind=SpanKind.SERVER, attributes=attributes,
                                        record_exception=False,
                                        set_status_on_exception=False)


# --- gRPC metadata -----------------------------------------------------------------------


def carrier() -> dict[str, str]:
    """The current span's W3C trace context (``traceparent``, ...); empty when off. For
    messages that carry it themselves (each message of a long-lived stream)."""
    out: dict[str, str] = {}
    if enabled():
        propagate.inject(out)
    return out


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    context = carrier()
    if not context:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    for key, value in context.items():
        metadata[key] = value
    return details._replace(metadata=metadata)


class _InjectUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _InjectStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


def client_interceptors() -> list:
    """For internal channels: the current span crosses each call in its metadata."""
    return [_InjectUnary(), _InjectStream()] if enabled() else []


def _rpc_attributes(method: str) -> dict:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _end_status(span: Span, context: grpc.aio.ServicerContext,
                exc: BaseException | None) -> None:
    code = context.code()
    if not isinstance(code, grpc.StatusCode) and isinstance(exc, Exception) \
            and not isinstance(exc, grpc.aio.AbortError):
        code = grpc.StatusCode.UNKNOWN  # what grpc answers for an unhandled exception
        span.record_exception(exc)
    if isinstance(code, grpc.StatusCode):
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code in _SERVER_ERRORS:
            span.set_status(Status(StatusCode.ERROR, str(context.details() or code.name)))


@contextmanager
def _call_span(name: str, carrier: Mapping[str, str], attributes: dict,
               context: grpc.aio.ServicerContext) -> Iterator[None]:
    """One call's SERVER span, its status set from the call's gRPC code at the end."""
    with server_span(name, carrier, attributes) as span:
        exc = None
        try:
            yield
        except BaseException as e:
            exc = e
            raise
        finally:
            _end_status(span, context, exc)


class _ServerSpans(grpc.aio.ServerInterceptor):
    """Each unary and server-streaming call runs inside a SERVER span, the child of the
    span in its ``traceparent`` metadata (health checks and reflection untraced)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_UNTRACED) or handler.request_streaming:
            return handler
        carrier = {k: v for k, v in (details.invocation_metadata or ())
                   if isinstance(v, str)}
        name, attributes = method.lstrip("/"), _rpc_attributes(method)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                with _call_span(name, carrier, attributes, context):
                    return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        inner_stream = handler.unary_stream

        async def stream(request, context):
            with _call_span(name, carrier, attributes, context):
                async for message in inner_stream(request, context):
                    yield message

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def server_interceptors() -> list:
    return [_ServerSpans()] if enabled() else []


"""A real OTLP/gRPC trace receiver (the ``TraceService`` Jaeger's collector serves, built from
``opentelemetry-proto``), for tests and the tracing benchmark: it keeps every span it is
sent, with its service's name."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from specinfer.net import free_port


@dataclass
class ReceivedSpan:
    service: str
    span: trace_pb2.Span
    attributes: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def links(self) -> list[tuple[str, str]]:
        return [(link.trace_id.hex(), link.span_id.hex()) for link in self.span.links]


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, port: int = 0) -> None:
        self.port = port or free_port()
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(service, span, _attributes(span.attributes)))
        with self._lock:
            self.spans += received
            self.requests += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> OtlpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(0)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]



def poll(predicate, timeout: float = 30.0, every: float = 0.2):
    """Call ``predicate()`` until it returns something truthy; returns that (or the last
    falsy value when time runs out)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(every)

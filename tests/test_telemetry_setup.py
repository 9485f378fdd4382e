"""When tracing is on and where it exports, in a fresh interpreter each (the SDK's provider
is process-global); trace ids in log records; metric labels."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from servers import cli

from specinfer import tracing
from specinfer.logs import JsonFormatter
from specinfer.metrics import tree_size

PROBE = """
import json, sys, threading
from opentelemetry import trace
from specinfer import tracing
on = tracing.setup_tracing("router", sys.argv[1] or None)
span = tracing.request_span("probe")
span.end()
print(json.dumps({
    "on": on,
    "otel_threads": [t.name for t in threading.enumerate() if t.name.startswith("Otel")],
    "provider": type(trace.get_tracer_provider()).__name__,
    "recording": span.is_recording() or span.get_span_context().is_valid,
    "interceptors": len(tracing.client_interceptors()) + len(tracing.server_interceptors()),
}))
"""


def _probe(flag: str = "", **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", PROBE, flag], env={**base, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_an_endpoint_nothing_is_installed_and_no_span_is_recorded():
    for env in ({}, {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"},
                {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                 "OTEL_SDK_DISABLED": "true"},
                {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317",
                 "OTEL_TRACES_EXPORTER": "none"}):
        got = _probe(**env)
        assert got == {"on": False, "otel_threads": [], "provider": "ProxyTracerProvider",
                       "recording": False, "interceptors": 0}, env


@pytest.mark.parametrize("flag,env", [
    ("http://127.0.0.1:4317", {}),
    pytest.param("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"},
                 marks=pytest.mark.matrix),
    ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces",
          "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}),
])
def test_an_endpoint_turns_tracing_on(flag, env):
    got = _probe(flag, **env)
    assert got["on"] and got["recording"] and got["provider"] == "TracerProvider"
    assert len(got["otel_threads"]) == 1 and got["interceptors"] == 3


def test_the_exporter_follows_the_flag_and_the_standard_environment():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    grpc_plain = tracing.exporter_for("jaeger:4317", {})
    assert isinstance(grpc_plain, OTLPSpanExporter)
    assert (grpc_plain._endpoint, grpc_plain._insecure) == ("jaeger:4317", True)
    assert tracing.exporter_for("https://collector:4317", {})._insecure is False
    assert tracing.exporter_for("grpc://jaeger:4317",
                                {"OTEL_EXPORTER_OTLP_INSECURE": "false"})._insecure is False
    # The flag wins over the environment.
    flag_first = tracing.exporter_for("http://a:4317",
                                      {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4317"})
    assert flag_first._endpoint == "a:4317"
    http = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    bare = tracing.exporter_for("http://jaeger:4318", http)
    assert isinstance(bare, HttpSpanExporter)
    assert bare._endpoint == "http://jaeger:4318/v1/traces"  # a bare collector gets the path
    assert tracing.exporter_for(None, {**http, "OTEL_EXPORTER_OTLP_ENDPOINT":
                                       "http://j:4318"})._endpoint == "http://j:4318/v1/traces"
    assert tracing.exporter_for(None, {
        **http, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://j:4318/custom"}
    )._endpoint == "http://j:4318/custom"  # the signal's own endpoint is used as given
    traces_protocol = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                       "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert isinstance(tracing.exporter_for("http://j:4318", traces_protocol), HttpSpanExporter)
    assert tracing.exporter_for(None, {}) is None


@pytest.mark.parametrize("endpoint,env,message", [
    ("http://", {}, "--otlp-traces-endpoint"),
    ("http://j:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_PROTOCOL"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "://"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
])
def test_a_bad_setting_is_named(endpoint, env, message):
    with pytest.raises(tracing.TracingError, match=message):
        tracing.exporter_for(endpoint, env)


def test_a_bad_endpoint_stops_a_service_with_exit_2():
    out = cli("serve", "router", "--verifier", "127.0.0.1:1", "--otlp-traces-endpoint",
              "http://")
    assert out.returncode == 2 and "--otlp-traces-endpoint" in out.stderr


def _record(message: str) -> dict:
    record = logging.LogRecord("t", logging.INFO, __file__, 1, message, (), None)
    return json.loads(JsonFormatter("router").format(record))


def test_log_records_carry_the_current_span_ids():
    from opentelemetry.sdk.trace import TracerProvider

    assert "trace_id" not in _record("outside a span")
    tracer = TracerProvider().get_tracer("test")  # not installed globally
    with tracer.start_as_current_span("step") as span:
        entry = _record("inside")
    ctx = span.get_span_context()
    assert entry["trace_id"] == format(ctx.trace_id, "032x")
    assert entry["span_id"] == format(ctx.span_id, "016x")


def test_tree_size_labels_are_upper_bounds():
    assert [tree_size(n) for n in (0, 1, 2, 3, 16, 17, 64, 256, 257)] == \
        ["0", "1", "2", "4", "16", "32", "64", "256", "+Inf"]

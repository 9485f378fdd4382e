"""Prometheus metrics every service shares: the registry (with the process's own CPU,
memory and GC series), the ``/metrics`` endpoint on ``--metrics-port``, bucket bounds, and
the tree-size label.

Names follow vLLM's with the prefix ``specinfer:`` (``specinfer:num_requests_waiting``,
``specinfer:time_to_first_token_seconds``, ...), so dashboards and KEDA triggers written
for vLLM carry over. Each service defines its own instruments (``services/<role>/
metrics.py``) on a registry of its own, so a test process can hold several.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from specinfer.config import flag

log = logging.getLogger(__name__)

PREFIX = "specinfer:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: from a millisecond (a GPU step) to minutes (a long generation on a CPU).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
# Token counts: 1, 2, 5, 10, 20, 50, ... up to a million.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Tree sizes as label values: the smallest of these at or above the node count.
TREE_SIZES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


def tree_size(nodes: int) -> str:
    """The ``tree_nodes`` label of a call with ``nodes`` draft nodes: an upper bound from
    ``TREE_SIZES`` ("0" for none), so the label has few values."""
    for size in TREE_SIZES:
        if nodes <= size:
            return str(size)
    return "+Inf"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (2.33+), or None elsewhere (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


class HeapCollector:
    """Where a process's memory goes, to tell a leak from fragmentation when its resident
    memory grows: ``specinfer:process_heap_bytes{state}`` from the C heap (``in_use``: what
    malloc handed out and is not freed, tensors' storage included; ``free``: freed but still
    held by malloc's arenas) and ``specinfer:process_python_blocks`` (objects Python's own
    allocator holds). A scrape costs well under a millisecond."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._mallinfo2 = _mallinfo2()
        registry.register(self)

    def collect(self) -> Any:
        if self._mallinfo2 is not None:
            info = self._mallinfo2()
            heap = GaugeMetricFamily(f"{PREFIX}process_heap_bytes", "The C heap (glibc "
                                     "malloc): in use, and freed but held by its arenas",
                                     labels=["state"])
            heap.add_metric(["in_use"], float(info.uordblks + info.hblkhd))
            heap.add_metric(["free"], float(info.fordblks))
            yield heap
        yield GaugeMetricFamily(f"{PREFIX}process_python_blocks", "Memory blocks Python's "
                                "allocator holds (live objects and their buffers)",
                                value=float(sys.getallocatedblocks()))


def new_registry() -> CollectorRegistry:
    """A registry with the process's own series (CPU, memory, open files, GC, the heap)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    HeapCollector(registry)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text format."""
    return generate_latest(registry)


def port_flag(what: str) -> Any:
    """The ``--metrics-port`` field of a service's config (``what``: the metrics it has)."""
    return flag(0, f"serve Prometheus metrics at http://HOST:PORT/metrics ({what}); 0 = off")


class _MetricsHandler(BaseHTTPRequestHandler):
    """``GET /metrics``: the registry in the text format, whatever the scraper accepts.
    (prometheus_client's own server answers Prometheus' ``Accept:
    application/openmetrics-text`` with OpenMetrics, whose sample names escape the colon of
    ``specinfer:...`` to ``_`` under a real Prometheus while ``# TYPE`` keeps it: every
    series then lands under another name than the docs and the dashboard use.)"""

    registry: CollectorRegistry

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "metrics are at /metrics")
            return
        body = exposition(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Not logged: a scrape a second would flood the logs."""


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> None:
    """``/metrics`` on ``port`` from a daemon thread (a scrape never waits on the model's
    thread or the event loop)."""
    if not 0 < port < 65536:
        return
    handler = type("Handler", (_MetricsHandler,), {"registry": registry})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics", extra={"address": f"{host}:{port}", "path": "/metrics"})

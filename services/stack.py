"""``specinfer up``: the whole stack on this machine — verifier(s), speculator(s) and the
router as separate ``specinfer serve <role>`` processes on loopback — until SIGINT/SIGTERM,
then stops every one of them."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

from services.router.policy import SPECULATION_CHOICES
from specinfer import tracing
from specinfer.models import DEFAULT_LLM
from specinfer.net import free_port
from specinfer.placement import add_flags as add_placement_flags
from specinfer.placement import from_flags

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM)
    p.add_argument("--ssm", action="append", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--verifiers", type=int, default=1)
    p.add_argument("--speculators", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--expansion", default=None, help="the speculator's static tree")
    p.add_argument("--draft-head", default="auto", help="the verifiers' draft head: auto, "
                   "none or a directory (see serve verifier)")
    p.add_argument("--datastore", default="auto", help="the speculators' and verifiers' "
                   "corpus drafts: auto, none or a saved .npz")
    p.add_argument("--speculation", choices=tuple(SPECULATION_CHOICES), default="adaptive")
    add_placement_flags(p)  # the verifiers' and speculators' (validated here, before starting)
    tracing.add_flags(p)  # passed to every service (the OTEL_* environment is inherited)
    p.add_argument("--metrics-port", type=int, default=0,
                   help="the router serves /metrics on --http-port; with this, the "
                        "verifiers serve theirs on this port and the next ones, then the "
                        "speculators (0 = only the router's)")


def wait_serving(address: str, procs: list[subprocess.Popen], timeout: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.3)
    return False


def run(args: argparse.Namespace) -> int:
    exe = [sys.executable, "-m", "services"]
    from_flags(args)  # a bad --device/--dtype fails here, not in every service
    tracing.exporter_for(args.otlp_traces_endpoint, os.environ)  # ... and a bad endpoint
    placement = ["--device", args.device, "--dtype", args.dtype, "--quantize", args.quantize,
                 "--compile", args.compile]
    if args.otlp_traces_endpoint:
        placement += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    metrics_ports = iter(range(args.metrics_port, args.metrics_port + 1000)
                         if args.metrics_port else [])
    metrics_urls = []

    def metrics_flag() -> list[str]:
        port = next(metrics_ports, 0)
        if not port:
            return []
        metrics_urls.append(f"http://127.0.0.1:{port}/metrics")
        return ["--metrics-port", str(port)]
    procs: list[subprocess.Popen] = []
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # Share the cores among the model processes.
    threads = max(1, (os.cpu_count() or 1) // max(1, args.verifiers * args.tp * args.pp))
    verifiers = []
    for _ in range(args.verifiers):
        port = free_port()
        verifiers.append(f"127.0.0.1:{port}")
        procs.append(subprocess.Popen(exe + [
            "serve", "verifier", "--llm", args.llm, "--port", str(port), "--tp", str(args.tp),
            "--pp", str(args.pp), "--slots", str(args.slots), "--max-context",
            str(args.max_context), "--threads", str(threads), "--datastore", args.datastore,
            "--draft-head", args.draft_head, *placement, *metrics_flag()]))
    speculators = []
    for _ in range(args.speculators):
        port = free_port()
        speculators.append(f"127.0.0.1:{port}")
        cmd = exe + ["serve", "speculator", "--llm", args.llm, "--port", str(port),
                     "--max-context", str(args.max_context), "--threads", str(threads)]
        for ref in args.ssm or []:
            cmd += ["--ssm", ref]
        if args.expansion:
            cmd += ["--expansion", args.expansion]
        cmd += ["--datastore", args.datastore, *placement, *metrics_flag()]
        procs.append(subprocess.Popen(cmd))
    router = f"{args.host}:{args.port}"
    cmd = exe + ["serve", "router", "--llm", args.llm, "--host", args.host, "--port",
                 str(args.port), "--http-port", str(args.http_port),
                 "--speculation", args.speculation]
    if args.otlp_traces_endpoint:
        cmd += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    for v in verifiers:
        cmd += ["--verifier", v]
    for s in speculators:
        cmd += ["--speculator", s]
    procs.append(subprocess.Popen(cmd))
    rc = 0
    try:
        if not wait_serving(router, procs, timeout=900):
            if not stopping:
                print("specinfer up: a service failed to start", file=sys.stderr)
                rc = 1
        else:
            print(f"specinfer is serving: gRPC {router}  OpenAI HTTP "
                  f"http://{args.host}:{args.http_port}/v1  metrics "
                  f"{' '.join([f'http://{args.host}:{args.http_port}/metrics', *metrics_urls])}"
                  "  (Ctrl-C stops)", flush=True)
        while not stopping and rc == 0:
            if any(p.poll() is not None for p in procs):
                print("specinfer up: a service exited; stopping", file=sys.stderr)
                rc = 1
                break
            time.sleep(0.5)
    finally:
        stop_processes(procs)
    return rc


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM every process that still runs, wait, and SIGKILL what did not stop."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()

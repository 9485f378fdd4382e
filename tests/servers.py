"""Start specinfer services as real processes on loopback for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(addr: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    channel = grpc.insecure_channel(addr)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}")
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                channel.close()
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{addr} not SERVING after {timeout}s")


@contextmanager
def service(*args: str, timeout: float = 180.0):
    """Run ``specinfer serve ...``; yields (address, process); SIGTERM on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "specinfer", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    addr = f"127.0.0.1:{port}"
    try:
        wait_serving(addr, proc, timeout)
        yield addr, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

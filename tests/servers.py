"""Start specinfer services as real processes on loopback for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager

from services import stack
from specinfer.net import free_port

__all__ = ["free_port", "service", "wait_serving"]


def wait_serving(addr: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    """Until ``addr`` reports SERVING; raises if the process exits or time runs out."""
    if not stack.wait_serving(addr, [proc], timeout):
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}")
        raise TimeoutError(f"{addr} not SERVING after {timeout}s")


@contextmanager
def service(*args: str, timeout: float = 180.0, env: dict[str, str] | None = None):
    """Run ``specinfer serve ...`` (``env``: added to the environment); yields (address,
    process); SIGTERM on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "services", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
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

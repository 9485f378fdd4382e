"""Start specinfer services as real processes on loopback for tests."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager

from services import stack
from specinfer.client import AsyncClient
from specinfer.net import free_port

__all__ = ["failovers", "free_port", "scrape", "service", "sessions_on", "stream_sessions",
           "wait_serving"]


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


def sessions_on(address: str, others: list[str], n: int) -> list[str]:
    """``n`` session ids the router's rendezvous hashing (services/router/replicas.py
    ``pick``) places on ``address`` first when the usable verifiers are it and ``others``."""
    out, i = [], 0
    while len(out) < n:
        key = f"s{i}"
        rank = sorted([address, *others], key=lambda a: hashlib.sha256(
            f"{key}|{a}".encode()).digest())
        if rank[0] == address:
            out.append(key)
        i += 1
    return out


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as {series (name and labels): value}."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series


def failovers(http: str, role: str) -> float:
    """The router's ``specinfer:failovers_total`` for ``role`` (from its HTTP /metrics)."""
    return sum(v for k, v in scrape(f"{http}/metrics").items()
               if k.startswith("specinfer:failovers_total") and f'role="{role}"' in k)


async def stream_sessions(addr: str, sessions: list[str], prompts: list[str], max_tokens: int,
                          started: asyncio.Event, quorum: int) -> list[tuple[str, list[int]]]:
    """One stream through the router at ``addr`` per session, prompts in turn; ``started``
    is set once ``quorum`` of them have their first tokens. Returns (prompt, token ids)."""
    first = 0

    async def one(client: AsyncClient, prompt: str, session: str) -> tuple[str, list[int]]:
        nonlocal first
        ids: list[int] = []
        async for chunk in client.stream(prompt, max_tokens=max_tokens, session_id=session):
            if not ids:
                first += 1
                if first >= quorum:
                    started.set()
            ids += chunk.token_ids
        return prompt, ids

    async with AsyncClient(addr) as client:
        return await asyncio.gather(*(one(client, prompts[i % len(prompts)], s)
                                      for i, s in enumerate(sessions)))


def http_post(url: str, data: bytes) -> tuple[int, dict]:
    """POST a JSON body; (status, the JSON answer), errors included."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())

"""Start specinfer services as real processes on loopback for tests: the one way a test
starts a service, ``specinfer up`` or the CLI (``start``, ``service``, ``cli``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services import stack
from specinfer.client import AsyncClient
from specinfer.net import free_port

__all__ = ["Service", "Stack", "cli", "failovers", "free_port", "http_post", "scrape", "service",
           "sessions_on", "start", "stream_sessions", "wait_serving"]


def _argv(args: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "services", *args]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}


def wait_serving(addr: str, proc: subprocess.Popen, timeout: float = 180.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Until ``addr`` reports SERVING; raises if the process exits or time runs out."""
    if not stack.wait_serving(addr, [proc], timeout, credentials=credentials):
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}")
        raise TimeoutError(f"{addr} not SERVING after {timeout}s")


@dataclass
class Service:
    """A service process started by ``start``, its port and the address it serves on."""

    port: int
    addr: str
    proc: subprocess.Popen

    def wait(self, timeout: float = 240.0,
             credentials: grpc.ChannelCredentials | None = None) -> Service:
        """Until it reports SERVING (raises if it exits first or time runs out)."""
        wait_serving(self.addr, self.proc, timeout, credentials)
        return self

    def stop(self, grace_s: float = 60.0) -> int:
        """SIGTERM (SIGKILL after ``grace_s``); its exit code."""
        stack.stop_processes([self.proc], grace_s)
        return self.proc.returncode


def start(role: str, *args: str, port: int | None = None, host: str = "127.0.0.1",
          env: dict[str, str] | None = None, **popen: Any) -> Service:
    """``specinfer serve ROLE ARGS --port PORT`` (``role`` "up": ``specinfer up``), started
    and not waited for; ``env`` is added to the environment, ``popen`` goes to Popen
    (stdout, start_new_session, ...). ``port`` defaults to a free one; ``host`` is where it
    is reached (pass ``--host`` in ``args`` too when it is not loopback)."""
    port = port or free_port()
    command = ("up",) if role == "up" else ("serve", role)
    proc = subprocess.Popen(_argv((*command, *args, "--port", str(port))), env=_env(env),
                            **popen)
    return Service(port, f"{host}:{port}", proc)


@contextmanager
def service(role: str, *args: str, timeout: float = 240.0, env: dict[str, str] | None = None,
            **popen: Any) -> Iterator[tuple[str, subprocess.Popen]]:
    """A ``start``ed service once it is SERVING; yields (address, process); stopped on exit."""
    running = start(role, *args, env=env, **popen)
    try:
        running.wait(timeout)
        yield running.addr, running.proc
    finally:
        running.stop()


def cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """``specinfer ARGS`` (``serve verifier ...``, ``generate ...``) run to its end, its
    output captured as text."""
    return subprocess.run(_argv(args), capture_output=True, text=True, timeout=timeout,
                          env=_env(None))


class Stack:
    """Services of one configuration as processes: ``start`` each (they load in parallel),
    ``wait`` for the ones a test calls first; ``stop`` (or leaving the ``with`` block) ends
    every one still running."""

    def __init__(self) -> None:
        self.services: list[Service] = []

    def start(self, role: str, *args: str, **kwargs: Any) -> Service:
        """``start`` (same arguments), stopped with the stack."""
        running = start(role, *args, **kwargs)
        self.services.append(running)
        return running

    def router(self, llm: str, verifiers: list[Service], *args: str,
               speculators: tuple[Service, ...] = (), **kwargs: Any) -> Service:
        """A router over ``verifiers`` (and ``speculators``), started and waited for."""
        peers = [arg for v in verifiers for arg in ("--verifier", v.addr)]
        peers += [arg for s in speculators for arg in ("--speculator", s.addr)]
        return self.start("router", "--llm", llm, *peers, *args, **kwargs).wait()

    def stop(self) -> None:
        stack.stop_processes([s.proc for s in self.services])

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


@contextmanager
def prometheus(targets: dict[str, str], workdir: Path, labels: dict[str, str] | None = None
               ) -> Iterator[str]:
    """Debian's Prometheus scraping ``targets`` (job -> ``http://host:port/metrics``) every
    second, its data in ``workdir``; yields its base URL once ready, stopped on exit."""
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": job, "metrics_path": "/" + url.split("//", 1)[1].split("/", 1)[1],
         "static_configs": [{"targets": [url.split("//", 1)[1].split("/", 1)[0]],
                             "labels": labels or {}}]}
        for job, url in targets.items()]}
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


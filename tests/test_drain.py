"""A verifier told to stop (SIGTERM: a pod scaled down, evicted or rolled) drains: it turns
NOT_SERVING, refuses new sequences, keeps serving its live ones, and the router moves them to
another replica (re-prefilled from the history it holds) — or, with nowhere to move them,
lets them finish there — so no request is lost and greedy output is unchanged. Real
processes on loopback: a router and two verifiers on a tiny random Llama."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import free_port, wait_serving

from services.stack import stop_processes
from specinfer.client import AsyncClient, Client
from specinfer.v1 import verifier_pb2, verifier_pb2_grpc

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of",
           "1, 2, 3, 4,"]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def stack(tiny_chat_llm):
    exe = [sys.executable, "-m", "services", "serve"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs, verifiers = [], []
    for _ in range(2):
        port = free_port()
        verifiers.append(f"127.0.0.1:{port}")
        procs.append(subprocess.Popen(exe + [
            "verifier", "--llm", tiny_chat_llm, "--port", str(port), "--slots", "16",
            "--max-context", "512", "--threads", "1", "--drain-timeout", "40"], env=env))
    port, http_port = free_port(), free_port()
    cmd = exe + ["router", "--llm", tiny_chat_llm, "--port", str(port), "--http-port",
                 str(http_port), "--speculation", "lookup"]
    for v in verifiers:
        cmd += ["--verifier", v]
    router = subprocess.Popen(cmd, env=env)
    procs.append(router)
    try:
        wait_serving(f"127.0.0.1:{port}", router, timeout=240)
        yield {"addr": f"127.0.0.1:{port}", "http": f"http://127.0.0.1:{http_port}",
               "verifiers": verifiers, "procs": procs[:2]}
    finally:
        stop_processes(procs)


def sessions_on(address: str, others: list[str], n: int) -> list[str]:
    """Session ids the router's consistent hashing places on ``address`` first."""
    out, i = [], 0
    while len(out) < n:
        key = f"s{i}"
        rank = sorted([address, *others], key=lambda a: hashlib.sha256(
            f"{key}|{a}".encode()).digest())
        if rank[0] == address:
            out.append(key)
        i += 1
    return out


def moved_sequences(http: str) -> float:
    text = urllib.request.urlopen(f"{http}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specinfer:failovers_total") and 'role="verifier"' in line)


async def streams(addr: str, sessions: list[str], started: asyncio.Event,
                  stop_after_first: int) -> list[tuple[str, list[int]]]:
    """One stream per session, prompts in turn; ``started`` is set once
    ``stop_after_first`` of them have their first tokens."""
    first = 0

    async def one(client, prompt, session):
        nonlocal first
        ids = []
        async for chunk in client.stream(prompt, max_tokens=MAX_TOKENS, session_id=session):
            if not ids:
                first += 1
                if first >= stop_after_first:
                    started.set()
            ids += chunk.token_ids
        return prompt, ids

    async with AsyncClient(addr) as client:
        return await asyncio.gather(*(one(client, PROMPTS[i % len(PROMPTS)], s)
                                      for i, s in enumerate(sessions)))


def test_draining_verifiers_lose_nothing(stack):
    with Client(stack["addr"]) as c:
        reference = {p: c.generate(p, max_tokens=MAX_TOKENS, speculation=False).token_ids
                     for p in PROMPTS}
    v0, v1 = stack["verifiers"]
    p0, p1 = stack["procs"]
    before = moved_sequences(stack["http"])

    # 1. Verifier 0 stops with 4 live sequences on it and 2 on verifier 1: its sequences
    # move to verifier 1, it frees them, and it exits well before its 40 s drain timeout.
    async def phase_one():
        started = asyncio.Event()
        sessions = sessions_on(v0, [v1], 4) + sessions_on(v1, [v0], 2)
        task = asyncio.create_task(streams(stack["addr"], sessions, started, 6))
        await asyncio.wait_for(started.wait(), 60)
        p0.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        results = await task
        return results, sent

    results, sent = asyncio.run(phase_one())
    for prompt, ids in results:
        assert ids == reference[prompt]
    assert p0.wait(timeout=30) == 0
    assert time.monotonic() - sent < 30, "verifier 0 waited out its drain timeout"
    assert moved_sequences(stack["http"]) >= before + 1

    # 2. Verifier 1, the last one, stops while a router's sequence and one of our own
    # ("held") are live on it: nowhere to move them, so it keeps serving them, NOT_SERVING,
    # refusing new sequences, and exits as soon as the last one is released.
    async def phase_two():
        async with grpc.aio.insecure_channel(v1) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            held = await stub.Prefill(verifier_pb2.PrefillRequest(items=[
                verifier_pb2.PrefillItem(sequence_id="held", token_ids=[1, 2, 3, 4])]),
                timeout=30)
            started = asyncio.Event()
            task = asyncio.create_task(streams(stack["addr"], ["last"], started, 1))
            await asyncio.wait_for(started.wait(), 60)
            p1.send_signal(signal.SIGTERM)
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 10
            while (await health.Check(health_pb2.HealthCheckRequest(), timeout=2)).status \
                    == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Prefill(verifier_pb2.PrefillRequest(items=[
                    verifier_pb2.PrefillItem(sequence_id="new", token_ids=[1, 2, 3])]),
                    timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in refused.value.details()
            results = await task
            decoded = await stub.Decode(verifier_pb2.DecodeRequest(items=[
                verifier_pb2.DecodeItem(sequence_id="held",
                                        root_token=held.results[0].token)]), timeout=10)
            assert len(decoded.results) == 1
            assert p1.poll() is None, "exited with a live sequence"
            await stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=["held"]), timeout=10)
            return results

    [(prompt, ids)] = asyncio.run(phase_two())
    assert ids == reference[prompt]
    assert p1.wait(timeout=15) == 0

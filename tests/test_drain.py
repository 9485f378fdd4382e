"""A verifier told to stop (SIGTERM: a pod scaled down, evicted or rolled) drains: it turns
NOT_SERVING, refuses new sequences, keeps serving its live ones, and the router moves them to
another replica (re-prefilled from the history it holds) — or, with nowhere to move them,
lets them finish there — so no request is lost and greedy output is unchanged. Real
processes on loopback: a router and two verifiers on a tiny random Llama."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import failovers, free_port, sessions_on, stream_sessions

from specinfer.client import Client
from specinfer.v1 import verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.processes

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of",
           "1, 2, 3, 4,"]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def stack(processes, tiny_chat_llm):
    verifiers = [processes.start("verifier", "--llm", tiny_chat_llm, "--slots", "16",
                                 "--max-context", "512", "--threads", "1", "--drain-timeout",
                                 "40") for _ in range(2)]
    http_port = free_port()
    router = processes.router(tiny_chat_llm, verifiers, "--http-port", str(http_port),
                              "--speculation", "lookup")
    return {"addr": router.addr, "http": f"http://127.0.0.1:{http_port}",
            "verifiers": [v.addr for v in verifiers], "procs": [v.proc for v in verifiers]}


def http_health(base: str) -> tuple[int, int]:
    """/health's status code and ready verifiers (no API key: a probe has none)."""
    response = requests.get(base + "/health", timeout=10)
    return response.status_code, response.json()["verifiers_ready"]


def wait_health(base: str, expected: tuple[int, int], within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while (got := http_health(base)) != expected:
        assert time.monotonic() < deadline, f"/health says {got}, expected {expected}"
        time.sleep(0.1)


def test_draining_verifiers_lose_nothing(stack):
    wait_health(stack["http"], (200, 2))
    with Client(stack["addr"]) as c:
        reference = {p: c.generate(p, max_tokens=MAX_TOKENS, speculation=False).token_ids
                     for p in PROMPTS}
    v0, v1 = stack["verifiers"]
    p0, p1 = stack["procs"]
    before = failovers(stack["http"], "verifier")

    # 1. Verifier 0 stops with 4 live sequences on it and 2 on verifier 1: its sequences
    # move to verifier 1, it frees them, and it exits well before its 40 s drain timeout.
    async def phase_one():
        started = asyncio.Event()
        sessions = sessions_on(v0, [v1], 4) + sessions_on(v1, [v0], 2)
        task = asyncio.create_task(stream_sessions(stack["addr"], sessions, PROMPTS,
                                                   MAX_TOKENS, started, 6))
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
    assert failovers(stack["http"], "verifier") >= before + 1
    wait_health(stack["http"], (200, 1))

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
            task = asyncio.create_task(stream_sessions(stack["addr"], ["last"], PROMPTS,
                                                       MAX_TOKENS, started, 1))
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
            decoded = await stub.Step(verifier_pb2.StepRequest(items=[
                verifier_pb2.StepItem(sequence_id="held",
                                      root_token=held.results[0].token)]), timeout=10)
            assert len(decoded.results) == 1
            assert p1.poll() is None, "exited with a live sequence"
            await stub.Release(verifier_pb2.ReleaseRequest(sequence_ids=["held"]), timeout=10)
            return results

    [(prompt, ids)] = asyncio.run(phase_two())
    assert ids == reference[prompt]
    assert p1.wait(timeout=15) == 0
    wait_health(stack["http"], (503, 0))  # the router stays up; nothing can take a sequence

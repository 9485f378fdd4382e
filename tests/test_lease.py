"""Routers come and go; the verifier's KV slots do not leak. A router killed mid-stream
(SIGKILL: no Release) leaves its sequences on the verifier only until their lease runs
out; a new router against the same verifier then serves at once. Routers sharing a
verifier do not disturb each other. A request that cannot get capacity within the queue
timeout is turned away with RESOURCE_EXHAUSTED / HTTP 429 and Retry-After."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from servers import free_port, service, start

from services.stack import stop_processes
from specinfer.client import Client, OverloadedError
from specinfer.v1 import router_pb2, router_pb2_grpc, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.processes

LEASE_S = 3.0
PROMPT = "Tell me a long story about a lighthouse keeper"


@pytest.fixture(scope="module")
def verifier(tiny_chat_llm, smollm2_datastore):
    with service("verifier", "--llm", tiny_chat_llm, "--slots", "4", "--max-context", "2048",
                 "--sequence-lease", str(LEASE_S), "--threads", "1") as (addr, proc):
        channel = grpc.insecure_channel(addr)
        yield addr, verifier_pb2_grpc.VerifierStub(channel)
        channel.close()


def start_router(llm: str, verifier: str, *extra: str) -> tuple[str, int, subprocess.Popen]:
    http = free_port()
    router = start("router", "--llm", llm, "--verifier", verifier, "--http-port", str(http),
                   "--speculation", "lookup", *extra).wait(timeout=120)
    return router.addr, http, router.proc


def live(stub) -> int:
    return stub.Info(verifier_pb2.InfoRequest(), timeout=10).live_sequences


def open_streams(addr: str, n: int, max_tokens: int = 1500) -> tuple[list, threading.Event]:
    """``n`` greedy streams in threads; returns their token lists and an event set once
    every stream has received tokens."""
    got = [[] for _ in range(n)]
    started = threading.Event()

    def run(i: int) -> None:
        try:
            with Client(addr, retry_seconds=0) as c:
                for chunk in c.stream(f"{PROMPT} {i}", max_tokens=max_tokens):
                    got[i] += chunk.token_ids
                    if all(got):
                        started.set()
        except Exception:  # noqa: BLE001 (the router may be killed under it)
            pass

    for i in range(n):
        threading.Thread(target=run, args=(i,), daemon=True).start()
    return got, started


def test_info_reports_the_lease(verifier):
    _, stub = verifier
    assert stub.Info(verifier_pb2.InfoRequest(), timeout=10).sequence_lease_seconds == LEASE_S


def test_a_killed_routers_sequences_are_freed_and_a_new_router_serves(verifier,
                                                                     tiny_chat_llm):
    addr, stub = verifier
    a_addr, _, a = start_router(tiny_chat_llm, addr)
    b = None
    try:
        _, started = open_streams(a_addr, 4)
        assert started.wait(120)
        assert live(stub) == 4  # every slot held
        a.send_signal(signal.SIGKILL)
        a.wait()
        killed = time.monotonic()
        b_addr, _, b = start_router(tiny_chat_llm, addr)
        asked = time.monotonic()
        with Client(b_addr) as c:
            out = c.generate(PROMPT, max_tokens=8)
        assert out.completion_tokens == 8
        # Served within the lease (counted from the kill) plus the sweep and a step.
        assert time.monotonic() - max(asked, killed + LEASE_S) < 5
        deadline = time.monotonic() + 10
        while live(stub) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert live(stub) == 0
    finally:
        stop_processes([p for p in (a, b) if p is not None])


def test_routers_sharing_a_verifier_do_not_disturb_each_other(verifier, tiny_chat_llm):
    addr, stub = verifier
    b_addr, _, b = start_router(tiny_chat_llm, addr)
    c_addr, _, c = start_router(tiny_chat_llm, addr)
    try:
        with Client(b_addr) as client:  # the answers B's streams must give
            want = [client.generate(f"{PROMPT} {i}", max_tokens=200, speculation=False)
                    .token_ids for i in range(2)]
        got, _ = open_streams(b_addr, 2, max_tokens=200)
        _, started = open_streams(c_addr, 2)
        assert started.wait(120)
        c.send_signal(signal.SIGKILL)
        c.wait()
        deadline = time.monotonic() + 120
        while [len(g) for g in got] != [200, 200] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got == want
        time.sleep(LEASE_S + 2)  # C's two are freed by their lease; B's finished cleanly
        assert live(stub) == 0
    finally:
        stop_processes([b, c])


def test_no_capacity_within_the_queue_timeout_is_429_with_retry_after(verifier,
                                                                      tiny_chat_llm):
    addr, stub = verifier
    b_addr, _, b = start_router(tiny_chat_llm, addr)
    d_addr, d_http, d = start_router(tiny_chat_llm, addr, "--queue-timeout", "1")
    try:
        _, started = open_streams(b_addr, 4)  # a live router holds every slot
        assert started.wait(120)
        req = urllib.request.Request(f"http://127.0.0.1:{d_http}/v1/completions",
                                     data=json.dumps({"prompt": "hi", "max_tokens": 4})
                                     .encode(), headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 429 and int(err.value.headers["Retry-After"]) >= 1
        assert json.loads(err.value.read())["error"]["type"] == "rate_limit_error"
        with Client(d_addr, retry_seconds=0) as client, pytest.raises(OverloadedError):
            client.generate("hi", max_tokens=4)
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(d_addr))
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(router_pb2.GenerateRequest(prompt="hi", max_tokens=4), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(err.value.trailing_metadata())["retry-after"]) >= 1
    finally:
        stop_processes([b, d])


def test_a_router_paused_past_the_lease_resumes_its_streams_unchanged(verifier,
                                                                     tiny_chat_llm):
    """A router stopped (SIGSTOP) longer than the lease loses its sequences on the
    verifier; resumed, it is told NOT_FOUND and prefills them again from its history:
    the greedy streams finish with the same tokens."""
    addr, stub = verifier
    b_addr, _, b = start_router(tiny_chat_llm, addr)
    try:
        with Client(b_addr) as client:
            want = [client.generate(f"{PROMPT} {i}", max_tokens=300, speculation=False)
                    .token_ids for i in range(2)]
        got, started = open_streams(b_addr, 2, max_tokens=300)
        assert started.wait(120)
        b.send_signal(signal.SIGSTOP)
        assert live(stub) == 2 and all(len(g) < 300 for g in got)  # mid-stream
        time.sleep(LEASE_S + 2.5)
        assert live(stub) == 0  # freed while the router was away
        b.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 120
        while [len(g) for g in got] != [300, 300] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got == want
    finally:
        b.send_signal(signal.SIGCONT)
        stop_processes([b])

"""The router follows a Service's EndpointSlices while it serves (``--discovery
kubernetes``): it serves while the pool is at zero (requests queue until a verifier is
ready), verifiers added mid-traffic take new sessions and move no live one, a
verifier whose endpoint turns terminating has its sequences moved, a ``410 Gone`` and a
missed change are repaired by re-listing, a watch that goes silent while a verifier dies is
survived (failover, then the re-list drops it) -- and every request completes with greedy
output identical to the reference.

Real processes: a router and three verifiers on a tiny random Llama, on 127.0.0.2-4 with
one port, as pods behind one Service. The Kubernetes API is kmock's double (the ``kmock``
fixture, in this process), reached by the router through a kubeconfig; slices change over
HTTP (open watches see it) or behind the watch's back (``kmock.objects``)."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import pytest
from kube_api import RES, Api, endpoint_slice, gone_once, is_watch, write_kubeconfig
from servers import (
    Stack,
    failovers,
    free_port,
    scrape,
    sessions_on,
    stream_sessions,
    wait_serving,
)

from specinfer.client import AsyncClient

pytestmark = pytest.mark.processes

SERVICE = "specinfer-verifier"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of",
           "1, 2, 3, 4,"]
MAX_TOKENS = 160
# Phases where a verifier leaves mid-stream run longer streams, so that they are still live
# when the router learns of it (up to one --discovery-interval later) on any machine speed.
LONG_TOKENS = 440
REPLICA = re.compile(r'replica="([^"]+)"')


def router_view(http: str) -> dict[str, float]:
    """The verifiers the router knows (its replica_healthy series): address -> 1 usable."""
    return {REPLICA.search(k).group(1): v for k, v in scrape(f"{http}/metrics").items()
            if k.startswith("specinfer:replica_healthy{") and 'role="verifier"' in k}


def waiting(http: str) -> float:
    return sum(v for k, v in scrape(f"{http}/metrics").items()
               if k.startswith("specinfer:num_requests_waiting"))


def prefill_tokens(metrics_url: str) -> float:
    return sum(v for k, v in scrape(metrics_url).items()
               if k.startswith("specinfer:verifier_prefill_tokens_total"))


async def until(predicate, what: str, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.2)


async def traffic(router: str, sessions: list[str], change=None,
                  max_tokens: int = MAX_TOKENS) -> list[tuple[str, list[int]]]:
    """Streams for ``sessions``; once all have their first tokens, ``change()`` runs."""
    started = asyncio.Event()
    task = asyncio.create_task(stream_sessions(router, sessions, PROMPTS, max_tokens,
                                               started, len(sessions)))
    await asyncio.wait_for(started.wait(), 120)
    if change is not None:
        await change()
    return await asyncio.wait_for(task, 180)


def ready(*hosts: str) -> list[dict]:
    return [{"addresses": [h], "conditions": {"ready": True}} for h in hosts]


@pytest.mark.asyncio
async def test_router_follows_endpointslices(kmock, tiny_chat_llm, tmp_path):
    kmock.resources[RES] = {}
    api = Api(kmock.url)
    stack = Stack()
    port = free_port()
    v0, v1, v2 = (f"{h}:{port}" for h in HOSTS)
    metrics_ports = [free_port() for _ in HOSTS]
    pairs = list(zip(HOSTS, metrics_ports, strict=True))
    metrics = {f"{h}:{port}": f"http://{h}:{m}/metrics" for h, m in pairs}
    verifiers = {f"{h}:{port}": stack.start(
        "verifier", "--llm", tiny_chat_llm, "--host", h, "--metrics-port", str(m), "--slots",
        "16", "--max-context", "512", "--threads", "1", "--datastore", "none", port=port,
        host=h).proc for h, m in pairs}
    try:
        await asyncio.gather(*(asyncio.to_thread(wait_serving, a, p, 240)
                               for a, p in verifiers.items()))
        # At start the Service has no ready endpoint (the pool scaled to zero): v0 and v1
        # are not ready yet; v2 is not in it.
        await api.create(endpoint_slice("verifier-a", SERVICE, [
            (HOSTS[0], False, None), (HOSTS[1], False, None)], ports=[("grpc", port)]))
        http_port = free_port()
        http = f"http://127.0.0.1:{http_port}"
        routing = stack.start(
            "router", "--llm", tiny_chat_llm, "--http-port", str(http_port), "--speculation",
            "lookup", "--discovery", "kubernetes", "--verifier", SERVICE, "--kube-namespace",
            "default", "--discovery-interval", "0.5",
            env={"KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", kmock.url))})
        raddr, router = routing.addr, routing.proc
        # 0. Scale from zero: the router serves with no verifier, queues a request (what
        # num_requests_waiting shows an autoscaler), and runs it once v0 turns ready.
        await asyncio.to_thread(wait_serving, raddr, router, 240)
        assert await asyncio.to_thread(router_view, http) == {}
        async with AsyncClient(raddr) as client:
            first = asyncio.create_task(client.generate(PROMPTS[0], max_tokens=LONG_TOKENS))
            await until(lambda: waiting(http) == 1, "the request queued")
            await api.patch("verifier-a", {"endpoints": [
                {"addresses": [HOSTS[0]], "conditions": {"ready": True}},
                {"addresses": [HOSTS[1]], "conditions": {"ready": False}}]})
            first = await asyncio.wait_for(first, 60)
            assert await asyncio.to_thread(router_view, http) == {v0: 1.0}
            reference = {p: (await client.generate(p, max_tokens=LONG_TOKENS,
                                                   speculation=False)).token_ids
                         for p in PROMPTS}
        assert first.token_ids == reference[PROMPTS[0]]

        def check(results: list[tuple[str, list[int]]]) -> None:
            assert len(results) == len(sessions)
            for prompt, ids in results:  # greedy: a shorter run is the longer one's prefix
                assert ids == reference[prompt][:len(ids)], prompt
                assert len(ids) in (MAX_TOKENS, LONG_TOKENS, len(reference[prompt])), prompt

        # 1. Scale up mid-traffic: v1 turns ready (watch: MODIFIED) and v2's slice appears
        # (watch: ADDED). Both join; no live sequence moves.
        moved = await asyncio.to_thread(failovers, http, "verifier")

        async def scale_up() -> None:
            await api.patch("verifier-a", {"endpoints": ready(HOSTS[0], HOSTS[1])})
            await api.create(endpoint_slice("verifier-b", SERVICE, [(HOSTS[2], True, None)],
                                            ports=[("grpc", port)]))
            await until(lambda: router_view(http) == {v0: 1.0, v1: 1.0, v2: 1.0},
                        "v1 and v2 join")

        sessions = [f"up{i}" for i in range(6)]
        check(await traffic(raddr, sessions, scale_up))
        assert await asyncio.to_thread(failovers, http, "verifier") == moved
        # New sessions reach the new replicas (consistent hashing over all three).
        before = {a: prefill_tokens(metrics[a]) for a in (v1, v2)}
        sessions = sessions_on(v1, [v0, v2], 2) + sessions_on(v2, [v0, v1], 2)
        check(await traffic(raddr, sessions))
        for a in (v1, v2):
            assert prefill_tokens(metrics[a]) > before[a], a

        # 2. v0's endpoint turns terminating behind the watch's back (a change it missed),
        # and the next watch gets 410 Gone: the re-list finds the change, v0's sequences
        # move to v1 and v2, and the router forgets v0.
        armed = gone_once(kmock, as_event=False)

        async def terminate_v0() -> None:
            kmock.objects[RES, "default", "verifier-a"] = endpoint_slice(
                "verifier-a", SERVICE, [(HOSTS[0], False, True), (HOSTS[1], True, None)],
                ports=[("grpc", port)])
            armed.set()
            await until(lambda: v0 not in router_view(http), "v0 forgotten")

        sessions = (sessions_on(v0, [v1, v2], 3) + sessions_on(v1, [v0, v2], 2)
                    + sessions_on(v2, [v0, v1], 1))
        moved = await asyncio.to_thread(failovers, http, "verifier")
        check(await traffic(raddr, sessions, terminate_v0, LONG_TOKENS))
        assert await asyncio.to_thread(failovers, http, "verifier") >= moved + 1
        await until(lambda: not armed.is_set(), "the 410 served", 10)
        verifiers[v0].send_signal(signal.SIGTERM)  # the pod stops once it is out
        assert await asyncio.to_thread(verifiers[v0].wait, 40) == 0

        # 3. Watches go silent (a connection that died without a word), and v2 dies before
        # the API says so: the router fails its sequences over to v1 at once, and the
        # periodic re-list (--discovery-interval 0.5) drops v2 from the router's view.
        silent = asyncio.Event()
        kmock[lambda req: silent.is_set() and is_watch(req)] << (
            b"", lambda: asyncio.sleep(3600))

        async def kill_v2() -> None:
            silent.set()
            verifiers[v2].kill()
            await api.delete("verifier-b")  # no watch hears it
            await until(lambda: router_view(http) == {v1: 1.0}, "v2 dropped by re-list")

        sessions = sessions_on(v1, [v2], 3) + sessions_on(v2, [v1], 3)
        moved = await asyncio.to_thread(failovers, http, "verifier")
        check(await traffic(raddr, sessions, kill_v2, LONG_TOKENS))
        assert await asyncio.to_thread(failovers, http, "verifier") >= moved + 1
        assert router.poll() is None
    finally:
        await api.session.close()
        stack.stop()

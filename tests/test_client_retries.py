"""The SDK rides out a router restart: UNAVAILABLE before the first token is retried with
backoff (for ``retry_seconds``, 30 by default), sync and async, unary and streamed; never
after a token was received (the caller has it). Against a real gRPC server in this process
that answers UNAVAILABLE as a restarting router does."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
from servers import free_port

from specinfer.client import AsyncClient, Client, UnavailableError
from specinfer.v1 import router_pb2, router_pb2_grpc


class Flaky(router_pb2_grpc.RouterServicer):
    """UNAVAILABLE for the first ``fail`` calls; then an answer. With ``break_after_first``,
    a stream sends one chunk and then fails with UNAVAILABLE."""

    def __init__(self, fail: int, break_after_first: bool = False) -> None:
        self.fail, self.break_after_first, self.calls = fail, break_after_first, 0

    def _maybe_fail(self, context) -> None:
        self.calls += 1
        if self.calls <= self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")

    def Generate(self, request, context):
        self._maybe_fail(context)
        return router_pb2.GenerateResponse(text="ok", token_ids=[1, 2], finish_reason="stop")

    def GenerateStream(self, request, context):
        self._maybe_fail(context)
        yield router_pb2.GenerateStreamResponse(text="o", token_ids=[1])
        if self.break_after_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "died mid-stream")
        yield router_pb2.GenerateStreamResponse(text="k", token_ids=[2], finish_reason="stop")


@pytest.fixture()
def router():
    servers = []

    def serve(servicer: Flaky) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"
    yield serve
    for server in servers:
        server.stop(0)


def test_unavailable_before_the_first_token_is_retried(router):
    unary, streamed = Flaky(fail=3), Flaky(fail=3)
    with Client(router(unary)) as c:
        assert c.generate("hi").token_ids == [1, 2] and unary.calls == 4
    with Client(router(streamed)) as c:
        assert [t for ch in c.stream("hi") for t in ch.token_ids] == [1, 2]
    assert streamed.calls == 4

    async def run():
        a, s = Flaky(fail=2), Flaky(fail=2)
        async with AsyncClient(router(a)) as c:
            assert (await c.generate("hi")).token_ids == [1, 2]
        async with AsyncClient(router(s)) as c:
            assert [t async for ch in c.stream("hi") for t in ch.token_ids] == [1, 2]
        return a.calls, s.calls
    assert asyncio.run(run()) == (3, 3)


def test_no_retry_after_a_token_or_past_the_budget(router):
    broken = Flaky(fail=0, break_after_first=True)
    with Client(router(broken)) as c:
        got = []
        with pytest.raises(UnavailableError):
            for ch in c.stream("hi"):
                got += ch.token_ids
        assert got == [1] and broken.calls == 1  # the token was not sent twice
    never = Flaky(fail=10**6)
    with Client(router(never), retry_seconds=0) as c, pytest.raises(UnavailableError):
        c.generate("hi")
    assert never.calls == 1
    with Client(router(never), retry_seconds=1.0) as c, pytest.raises(UnavailableError):
        c.generate("hi")
    assert 3 <= never.calls <= 8  # 0.25 + 0.5 + ... within a second, then given up

    async def run():
        b = Flaky(fail=0, break_after_first=True)
        async with AsyncClient(router(b)) as c:
            got = []
            with pytest.raises(UnavailableError):
                async for ch in c.stream("hi"):
                    got += ch.token_ids
        return got, b.calls
    assert asyncio.run(run()) == ([1], 1)

"""A router that starts before its verifier: it listens at once and refuses calls with
UNAVAILABLE and a message until a verifier answers, then serves."""

from __future__ import annotations

import pytest
from servers import Stack, free_port

pytestmark = pytest.mark.processes


def test_every_rpc_is_unavailable_until_the_verifiers_answer(tiny_chat_llm):
    """A router whose verifier is not there yet listens at once: Generate and
    GenerateStream answer UNAVAILABLE with a message (and health NOT_SERVING) until the
    verifier answers; then it generates."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specinfer.client import build_request
    from specinfer.v1 import router_pb2_grpc

    verifier_port = free_port()
    stack = Stack()
    router = stack.start("router", "--llm", tiny_chat_llm, "--http-port", "0", "--verifier",
                         f"127.0.0.1:{verifier_port}")
    channel = grpc.insecure_channel(router.addr)
    stub, health = router_pb2_grpc.RouterStub(channel), health_pb2_grpc.HealthStub(channel)
    request = build_request("The quick brown fox", max_tokens=4)
    calls = {"Generate": lambda: stub.Generate(request, timeout=5),
             "GenerateStream": lambda: list(stub.GenerateStream(request, timeout=5))}
    seen = {name: [] for name in calls}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                "starting" in details for _, details in seen["GenerateStream"]):
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as err:
                    call()
                seen[name].append((err.value.code(), err.value.details()))
            time.sleep(0.05)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        stack.start("verifier", "--llm", tiny_chat_llm, "--slots", "2", "--max-context", "64",
                    "--datastore", "none", "--draft-head", "none", port=verifier_port)
        while True:  # until the verifier has loaded and the router has found it
            try:
                out = stub.Generate(request, timeout=5)
                break
            except grpc.RpcError as exc:
                seen["Generate"].append((exc.code(), exc.details()))
                assert time.monotonic() < deadline, "the router never served"
                time.sleep(0.05)
        assert len(out.token_ids) == 4
        for name, answers in seen.items():
            assert {code for code, _ in answers} == {grpc.StatusCode.UNAVAILABLE}, (name,
                                                                                    answers)
            assert all(details for _, details in answers)
            assert any("starting" in details for _, details in answers), answers
    finally:
        channel.close()
        stack.stop()

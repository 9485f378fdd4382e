"""Rolling upgrades: a router meets a verifier from before the Step call (its Info reports no
step protocol) and routes nothing to it, logging why, while it keeps answering; a verifier
speaking the router's protocol joins."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from services.router.metrics import RouterMetrics
from services.router.replicas import ReplicaSet
from services.router.request import GenRequest
from specinfer.sampling import SamplingParams
from specinfer.v1 import verifier_pb2, verifier_pb2_grpc
from specinfer.wire import STEP_PROTOCOL


class InfoOnly(verifier_pb2_grpc.VerifierServicer):
    """A verifier's Info as a release of a given step protocol answers it."""

    def __init__(self, protocol: int) -> None:
        self.protocol = protocol
        self.asked = 0

    async def Info(self, request, context):
        self.asked += 1
        return verifier_pb2.InfoResponse(model="m", vocab_size=128, max_context=64,
                                         kv_capacity_tokens=256, max_tree_nodes=8,
                                         step_protocol=self.protocol)


async def _serve(servicer: InfoOnly) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("protocol,joins", [(0, False), (STEP_PROTOCOL, True)])
def test_a_verifier_without_the_step_call_gets_no_sequences(protocol, joins, caplog):
    async def main() -> tuple[bool, bool, int]:
        servicer = InfoOnly(protocol)
        server, addr = await _serve(servicer)
        replicas = ReplicaSet([addr], RouterMetrics("m"))
        try:
            await replicas.start(wait=False)
            await asyncio.sleep(1.5)
            picked = replicas.pick(GenRequest([1, 2, 3], 4, SamplingParams()))
            return replicas.by_address[addr].joined, picked is not None, servicer.asked
        finally:
            await replicas.close()
            await server.stop(None)

    with caplog.at_level(logging.ERROR, logger="services.router.replicas"):
        joined, picked, asked = asyncio.run(main())
    assert (joined, picked) == (joins, joins)
    assert asked >= 1
    refused = [r for r in caplog.records if "step protocol" in r.getMessage()]
    assert bool(refused) != joins

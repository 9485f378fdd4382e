"""The speculator's gRPC service (``specinfer serve speculator``)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from services.speculator.engine import SpeculateSpec, SpeculatorEngine
from services.speculator.metrics import SpeculatorMetrics
from specinfer import tracing
from specinfer.errors import InvalidArgument
from specinfer.grpc_server import abort_on_error, serve_engine
from specinfer.v1 import speculator_pb2, speculator_pb2_grpc
from specinfer.wire import sampling_from_proto, tree_to_proto

log = logging.getLogger(__name__)


MAX_ITEMS = 1024  # sequences per Speculate call: a router's batch is far smaller


def specs_from_proto(request: speculator_pb2.SpeculateRequest) -> list[SpeculateSpec]:
    if len(request.items) > MAX_ITEMS:  # one call must not hold the worker for minutes
        raise InvalidArgument("items", f"{len(request.items)} sequences; at most {MAX_ITEMS} "
                              "per call")
    specs = []
    for i, item in enumerate(request.items):
        params = sampling_from_proto(item.sampling, f"items[{i}].sampling")
        specs.append(SpeculateSpec(item.sequence_id, list(item.context), params,
                                   list(item.tree.expansion), item.tree.max_nodes,
                                   item.tree.dynamic))
    return specs


class SpeculatorServicer(speculator_pb2_grpc.SpeculatorServicer):
    def __init__(self, metrics: SpeculatorMetrics | None = None) -> None:
        self.engine: SpeculatorEngine | None = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speculator")
        self.metrics = metrics if metrics is not None else SpeculatorMetrics("")

    def _speculate(self, request: speculator_pb2.SpeculateRequest):
        start = time.perf_counter()
        return self.engine.speculate(specs_from_proto(request)), time.perf_counter() - start

    async def Speculate(self, request, context):
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the SSMs are still loading")
        try:
            trees, seconds = await asyncio.get_running_loop().run_in_executor(
                self.pool, self._speculate, request)
        except Exception as exc:
            log.info("request failed", extra={"method": "Speculate", "error": str(exc)[:300]})
            await abort_on_error(context, exc)
        nodes = sum(len(t.tokens) for t in trees)
        budget = max((item.tree.max_nodes for item in request.items), default=0)
        self.metrics.call(len(trees), budget, nodes, seconds)
        if tracing.enabled():
            trace.get_current_span().set_attributes({
                "specinfer.batch_size": len(trees), "specinfer.node_budget": budget,
                "specinfer.tree_nodes": nodes, "specinfer.engine_seconds": seconds})
        return speculator_pb2.SpeculateResponse(results=[
            speculator_pb2.SpeculateResult(sequence_id=item.sequence_id, tree=tree_to_proto(t))
            for item, t in zip(request.items, trees, strict=True)
        ])


async def serve(build, host: str, port: int, grace_s: float = 10.0,
                metrics: SpeculatorMetrics | None = None,
                credentials: grpc.ServerCredentials | None = None) -> None:
    await serve_engine("speculator", SpeculatorServicer(metrics),
                       speculator_pb2_grpc.add_SpeculatorServicer_to_server,
                       speculator_pb2.DESCRIPTOR.services_by_name["Speculator"].full_name,
                       build, host, port, grace_s, credentials=credentials)

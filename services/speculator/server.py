"""The speculator's gRPC service (``specinfer serve speculator``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from services.speculator.engine import SpeculateSpec, SpeculatorEngine
from services.speculator.metrics import SpeculatorMetrics
from specinfer import tracing
from specinfer.constraints import Constraint
from specinfer.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from specinfer.grpc_server import abort_on_error, serve_engine
from specinfer.v1 import speculator_pb2, speculator_pb2_grpc
from specinfer.wire import constraint_from_proto, sampling_from_proto, tree_to_proto

log = logging.getLogger(__name__)


MAX_ITEMS = 1024  # sequences per Speculate call: a router's batch is far smaller
MAX_STREAM_SEQUENCES = 4096  # sequences one SpeculateStream holds (the router releases them)


def _spec(sequence_id: str, context: list[int], params, tree: speculator_pb2.TreeConfig,
          constraint: Constraint | None = None, prompt_length: int = 0) -> SpeculateSpec:
    return SpeculateSpec(sequence_id, context, params, list(tree.expansion), tree.max_nodes,
                         tree.dynamic, tree.ssm_only, constraint, prompt_length)


def _constraint(item, field: str) -> Constraint | None:
    return constraint_from_proto(item.constraint, field) if item.HasField("constraint") \
        else None


def specs_from_proto(request: speculator_pb2.SpeculateRequest) -> list[SpeculateSpec]:
    if len(request.items) > MAX_ITEMS:  # one call must not hold the worker for minutes
        raise InvalidArgument("items", f"{len(request.items)} sequences; at most {MAX_ITEMS} "
                              "per call")
    specs = []
    for i, item in enumerate(request.items):
        params = sampling_from_proto(item.sampling, f"items[{i}].sampling")
        specs.append(_spec(item.sequence_id, list(item.context), params, item.tree,
                           _constraint(item, f"items[{i}].constraint"), item.prompt_length))
    return specs


def _message_span(request: speculator_pb2.SpeculateStreamRequest):
    """A SERVER span per stream message, the child of the span in its trace context (the
    router's step), so each step's drafting shows in its requests' traces."""
    if not tracing.enabled():
        return contextlib.nullcontext()
    return tracing.server_span("specinfer.v1.Speculator/SpeculateStream", request.trace_context,
                               {"rpc.system": "grpc", "rpc.service": "specinfer.v1.Speculator",
                                "rpc.method": "SpeculateStream",
                                "specinfer.step": request.step})


class StreamContexts:
    """What one SpeculateStream holds: each sequence's context (the tokens sent so far)
    and its constraint (sent with its first tokens)."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}
        self.constraints: dict[str, tuple[Constraint, int]] = {}  # (constraint, prompt len)

    def specs(self, request: speculator_pb2.SpeculateStreamRequest) -> list[SpeculateSpec]:
        """The step's specs from the held contexts and the deltas; holds nothing new until
        ``commit`` (a refused message changes nothing)."""
        if len(request.items) > MAX_ITEMS:
            raise InvalidArgument("items", f"{len(request.items)} sequences; at most "
                                  f"{MAX_ITEMS} per message")
        seen: set[str] = set()
        specs = []
        for i, item in enumerate(request.items):
            sid = item.sequence_id
            if sid in seen:
                raise InvalidArgument(f"items[{i}].sequence_id", f"{sid!r} appears twice")
            seen.add(sid)
            held = self.held.get(sid, []) if item.offset else []
            if item.offset != len(held):
                raise FailedPrecondition(
                    f"items[{i}].offset", f"the stream holds {len(held)} tokens of sequence "
                    f"{sid!r}, not {item.offset}; send its full context with offset 0")
            params = sampling_from_proto(item.sampling, f"items[{i}].sampling")
            constraint, prompt_length = self.constraints.get(sid, (None, 0)) if item.offset \
                else (_constraint(item, f"items[{i}].constraint"), item.prompt_length)
            specs.append(_spec(sid, held + list(item.delta), params, item.tree, constraint,
                               prompt_length))
        if len(self.held.keys() | seen) > MAX_STREAM_SEQUENCES:
            raise ResourceExhausted(f"the stream would hold more than {MAX_STREAM_SEQUENCES} "
                                    "sequences; release those that ended")
        return specs

    def commit(self, specs: list[SpeculateSpec]) -> None:
        for spec in specs:
            self.held[spec.sequence_id] = spec.context
            if spec.constraint is not None:
                self.constraints[spec.sequence_id] = (spec.constraint, spec.prompt_length)
            else:
                self.constraints.pop(spec.sequence_id, None)

    def release(self, sequence_ids) -> list[str]:
        for sid in sequence_ids:
            self.constraints.pop(sid, None)
        return [sid for sid in sequence_ids if self.held.pop(sid, None) is not None]


class SpeculatorServicer(speculator_pb2_grpc.SpeculatorServicer):
    def __init__(self, metrics: SpeculatorMetrics | None = None) -> None:
        self.engine: SpeculatorEngine | None = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speculator")
        self.metrics = metrics if metrics is not None else SpeculatorMetrics("")

    def _speculate(self, request: speculator_pb2.SpeculateRequest):
        start = time.perf_counter()
        return self.engine.speculate(specs_from_proto(request)), time.perf_counter() - start

    def _stream_step(self, request: speculator_pb2.SpeculateStreamRequest,
                     stream: StreamContexts):
        self.engine.forget(stream.release(request.release))
        start = time.perf_counter()
        specs = stream.specs(request)
        trees = self.engine.speculate(specs) if specs else []
        stream.commit(specs)
        return trees, time.perf_counter() - start

    async def SpeculateStream(self, request_iterator, context):
        """Speculate, one message per step on a long-lived stream (speculator.proto)."""
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the SSMs are still loading")
        stream = StreamContexts()
        loop = asyncio.get_running_loop()
        try:
            async for request in request_iterator:
                with _message_span(request):
                    try:
                        trees, seconds = await loop.run_in_executor(
                            self.pool, self._stream_step, request, stream)
                    except Exception as exc:
                        log.info("request failed", extra={"method": "SpeculateStream",
                                                          "error": str(exc)[:300]})
                        await abort_on_error(context, exc)
                    self._observe(request.items, trees, seconds)
                yield speculator_pb2.SpeculateStreamResponse(step=request.step, results=[
                    speculator_pb2.SpeculateResult(sequence_id=item.sequence_id,
                                                   tree=tree_to_proto(t))
                    for item, t in zip(request.items, trees, strict=True)])
        finally:  # the stream's SSM caches go with it
            held = list(stream.held)
            if held:
                with contextlib.suppress(RuntimeError):  # the pool is shut down
                    self.pool.submit(self.engine.forget, held)

    def _observe(self, items, trees, seconds: float) -> None:
        nodes = sum(len(t.tokens) for t in trees)
        budget = max((item.tree.max_nodes for item in items), default=0)
        self.metrics.call(len(trees), budget, nodes, seconds)
        if tracing.enabled():
            trace.get_current_span().set_attributes({
                "specinfer.batch_size": len(trees), "specinfer.node_budget": budget,
                "specinfer.tree_nodes": nodes, "specinfer.engine_seconds": seconds})

    async def Speculate(self, request, context):
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the SSMs are still loading")
        try:
            trees, seconds = await asyncio.get_running_loop().run_in_executor(
                self.pool, self._speculate, request)
        except Exception as exc:
            log.info("request failed", extra={"method": "Speculate", "error": str(exc)[:300]})
            await abort_on_error(context, exc)
        self._observe(request.items, trees, seconds)
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

"""Drafting for the router's steps: calls to the speculator pool, their failover, node
budgets, and the overlapped step that drafts one micro-batch while the other is verified.

The speculators are stateless, so any one of them may answer; one that fails is skipped
for a few seconds and the step goes on without its trees (the router keeps every history,
so nothing is lost but that step's speculation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.metrics import RouterMetrics
from services.router.policy import SpeculationMode
from services.router.request import GenRequest, hop_timeout
from specinfer import tracing
from specinfer.channels import internal_channel
from specinfer.tls import TlsConfig
from specinfer.v1 import common_pb2, speculator_pb2, speculator_pb2_grpc
from specinfer.wire import sampling_to_proto

log = logging.getLogger(__name__)

Trees = dict[str, common_pb2.TokenTree]  # by sequence id


async def together(*steps: Awaitable) -> list:
    """Run ``steps`` concurrently; if one raises, the others still finish before the
    error propagates, so no verification outlives the step that started it."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class SpeculatorPool:
    """The router's side of the speculator pool (and of drafting in general: node
    budgets, the overlapped step)."""

    def __init__(self, speculators: list[str], metrics: RouterMetrics, *,
                 expansion: list[int] | None = None, max_nodes: int = 0,
                 timeout_s: float = 10.0, step_timeout_s: float = 60.0,
                 down_for_s: float = 5.0, tls: TlsConfig | None = None) -> None:
        self.channels = [internal_channel(a, tls) for a in speculators]
        self.clients = [speculator_pb2_grpc.SpeculatorStub(c) for c in self.channels]
        self.down_until = [0.0] * len(speculators)
        for i, address in enumerate(speculators):
            metrics.replica("speculator", address,
                            lambda i=i: self.down_until[i] <= time.monotonic())
        self.metrics = metrics
        self.expansion = expansion or []  # [] = the speculator's default
        self.max_nodes = max_nodes  # 0 = each replica's max_tree_nodes
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.down_for_s = down_for_s
        # Trees drafted during the last step's second half for the next step's first
        # micro-batch (overlap mode): sequence id -> (history length drafted for, node
        # budget, tree).
        self.prefetched: dict[str, tuple[int, int, common_pb2.TokenTree]] = {}

    async def await_serving(self, timeout_s: float = 180.0) -> None:
        """Give starting speculators (loading SSMs, building the datastore on a first run)
        time to report SERVING; one that never does is failed over like a dead one."""

        async def serving(i: int, channel: grpc.aio.Channel) -> None:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                with contextlib.suppress(grpc.aio.AioRpcError):  # not listening yet
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                await asyncio.sleep(0.5)
            log.warning("speculator not serving; starting without it", extra={"speculator": i})

        await asyncio.gather(*(serving(i, c) for i, c in enumerate(self.channels)))

    def node_budget(self, req: GenRequest, budget: int, mode: SpeculationMode) -> int:
        """The most nodes ``req``'s tree may have this step."""
        if mode.max_nodes:
            budget = min(budget, mode.max_nodes)
        replica = req.replica
        return min(self.max_nodes or replica.max_tree_nodes, replica.max_tree_nodes, budget,
                   replica.max_context - len(req.history) - 1)

    async def speculate(self, reqs: list[GenRequest], budget: int,
                        mode: SpeculationMode) -> Trees:
        """Trees for the speculating requests, or {} if no speculator answers."""
        if not reqs:
            return {}
        now = time.monotonic()
        trees = {}
        for i, client in enumerate(self.clients):
            if self.down_until[i] > now:
                continue
            items = [speculator_pb2.SpeculateItem(
                sequence_id=r.id, context=r.history, sampling=sampling_to_proto(r.params),
                tree=speculator_pb2.TreeConfig(
                    expansion=list(mode.expansion) or self.expansion,
                    max_nodes=self.node_budget(r, budget, mode)))
                for r in reqs]
            most = max(item.tree.max_nodes for item in items)
            try:
                with tracing.batch_span("Speculate", [r.span for r in reqs], {
                        "specinfer.batch_size": len(reqs), "specinfer.node_budget": most,
                        "specinfer.speculation_mode": mode.name}) as span:
                    out = await client.Speculate(speculator_pb2.SpeculateRequest(items=items),
                                                 timeout=min(self.timeout_s, hop_timeout(
                                                     reqs, self.step_timeout_s)))
                    span.set_attribute("specinfer.tree_nodes",
                                       sum(len(res.tree.tokens) for res in out.results))
                self.metrics.drafted(most, time.monotonic() - now)
                trees = {res.sequence_id: res.tree for res in out.results}
                break
            except grpc.aio.AioRpcError as exc:
                log.warning("speculator failed; this step decodes without it",
                            extra={"speculator": i, "error": exc.code().name})
                self.down_until[i] = now + self.down_for_s
                self.metrics.failover("speculator")
        for r in reqs:
            r.speculate_s += time.monotonic() - now
        return trees

    async def overlapped_step(self, batch: list[GenRequest], speculate: list[GenRequest],
                              budget: int, mode: SpeculationMode,
                              verify: Callable[[list[GenRequest], Trees], Awaitable[None]],
                              running: Callable[[GenRequest], bool]) -> bool:
        """One step in two micro-batches, drafting for one while the other is verified:
        verify(first) ‖ draft(second), then verify(second) ‖ draft(first's next step). The
        first micro-batch's trees were drafted during the previous step when still current.
        ``running``: whether a request is still generating after its verification. Returns
        whether any tree was verified."""
        first, second = speculate[: len(speculate) // 2], speculate[len(speculate) // 2:]
        drafting = {r.id for r in speculate}
        trees = {}
        for r in first:  # drafted ahead for this history, within this step's budget
            hit = self.prefetched.get(r.id)
            if hit is not None and hit[0] == len(r.history) and hit[1] <= budget:
                trees[r.id] = hit[2]
        trees |= await self.speculate([r for r in first if r.id not in trees], budget, mode)
        plain = [r for r in batch if r.id not in drafting]
        _, second_trees = await together(verify(first + plain, trees),
                                         self.speculate(second, budget, mode))
        ahead = [r for r in first if running(r) and r.replica is not None
                 and r.replica.max_context - len(r.history) > 2]
        _, next_trees = await together(verify(second, second_trees),
                                       self.speculate(ahead, budget, mode))
        self.prefetched = {r.id: (len(r.history), budget, next_trees[r.id]) for r in ahead
                           if r.id in next_trees}
        return bool(trees or second_trees)

    async def close(self) -> None:
        for c in self.channels:
            await c.close()

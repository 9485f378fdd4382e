"""Drafting for the router's steps: calls to the speculator pool, their failover, node
budgets, and the overlapped step that drafts one micro-batch while the other is verified.

The speculators are stateless, so any one of them may answer; one that fails is skipped
for a few seconds and the step goes on without its trees (the router keeps every history,
so nothing is lost but that step's speculation). Calls go over one ``SpeculateStream`` per
replica (speculate_stream.py: only each sequence's new tokens per step) or, with
``stream=False``, the unary ``Speculate`` (the whole history every step).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.metrics import RouterMetrics
from services.router.policy import SpeculationMode
from services.router.request import GenRequest, hop_timeout
from services.router.speculate_stream import SpeculatorStream, StreamEnded
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


@dataclass
class Speculator:
    address: str
    channel: grpc.aio.Channel
    rpc: speculator_pb2_grpc.SpeculatorStub
    stream: SpeculatorStream
    down_until: float = 0.0  # skipped until then (it failed)


class SpeculatorPool:
    """The router's side of the speculator pool (and of drafting in general: node
    budgets, the overlapped step)."""

    def __init__(self, speculators: list[str], metrics: RouterMetrics, *,
                 expansion: list[int] | None = None, max_nodes: int = 0,
                 timeout_s: float = 10.0, step_timeout_s: float = 60.0,
                 down_for_s: float = 5.0, tls: TlsConfig | None = None,
                 stream: bool = True) -> None:
        self.metrics = metrics
        self.tls = tls
        self.use_stream = stream
        self.members: dict[str, Speculator] = {}
        self._checks: dict[str, asyncio.Future] = {}
        self.update(frozenset(speculators))
        self.expansion = expansion or []  # [] = the speculator's default
        self.max_nodes = max_nodes  # 0 = each replica's max_tree_nodes
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.down_for_s = down_for_s
        # Trees drafted during the last step's second half for the next step's first
        # micro-batch (overlap mode): sequence id -> (history length drafted for, node
        # budget, tree).
        self.prefetched: dict[str, tuple[int, int, common_pb2.TokenTree]] = {}

    def update(self, addresses: frozenset[str]) -> None:
        """The pool is now ``addresses`` (from service discovery)."""
        for address in sorted(addresses - self.members.keys()):
            channel = internal_channel(address, self.tls)
            stub = speculator_pb2_grpc.SpeculatorStub(channel)
            member = Speculator(address, channel, stub, SpeculatorStream(stub),
                                down_until=math.inf)  # until it reports SERVING
            self.members[address] = member
            self.metrics.replica("speculator", address,
                                 lambda m=member: m.down_until <= time.monotonic())
            self._checks[address] = asyncio.ensure_future(self._until_serving(member))
            log.info("speculator added", extra={"speculator": address})
        for address in sorted(self.members.keys() - addresses):
            member = self.members.pop(address)
            member.stream.close()
            self._checks.pop(address).cancel()
            self.metrics.forget_replica("speculator", address)
            # A call in flight on it ends with it; close once that had time to finish.
            with contextlib.suppress(RuntimeError):  # no running loop: nothing in flight
                asyncio.get_running_loop().call_later(
                    self.timeout_s + 1, lambda c=member.channel: asyncio.ensure_future(c.close()))
            log.info("speculator removed", extra={"speculator": address})

    def available(self) -> bool:
        return bool(self.members)

    def release(self, sequence_id: str) -> None:
        """The sequence ended: every stream that holds it forgets it with its next step."""
        for member in self.members.values():
            member.stream.release(sequence_id)

    async def _until_serving(self, member: Speculator, warn_after_s: float = 180.0) -> None:
        """Use a speculator once its health reports SERVING (it may be loading SSMs or
        building its datastore)."""
        started = time.monotonic()
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):  # not listening yet
                reply = await health_pb2_grpc.HealthStub(member.channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    member.down_until = 0.0
                    log.info("speculator serving", extra={"speculator": member.address})
                    return
            if started is not None and time.monotonic() - started > warn_after_s:
                log.warning("speculator not serving yet", extra={"speculator": member.address})
                started = None
            await asyncio.sleep(0.5)

    async def await_serving(self, timeout_s: float = 180.0) -> None:
        """Give the starting speculators time to report SERVING; the router starts without
        those that do not (they join when they do)."""
        checks = list(self._checks.values())
        if checks:
            await asyncio.wait(checks, timeout=timeout_s)

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
        # Affinity by the batch's first sequence (rendezvous hashing): a speculator keeps
        # the SSM caches of the sequences it drafted for, a larger pool shares the batches,
        # and one joining or leaving moves few of them.
        key = reqs[0].id
        for member in sorted(self.members.values(), key=lambda m: hashlib.sha256(
                f"{key}|{m.address}".encode()).digest()):
            if member.down_until > now:
                continue
            sampling = [sampling_to_proto(r.params) for r in reqs]
            # Merged: the verifier makes the model-free drafts, so only the SSMs' here.
            configs = [speculator_pb2.TreeConfig(expansion=list(mode.expansion) or self.expansion,
                                                 max_nodes=self.node_budget(r, budget, mode),
                                                 ssm_only=mode.merge_speculator)
                       for r in reqs]
            most = max(c.max_nodes for c in configs)
            timeout = min(self.timeout_s, hop_timeout(reqs, self.step_timeout_s))
            try:
                with tracing.batch_span("Speculate", [r.span for r in reqs], {
                        "specinfer.batch_size": len(reqs), "specinfer.node_budget": most,
                        "specinfer.speculation_mode": mode.name,
                        "specinfer.speculator": member.address,
                        "specinfer.stream": self.use_stream}) as span:
                    if self.use_stream:
                        out = await member.stream.speculate(reqs, sampling, configs, timeout)
                    else:
                        out = await member.rpc.Speculate(speculator_pb2.SpeculateRequest(items=[
                            speculator_pb2.SpeculateItem(sequence_id=r.id, context=r.history,
                                                         sampling=s, tree=c)
                            for r, s, c in zip(reqs, sampling, configs, strict=True)]),
                            timeout=timeout)
                    span.set_attribute("specinfer.tree_nodes",
                                       sum(len(res.tree.tokens) for res in out.results))
                self.metrics.drafted(most, time.monotonic() - now)
                trees = {res.sequence_id: res.tree for res in out.results}
                break
            except (grpc.aio.AioRpcError, TimeoutError, StreamEnded) as exc:
                error = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) \
                    else "DEADLINE_EXCEEDED" if isinstance(exc, TimeoutError) else str(exc)
                log.warning("speculator failed; this step decodes without it",
                            extra={"speculator": member.address, "error": error})
                member.down_until = now + self.down_for_s
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
        for check in self._checks.values():
            check.cancel()
        for member in self.members.values():
            member.stream.close()
            await member.channel.close()

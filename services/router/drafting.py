"""The router's side of the speculator pool: its members as discovery changes them, their
health, and the calls that draft a step's SSM trees, with failover.

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
from collections.abc import Awaitable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.metrics import RouterMetrics
from services.router.policy import SpeculatorPlan
from services.router.request import GenRequest, hop_timeout
from services.router.speculate_stream import SpeculatorStream, StreamEnded
from specinfer import tracing
from specinfer.channels import internal_channel
from specinfer.tls import TlsConfig
from specinfer.v1 import common_pb2, speculator_pb2, speculator_pb2_grpc
from specinfer.wire import constraint_to_proto, sampling_to_proto

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
    """The speculator replicas and the Speculate calls to them."""

    def __init__(self, speculators: list[str], metrics: RouterMetrics, *,
                 timeout_s: float = 10.0, step_timeout_s: float = 60.0,
                 down_for_s: float = 5.0, tls: TlsConfig | None = None,
                 stream: bool = True) -> None:
        self.metrics = metrics
        self.tls = tls
        self.use_stream = stream
        self.members: dict[str, Speculator] = {}
        self._checks: dict[str, asyncio.Future] = {}
        self.update(frozenset(speculators))
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.down_for_s = down_for_s

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

    async def speculate(self, reqs: list[GenRequest], plans: list[SpeculatorPlan],
                        mode: str) -> Trees:
        """Trees for ``reqs`` as ``plans`` ask (``mode``: the step's, for the span), or {}
        if no speculator answers."""
        if not reqs:
            return {}
        now = time.monotonic()
        trees = {}
        sampling = [sampling_to_proto(r.params) for r in reqs]
        configs = [speculator_pb2.TreeConfig(expansion=p.expansion,
                                             max_nodes=p.max_nodes, ssm_only=p.ssm_only)
                   for p in plans]
        most = max(c.max_nodes for c in configs)
        # Affinity by the batch's first sequence (rendezvous hashing): a speculator keeps
        # the SSM caches of the sequences it drafted for, a larger pool shares the batches,
        # and one joining or leaving moves few of them.
        key = reqs[0].id
        for member in sorted(self.members.values(), key=lambda m: hashlib.sha256(
                f"{key}|{m.address}".encode()).digest()):
            if member.down_until > now:
                continue
            timeout = min(self.timeout_s, hop_timeout(reqs, self.step_timeout_s))
            try:
                with tracing.batch_span("Speculate", [r.span for r in reqs], {
                        "specinfer.batch_size": len(reqs), "specinfer.node_budget": most,
                        "specinfer.speculation_mode": mode,
                        "specinfer.speculator": member.address,
                        "specinfer.stream": self.use_stream}) as span:
                    if self.use_stream:
                        out = await member.stream.speculate(reqs, sampling, configs, timeout)
                    else:
                        out = await member.rpc.Speculate(speculator_pb2.SpeculateRequest(items=[
                            speculator_pb2.SpeculateItem(
                                sequence_id=r.id, context=r.history, sampling=s, tree=c,
                                constraint=constraint_to_proto(r.constraint),
                                prompt_length=len(r.prompt_ids))
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

    async def close(self) -> None:
        for check in self._checks.values():
            check.cancel()
        for member in self.members.values():
            member.stream.close()
            await member.channel.close()

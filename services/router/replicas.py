"""The verifier replicas: which ones there are, which one a sequence goes to, which are
down or draining, and the one path by which a sequence leaves its replica.

A sequence stays on the replica that holds its KV cache (affinity by consistent hashing
on its session, or its own id, so a replica joining moves few sessions); a replica that
fails is marked down, its sequences are re-prefilled elsewhere from the router's history,
and it is probed until it answers. The set changes at run time (``update``, from service
discovery): a new replica joins once its Info answers; one that reports NOT_SERVING on the
health service (shutting down, e.g. a pod being scaled down or evicted) takes no new
sequences and the scheduler moves its live ones to other replicas; one that discovery no
longer lists is dropped once its sequences have moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.router.metrics import RouterMetrics
from services.router.prefix_routing import ReplicaPrefixes, choose
from services.router.request import GenRequest, Replica
from specinfer.channels import internal_channel
from specinfer.tls import TlsConfig
from specinfer.v1 import verifier_pb2, verifier_pb2_grpc
from specinfer.wire import STEP_PROTOCOL

log = logging.getLogger(__name__)


class ReplicaSet:
    def __init__(self, addresses: list[str], metrics: RouterMetrics,
                 probe_every_s: float = 1.0, tls: TlsConfig | None = None,
                 prefix_load_margin: float | None = 0.25) -> None:
        self.metrics = metrics
        self.prefix_load_margin = prefix_load_margin  # None: by load alone
        self.tls = tls
        # A down replica's sequences wait for it (the only one, or all down): an Info call a
        # second is cheap, and they resume within a second of it being back.
        self.probe_every_s = probe_every_s
        self.by_address: dict[str, Replica] = {}
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self.info: verifier_pb2.InfoResponse | None = None  # the first replica's
        self.joined = asyncio.Event()  # set once any replica has joined
        # Called when sequences should move (a replica drains or leaves, or one joins that
        # can take them): the scheduler moves them between steps.
        self.on_change: Callable[[], None] = lambda: None
        self._initial = list(addresses)

    @property
    def replicas(self) -> list[Replica]:
        return list(self.by_address.values())

    async def start(self, all_within_s: float = 60.0,
                    wait: bool = True) -> verifier_pb2.InfoResponse | None:
        """Start with the addresses given at construction; returns the first joined
        replica's Info once every replica has joined, or once one has and the others
        have not within ``all_within_s`` (they join when they answer). ``wait=False``:
        return at once (None if no replica has joined yet)."""
        if self._initial:  # else discovery calls update
            self.update(frozenset(self._initial))
        if not wait:
            return self.info
        await self.joined.wait()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(all_within_s):
                while not all(r.joined for r in self.by_address.values()):
                    await asyncio.sleep(0.2)
        return self.info

    def update(self, addresses: frozenset[str]) -> None:
        """The replicas are now ``addresses``: new ones start joining, missing ones leave
        (their sequences move first)."""
        for address in sorted(addresses - self.by_address.keys()):
            channel = internal_channel(address, self.tls)
            replica = Replica(address, verifier_pb2_grpc.VerifierStub(channel), channel)
            self.by_address[address] = replica
            self.metrics.replica("verifier", address, lambda r=replica: r.usable)
            self._tasks[address] = [asyncio.ensure_future(self._join(replica)),
                                    asyncio.ensure_future(self._watch_health(replica))]
            log.info("verifier replica added", extra={"replica": address})
        for address in sorted(self.by_address.keys() - addresses):
            replica = self.by_address[address]
            if not replica.removed:
                replica.removed = True
                log.info("verifier replica removed; moving its sequences",
                         extra={"replica": address, "live": replica.live})
                self.on_change()

    def forget_removed(self, close_after_s: float = 15.0) -> None:
        """Drop removed replicas that hold no more of this router's sequences (their
        channels close a little later, after the releases sent to them)."""
        loop = asyncio.get_running_loop()
        for address, replica in list(self.by_address.items()):
            if replica.removed and replica.live == 0:
                del self.by_address[address]
                for task in self._tasks.pop(address, []):
                    task.cancel()
                self.metrics.forget_replica("verifier", address)
                loop.call_later(close_after_s,
                                lambda c=replica.channel: asyncio.ensure_future(c.close()))

    async def _join(self, replica: Replica) -> None:
        """Ask for the replica's Info until it answers (it may still be loading)."""
        delay = 0.5
        while not replica.removed:
            try:
                info = await replica.rpc.Info(verifier_pb2.InfoRequest(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                log.debug("verifier replica not ready yet", extra={
                    "replica": replica.address, "error": exc.code().name})
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
                continue
            if info.step_protocol != STEP_PROTOCOL:
                # A verifier from before the Step call (a rolling upgrade): its sequences
                # would fail every step, so it gets none; it joins once it is replaced.
                log.error("verifier replica speaks another step protocol; not using it",
                          extra={"replica": replica.address, "protocol": info.step_protocol,
                                 "expected": STEP_PROTOCOL})
                await asyncio.sleep(30.0)
                continue
            replica.capacity = max(1, info.kv_capacity_tokens // max(1, info.max_context))
            replica.prefixes = ReplicaPrefixes(  # empty: a (re)joined replica holds none
                info.prefix_block_size,
                info.kv_capacity_tokens // max(1, info.prefix_block_size))
            replica.max_tree_nodes, replica.max_context = info.max_tree_nodes, info.max_context
            replica.draft_sources = frozenset(s.name for s in info.draft_sources)
            replica.joined = True
            if self.info is None:
                self.info = info
            elif info.vocab_size != self.info.vocab_size:
                log.error("verifier replica serves another model's vocabulary; not using it",
                          extra={"replica": replica.address, "vocab_size": info.vocab_size,
                                 "expected": self.info.vocab_size})
                replica.joined = False
                return
            log.info("verifier replica joined", extra={
                "replica": replica.address, "capacity": replica.capacity})
            self.joined.set()
            self.on_change()
            return

    async def _watch_health(self, replica: Replica) -> None:
        """Follow the replica's health: NOT_SERVING after it has served means it is
        shutting down (or lost a rank), so its sequences should move."""
        stub = health_pb2_grpc.HealthStub(replica.channel)
        delay = 0.5
        while not replica.removed:
            try:
                async for reply in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    delay = 0.5
                    draining = reply.status != health_pb2.HealthCheckResponse.SERVING
                    if draining != replica.draining:
                        replica.draining = draining
                        log.info("verifier replica draining" if draining else
                                 "verifier replica serving", extra={"replica": replica.address})
                        self.on_change()
            except grpc.aio.AioRpcError:
                pass  # not up (yet) or gone: calls fail over; keep watching
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)

    @property
    def max_context(self) -> int:
        joined = [r.max_context for r in self.by_address.values() if r.joined]
        if joined:
            return min(joined)
        return self.info.max_context if self.info is not None else 2048

    def have_sources(self, names: tuple[str, ...]) -> bool:
        """Whether every usable replica drafts with its own sources ``names`` (so a mode
        that names them can run anywhere)."""
        usable = [r for r in self.by_address.values() if r.usable]
        return bool(usable) and all(r.has_sources(names) for r in usable)

    def pick(self, req: GenRequest) -> Replica | None:
        """A usable replica with room for a new sequence: a session's by consistent hashing
        on its id (where its KV is), falling back to the least loaded; any other by prefix
        and load (``prefix_routing.choose``). Records the choice on the request (and its
        span), and that the replica now holds the prompt's prefix."""
        room = [r for r in self.by_address.values() if r.usable and r.live < r.capacity]
        if not room:
            return None
        if req.session_id:
            home = min((r for r in self.by_address.values() if r.usable),
                       key=lambda r: hashlib.sha256(f"{req.session_id}|{r.address}".encode())
                       .digest())
            replica = home if home in room else min(room, key=lambda r: r.live / r.capacity)
            req.routing, held = "session", 0
        else:
            replica, req.routing, held = choose(room, req.history, req.cache_salt, req.id,
                                                self.prefix_load_margin)
        if req.span.is_recording():
            req.span.set_attributes({"specinfer.routing": req.routing,
                                     "specinfer.routing_prefix_tokens": held,
                                     "specinfer.replica": replica.address})
        replica.prefixes.learn(req.history, req.cache_salt)
        return replica

    def should_move(self, replica: Replica) -> bool:
        """Whether sequences on ``replica`` should move now: it left, or it drains and
        another replica can take them (otherwise they finish there while it drains)."""
        if replica.removed:
            return True
        return replica.draining and any(
            r.usable and r.live < r.capacity for r in self.by_address.values())

    @staticmethod
    def attach(req: GenRequest, replica: Replica) -> None:
        replica.live += 1
        req.replica = replica

    @staticmethod
    def detach(req: GenRequest) -> Replica | None:
        """Take ``req`` off its replica's books; returns the replica it was on."""
        replica, req.replica = req.replica, None
        if replica is not None:
            replica.live -= 1
        return replica

    @staticmethod
    async def release(replica: Replica, ids: list[str], keep_for_session: bool = False) -> None:
        """Best effort: free sequences on a replica (gone already is fine)."""
        try:
            await replica.rpc.Release(verifier_pb2.ReleaseRequest(
                sequence_ids=ids, keep_for_session=keep_for_session), timeout=10)
        except grpc.aio.AioRpcError as exc:
            log.info("release failed", extra={"replica": replica.address,
                                              "error": exc.code().name})

    def mark_down(self, replica: Replica, exc: Exception, sequence_ids: list[str]) -> None:
        """``sequence_ids``: this router's sequences whose call failed there; if the replica
        did not die (it stalled past a step's timeout), they are still live on it and are
        released before it is used again (their re-prefill would be refused)."""
        replica.stale.update(sequence_ids)
        if not replica.healthy:
            return  # already failed over, and probed until it is back
        log.warning("verifier replica failed; failing over",
                    extra={"replica": replica.address, "error": str(exc)[:200]})
        replica.healthy = False
        self.metrics.failover("verifier")
        asyncio.get_running_loop().call_later(self.probe_every_s, self._probe, replica)

    def _probe(self, replica: Replica) -> None:
        if replica.removed:
            return

        async def check() -> None:
            try:
                await replica.rpc.Info(verifier_pb2.InfoRequest(), timeout=2)
                stale = sorted(replica.stale)
                if stale:  # unknown ids (it restarted) are fine
                    await replica.rpc.Release(verifier_pb2.ReleaseRequest(sequence_ids=stale),
                                              timeout=5)
                    replica.stale.difference_update(stale)
                replica.healthy, replica.live = True, 0
                replica.prefixes.clear()  # it may have restarted: an empty cache
                log.info("verifier replica back", extra={"replica": replica.address})
                self.on_change()
            except grpc.aio.AioRpcError:
                asyncio.get_running_loop().call_later(self.probe_every_s, self._probe, replica)

        asyncio.ensure_future(check())

    async def close(self) -> None:
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        for r in self.by_address.values():
            await r.channel.close()

"""The verifier replicas: which one a sequence goes to, which are down, and the one path by
which a sequence leaves its replica.

A sequence stays on the replica that holds its KV cache (affinity by consistent hashing
on its session, or its own id); a replica that fails is marked down, its sequences are
re-prefilled elsewhere from the router's history, and it is probed until it answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

import grpc

from services.router.metrics import RouterMetrics
from services.router.request import GenRequest, Replica
from specinfer.channels import internal_channel
from specinfer.tls import TlsConfig
from specinfer.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)


class ReplicaSet:
    def __init__(self, addresses: list[str], metrics: RouterMetrics,
                 probe_every_s: float = 1.0, tls: TlsConfig | None = None) -> None:
        self.replicas = []
        for address in addresses:
            channel = internal_channel(address, tls)
            replica = Replica(address, verifier_pb2_grpc.VerifierStub(channel), channel)
            self.replicas.append(replica)
            metrics.replica("verifier", address, lambda r=replica: r.healthy)
        self.metrics = metrics
        # A down replica's sequences wait for it (the only one, or all down): an Info call a
        # second is cheap, and they resume within a second of it being back.
        self.probe_every_s = probe_every_s

    async def start(self) -> verifier_pb2.InfoResponse:
        """Every replica's Info (they must answer); returns the first one's."""
        first = None
        for r in self.replicas:
            info = await r.rpc.Info(verifier_pb2.InfoRequest(), timeout=30)
            r.capacity = max(1, info.kv_capacity_tokens // max(1, info.max_context))
            r.max_tree_nodes, r.max_context = info.max_tree_nodes, info.max_context
            r.has_draft_head = info.draft_head
            first = first or info
        return first

    @property
    def max_context(self) -> int:
        return min(r.max_context for r in self.replicas)

    @property
    def draft_head(self) -> bool:
        """Whether every replica has a draft head (so the head mode can run anywhere)."""
        return all(r.has_draft_head for r in self.replicas)

    def pick(self, req: GenRequest) -> Replica | None:
        """Consistent hashing on the session (or request) id, falling back to the least
        loaded healthy replica with room."""
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            return None
        key = req.session_id or req.id
        ranked = sorted(healthy, key=lambda r: hashlib.sha256(
            f"{key}|{r.address}".encode()).digest())
        for r in ranked[:1] + sorted(ranked[1:], key=lambda r: r.live / r.capacity):
            if r.live < r.capacity:
                return r
        return None

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
        async def check() -> None:
            try:
                await replica.rpc.Info(verifier_pb2.InfoRequest(), timeout=2)
                stale = sorted(replica.stale)
                if stale:  # unknown ids (it restarted) are fine
                    await replica.rpc.Release(verifier_pb2.ReleaseRequest(sequence_ids=stale),
                                              timeout=5)
                    replica.stale.difference_update(stale)
                replica.healthy, replica.live = True, 0
                log.info("verifier replica back", extra={"replica": replica.address})
            except grpc.aio.AioRpcError:
                asyncio.get_running_loop().call_later(self.probe_every_s, self._probe, replica)

        asyncio.ensure_future(check())

    async def close(self) -> None:
        for r in self.replicas:
            await r.channel.close()

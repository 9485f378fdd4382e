"""What happens to a request in the router's running batch as steps emit its tokens and
it leaves: its stream, its metrics and span, its KV slot, its shadow drafts' outcomes.

The scheduler holds one ``RequestLifecycle``, built from exactly what it needs: the
scheduler's queues (the same list objects: it mutates them in place), the replicas and
speculators a leaving request is released from, the policy its yields feed, the metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.router.drafting import SpeculatorPool
from services.router.metrics import RouterMetrics
from services.router.policy import SpeculationPolicy
from services.router.replicas import ReplicaSet
from services.router.request import GenRequest, Replica
from services.router.request_span import close_request_span
from specinfer import tracing
from specinfer.errors import ServiceError
from specinfer.tree import accepted_depth
from specinfer.v1 import common_pb2
from specinfer.wire import logprob_from_proto


class RequestLifecycle:
    def __init__(self, running: list[GenRequest], waiting: list[GenRequest],
                 replicas: ReplicaSet, speculators: SpeculatorPool, metrics: RouterMetrics,
                 eos_ids: set[int], detokenize: Callable[[list[int]], str] | None,
                 policy: SpeculationPolicy | None = None,
                 shadow_modes: list[tuple[int, int]] | None = None) -> None:
        self.running, self.waiting = running, waiting
        self.replicas, self.speculators, self.metrics = replicas, speculators, metrics
        self.eos_ids, self.detokenize = eos_ids, detokenize
        self.policy = policy
        # (mode index, nodes) of the modes measured by shadow drafts.
        self.shadow_modes = shadow_modes or []

    async def emit(self, req: GenRequest, tokens: list[int],
                    logprobs: list[common_pb2.TokenLogprob], step: bool,
                    drafted: int = 0) -> None:
        """Append a step's tokens and their logprobs (empty unless asked for) to the
        request and its stream; ``step``: an LLM step (a Step call), not the prefill's
        first token, with a tree of ``drafted`` nodes."""
        if req.params.logprobs is not None and len(logprobs) != len(tokens):
            self.fail(req, ServiceError(f"the verifier returned {len(logprobs)} logprobs "
                                         f"for {len(tokens)} tokens"))
            return
        new = req.append(tokens, self.eos_ids, self.detokenize)
        req.logprobs += [logprob_from_proto(lp) for lp in logprobs[: len(new)]]
        self.metrics.emitted(req, len(new), time.monotonic())
        if step:
            req.accepted_per_step.append(len(new))
            self.metrics.speculated(drafted, len(new))
            self.measure_shadows(req)
        await req.events.put(("tokens", new))
        if req.finish_reason:
            await self.finish(req, req.finish_reason)

    def measure_shadows(self, req: GenRequest) -> None:
        """Each shadow draft whose outcome the emitted tokens now settle: how many tokens a
        step of each model-free mode (its first nodes of the tree) would have emitted."""
        pending = []
        for start, tokens, parents in req.shadows:
            emitted = req.generated[start:]
            outcomes = [(index, accepted_depth(tokens[:n], parents[:n], emitted))
                        for index, n in self.shadow_modes]
            if all(settled for _, (_, settled) in outcomes):
                for index, (accepted, _) in outcomes:
                    self.policy.record_yield(req.params.greedy, index, req.id, 1 + accepted)
            else:
                pending.append((start, tokens, parents))
        req.shadows = pending

    # --- leaving the running batch ----------------------------------------------------

    def requeue(self, req: GenRequest) -> None:
        """Take a running sequence off its replica; it is prefilled again (on another
        replica if that one is down) from the router's history, first in the queue."""
        if req in self.running:
            self.running.remove(req)
        self.replicas.detach(req)
        req.queued_at = time.monotonic()
        self.waiting.insert(0, req)

    def leave(self, req: GenRequest) -> Replica | None:
        """Take a request out of the batch for good; returns the replica it was on."""
        if self.policy:
            self.policy.forget(req.id)
        self.speculators.release(req.id)
        if req in self.running:
            self.running.remove(req)
        return self.replicas.detach(req)

    async def finish(self, req: GenRequest, reason: str) -> None:
        replica = self.leave(req)
        if replica is not None:
            replica.prefixes.learn(req.history, req.cache_salt)  # it keeps them (caching)
            with tracing.within(req.span):  # the Release call joins the request's trace
                await self.replicas.release(replica, [req.id],
                                            keep_for_session=bool(req.session_id))
        req.finish_reason = reason
        self.ended(req, "abort" if reason == "cancelled" else reason)
        await req.events.put(("done", reason))

    def fail(self, req: GenRequest, exc: Exception) -> None:
        req.error = exc
        replica = self.leave(req)
        if replica is not None:  # its KV slot
            with tracing.within(req.span):
                asyncio.ensure_future(self.replicas.release(replica, [req.id]))
        self.ended(req, "error", exc)
        req.events.put_nowait(("error", exc))

    def ended(self, req: GenRequest, reason: str, exc: Exception | None = None) -> None:
        """The one place a request's end is recorded: its metrics, and its span (with what
        the request did) ended. ``reason``: stop, length, abort or error."""
        if req.ended:
            return
        req.ended = True
        self.metrics.ended(req, reason, time.monotonic())
        close_request_span(req, reason, exc)

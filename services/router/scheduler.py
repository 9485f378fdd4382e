"""The router's step loop (iteration-level scheduling).

One loop drives every decoding step of every live sequence, top to bottom in ``_loop``:
admit (new requests are prefilled and join the running batch), choose a speculation mode
for the batch, draft (the speculator pool's trees, or none: the verifier drafts for
itself), verify (every verifier replica verifies or decodes its sequences, replicas in
parallel), emit (tokens to each request's stream). The router keeps each sequence's full
token history, so a speculator that fails costs one step without speculation, and a
verifier that fails has its sequences re-prefilled on another replica from that history
(greedy output is unchanged).

Around it: ``request`` (the records), ``policy`` (modes and the adaptive choice),
``replicas`` (affinity, failover, release), ``drafting`` (the speculator pool: calls,
failover, overlap), ``lifecycle`` (emitting, requeueing and ending a request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from services.router.drafting import SpeculatorPool, Trees, together
from services.router.lifecycle import RequestLifecycle
from services.router.metrics import RouterMetrics
from services.router.policy import SPECULATION_CHOICES, SpeculationMode, SpeculationPolicy
from services.router.replicas import ReplicaSet
from services.router.request import GenRequest, hop_timeout
from services.router.request_span import open_request_span
from specinfer import tracing
from specinfer.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, ServiceError
from specinfer.tls import TlsConfig
from specinfer.v1 import common_pb2, verifier_pb2
from specinfer.wire import sampling_to_proto

log = logging.getLogger(__name__)


class Scheduler(RequestLifecycle):
    def __init__(self, verifiers: list[str], speculators: list[str], *, eos_ids: list[int],
                 max_waiting: int = 64, spec_max_batch: int = 2,
                 expansion: list[int] | None = None, max_nodes: int = 0,
                 step_timeout_s: float = 60.0, speculate_timeout_s: float = 10.0,
                 prefill_token_budget: int = 4096,
                 detokenize: Callable[[list[int]], str] | None = None,
                 speculation: str = "adaptive", queue_timeout_s: float = 60.0,
                 metrics: RouterMetrics | None = None, tls: TlsConfig | None = None,
                 speculate_stream: bool = True) -> None:
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.replicas = ReplicaSet(verifiers, self.metrics, tls=tls)
        self.speculators = SpeculatorPool(speculators, self.metrics, expansion=expansion,
                                          max_nodes=max_nodes, timeout_s=speculate_timeout_s,
                                          step_timeout_s=step_timeout_s, tls=tls,
                                          stream=speculate_stream)
        self.eos_ids = set(eos_ids)
        self.max_waiting = max_waiting
        # A request that waits this long for capacity is turned away (RESOURCE_EXHAUSTED,
        # HTTP 429): longer than a verifier's sequence lease plus a step by default, so
        # the slots a dead router held come back before anyone is.
        self.queue_timeout_s = queue_timeout_s
        self.spec_max_batch = spec_max_batch
        self.modes = SPECULATION_CHOICES[speculation]  # mode 0: plain decoding
        self.policy = SpeculationPolicy(len(self.modes)) if speculation == "adaptive" else None
        # The verifier's model-free modes are measured on every step, not only when they
        # run: it drafts (without verifying) the largest of their trees for the next step,
        # and what the sequence then emits shows how each would have fared.
        self.shadow_modes = [(i, m.max_nodes) for i, m in enumerate(self.modes)
                             if m.in_verifier and not m.draft_head] if self.policy else []
        self.shadow_nodes = max((n for _, n in self.shadow_modes), default=0)
        self.step_timeout_s = step_timeout_s
        self.prefill_token_budget = prefill_token_budget
        self.detokenize = detokenize
        self.waiting: list[GenRequest] = []
        self.running: list[GenRequest] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.step_mode = "plain"  # the running step's speculation mode, for its spans
        self.metrics.watch_queues(lambda: len(self.running), lambda: len(self.waiting))
        self.replicas.on_change = self.wake.set  # sequences may move (_move_off_leaving)

    async def start(self, wait_for_verifier: bool = True) -> dict | None:
        """Wait for the verifiers to join (every one given, or the first to answer, see
        ``ReplicaSet.start``) and the speculators to serve; start the loop. Without
        ``wait_for_verifier`` the loop starts at once (requests queue until a verifier
        joins) and the result is None while none has."""
        info = await self.replicas.start(wait=wait_for_verifier)
        if wait_for_verifier:
            await self.speculators.await_serving()
        self.task = asyncio.create_task(self._loop())
        if info is None:
            return None
        return {"vocab_size": info.vocab_size, "max_context": info.max_context,
                "model": info.model, "dtype": info.dtype}

    async def close(self) -> None:
        if self.task:
            self.task.cancel()
        # Free this router's KV slots now, not a lease later (a draining verifier waits
        # for them).
        held: dict[str, list[GenRequest]] = {}
        for req in self.running:
            if req.replica is not None:
                held.setdefault(req.replica.address, []).append(req)
        await asyncio.gather(*(asyncio.wait_for(self.replicas.release(
            reqs[0].replica, [r.id for r in reqs]), 3) for reqs in held.values()),
            return_exceptions=True)
        await self.replicas.close()
        await self.speculators.close()

    def submit(self, req: GenRequest) -> None:
        max_context = self.replicas.max_context
        if len(req.prompt_ids) + 1 > max_context:
            raise InvalidArgument("prompt", f"{len(req.prompt_ids)} tokens exceed the context "
                                  f"limit of {max_context - 1}")
        req.max_tokens = min(req.max_tokens, max_context - len(req.prompt_ids))
        if len(self.waiting) >= self.max_waiting:
            raise ResourceExhausted(f"{len(self.waiting)} requests already queued; retry later",
                                    retry_after_s=1)
        req.queued_at = time.monotonic()
        open_request_span(req, self.metrics.model_name)
        self.waiting.append(req)
        self.wake.set()

    def cancel(self, req: GenRequest) -> None:
        req.cancelled = True
        self.wake.set()

    # --- the loop ---------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
            try:
                await self._drop_ended()
                self._move_off_leaving()
                await self._admit()
                if self.running:
                    await self._step()
                elif self.waiting:
                    await asyncio.sleep(0.05)  # no room anywhere: wait for capacity
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad step stop the router
                log.exception("scheduler step failed")
                await asyncio.sleep(0.1)

    async def _drop_ended(self) -> None:
        """Requests cancelled, past their client's deadline, or queued too long."""
        now = time.monotonic()
        for req in self.running + self.waiting:
            if req.deadline is not None and now > req.deadline and not req.cancelled:
                req.cancelled = True
                req.events.put_nowait(("error", DeadlineExceeded("the request's deadline "
                                                                 "passed")))
        for req in self.waiting:
            if not req.cancelled and now - req.queued_at > self.queue_timeout_s:
                req.cancelled = True
                req.events.put_nowait(("error", ResourceExhausted(
                    f"no verifier capacity for {self.queue_timeout_s:g} s; retry later",
                    retry_after_s=5)))
        for req in [r for r in self.running if r.cancelled]:
            await self._finish(req, "cancelled")
        for req in self.waiting:
            if req.cancelled:
                self._ended(req, "abort")
        self.waiting = [r for r in self.waiting if not r.cancelled]

    def _move_off_leaving(self) -> None:
        """Sequences on a replica that left, or that drains while another can take them,
        restart elsewhere from the router's history (between steps, so no call is in
        flight for them); their slots there are freed."""
        moving: dict[str, list[GenRequest]] = {}
        for req in list(self.running):
            if req.replica is not None and self.replicas.should_move(req.replica):
                moving.setdefault(req.replica.address, []).append(req)
        for address, reqs in moving.items():
            replica = reqs[0].replica
            log.info("moving sequences off a verifier replica", extra={
                "replica": address, "sequences": len(reqs),
                "reason": "removed" if replica.removed else "draining"})
            self.metrics.failover("verifier")
            for req in reqs:
                self._requeue(req)
            asyncio.ensure_future(self.replicas.release(replica, [r.id for r in reqs]))
        self.replicas.forget_removed()

    async def _admit(self) -> None:
        """Prefill waiting requests, up to the step's prompt-token budget (the first one is
        always admitted, so a long prompt cannot starve)."""
        by_replica: dict[str, list[GenRequest]] = {}
        still, budget = [], self.prefill_token_budget
        for req in self.waiting:
            replica = self.replicas.pick(req) if budget > 0 else None
            if replica is None:
                still.append(req)
                continue
            self.replicas.attach(req, replica)
            self.metrics.admitted(req, time.monotonic())
            budget -= len(req.history)
            by_replica.setdefault(replica.address, []).append(req)
        self.waiting = still
        await asyncio.gather(*(self._prefill(reqs) for reqs in by_replica.values()))

    async def _prefill(self, reqs: list[GenRequest]) -> None:
        replica = reqs[0].replica
        items, ok = [], []
        for r in reqs:
            try:
                items.append(verifier_pb2.PrefillItem(
                    sequence_id=r.id, token_ids=r.history, sampling=sampling_to_proto(r.params),
                    session_id=r.session_id, prompt_length=len(r.prompt_ids)))
                ok.append(r)
            except (ValueError, TypeError) as exc:  # fails alone, never blocks the queue
                log.warning("request cannot be sent to a verifier", extra={
                    "sequence": r.id, "error": str(exc)[:200]})
                self._fail(r, ServiceError(f"request could not be encoded: {type(exc).__name__}"))
        reqs = ok
        if not reqs:
            return
        started = time.monotonic()
        try:
            with tracing.batch_span("Prefill", [r.span for r in reqs], {
                    "specinfer.batch_size": len(reqs),
                    "specinfer.prompt_tokens": sum(len(r.history) for r in reqs),
                    "specinfer.replica": replica.address}) as span:
                out = await replica.rpc.Prefill(verifier_pb2.PrefillRequest(items=items),
                                                timeout=hop_timeout(reqs, self.step_timeout_s))
                span.set_attribute("specinfer.reused_tokens",
                                   sum(res.reused_tokens for res in out.results))
        except grpc.aio.AioRpcError as exc:
            for r in reqs:
                self.replicas.detach(r)
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.waiting.extend(reqs)  # retry when capacity frees up
            elif _client_deadline_passed(exc, reqs):
                # Not a dead replica: it may have prefilled them, so free them there; the
                # expired requests end on the next loop, the others are prefilled again.
                await self.replicas.release(replica, [r.id for r in reqs])
                self.waiting[:0] = reqs
            elif exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                self.replicas.mark_down(replica, exc, [r.id for r in reqs])
                self.waiting.extend(reqs)
            else:
                for r in reqs:
                    self._fail(r, exc)
            return
        self.metrics.verified("Prefill", 0, time.monotonic() - started)
        for r, res in zip(reqs, out.results, strict=True):
            r.reused_tokens = res.reused_tokens
            if not r.first_token_at:
                r.first_token_at = time.monotonic()
            self.metrics.prefilled(r)
            self.running.append(r)
            await self._emit(r, [res.token], _logprobs(res), step=False)

    async def _step(self) -> None:
        started = time.monotonic()
        batch = list(self.running)
        before = {r.id: len(r.generated) for r in batch}
        greedy = all(r.params.greedy for r in batch)
        speculate = [r for r in batch if r.speculation
                     and r.replica.max_context - len(r.history) > 2]
        index = self._choose_mode(batch, speculate, greedy)
        mode = self.modes[index]
        self.step_mode = mode.name
        if mode.plain:
            speculate = []
        # A larger batch amortises the LLM's weights over more sequences, so each sequence
        # gets a smaller tree.
        budget = max(4, 64 // max(1, len(speculate)))
        if mode.overlap and len(speculate) >= 2:
            verify, drafting = self._verify_all, mode
            if mode.in_verifier:  # merged
                drafting, nodes = self._verifier_drafting(mode, budget, speculate)

                async def verify(reqs: list[GenRequest], trees: Trees) -> None:
                    await self._verify_all(reqs, trees, nodes, draft_head=mode.draft_head)
            drafted = await self.speculators.overlapped_step(
                batch, speculate, budget, drafting, verify, lambda r: r in self.running
            ) or mode.in_verifier
        else:
            self.speculators.prefetched.clear()
            shadow = len(batch) <= self.spec_max_batch
            if mode.in_verifier:
                drafting, nodes = self._verifier_drafting(mode, budget, speculate)
                trees = await self.speculators.speculate(speculate, budget, drafting) \
                    if mode.merge_speculator else {}
                await self._verify_all(batch, trees, nodes, shadow, mode.draft_head)
                drafted = True
            else:
                trees = await self.speculators.speculate(speculate, budget, mode)
                await self._verify_all(batch, trees, shadow=shadow)
                drafted = bool(trees)
        self.metrics.step(mode.name if drafted else "plain")
        if self.policy and len(batch) <= self.spec_max_batch \
                and any(r.speculation for r in batch):
            # The verifier's model-free modes are measured by their shadow drafts.
            measured = drafted and (not mode.in_verifier or mode.draft_head)
            self.policy.record(len(batch), greedy, index if drafted else 0,
                               time.monotonic() - started,
                               {r.id: len(r.generated) - before[r.id] for r in speculate}
                               if measured else None)

    def _verifier_drafting(self, mode: SpeculationMode, budget: int,
                           speculate: list[GenRequest]) -> tuple[SpeculationMode, dict[str, int]]:
        """For a mode the verifier drafts in: the mode the speculator's SSM trees are asked
        in (merged: half the node budget) and each sequence's whole budget, which the
        verifier's own drafts fill after the SSM trees."""
        return (dataclasses.replace(mode, max_nodes=mode.max_nodes // 2),
                {r.id: self.speculators.node_budget(r, budget, mode) for r in speculate})

    def _choose_mode(self, batch: list[GenRequest], speculate: list[GenRequest],
                     greedy: bool) -> int:
        """The index of this step's mode: plain decoding past ``spec_max_batch`` sequences
        or with none speculating; else the policy's choice by measured speed at this batch
        size, or the one forced mode where it can run."""
        if not speculate or len(batch) > self.spec_max_batch:
            return 0
        if self.policy is None:
            return next((i for i, m in enumerate(self.modes) if i
                         and self._can_run(m, len(speculate))), 0)
        return self.policy.choose(len(batch), greedy, skip=frozenset(
            i for i, m in enumerate(self.modes) if not self._can_run(m, len(speculate))),
            sequences=tuple(r.id for r in speculate))

    def _can_run(self, mode: SpeculationMode, speculating: int) -> bool:
        if mode.plain:
            return True
        if mode.overlap and speculating < 2:
            return False
        if mode.merge_speculator and not self.speculators.available():
            return False
        if mode.in_verifier:
            return self.replicas.draft_head or not mode.draft_head
        return self.speculators.available()

    async def _verify_all(self, reqs: list[GenRequest], trees: Trees,
                          draft_nodes: dict[str, int] | None = None,
                          shadow: bool = False, draft_head: bool = False) -> None:
        """Verify (or decode) ``reqs`` that are still running, each verifier replica's
        share in one call, replicas in parallel. ``trees``: the speculator's, by sequence
        id; ``draft_nodes``: node budgets of sequences the verifier drafts for itself (with
        its draft head too, if ``draft_head``); ``shadow``: ask for the shadow drafts that
        measure the model-free modes."""
        by_replica: dict[str, list[GenRequest]] = {}
        for r in reqs:
            if r in self.running and r.replica is not None:
                by_replica.setdefault(r.replica.address, []).append(r)
        await together(*(self._verify(rs, trees, draft_nodes or {}, shadow, draft_head)
                         for rs in by_replica.values()))

    async def _verify(self, reqs: list[GenRequest], trees: Trees, draft_nodes: dict[str, int],
                      shadow: bool, draft_head: bool) -> None:
        replica = reqs[0].replica
        with_tree = [r for r in reqs if r.id in trees or draft_nodes.get(r.id, 0) > 0]
        plain = [r for r in reqs if r not in with_tree]
        shadow_nodes = {r.id: min(self.shadow_nodes, replica.max_tree_nodes)
                        if shadow and r.speculation else 0 for r in reqs}
        calls = []
        if with_tree:
            calls.append(self._call(replica, "Verify", with_tree, verifier_pb2.VerifyRequest(
                items=[verifier_pb2.VerifyItem(
                    sequence_id=r.id, root_token=r.generated[-1], tree=trees.get(r.id),
                    draft_nodes=draft_nodes.get(r.id, 0),
                    draft_head=draft_head and draft_nodes.get(r.id, 0) > 0,
                    shadow_nodes=shadow_nodes[r.id]) for r in with_tree])))
        if plain:
            calls.append(self._call(replica, "Decode", plain, verifier_pb2.DecodeRequest(
                items=[verifier_pb2.DecodeItem(sequence_id=r.id, root_token=r.generated[-1],
                                               shadow_nodes=shadow_nodes[r.id])
                       for r in plain])))
        started = time.monotonic()
        try:
            results = await together(*calls)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                # The verifier freed a sequence after its lease (this router was paused):
                # the call changed nothing, so all restart from the router's history.
                log.warning("verifier lost a sequence; prefilling again",
                            extra={"replica": replica.address, "error": exc.details()})
                for r in reqs:
                    self._requeue(r)
                await self.replicas.release(replica, [r.id for r in reqs])
            elif exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                for r in reqs:  # e.g. a tree the verifier rejects: fail loudly, not silently
                    self._fail(r, exc)
            elif _client_deadline_passed(exc, reqs):
                # A client's deadline, not a dead replica: the expired requests end on the
                # next loop; the others restart from the router's history (the verifier
                # may or may not have applied the step).
                for r in reqs:
                    self._requeue(r)
                await self.replicas.release(replica, [r.id for r in reqs])
            else:
                self.replicas.mark_down(replica, exc, [r.id for r in reqs])
                for r in reqs:  # re-prefill elsewhere from the router's history
                    self._requeue(r)
            return
        outs = []
        if with_tree:
            for r, res in zip(with_tree, results[0].results, strict=True):
                outs.append((r, list(res.tokens), list(res.logprobs), res, res.drafted_nodes))
                r.drafted += res.drafted_nodes
                r.speculative_steps += res.drafted_nodes > 0
        for r in reqs:
            r.verify_s += time.monotonic() - started
        if plain:
            outs += [(r, [res.token], _logprobs(res), res, 0)
                     for r, res in zip(plain, results[-1].results, strict=True)]
        for r, tokens, logprobs, res, drafted in outs:
            await self._emit(r, tokens, logprobs, step=True, drafted=drafted)
            if res.HasField("next_draft") and not r.finish_reason:
                r.shadows.append((len(r.generated), list(res.next_draft.tokens),
                                  list(res.next_draft.parents)))

    async def _call(self, replica, rpc: str, reqs: list[GenRequest], request):
        """A Verify or Decode call for ``reqs``, in a span of the first one's trace (linked
        to the others'), timed for the metrics."""
        attributes = {"specinfer.batch_size": len(reqs), "specinfer.replica": replica.address,
                      "specinfer.speculation_mode": self.step_mode}
        with tracing.batch_span(rpc, [r.span for r in reqs], attributes) as span:
            started = time.monotonic()
            out = await getattr(replica.rpc, rpc)(request,
                                                  timeout=hop_timeout(reqs, self.step_timeout_s))
            nodes = [getattr(res, "drafted_nodes", 0) for res in out.results]
            self.metrics.verified(rpc, max(nodes), time.monotonic() - started)
            if span.is_recording():
                tokens = [len(res.tokens) if rpc == "Verify" else 1 for res in out.results]
                span.set_attributes({"specinfer.tree_nodes": sum(nodes),
                                     "specinfer.accepted_tokens": sum(tokens) - len(tokens)})
            return out

def _client_deadline_passed(exc: grpc.aio.AioRpcError, reqs: list[GenRequest]) -> bool:
    """A hop that ran out of time because a client's deadline passed, not because the
    replica is dead."""
    return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and any(
        r.deadline_passed() for r in reqs)


def _logprobs(result) -> list[common_pb2.TokenLogprob]:
    """A Prefill or Decode result's one logprob, if it carries one."""
    return [result.logprob] if result.HasField("logprob") else []

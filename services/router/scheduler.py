"""The router's step loop (iteration-level scheduling).

One loop drives every decoding step of every live sequence, top to bottom in ``_step``:
admit (new requests' Prefill calls start; they join the running batch when they answer,
while the batch keeps stepping: a verifier computes a long prompt a chunk at a time
between steps), plan (the policy picks a
speculation mode and ``plan_step`` turns it into each sequence's ``StepPlan``: plain, the
speculator's tree, the verifier's own drafts, or both), draft (the speculator pool's trees
for the plans that ask for them), step (one ``Step`` call per verifier replica, replicas in
parallel: one forward pass whatever the mix of plain and speculating rows), emit (tokens to
each request's stream). Overlap modes split the speculating sequences into two
micro-batches and draft one's trees while the other steps (``_overlapped``).

The router keeps each sequence's full token history, so a speculator that fails costs one
step without speculation, and a verifier that fails has its sequences re-prefilled on
another replica from that history (greedy output is unchanged).

Around it: ``request`` (the records), ``planner`` (the step's mode and each sequence's plan),
``policy`` (modes, plans and the adaptive choice),
``replicas`` (affinity, failover, release), ``drafting`` (the speculator pool: calls and
failover), ``lifecycle`` (emitting, requeueing and ending a request).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from services.router.config import RouterConfig
from services.router.drafting import SpeculatorPool, Trees, together
from services.router.lifecycle import RequestLifecycle
from services.router.metrics import RouterMetrics
from services.router.planner import Plans, StepPlanner
from services.router.policy import Budgets, StepPlan
from services.router.replicas import ReplicaSet
from services.router.request import GenRequest, Replica, hop_timeout
from services.router.request_span import open_request_span
from specinfer import tracing
from specinfer.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, ServiceError
from specinfer.tls import TlsConfig
from specinfer.v1 import common_pb2, verifier_pb2
from specinfer.wire import constraint_to_proto, draft_plan_to_proto, sampling_to_proto

log = logging.getLogger(__name__)

class Scheduler:
    # A request's prompt tokens admitted per iteration, at most (the first one always is).
    prefill_token_budget = 4096

    def __init__(self, config: RouterConfig, *, eos_ids: list[int],
                 verifiers: list[str] | None = None, speculators: list[str] | None = None,
                 detokenize: Callable[[list[int]], str] | None = None,
                 metrics: RouterMetrics | None = None, tls: TlsConfig | None = None,
                 step_timeout_s: float = 60.0, budgets: Budgets | None = None) -> None:
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.replicas = ReplicaSet(verifiers or [], self.metrics, tls=tls,
                                   prefix_load_margin=config.prefix_load_margin
                                   if config.routing == "prefix" else None)
        self.speculators = SpeculatorPool(speculators or [], self.metrics,
                                          timeout_s=config.speculate_timeout,
                                          step_timeout_s=step_timeout_s, tls=tls,
                                          stream=config.speculate_rpc == "stream")
        self.max_waiting = config.max_waiting
        # A request that waits this long for capacity is turned away (RESOURCE_EXHAUSTED,
        # HTTP 429): longer than a verifier's sequence lease plus a step by default, so
        # the slots a dead router held come back before anyone is.
        self.queue_timeout_s = config.queue_timeout
        self.planner = StepPlanner(config, self.replicas, self.speculators, budgets)
        self.modes, self.policy = self.planner.modes, self.planner.policy
        self.metrics.known_modes([m.name for m in self.modes])
        self.step_timeout_s = step_timeout_s
        self.waiting: list[GenRequest] = []
        self.running: list[GenRequest] = []
        self.lifecycle = RequestLifecycle(self.running, self.waiting, self.replicas,
                                          self.speculators, self.metrics, set(eos_ids),
                                          detokenize, self.policy,
                                          self.planner.shadow_modes)
        # Trees drafted during an overlapped step's second half for the next step's first
        # micro-batch: sequence id -> (history length drafted for, its plan, tree).
        self.prefetched: dict[str, tuple[int, StepPlan, common_pb2.TokenTree]] = {}
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.admitting: dict[str, asyncio.Task] = {}  # replica -> its Prefill under way
        self.admissions = 0  # Prefill calls started
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
        for task in list(self.admitting.values()):
            task.cancel()
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
            await self.lifecycle.finish(req, "cancelled")
        for req in self.waiting:
            if req.cancelled:
                self.lifecycle.ended(req, "abort")
        self.waiting[:] = [r for r in self.waiting if not r.cancelled]

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
                self.lifecycle.requeue(req)
            asyncio.ensure_future(self.replicas.release(replica, [r.id for r in reqs]))
        self.replicas.forget_removed()

    # --- admit ------------------------------------------------------------------------

    async def _admit(self) -> None:
        """Start prefilling waiting requests, up to the step's prompt-token budget (the
        first one is always admitted, so a long prompt cannot starve). One Prefill call per
        replica at a time: a request for a replica with one under way waits for it, so it
        finds that call's prompts cached (a shared prefix is computed once) and the steps
        there share the engine with one prefill at most."""
        by_replica: dict[str, list[GenRequest]] = {}
        still, budget = [], self.prefill_token_budget
        for req in self.waiting:
            replica = self.replicas.pick(req) if budget > 0 else None
            if replica is None or replica.address in self.admitting:
                still.append(req)
                continue
            self.replicas.attach(req, replica)
            self.metrics.admitted(req, time.monotonic())
            budget -= len(req.history)
            by_replica.setdefault(replica.address, []).append(req)
        self.waiting[:] = still
        for address, reqs in by_replica.items():  # not awaited: the batch keeps stepping
            self.admissions += 1
            task = asyncio.create_task(self._admitting(reqs))
            self.admitting[address] = task
            task.add_done_callback(lambda _, a=address: self.admitting.pop(a, None))

    async def _admitting(self, reqs: list[GenRequest]) -> None:
        """A Prefill call under way while the running batch steps (the verifier computes
        long prompts a chunk at a time between the steps); its sequences join the batch
        when it answers."""
        try:
            await self._prefill(reqs)
        except Exception:  # never lose the requests: they fail, loudly
            log.exception("prefill failed")
            for r in reqs:
                if r not in self.running and not r.ended:
                    self.lifecycle.fail(r, ServiceError("prefill failed"))
        finally:
            self.wake.set()

    async def _prefill(self, reqs: list[GenRequest]) -> None:
        replica = reqs[0].replica
        items, ok = [], []
        for r in reqs:
            try:
                items.append(verifier_pb2.PrefillItem(
                    sequence_id=r.id, token_ids=r.history, sampling=sampling_to_proto(r.params),
                    session_id=r.session_id, prompt_length=len(r.prompt_ids),
                    cache_salt=r.cache_salt,
                    constraint=constraint_to_proto(r.constraint)))
                ok.append(r)
            except (ValueError, TypeError) as exc:  # fails alone, never blocks the queue
                log.warning("request cannot be sent to a verifier", extra={
                    "sequence": r.id, "error": str(exc)[:200]})
                self.lifecycle.fail(r, ServiceError(
                    f"request could not be encoded: {type(exc).__name__}"))
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
                    self.lifecycle.fail(r, exc)
            return
        self.metrics.verified("Prefill", 0, time.monotonic() - started)
        for r, res in zip(reqs, out.results, strict=True):
            r.reused_tokens = res.reused_tokens
            if not r.first_token_at:
                r.first_token_at = time.monotonic()
            self.metrics.prefilled(r, len(r.history), res.reused_tokens)
            self.running.append(r)
            await self.lifecycle.emit(r, [res.token],
                                      [res.logprob] if res.HasField("logprob") else [],
                                      step=False)

    # --- one iteration: plan, draft, step, emit ---------------------------------------

    async def _step(self) -> None:
        """One iteration of the running batch: plan, draft, step (emitting as each
        replica answers), then the policy learns what the step cost and yielded."""
        started, admissions = time.monotonic(), self.admissions
        # A step that shared the verifier with a prefill chunk timed the chunk too.
        disturbed = bool(self.admitting)
        batch = list(self.running)
        before = {r.id: len(r.generated) for r in batch}
        greedy = all(r.params.greedy for r in batch)
        index, plans = self.planner.plan(batch, greedy)
        mode = self.modes[index]
        self.step_mode = mode.name
        speculating = [r for r in batch if plans[r.id].speculates]
        if mode.overlap:
            drafted = await self._overlapped(batch, speculating, plans)
        else:
            self.prefetched.clear()
            trees = await self._draft(speculating, plans)
            await self._step_all(batch, plans, trees)
            drafted = bool(trees) or any(plans[r.id].draft for r in speculating)
        self.metrics.step(mode.name if drafted else "plain")
        if self.policy and any(r.speculation for r in batch):
            # The shadow modes are measured by their shadow drafts, not by running them.
            measured = drafted and not mode.shadow
            disturbed = disturbed or self.admissions != admissions  # or one began since
            self.policy.record(len(batch), greedy, index if drafted else 0,
                               time.monotonic() - started,
                               {r.id: len(r.generated) - before[r.id] for r in speculating}
                               if measured else None, disturbed=disturbed)

    async def _draft(self, reqs: list[GenRequest], plans: Plans) -> Trees:
        """The speculator's trees for the plans among ``reqs`` that ask for one."""
        asking = [r for r in reqs if plans[r.id].speculator is not None]
        return await self.speculators.speculate(
            asking, [plans[r.id].speculator for r in asking], self.step_mode)

    async def _overlapped(self, batch: list[GenRequest], speculating: list[GenRequest],
                          plans: Plans) -> bool:
        """One step in two micro-batches, drafting for one while the other steps:
        step(first + plain rows) ‖ draft(second), then step(second) ‖ draft(first's next
        step). The first micro-batch's trees were drafted during the previous step when
        still current. Returns whether any tree was stepped."""
        first, second = speculating[: len(speculating) // 2], speculating[len(speculating) // 2:]
        trees = {}
        for r in first:  # drafted ahead for this history, within this step's budget
            hit = self.prefetched.get(r.id)
            if hit is not None and hit[0] == len(r.history) \
                    and hit[1].speculator.max_nodes <= plans[r.id].speculator.max_nodes:
                trees[r.id] = hit[2]
        trees |= await self._draft([r for r in first if r.id not in trees], plans)
        plain = [r for r in batch if r not in speculating]
        _, second_trees = await together(self._step_all(first + plain, plans, trees),
                                         self._draft(second, plans))
        ahead = [r for r in first if r in self.running and r.replica is not None
                 and self.planner.room(r) > 1]
        _, next_trees = await together(self._step_all(second, plans, second_trees),
                                       self._draft(ahead, plans))
        self.prefetched = {r.id: (len(r.history), plans[r.id], next_trees[r.id])
                           for r in ahead if r.id in next_trees}
        return bool(trees or second_trees) or any(plans[r.id].draft for r in speculating)

    async def _step_all(self, reqs: list[GenRequest], plans: Plans, trees: Trees) -> None:
        """Step ``reqs`` that are still running: each verifier replica's share in one
        Step call, replicas in parallel."""
        by_replica: dict[str, list[GenRequest]] = {}
        for r in reqs:
            if r in self.running and r.replica is not None:
                by_replica.setdefault(r.replica.address, []).append(r)
        await together(*(self._step_replica(rs, plans, trees) for rs in by_replica.values()))

    async def _step_replica(self, reqs: list[GenRequest], plans: Plans, trees: Trees) -> None:
        """One Step call on one replica, then its tokens emitted."""
        replica = reqs[0].replica
        request = verifier_pb2.StepRequest(items=[_step_item(r, plans[r.id], trees.get(r.id))
                                                  for r in reqs])
        started = time.monotonic()
        try:
            out = await self._call(replica, reqs, request)
        except grpc.aio.AioRpcError as exc:
            await self._step_failed(replica, reqs, exc)
            return
        for r in reqs:
            r.verify_s += time.monotonic() - started
        for r, res in zip(reqs, out.results, strict=True):
            r.drafted += res.drafted_nodes
            r.speculative_steps += res.drafted_nodes > 0
            await self.lifecycle.emit(r, list(res.tokens), list(res.logprobs), step=True,
                                      drafted=res.drafted_nodes)
            if res.HasField("next_draft") and not r.finish_reason:
                r.shadows.append((len(r.generated), list(res.next_draft.tokens),
                                  list(res.next_draft.parents)))

    async def _step_failed(self, replica: Replica, reqs: list[GenRequest],
                           exc: grpc.aio.AioRpcError) -> None:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            # The verifier freed a sequence after its lease (this router was paused): the
            # call changed nothing, so all restart from the router's history.
            log.warning("verifier lost a sequence; prefilling again",
                        extra={"replica": replica.address, "error": exc.details()})
            for r in reqs:
                self.lifecycle.requeue(r)
            await self.replicas.release(replica, [r.id for r in reqs])
        elif exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            for r in reqs:  # e.g. a tree the verifier rejects: fail loudly, not silently
                self.lifecycle.fail(r, exc)
        elif _client_deadline_passed(exc, reqs):
            # A client's deadline, not a dead replica: the expired requests end on the next
            # loop; the others restart from the router's history (the verifier may or may
            # not have applied the step).
            for r in reqs:
                self.lifecycle.requeue(r)
            await self.replicas.release(replica, [r.id for r in reqs])
        else:
            self.replicas.mark_down(replica, exc, [r.id for r in reqs])
            for r in reqs:  # re-prefill elsewhere from the router's history
                self.lifecycle.requeue(r)

    async def _call(self, replica: Replica, reqs: list[GenRequest],
                    request: verifier_pb2.StepRequest) -> verifier_pb2.StepResponse:
        """The Step call, in a span of the first request's trace (linked to the others'),
        timed for the metrics."""
        attributes = {"specinfer.batch_size": len(reqs), "specinfer.replica": replica.address,
                      "specinfer.speculation_mode": self.step_mode}
        with tracing.batch_span("Step", [r.span for r in reqs], attributes) as span:
            started = time.monotonic()
            out = await replica.rpc.Step(request, timeout=hop_timeout(reqs, self.step_timeout_s))
            nodes = [res.drafted_nodes for res in out.results]
            self.metrics.verified("Step", max(nodes, default=0), time.monotonic() - started)
            if span.is_recording():
                tokens = [len(res.tokens) for res in out.results]
                span.set_attributes({"specinfer.tree_nodes": sum(nodes),
                                     "specinfer.accepted_tokens": sum(tokens) - len(tokens)})
            return out


def _step_item(req: GenRequest, plan: StepPlan,
               tree: common_pb2.TokenTree | None) -> verifier_pb2.StepItem:
    """``req``'s part of a Step call: its root, the speculator's tree, its plan. A
    constrained request that allows speculation has its grammar's forced tokens drafted
    in every step, whatever the mode: they cost a row each and are accepted with
    certainty."""
    return verifier_pb2.StepItem(sequence_id=req.id, root_token=req.generated[-1], tree=tree,
                                 draft=draft_plan_to_proto(plan.draft),
                                 shadow=draft_plan_to_proto(plan.shadow),
                                 forced=req.speculation and req.constraint is not None)


def _client_deadline_passed(exc: grpc.aio.AioRpcError, reqs: list[GenRequest]) -> bool:
    """A hop that ran out of time because a client's deadline passed, not because the
    replica is dead."""
    return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and any(
        r.deadline_passed() for r in reqs)

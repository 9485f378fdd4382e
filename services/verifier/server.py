"""The verifier's gRPC service (``specinfer serve verifier``).

The engine is not thread-safe and every call is compute-bound, so calls run one at a time
on a single worker thread; the event loop stays free for health checks and new requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from services.verifier.engine import PrefillSpec, StepItem, VerifierEngine
from services.verifier.metrics import VerifierMetrics
from services.verifier.prefill import PrefillJob, prefill_done
from specinfer import tracing
from specinfer.constraints import InvalidConstraint
from specinfer.errors import InvalidArgument, ResourceExhausted
from specinfer.grpc_server import abort_on_error, serve_engine
from specinfer.v1 import verifier_pb2, verifier_pb2_grpc
from specinfer.wire import (
    STEP_PROTOCOL,
    constraint_from_proto,
    draft_plan_from_proto,
    logprob_to_proto,
    sampling_from_proto,
    tree_from_proto,
    tree_shape_to_proto,
)

log = logging.getLogger(__name__)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, metrics: VerifierMetrics | None = None) -> None:
        self.engine: VerifierEngine | None = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.metrics = metrics if metrics is not None else VerifierMetrics("")
        self.draining = False  # shutting down: no new sequences (Prefill is refused)
        self.stepped = asyncio.Event()  # set (and replaced) as each Step call ends
        self.riding_counted = 0  # the engine's riding_tokens in the metrics so far

    def _measured(self, fn, *args):
        """``fn(engine, *args)``, then the cache's state (read here: only this thread
        touches the engine); returns the result and the engine's seconds."""
        start = time.perf_counter()
        try:
            return fn(self.engine, *args), time.perf_counter() - start
        finally:
            self.metrics.cache(self.engine)

    async def _call(self, context: grpc.aio.ServicerContext, method: str, fn, *args):
        """``fn(engine, *args)`` on the engine's thread, its errors mapped to statuses;
        returns its result and the engine's seconds."""
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed in queue")
        try:
            result, seconds = await asyncio.get_running_loop().run_in_executor(
                self.pool, self._measured, fn, *args)
        except Exception as exc:  # mapped to a status; the service keeps serving
            # A full cache is routine under load (routers retry until slots free up).
            log.log(logging.DEBUG if isinstance(exc, ResourceExhausted) else logging.INFO,
                    "request failed", extra={"method": method, "error": str(exc)[:300]})
            await abort_on_error(context, exc)
        log.debug("done", extra={"method": method, "ms": seconds * 1e3})
        return result, seconds

    async def Prefill(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the verifier is shutting down: "
                                "prefill on another replica")
        constraints, compile_s, hits = await self._compile(context, request.items)

        def run(engine: VerifierEngine):
            specs = []
            for i, item in enumerate(request.items):
                params = sampling_from_proto(item.sampling, f"items[{i}].sampling")
                specs.append(PrefillSpec(item.sequence_id, list(item.token_ids), params,
                                         item.session_id,
                                         item.prompt_length if item.HasField("prompt_length")
                                         else None, constraints[i], item.cache_salt))
            return engine.begin_prefill(specs)

        job, seconds = await self._call(context, "Prefill", run)
        done, ride = False, True
        try:  # a chunk of the prompts at a time, so queued Step calls run in between
            while not done:
                # Riding in steps until a wait for one times out (then no more waits).
                ride = ride and await self._ride(job)
                if ride:
                    done = prefill_done(job)
                    continue
                done, chunk_seconds = await self._call(context, "Prefill",
                                                       VerifierEngine.advance_prefill, job)
                seconds += chunk_seconds
        finally:
            if not done:  # failed, or the caller went away: free what the job took
                with contextlib.suppress(RuntimeError):  # the pool is shut down
                    await asyncio.get_running_loop().run_in_executor(
                        self.pool, self._measured, VerifierEngine.abort_prefill, job)
        out = job.outs
        tokens = sum(len(item.token_ids) for item in request.items)
        reused = sum(r.reused_tokens for r in out)
        self.metrics.call("Prefill", len(out), 0, seconds)
        self.metrics.prefill_tokens.inc(tokens - reused)
        self.metrics.prefix_queries.inc(tokens)
        self.metrics.prefix_hits.inc(reused)
        _annotate(batch_size=len(out), prompt_tokens=tokens, reused_tokens=reused,
                  engine_seconds=seconds)
        kinds = sorted({c.kind for c in constraints if c is not None})
        if kinds:
            _annotate(constraint_kinds=kinds, grammar_compile_seconds=compile_s,
                      grammar_cache_hits=hits)
        return verifier_pb2.PrefillResponse(results=[
            verifier_pb2.PrefillResult(sequence_id=r.sequence_id, token=r.token,
                                       reused_tokens=r.reused_tokens,
                                       logprob=_first_logprob(r.logprobs)) for r in out
        ])

    async def _ride(self, job: PrefillJob) -> bool:
        """While sequences are stepping here, let ``job``'s chunks ride in their steps
        (``VerifierEngine.ride_prefill``) and wait for the next step; False when that
        cannot be, or no step came for a few steps' time (the batch went idle: the call
        computes its chunks itself)."""
        engine = self.engine
        if not engine.rides_prefill or not engine.sequences or job.error is not None:
            return False
        # The engine thread only reads the list and removes finished or failed jobs: an
        # append from here is safe (one bytecode under the GIL).
        engine.ride_prefill(job)
        step_s = engine.step_rate[1] / engine.step_rate[0] if engine.step_rate[0] else 0.1
        stepped = self.stepped
        try:
            await asyncio.wait_for(stepped.wait(), timeout=max(0.25, 4 * step_s))
        except TimeoutError:
            return False
        return True

    def _pulse(self) -> None:
        """A step finished: wake the Prefill calls waiting to ride the next one."""
        stepped, self.stepped = self.stepped, asyncio.Event()
        stepped.set()

    async def _compile(self, context: grpc.aio.ServicerContext, items
                       ) -> tuple[list, float, int]:
        """Each item's constraint (or None), its grammar compiled (or found in the cache)
        on a worker thread, off the engine's: a slow compile holds no other request's
        step. A constraint that does not compile is INVALID_ARGUMENT naming the item.
        Also returns the seconds spent compiling and the cache hits."""
        out, compile_s, hits = [], 0.0, 0
        for i, item in enumerate(items):
            field = f"items[{i}].constraint"
            try:
                constraint = constraint_from_proto(item.constraint, field)
                grammars = self.engine.grammars if self.engine is not None else None
                if constraint is not None and grammars is not None:
                    await asyncio.get_running_loop().run_in_executor(
                        None, grammars.compile, constraint, field)
                    self.metrics.grammar(constraint.kind, grammars.last_compile_s)
                    compile_s += grammars.last_compile_s
                    hits += not grammars.last_compile_s
            except (InvalidArgument, InvalidConstraint) as exc:
                await abort_on_error(context, exc if isinstance(exc, InvalidArgument)
                                     else InvalidArgument(field, _after(str(exc), field)))
            out.append(constraint)
        return out, compile_s, hits

    async def Step(self, request, context):
        try:
            out, seconds = await self._call(context, "Step", lambda engine: engine.step(
                [step_item_from_proto(item, f"items[{i}]")
                 for i, item in enumerate(request.items)]))
        finally:
            self._pulse()
        nodes = [r.drafted_nodes for r in out]
        self.metrics.call("Step", len(out), max(nodes, default=0), seconds)
        self.metrics.riding_tokens.inc(self.engine.riding_tokens - self.riding_counted)
        self.riding_counted = self.engine.riding_tokens
        self.metrics.grammar_step(self.engine.grammar_seconds, self.engine.forced_tokens)
        self.metrics.tree_nodes.inc(sum(nodes))
        if out:
            self.metrics.forward_passes.inc()
        _annotate(batch_size=len(out), tree_nodes=sum(nodes),
                  accepted_tokens=sum(len(r.tokens) - 1 for r in out), engine_seconds=seconds)
        return verifier_pb2.StepResponse(results=[
            verifier_pb2.StepResult(sequence_id=r.sequence_id, tokens=r.tokens,
                                    accepted_nodes=r.accepted_nodes,
                                    cached_tokens=r.cached_tokens,
                                    logprobs=[logprob_to_proto(lp) for lp in r.logprobs],
                                    drafted_nodes=r.drafted_nodes,
                                    next_draft=tree_shape_to_proto(r.next_draft))
            for r in out
        ])

    async def Release(self, request, context):
        n, _ = await self._call(context, "Release", VerifierEngine.release,
                                list(request.sequence_ids), request.keep_for_session)
        return verifier_pb2.ReleaseResponse(released=n)

    async def Info(self, request, context):
        info, _ = await self._call(context, "Info", VerifierEngine.info)
        sources = [verifier_pb2.DraftSource(name=name, sampled=sampled)
                   for name, sampled in info.pop("draft_sources")]
        return verifier_pb2.InfoResponse(**info, draft_sources=sources,
                                         step_protocol=STEP_PROTOCOL)


def step_item_from_proto(msg: verifier_pb2.StepItem, field: str) -> StepItem:
    """A Step item as the engine takes it; errors name ``field`` and the bad part."""
    try:
        tree = tree_from_proto(msg.tree)
    except ValueError as exc:
        raise ValueError(f"{field}.{exc}") from exc
    return StepItem(msg.sequence_id, msg.root_token, tree,
                    draft_plan_from_proto(msg.draft, f"{field}.draft"),
                    draft_plan_from_proto(msg.shadow, f"{field}.shadow"), msg.forced)


def _after(message: str, field: str) -> str:
    """An InvalidConstraint's message without the field it starts with."""
    return message.removeprefix(field).lstrip(".: ") or message


def _annotate(**attributes) -> None:
    """Attributes on the call's server span (``specinfer.<name>``), while tracing is on."""
    if tracing.enabled():
        trace.get_current_span().set_attributes(
            {f"specinfer.{k}": v for k, v in attributes.items()})


def _first_logprob(logprobs: list) -> object:
    return logprob_to_proto(logprobs[0]) if logprobs else None


# A drain ends early once no Step has come for this long: the live sequences' routers are
# gone (killed, or stopped with the stack), and nobody would finish or move them. A router
# steps its running sequences every iteration (well under a second here).
DRAIN_IDLE_S = 3.0


async def serve(build, host: str, port: int, grace_s: float = 10.0,
                sweep_every_s: float = 1.0, metrics: VerifierMetrics | None = None,
                credentials: grpc.ServerCredentials | None = None,
                drain_timeout_s: float = 30.0) -> None:
    """Serve until SIGTERM; every ``sweep_every_s`` free the sequences past their lease
    (``VerifierEngine.expire``), on the engine's thread like every call. On SIGTERM:
    NOT_SERVING, refuse new sequences, and keep serving the live ones for up to
    ``drain_timeout_s`` while the routers move them elsewhere (or finish them)."""
    servicer = VerifierServicer(metrics)

    async def drain() -> None:
        servicer.draining = True
        engine = servicer.engine
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s

        def stepped() -> bool:  # a router is still finishing or moving the sequences
            return time.monotonic() - engine.last_touched < DRAIN_IDLE_S

        while engine is not None and engine.sequences and loop.time() < deadline \
                and stepped():
            await asyncio.sleep(0.1)
        log.info("drained", extra={"sequences_left": len(engine.sequences) if engine else 0,
                                   "idle": bool(engine and engine.sequences and not stepped())})

    async def sweep() -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(sweep_every_s)
            if servicer.engine is not None:
                await loop.run_in_executor(servicer.pool, servicer._measured,
                                           VerifierEngine.expire)

    sweeper = asyncio.create_task(sweep())
    try:
        await serve_engine("verifier", servicer,
                           verifier_pb2_grpc.add_VerifierServicer_to_server,
                           verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name,
                           build, host, port, grace_s, close=lambda e: e.executor.close(),
                           healthy=lambda e: e.executor.healthy,
                           credentials=credentials, drain=drain)
    finally:
        sweeper.cancel()

"""The router's gRPC API, ``specinfer.v1.Router``: a thin servicer over the scheduler (the
shared validation and streaming state are ``frontend``'s; API keys are checked here, from
the call's ``authorization`` metadata)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.router.auth import ApiKeys
from services.router.frontend import Frontend, Generation, request_from_proto
from services.router.limits import KeyStreams
from services.router.request import GenRequest
from services.router.scheduler import Scheduler
from services.router.tools import CallStream, calls_finish
from specinfer.errors import ServiceError, Unavailable
from specinfer.grpc_server import abort_on_error
from specinfer.v1 import common_pb2, router_pb2, router_pb2_grpc
from specinfer.wire import logprob_to_proto

log = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, keys: ApiKeys | None = None, streams: KeyStreams | None = None) -> None:
        self.scheduler: Scheduler | None = None
        self.fe: Frontend | None = None
        self.keys = keys if keys is not None else ApiKeys([])
        self.streams = streams if streams is not None else KeyStreams(1 << 30)

    def _start(self, request, context) -> Generation:
        if self.scheduler is None:
            raise Unavailable("the router is still starting")
        req = request_from_proto(request, self.fe)
        remaining = context.time_remaining()
        if remaining is not None:
            req.deadline = time.monotonic() + remaining
        self.scheduler.submit(req)
        return Generation(req)

    async def Generate(self, request, context):
        """The unary form of GenerateStream: the same run, collected."""
        text, ids, logprobs, calls, last = [], [], [], [], None
        async for msg in self.GenerateStream(request, context):
            text.append(msg.text)
            ids += msg.token_ids
            logprobs += msg.logprobs
            calls += msg.tool_calls
            last = msg
        return router_pb2.GenerateResponse(text="".join(text), token_ids=ids,
                                           finish_reason=last.finish_reason, usage=last.usage,
                                           stats=last.stats, dtype=last.dtype,
                                           logprobs=logprobs, tool_calls=calls)

    async def GenerateStream(self, request, context):
        gen = None
        try:
            key = self.keys.check(dict(context.invocation_metadata() or ()).get("authorization"))
            with self.streams.hold(key):
                gen = self._start(request, context)
                calls, finish = CallStream(gen.req.tools), ""
                async for new, delta, logprobs in gen.deltas():
                    delta, made = calls.push(delta, bool(gen.req.finish_reason))
                    if made:
                        finish = calls_finish(gen.req.finish_reason)
                    if new or delta or made:
                        yield router_pb2.GenerateStreamResponse(
                            text=delta, token_ids=new,
                            logprobs=[logprob_to_proto(lp) for lp in logprobs],
                            tool_calls=[_tool_call(c) for c in made])
                yield router_pb2.GenerateStreamResponse(
                    finish_reason=finish or gen.req.finish_reason, usage=_usage(gen.req),
                    stats=_stats(gen.req), dtype=self.fe.dtype)
        except asyncio.CancelledError:  # the client went away: free the sequence
            if gen:
                self.scheduler.cancel(gen.req)
            raise
        except (ServiceError, ValueError, grpc.aio.AioRpcError) as exc:
            if gen:
                self.scheduler.cancel(gen.req)
            await _abort(context, exc)


async def _abort(context, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AioRpcError):
        await context.abort(exc.code(), exc.details() or "")
    await abort_on_error(context, exc)


def _tool_call(call: dict) -> router_pb2.ToolCall:
    return router_pb2.ToolCall(id=call["id"], name=call["function"]["name"],
                               arguments=call["function"]["arguments"])


def _usage(req: GenRequest) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=len(req.prompt_ids),
                            completion_tokens=len(req.generated),
                            cached_prompt_tokens=req.reused_tokens)


def _stats(req: GenRequest) -> common_pb2.SpeculationStats:
    return common_pb2.SpeculationStats(steps=len(req.accepted_per_step),
                                       accepted_per_step=req.accepted_per_step,
                                       drafted_tokens=req.drafted,
                                       speculate_seconds=req.speculate_s,
                                       verify_seconds=req.verify_s,
                                       speculative_steps=req.speculative_steps)

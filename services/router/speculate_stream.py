"""The router's side of ``SpeculateStream``: one long-lived stream per speculator replica.

Each step's message carries, per sequence, only the tokens accepted since its last message
on this stream (``offset`` = what the stream already holds; the full context the first
time), so a step costs the same at any context length. The router's histories only grow,
which is what makes a delta enough.

Any failure -- an error status, the stream ending, a reply later than its timeout --
closes the stream: what the speculator held for it is gone with it, and the next call opens
a new one that starts again from full contexts. The caller decides what a failure costs
(drafting.py: that step decodes without the speculator).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.router.request import GenRequest
from specinfer import tracing
from specinfer.v1 import common_pb2, speculator_pb2, speculator_pb2_grpc
from specinfer.wire import constraint_to_proto

# A stream holding this many sequences starts again (the speculator refuses more): the
# router releases ended sequences, so only a leak would get here.
MAX_HELD = 4096


class StreamEnded(Exception):
    """The speculator ended the stream without an error status."""


class SpeculatorStream:
    """The stream to one speculator: what it holds of each sequence, the releases for the
    next message, one message in flight at a time."""

    def __init__(self, stub: speculator_pb2_grpc.SpeculatorStub) -> None:
        self.stub = stub
        self.call: grpc.aio.StreamStreamCall | None = None
        self.sent: dict[str, int] = {}  # sequence id -> tokens the stream holds
        self.releases: set[str] = set()
        self.step = 0
        self.bytes_sent = 0  # request bytes on the wire, all streams of this replica
        self.lock = asyncio.Lock()

    def release(self, sequence_id: str) -> None:
        """The sequence ended: the next message tells the speculator to forget it."""
        if self.sent.pop(sequence_id, None) is not None:
            self.releases.add(sequence_id)

    def _message(self, reqs: list[GenRequest], sampling: list[common_pb2.SamplingParams],
                 trees: list[speculator_pb2.TreeConfig]) -> speculator_pb2.SpeculateStreamRequest:
        self.step += 1
        items = []
        for r, params, tree in zip(reqs, sampling, trees, strict=True):
            offset = self.sent.get(r.id, 0)
            if offset > len(r.history):  # cannot happen (histories only grow): start over
                offset = 0
            item = speculator_pb2.StreamItem(sequence_id=r.id, offset=offset,
                                             delta=r.history[offset:], sampling=params,
                                             tree=tree)
            if offset == 0 and r.constraint is not None:  # the stream holds it from here
                item.constraint.CopyFrom(constraint_to_proto(r.constraint))
                item.prompt_length = len(r.prompt_ids)
            items.append(item)
        msg = speculator_pb2.SpeculateStreamRequest(step=self.step, items=items,
                                                    release=sorted(self.releases),
                                                    trace_context=tracing.carrier())
        self.releases.clear()
        return msg

    async def speculate(self, reqs: list[GenRequest], sampling: list[common_pb2.SamplingParams],
                        trees: list[speculator_pb2.TreeConfig],
                        timeout_s: float) -> speculator_pb2.SpeculateStreamResponse:
        """One step's trees; raises ``grpc.aio.AioRpcError``, ``TimeoutError`` or
        ``StreamEnded`` after closing the stream."""
        async with self.lock:
            if self.call is None or len(self.sent) > MAX_HELD:
                self.close()
                self.call = self.stub.SpeculateStream()
            msg = self._message(reqs, sampling, trees)
            try:
                async with asyncio.timeout(timeout_s):
                    await self.call.write(msg)
                    reply = await self.call.read()
                if reply is grpc.aio.EOF:
                    raise StreamEnded("the speculator ended the stream")
                if reply.step != msg.step or len(reply.results) != len(reqs):
                    raise StreamEnded(f"reply to step {reply.step} with {len(reply.results)} "
                                      f"trees; expected step {msg.step} with {len(reqs)}")
            except BaseException:
                self.close()
                raise
            self.bytes_sent += msg.ByteSize()
            for r in reqs:
                self.sent[r.id] = len(r.history)
            return reply

    def close(self) -> None:
        if self.call is not None:
            with contextlib.suppress(Exception):
                self.call.cancel()
        self.call = None
        self.sent.clear()
        self.releases.clear()

"""The router's records: a generation request as the scheduler drives it, and a verifier
replica as the router sees it."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import INVALID_SPAN, Span

from specinfer.sampling import SamplingParams, TokenLogprob
from specinfer.v1 import verifier_pb2_grpc

_ids = itertools.count()


@dataclass
class Replica:
    address: str
    rpc: verifier_pb2_grpc.VerifierStub
    channel: grpc.aio.Channel
    healthy: bool = True  # False while failed over (probed until it answers)
    joined: bool = False  # its Info answered: capacity and limits known
    draining: bool = False  # it reports NOT_SERVING (shutting down): no new sequences
    removed: bool = False  # discovery no longer lists it
    capacity: int = 1
    live: int = 0
    max_tree_nodes: int = 64
    max_context: int = 2048
    has_draft_head: bool = False  # Info.draft_head
    # Sequences a failed call left behind there, released before it is used again.
    stale: set[str] = field(default_factory=set)

    @property
    def usable(self) -> bool:
        """Whether it may take new sequences."""
        return self.joined and self.healthy and not self.draining and not self.removed


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    speculation: bool = True
    stop: list[str] = field(default_factory=list)
    stop_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False  # EOS does not end it (stop_ids still do)
    session_id: str = ""
    operation: str = "text_completion"  # or "chat" (OpenTelemetry's gen_ai.operation.name)
    id: str = field(default_factory=lambda: f"r{next(_ids)}-{time.monotonic_ns() % 10**9}")
    # Filled in by the scheduler.
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # if asked for
    accepted_per_step: list[int] = field(default_factory=list)
    drafted: int = 0
    speculative_steps: int = 0
    speculate_s: float = 0.0  # wall time of the Speculate calls it took part in
    verify_s: float = 0.0  # ... and of its Verify/Decode calls
    reused_tokens: int = 0
    finish_reason: str = ""
    error: Exception | None = None
    cancelled: bool = False
    replica: Replica | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    queued_at: float = field(default_factory=time.monotonic)  # since when it waits
    first_token_at: float = 0.0
    # For metrics and the trace: when it was first admitted and last emitted, whether its
    # prompt was counted (a failover's re-prefill is not counted again), and its span.
    admitted_at: float = 0.0
    last_token_at: float = 0.0
    prompt_counted: bool = False
    span: Span = INVALID_SPAN
    ended: bool = False
    deadline: float | None = None  # time.monotonic() by which the client gives up
    # Model-free trees the verifier drafted but did not verify, waiting for the tokens
    # that show how they would have fared: (index in generated, tokens, parents).
    shadows: list[tuple[int, list[int], list[int]]] = field(default_factory=list)

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.generated

    def append(self, tokens: list[int], eos_ids: set[int],
               detokenize: Callable[[list[int]], str] | None) -> list[int]:
        """Append a step's tokens, cut at max_tokens, a stop token or the token that
        completes a stop string (a step may accept several past it; one-token steps would
        have stopped there); sets ``finish_reason`` if the request is done. Returns the
        tokens appended."""
        start = len(self.generated)
        for tok in tokens:
            if len(self.generated) >= self.max_tokens:
                break
            self.generated.append(tok)
            if tok in self.stop_ids or (tok in eos_ids and not self.ignore_eos):
                self.finish_reason = "stop"
                break
        if self.stop and detokenize:  # also when an EOS ended the step's tokens
            self._cut_at_stop_string(start, detokenize)
        if not self.finish_reason and len(self.generated) >= self.max_tokens:
            self.finish_reason = "length"
        return self.generated[start:]

    def _cut_at_stop_string(self, start: int, detokenize: Callable[[list[int]], str]) -> None:
        if not any(s in detokenize(self.generated) for s in self.stop):
            return
        for end in range(start + 1, len(self.generated) + 1):
            if any(s in detokenize(self.generated[:end]) for s in self.stop):
                del self.generated[end:]
                self.finish_reason = "stop"
                return

    def deadline_passed(self) -> bool:
        return self.deadline is not None and self.deadline <= time.monotonic()


def hop_timeout(reqs: list[GenRequest], step_timeout_s: float) -> float:
    """A hop's deadline: the step timeout, or sooner if a client's deadline is."""
    deadlines = [r.deadline for r in reqs if r.deadline is not None]
    if not deadlines:
        return step_timeout_s
    return max(0.05, min(step_timeout_s, min(deadlines) - time.monotonic()))

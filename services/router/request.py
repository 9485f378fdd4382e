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

from services.router.prefix_routing import ReplicaPrefixes
from services.router.tools import Tools
from specinfer.constraints import Constraint
from specinfer.sampling import SamplingParams, TokenLogprob
from specinfer.stops import SequenceStops, Stops, stop_token_ids
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
    draft_sources: frozenset[str] = frozenset()  # Info.draft_sources' names
    # The prefixes the router believes it caches (prefix_routing.py).
    prefixes: ReplicaPrefixes = field(default_factory=ReplicaPrefixes)
    # Sequences a failed call left behind there, released before it is used again.
    stale: set[str] = field(default_factory=set)

    def has_sources(self, names: tuple[str, ...]) -> bool:
        """Whether it can draft with every one of its own sources ``names``."""
        return self.draft_sources.issuperset(names)

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
    constraint: Constraint | None = None  # structured output (EOS always ends it then)
    tools: Tools | None = None  # chat tools: the answer is parsed for calls
    session_id: str = ""
    cache_salt: str = ""  # prefix caching: shares cached KV only with the same salt
    routing: str = ""  # why its replica was chosen: session, prefix or load
    operation: str = "text_completion"  # or "chat" (OpenTelemetry's gen_ai.operation.name)
    id: str = field(default_factory=lambda: f"r{next(_ids)}-{time.monotonic_ns() % 10**9}")
    # Filled in by the scheduler.
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # if asked for
    accepted_per_step: list[int] = field(default_factory=list)
    drafted: int = 0
    speculative_steps: int = 0
    speculate_s: float = 0.0  # wall time of the Speculate calls it took part in
    verify_s: float = 0.0  # ... and of its Step calls
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
    # Its stops and text, token by token (set by the first ``append``).
    stops: SequenceStops | None = None

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.generated

    def append(self, tokens: list[int], eos_ids: set[int],
               detokenize: Callable[[list[int]], str] | None) -> list[int]:
        """Append a step's tokens, cut at max_tokens, a stop token or the token that
        completes a stop string (a step may accept several past it; one-token steps would
        have stopped there); sets ``finish_reason`` if the request is done. Returns the
        tokens appended. ``eos_ids`` and ``detokenize`` (the tokenizer's decode; None: no
        text, so no stop strings) are read on the first call."""
        if self.stops is None:
            self.stops = SequenceStops(
                Stops(self.max_tokens,
                      stop_token_ids(eos_ids, self.stop_ids,
                                     self.ignore_eos and self.constraint is None),
                      tuple(self.stop)), detokenize)
        new = tokens[:self.stops.add(tokens)]
        self.generated += new
        self.finish_reason = self.finish_reason or self.stops.finish_reason
        return new

    def text_since(self, start: int, final: bool) -> str:
        """Its text after character ``start`` that a stream may show now (see
        ``SequenceStops.shown_since``)."""
        return "" if self.stops is None else self.stops.shown_since(start, final)

    def deadline_passed(self) -> bool:
        return self.deadline is not None and self.deadline <= time.monotonic()


def hop_timeout(reqs: list[GenRequest], step_timeout_s: float) -> float:
    """A hop's deadline: the step timeout, or sooner if a client's deadline is."""
    deadlines = [r.deadline for r in reqs if r.deadline is not None]
    if not deadlines:
        return step_timeout_s
    return max(0.05, min(step_timeout_s, min(deadlines) - time.monotonic()))

"""The router's iteration-level scheduler.

One loop drives every decoding step of every live sequence: new requests are prefilled and
join the running batch at the next step; each step asks the speculator for trees for the
whole speculating batch, then every verifier replica verifies (or decodes) its sequences,
replicas in parallel. The router keeps each sequence's full token history, so a speculator
that fails costs one step without speculation, and a verifier that fails has its sequences
re-prefilled on another replica from that history (greedy output is unchanged).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specinfer.errors import InvalidArgument, ResourceExhausted, ServiceError
from specinfer.grpc_server import CHANNEL_OPTIONS
from specinfer.sampling import SamplingParams, TokenLogprob
from specinfer.tree import ROOT
from specinfer.v1 import (
    common_pb2,
    speculator_pb2,
    speculator_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from specinfer.wire import logprob_from_proto

log = logging.getLogger(__name__)
_ids = itertools.count()


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    speculation: bool = True
    stop: list[str] = field(default_factory=list)
    stop_ids: set[int] = field(default_factory=set)
    session_id: str = ""
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
    first_token_at: float = 0.0
    deadline: float | None = None  # time.monotonic() by which the client gives up
    # Model-free trees the verifier drafted but did not verify, waiting for the tokens
    # that show how they would have fared: (index in generated, tokens, parents).
    shadows: list[tuple[int, list[int], list[int]]] = field(default_factory=list)

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.generated


@dataclass
class Replica:
    address: str
    rpc: verifier_pb2_grpc.VerifierStub
    channel: grpc.aio.Channel
    healthy: bool = True
    capacity: int = 1
    live: int = 0
    max_tree_nodes: int = 64
    max_context: int = 2048
    has_head: bool = False  # a draft head (Info.draft_head)


@dataclass(frozen=True)
class SpeculationMode:
    """One way to speculate: who drafts a step's trees, and their shape."""

    name: str
    expansion: tuple[int, ...] = ()  # () = the speculator's default
    max_nodes: int = 0  # 0 = the router's per-step budget
    # Split the speculating batch into two micro-batches and draft for one while the other
    # is verified: pays where drafting and verifying do not share the same cores.
    overlap: bool = False
    # Model-free drafts made by the verifier from the history it holds (Verify items'
    # draft_nodes): no Speculate call, no history sent, and no speculator needed.
    in_verifier: bool = False
    # With in_verifier: the verifier's draft head (on the LLM's features) drafts too.
    head: bool = False


TREE = SpeculationMode("tree")
TREE_OVERLAP = SpeculationMode("tree-overlap", overlap=True)


# What adaptive speculation chooses from, besides plain decoding (arm 0). Model-free drafts
# (corpus datastore, prompt lookup) cost almost nothing to make, so small trees of them can
# pay where SSM trees do not (a CPU verifier, a large batch); which mode wins is measured.
LOOKUP = SpeculationMode("lookup-2", max_nodes=2, in_verifier=True)
# The verifier's draft head: its tree (the verifier's --head-tree, at most --head-nodes)
# and model-free drafts, in one tree of up to 16 nodes (bench/speculator.py measures it;
# 8 nodes accept fewer and, on a 2-core CPU, ran no faster); no Speculate call either.
HEAD = SpeculationMode("head", max_nodes=16, in_verifier=True, head=True)
ADAPTIVE_MODES = (
    LOOKUP,
    SpeculationMode("lookup-6", max_nodes=6, in_verifier=True),
    HEAD,
    TREE,
    TREE_OVERLAP,
)
# --speculation: adaptive, or one mode on every step.
SPECULATION_CHOICES = {"adaptive": ADAPTIVE_MODES, "always": (TREE,),
                       "overlap": (TREE_OVERLAP,), "lookup": (LOOKUP,), "head": (HEAD,)}


class SpeculationPolicy:
    """Decides, step by step, which speculation mode pays for the current batch.

    Speculation trades extra work (drafting, a wider verification) for more tokens per LLM
    step; whether that wins depends on the batch, on how well the drafts fit the text and
    on the hardware. So it is measured, not assumed. An arm's rate (0 = plain decoding,
    then one per mode) on a batch is the tokens it is expected to emit over the seconds
    its step is expected to take:

    - seconds per step are measured per arm, batch-size bucket (1, 2, 3-4, 5-8, ...) and
      kind of batch (all greedy or not): they depend on the batch and the hardware, and
      vary little from step to step;
    - tokens per sequence and step are exactly 1 for plain decoding; for a mode they
      depend on how well its drafts fit the text, not on the batch, so they are measured
      per mode over all batch sizes (with a longer memory: they are noisy) and per
      sequence, each sequence's own count shrunk toward the pooled one by
      ``prior_steps``: drafts that keep missing one sequence stop costing it, drafts that
      fit another keep it speculating.

    Each step takes the fastest arm (a challenger must beat the current choice by
    ``margin``, so noise does not flip it back and forth). Each other arm is tried every
    ``explore_every`` steps, so an estimate that went stale is corrected; an arm whose
    tries keep losing is tried half as often each time, down to one step in
    ``max_explore_every``, and an arm that loses by far is tried less often from the
    start: a try of an arm at a fraction f of the best rate costs about 1/f - 1 steps,
    kept under ``explore_cost`` of the steps between tries."""

    def __init__(self, arms: int = 2, explore_every: int = 16, smoothing: float = 0.03,
                 max_explore_every: int = 128, margin: float = 0.03,
                 explore_cost: float = 0.01, yield_smoothing: float = 0.02,
                 prior_steps: float = 2.0) -> None:
        self.arms = arms
        self.explore_cost = explore_cost
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.smoothing = smoothing
        self.yield_smoothing = yield_smoothing
        self.prior_steps = prior_steps
        self.margin = margin
        # (bucket, greedy, arm) -> discounted [seconds, steps]
        self.times: dict[tuple[int, bool, int], list[float]] = {}
        # (greedy, arm) -> discounted [tokens per sequence, steps]; (sequence id, arm) ->
        # the sequence's own [tokens, steps]
        self.yields: dict[tuple[bool, int], list[float]] = {}
        self.sequences: dict[tuple[str, int], list[float]] = {}
        self.choice: dict[tuple[int, bool], int] = {}
        # (bucket, greedy, arm) -> steps between tries of a non-chosen arm, steps to go
        self.interval: dict[tuple[int, bool, int], int] = {}
        self.countdown: dict[tuple[int, bool, int], int] = {}

    @staticmethod
    def _key(batch: int, greedy: bool) -> tuple[int, bool]:
        return 1 << max(0, batch - 1).bit_length(), greedy

    def tokens_per_step(self, greedy: bool, arm: int, sequence: str | None = None) -> float:
        """Expected tokens one sequence emits in a step of ``arm``."""
        if arm == 0:
            return 1.0
        pooled = self.yields.get((greedy, arm))
        prior = pooled[0] / pooled[1] if pooled else 1.0
        own = self.sequences.get((sequence, arm)) if sequence is not None else None
        if own is None:
            return prior
        return (own[0] + self.prior_steps * prior) / (own[1] + self.prior_steps)

    def rate(self, key: tuple[int, bool], arm: int, batch: int | None = None,
             sequences: tuple[str, ...] = ()) -> float | None:
        """Expected tokens per second of ``arm`` on a batch of ``batch`` sequences (default:
        the bucket's size) of which ``sequences`` speculate; None if not measured yet."""
        t = self.times.get((*key, arm))
        if t is None or (arm and (key[1], arm) not in self.yields):
            return None
        batch = batch or key[0]
        tokens = (batch - len(sequences)) * self.tokens_per_step(key[1], arm) + sum(
            self.tokens_per_step(key[1], arm, seq) for seq in sequences)
        return tokens / (t[0] / t[1])

    def choose(self, batch: int, greedy: bool, skip: frozenset[int] = frozenset(),
               sequences: tuple[str, ...] = ()) -> int:
        """The arm for this step; arms in ``skip`` cannot run on this batch (e.g. micro-batch
        overlap on one sequence) and are neither chosen nor counted down. ``sequences``:
        the ids of the batch's speculating sequences, for their own measured yields."""
        key = self._key(batch, greedy)
        rates = [None if arm in skip else self.rate(key, arm, batch, sequences)
                 for arm in range(self.arms)]
        # Measure every arm first (the speculating ones, then plain decoding), except one
        # that lost by far at the next smaller batch size: speculation pays less as the
        # batch grows, so it starts as a loser here and is only tried rarely.
        for arm in [*range(1, self.arms), 0]:
            if arm not in skip and rates[arm] is None and not self._lost_below(key, arm):
                return arm
        known = [arm for arm in range(self.arms) if rates[arm] is not None]
        current = self.choice.get(key)
        best = max(known, key=lambda arm: (rates[arm], -arm))
        if current in skip:
            return best  # the usual choice cannot run on this batch: the best that can
        if current is None or rates[best] > rates[current] * (1 + self.margin):
            if current is not None:
                log.info("speculation policy: new choice", extra={
                    "batch_bucket": key[0], "greedy": key[1], "arm": best,
                    "tokens_per_s": [None if r is None else round(r, 1) for r in rates]})
                self._try_after((*key, current), self.explore_every)
            self.choice[key] = current = best
            for arm in range(self.arms):
                if (*key, arm) not in self.countdown:
                    self._try_after((*key, arm), self.explore_every if arm in known
                                    else self.max_explore_every)
        due = None
        for arm in range(self.arms):
            if arm != current and arm not in skip and (*key, arm) in self.countdown:
                self.countdown[(*key, arm)] -= 1
                if self.countdown[(*key, arm)] <= 0 and due is None:
                    due = arm
        if due is None:
            return current
        slot = (*key, due)
        self._try_after(slot, min(max(2 * self.interval[slot], self._affordable(rates, due)),
                                  self.max_explore_every))
        return due

    def _lost_below(self, key: tuple[int, bool], arm: int, by: float = 0.7) -> bool:
        """Whether ``arm`` ran below ``by`` times the best arm at the nearest smaller batch
        size where it was measured."""
        if arm == 0:
            return False
        bucket = key[0] // 2
        while bucket >= 1:
            smaller = (bucket, key[1])
            mine = self.rate(smaller, arm)
            if mine is not None:
                rates = [self.rate(smaller, a) for a in range(self.arms)]
                return mine < by * max(r for r in rates if r is not None)
            bucket //= 2
        return False

    def _affordable(self, rates: list[float | None], arm: int) -> int:
        """Steps between tries of ``arm`` that keep their cost under ``explore_cost``."""
        best = max(r for r in rates if r is not None)
        rate = rates[arm]
        loss = best / rate - 1 if rate else float("inf")
        return int(min(self.max_explore_every, loss / self.explore_cost))

    def _try_after(self, slot: tuple[int, bool, int], steps: int) -> None:
        self.interval[slot] = self.countdown[slot] = steps

    def record(self, batch: int, greedy: bool, arm: int, seconds: float,
               per_sequence: dict[str, int] | None = None) -> None:
        """A step of ``arm`` on ``batch`` sequences took ``seconds``; ``per_sequence``: the
        tokens each speculating sequence emitted, if they measure the arm's drafts."""
        if seconds <= 0:
            return
        key = self._key(batch, greedy)
        _discount(self.times.setdefault((*key, arm), [0.0, 0.0]), seconds, self.smoothing)
        for seq, n in (per_sequence or {}).items():
            self.record_yield(greedy, arm, seq, n)
        current = self.choice.get(key)
        if current is not None and arm != current and (self.rate(key, arm) or 0) > \
                (self.rate(key, current) or 0):
            self._try_after((*key, arm), self.explore_every)  # it may have caught up

    def record_yield(self, greedy: bool, arm: int, sequence: str, tokens: int) -> None:
        """A step of ``arm`` emitted (or, for a shadow draft, would have emitted)
        ``tokens`` for ``sequence``."""
        if arm == 0:
            return
        _discount(self.yields.setdefault((greedy, arm), [0.0, 0.0]), tokens,
                  self.yield_smoothing)
        _discount(self.sequences.setdefault((sequence, arm), [0.0, 0.0]), tokens,
                  self.yield_smoothing)

    def forget(self, sequence: str) -> None:
        """Drop a finished sequence's own measurements."""
        for arm in range(1, self.arms):
            self.sequences.pop((sequence, arm), None)


def _discount(acc: list[float], value: float, smoothing: float) -> None:
    """Discounted running sums [value, count]: their ratio is a mean that forgets."""
    acc[0] = (1 - smoothing) * acc[0] + value
    acc[1] = (1 - smoothing) * acc[1] + 1


class Scheduler:
    def __init__(self, verifiers: list[str], speculators: list[str], *, eos_ids: list[int],
                 max_waiting: int = 64, spec_max_batch: int = 2,
                 expansion: list[int] | None = None, max_nodes: int = 0,
                 step_timeout_s: float = 60.0, speculate_timeout_s: float = 10.0,
                 prefill_token_budget: int = 4096, detokenize=None,
                 speculation: str = "adaptive") -> None:
        self.replicas = [self._replica(a) for a in verifiers]
        self.spec_channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS)
                              for a in speculators]
        self.spec_clients = [speculator_pb2_grpc.SpeculatorStub(c) for c in self.spec_channels]
        self.spec_down_until = [0.0] * len(speculators)
        self.eos_ids = set(eos_ids)
        self.max_waiting = max_waiting
        self.spec_max_batch = spec_max_batch
        self.modes = SPECULATION_CHOICES[speculation]
        self.policy = SpeculationPolicy(1 + len(self.modes)) if len(self.modes) > 1 else None
        # The verifier's model-free modes are measured on every step, not only when they
        # run: it drafts (without verifying) the largest of their trees for the next step,
        # and what the sequence then emits shows how each would have fared.
        self.shadow_arms = [(1 + i, m.max_nodes) for i, m in enumerate(self.modes)
                            if m.in_verifier and not m.head] if self.policy else []
        self.has_head = False  # every verifier has a draft head (Info, at start)
        self.shadow_nodes = max((n for _, n in self.shadow_arms), default=0)
        # Trees drafted during the last step's second half for the next step's first
        # micro-batch (overlap mode): sequence id -> (history length drafted for, node
        # budget, tree).
        self.prefetched: dict[str, tuple[int, int, object]] = {}
        self.expansion = expansion or []
        self.max_nodes = max_nodes
        self.step_timeout_s = step_timeout_s
        self.speculate_timeout_s = speculate_timeout_s
        self.prefill_token_budget = prefill_token_budget
        self.detokenize = detokenize
        self.waiting: list[GenRequest] = []
        self.running: list[GenRequest] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    @staticmethod
    def _replica(address: str) -> Replica:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return Replica(address, verifier_pb2_grpc.VerifierStub(channel), channel)

    async def start(self) -> dict:
        """Query every verifier's Info (they must be up); start the loop."""
        info = None
        for r in self.replicas:
            i = await r.rpc.Info(verifier_pb2.InfoRequest(), timeout=30)
            r.capacity = max(1, i.kv_capacity_tokens // max(1, i.max_context))
            r.max_tree_nodes, r.max_context = i.max_tree_nodes, i.max_context
            r.has_head = i.draft_head
            info = info or i
        self.has_head = all(r.has_head for r in self.replicas)
        await self._await_speculators()
        self.task = asyncio.create_task(self._loop())
        return {"vocab_size": info.vocab_size, "max_context": info.max_context,
                "model": info.model, "dtype": info.dtype}

    async def _await_speculators(self, timeout_s: float = 180.0) -> None:
        """Give starting speculators (loading SSMs, building the datastore on a first run)
        time to report SERVING; one that never does is failed over like a dead one."""

        async def serving(i: int, channel: grpc.aio.Channel) -> None:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                with contextlib.suppress(grpc.aio.AioRpcError):  # not listening yet
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                await asyncio.sleep(0.5)
            log.warning("speculator not serving; starting without it", extra={"speculator": i})

        await asyncio.gather(*(serving(i, c) for i, c in enumerate(self.spec_channels)))

    async def close(self) -> None:
        if self.task:
            self.task.cancel()
        for c in [r.channel for r in self.replicas] + self.spec_channels:
            await c.close()

    # --- admission --------------------------------------------------------------------

    def submit(self, req: GenRequest) -> None:
        max_context = min(r.max_context for r in self.replicas)
        if len(req.prompt_ids) + 1 > max_context:
            raise InvalidArgument("prompt", f"{len(req.prompt_ids)} tokens exceed the context "
                                  f"limit of {max_context - 1}")
        req.max_tokens = min(req.max_tokens, max_context - len(req.prompt_ids))
        if len(self.waiting) >= self.max_waiting:
            raise ResourceExhausted(f"{len(self.waiting)} requests already queued; retry later")
        self.waiting.append(req)
        self.wake.set()

    def cancel(self, req: GenRequest) -> None:
        req.cancelled = True
        self.wake.set()

    def _pick_replica(self, req: GenRequest) -> Replica | None:
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

    # --- the loop ---------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
            try:
                await self._drop_cancelled()
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

    async def _drop_cancelled(self) -> None:
        now = time.monotonic()
        for req in self.running + self.waiting:
            if req.deadline is not None and now > req.deadline and not req.cancelled:
                req.cancelled = True
                req.events.put_nowait(("error", DeadlineExceeded("the request's deadline "
                                                                 "passed")))
        for req in [r for r in self.running if r.cancelled]:
            await self._finish(req, "cancelled")
        self.waiting = [r for r in self.waiting if not r.cancelled]

    def _timeout(self, reqs: list[GenRequest]) -> float:
        """A hop's deadline: the step timeout, or sooner if a client's deadline is."""
        deadlines = [r.deadline for r in reqs if r.deadline is not None]
        if not deadlines:
            return self.step_timeout_s
        return max(0.05, min(self.step_timeout_s, min(deadlines) - time.monotonic()))

    async def _admit(self) -> None:
        """Prefill waiting requests, up to the step's prompt-token budget (the first one is
        always admitted, so a long prompt cannot starve)."""
        by_replica: dict[str, list[GenRequest]] = {}
        still, budget = [], self.prefill_token_budget
        for req in self.waiting:
            replica = self._pick_replica(req) if budget > 0 else None
            if replica is None:
                still.append(req)
                continue
            replica.live += 1
            req.replica = replica
            budget -= len(req.history)
            by_replica.setdefault(replica.address, []).append(req)
        self.waiting = still
        await asyncio.gather(*(self._prefill(reqs) for reqs in by_replica.values()))

    async def _prefill(self, reqs: list[GenRequest]) -> None:
        replica = reqs[0].replica
        items = [verifier_pb2.PrefillItem(sequence_id=r.id, token_ids=r.history,
                                          sampling=_sampling_proto(r.params),
                                          session_id=r.session_id) for r in reqs]
        try:
            out = await replica.rpc.Prefill(verifier_pb2.PrefillRequest(items=items),
                                             timeout=self._timeout(reqs))
        except grpc.aio.AioRpcError as exc:
            for r in reqs:
                replica.live -= 1
                r.replica = None
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.waiting.extend(reqs)  # retry when capacity frees up
                return
            if self._client_deadline_passed(exc, reqs):
                # Not a dead replica: it may have prefilled them, so free them there; the
                # expired requests end on the next loop, the others are prefilled again.
                await self._release(replica, [r.id for r in reqs])
                self.waiting[:0] = reqs
                return
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                self._mark_down(replica, exc)
                self.waiting.extend(reqs)
                return
            for r in reqs:
                self._fail(r, exc)
            return
        for r, res in zip(reqs, out.results, strict=True):
            r.reused_tokens = res.reused_tokens
            if not r.first_token_at:
                r.first_token_at = time.monotonic()
            self.running.append(r)
            await self._emit(r, [res.token], _logprobs(res), step=False)

    def _mark_down(self, replica: Replica, exc: Exception) -> None:
        if not replica.healthy:
            return  # already failed over, and probed until it is back
        log.warning("verifier replica failed; failing over",
                    extra={"replica": replica.address, "error": str(exc)[:200]})
        replica.healthy = False
        asyncio.get_running_loop().call_later(5.0, self._probe, replica)

    def _probe(self, replica: Replica) -> None:
        async def check() -> None:
            try:
                await replica.rpc.Info(verifier_pb2.InfoRequest(), timeout=2)
                replica.healthy, replica.live = True, 0
                log.info("verifier replica back", extra={"replica": replica.address})
            except grpc.aio.AioRpcError:
                asyncio.get_running_loop().call_later(5.0, self._probe, replica)

        asyncio.ensure_future(check())

    def _node_budget(self, req: GenRequest, budget: int, mode: SpeculationMode) -> int:
        """The most nodes ``req``'s tree may have this step."""
        if mode.max_nodes:
            budget = min(budget, mode.max_nodes)
        replica = req.replica
        return min(self.max_nodes or replica.max_tree_nodes, replica.max_tree_nodes, budget,
                   replica.max_context - len(req.history) - 1)

    async def _speculate(self, reqs: list[GenRequest], budget: int,
                         mode: SpeculationMode) -> dict[str, object]:
        """Trees for the speculating requests, or {} if no speculator answers."""
        if not reqs:
            return {}
        now = time.monotonic()
        trees = {}
        for i, client in enumerate(self.spec_clients):
            if self.spec_down_until[i] > now:
                continue
            items = [speculator_pb2.SpeculateItem(
                sequence_id=r.id, context=r.history, sampling=_sampling_proto(r.params),
                tree=speculator_pb2.TreeConfig(
                    expansion=list(mode.expansion) or self.expansion,
                    max_nodes=self._node_budget(r, budget, mode)))
                for r in reqs]
            try:
                out = await client.Speculate(speculator_pb2.SpeculateRequest(items=items),
                                           timeout=min(self.speculate_timeout_s,
                                                       self._timeout(reqs)))
                trees = {res.sequence_id: res.tree for res in out.results}
                break
            except grpc.aio.AioRpcError as exc:
                log.warning("speculator failed; this step decodes without it",
                            extra={"speculator": i, "error": exc.code().name})
                self.spec_down_until[i] = now + 5.0
        for r in reqs:
            r.speculate_s += time.monotonic() - now
        return trees

    async def _step(self) -> None:
        started = time.monotonic()
        batch = list(self.running)
        before = {r.id: len(r.generated) for r in batch}
        greedy = all(r.params.greedy for r in batch)
        speculate = [r for r in batch if r.speculation
                     and r.replica.max_context - len(r.history) > 2]
        # Adaptive speculation: a larger batch amortises the LLM's weights over more
        # sequences, so each sequence gets a smaller tree, none past spec_max_batch; the
        # policy picks plain decoding or a mode by measured speed at this batch size.
        arm = 0
        if speculate and len(batch) <= self.spec_max_batch:
            if self.policy:  # not the arms that cannot run on this batch
                arm = self.policy.choose(len(batch), greedy, skip=frozenset(
                    1 + i for i, m in enumerate(self.modes)
                    if not self._can_run(m, len(speculate))),
                    sequences=tuple(r.id for r in speculate))
            elif self._can_run(self.modes[0], len(speculate)):
                arm = 1
        if arm == 0:
            speculate = []
        mode = self.modes[arm - 1] if arm else None
        budget = max(4, 64 // max(1, len(speculate)))
        if mode is not None and mode.overlap and len(speculate) >= 2:
            drafted = await self._overlapped_step(batch, speculate, budget, mode)
        else:
            self.prefetched.clear()
            shadow = len(batch) <= self.spec_max_batch
            if mode is not None and mode.in_verifier:
                await self._verify_all(batch, {}, {r.id: self._node_budget(r, budget, mode)
                                                   for r in speculate}, shadow, mode.head)
                drafted = True
            else:
                trees = await self._speculate(speculate, budget, mode) if speculate else {}
                await self._verify_all(batch, trees, shadow=shadow)
                drafted = bool(trees)
        if self.policy and len(batch) <= self.spec_max_batch \
                and any(r.speculation for r in batch):
            # The verifier's model-free modes are measured by their shadow drafts.
            measured = drafted and (not mode.in_verifier or mode.head)
            self.policy.record(len(batch), greedy, arm if drafted else 0,
                               time.monotonic() - started,
                               {r.id: len(r.generated) - before[r.id] for r in speculate}
                               if measured else None)

    def _can_run(self, mode: SpeculationMode, speculating: int) -> bool:
        if mode.overlap and speculating < 2:
            return False
        if mode.in_verifier:
            return self.has_head or not mode.head
        return bool(self.spec_clients)

    async def _overlapped_step(self, batch: list[GenRequest], speculate: list[GenRequest],
                               budget: int, mode: SpeculationMode) -> bool:
        """One step in two micro-batches, drafting for one while the other is verified:
        verify(first) ‖ draft(second), then verify(second) ‖ draft(first's next step). The
        first micro-batch's trees were drafted during the previous step when still current.
        Returns whether any tree was verified."""
        first, second = speculate[: len(speculate) // 2], speculate[len(speculate) // 2:]
        drafting = {r.id for r in speculate}
        trees = {}
        for r in first:  # drafted ahead for this history, within this step's budget
            hit = self.prefetched.get(r.id)
            if hit is not None and hit[0] == len(r.history) and hit[1] <= budget:
                trees[r.id] = hit[2]
        trees |= await self._speculate([r for r in first if r.id not in trees], budget, mode)
        plain = [r for r in batch if r.id not in drafting]
        _, second_trees = await _together(self._verify_all(first + plain, trees),
                                          self._speculate(second, budget, mode))
        ahead = [r for r in first if r in self.running and r.replica is not None
                 and r.replica.max_context - len(r.history) > 2]
        _, next_trees = await _together(self._verify_all(second, second_trees),
                                        self._speculate(ahead, budget, mode))
        self.prefetched = {r.id: (len(r.history), budget, next_trees[r.id]) for r in ahead
                           if r.id in next_trees}
        return bool(trees or second_trees)

    async def _verify_all(self, reqs: list[GenRequest], trees: dict,
                          draft_nodes: dict[str, int] | None = None,
                          shadow: bool = False, head: bool = False) -> None:
        """Verify (or decode) ``reqs`` that are still running, each verifier replica's
        share in one call, replicas in parallel. ``trees``: the speculator's, by sequence
        id; ``draft_nodes``: node budgets of sequences the verifier drafts for itself (with
        its draft head too, if ``head``); ``shadow``: ask for the shadow drafts that measure
        the model-free modes."""
        by_replica: dict[str, list[GenRequest]] = {}
        for r in reqs:
            if r not in self.running or r.replica is None:
                continue
            by_replica.setdefault(r.replica.address, []).append(r)
        await _together(*(self._verify(rs, trees, draft_nodes or {}, shadow, head)
                          for rs in by_replica.values()))

    def _requeue(self, req: GenRequest) -> None:
        """Take a running sequence off its replica; it is prefilled again (on another
        replica if that one is down) from the router's history, first in the queue."""
        if req in self.running:
            self.running.remove(req)
        if req.replica is not None:
            req.replica.live -= 1
            req.replica = None
        self.waiting.insert(0, req)

    async def _verify(self, reqs: list[GenRequest], trees: dict,
                      draft_nodes: dict[str, int], shadow: bool = False,
                      head: bool = False) -> None:
        replica = reqs[0].replica
        with_tree = [r for r in reqs if r.id in trees or draft_nodes.get(r.id, 0) > 0]
        plain = [r for r in reqs if r not in with_tree]
        shadow_nodes = {r.id: min(self.shadow_nodes, replica.max_tree_nodes)
                        if shadow and r.speculation else 0 for r in reqs}
        calls = []
        if with_tree:
            calls.append(replica.rpc.Verify(verifier_pb2.VerifyRequest(items=[
                verifier_pb2.VerifyItem(sequence_id=r.id, root_token=r.generated[-1],
                                        tree=trees.get(r.id),
                                        draft_nodes=draft_nodes.get(r.id, 0),
                                        draft_head=head and draft_nodes.get(r.id, 0) > 0,
                                        shadow_nodes=shadow_nodes[r.id])
                for r in with_tree]), timeout=self._timeout(with_tree)))
        if plain:
            calls.append(replica.rpc.Decode(verifier_pb2.DecodeRequest(items=[
                verifier_pb2.DecodeItem(sequence_id=r.id, root_token=r.generated[-1],
                                        shadow_nodes=shadow_nodes[r.id])
                for r in plain]), timeout=self._timeout(plain)))
        started = time.monotonic()
        try:
            results = await _together(*calls)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                for r in reqs:  # e.g. a tree the verifier rejects: fail loudly, not silently
                    self._fail(r, exc)
                return
            if self._client_deadline_passed(exc, reqs):
                # A client's deadline, not a dead replica: the expired requests end on the
                # next loop; the others restart from the router's history (the verifier
                # may or may not have applied the step).
                for r in reqs:
                    self._requeue(r)
                await self._release(replica, [r.id for r in reqs])
                return
            self._mark_down(replica, exc)
            for r in reqs:  # re-prefill elsewhere from the router's history
                self._requeue(r)
            return
        outs = []
        if with_tree:
            for r, res in zip(with_tree, results[0].results, strict=True):
                outs.append((r, list(res.tokens), list(res.logprobs), res))
                r.drafted += res.drafted_nodes
                r.speculative_steps += res.drafted_nodes > 0
        for r in reqs:
            r.verify_s += time.monotonic() - started
        if plain:
            outs += [(r, [res.token], _logprobs(res), res)
                     for r, res in zip(plain, results[-1].results, strict=True)]
        for r, tokens, logprobs, res in outs:
            await self._emit(r, tokens, logprobs, step=True)
            if res.HasField("next_draft") and not r.finish_reason:
                r.shadows.append((len(r.generated), list(res.next_draft.tokens),
                                  list(res.next_draft.parents)))

    async def _emit(self, req: GenRequest, tokens: list[int],
                    logprobs: list[common_pb2.TokenLogprob], step: bool) -> None:
        """Append a step's tokens (cut at max_tokens, a stop token or the token that
        completes a stop string) and their logprobs (empty unless asked for); ``step``: an
        LLM step (Verify/Decode), not the prefill's first token."""
        if req.params.logprobs is not None and len(logprobs) != len(tokens):
            self._fail(req, ServiceError(f"the verifier returned {len(logprobs)} logprobs "
                                         f"for {len(tokens)} tokens"))
            return
        start = len(req.generated)
        for tok in tokens:
            if len(req.generated) >= req.max_tokens:
                break
            req.generated.append(tok)
            if tok in self.eos_ids or tok in req.stop_ids:
                req.finish_reason = "stop"
                break
        if req.stop and self.detokenize:  # also when an EOS ended the step's tokens
            self._cut_at_stop_string(req, start)
        new = req.generated[start:]
        req.logprobs += [logprob_from_proto(lp) for lp in logprobs[: len(new)]]
        if not req.finish_reason and len(req.generated) >= req.max_tokens:
            req.finish_reason = "length"
        if step:
            req.accepted_per_step.append(len(new))
            self._measure_shadows(req)
        await req.events.put(("tokens", new))
        if req.finish_reason:
            await self._finish(req, req.finish_reason)

    def _measure_shadows(self, req: GenRequest) -> None:
        """Each shadow draft whose outcome the emitted tokens now settle: how many tokens a
        step of each model-free mode (its first nodes of the tree) would have emitted."""
        pending = []
        for start, tokens, parents in req.shadows:
            emitted = req.generated[start:]
            outcomes = [(arm, _accepted(tokens[:n], parents[:n], emitted))
                        for arm, n in self.shadow_arms]
            if all(settled for _, (_, settled) in outcomes):
                for arm, (accepted, _) in outcomes:
                    self.policy.record_yield(req.params.greedy, arm, req.id, 1 + accepted)
            else:
                pending.append((start, tokens, parents))
        req.shadows = pending

    def _cut_at_stop_string(self, req: GenRequest, start: int) -> None:
        """If the text now holds a stop string, keep only the tokens up to the one that
        completed it (a step may accept several past it), as one-token steps would."""
        if not any(s in self.detokenize(req.generated) for s in req.stop):
            return
        for end in range(start + 1, len(req.generated) + 1):
            if any(s in self.detokenize(req.generated[:end]) for s in req.stop):
                del req.generated[end:]
                req.finish_reason = "stop"
                return

    async def _finish(self, req: GenRequest, reason: str) -> None:
        if self.policy:
            self.policy.forget(req.id)
        if req in self.running:
            self.running.remove(req)
        replica = req.replica
        if replica is not None:
            replica.live -= 1
            req.replica = None
            try:
                await replica.rpc.Release(verifier_pb2.ReleaseRequest(
                    sequence_ids=[req.id], keep_for_session=bool(req.session_id)), timeout=10)
            except grpc.aio.AioRpcError as exc:
                log.info("release failed", extra={"error": exc.code().name})
        req.finish_reason = reason
        await req.events.put(("done", reason))

    def _fail(self, req: GenRequest, exc: Exception) -> None:
        if self.policy:
            self.policy.forget(req.id)
        req.error = exc
        if req in self.running:
            self.running.remove(req)
        if req.replica is not None:
            req.replica.live -= 1
            asyncio.ensure_future(self._release(req.replica, [req.id]))  # its KV slot
            req.replica = None
        req.events.put_nowait(("error", exc))

    @staticmethod
    def _client_deadline_passed(exc: grpc.aio.AioRpcError, reqs: list[GenRequest]) -> bool:
        """A hop that ran out of time because a client's deadline passed, not because the
        replica is dead."""
        return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and any(
            r.deadline is not None and r.deadline <= time.monotonic() for r in reqs)

    @staticmethod
    async def _release(replica: Replica, ids: list[str]) -> None:
        """Best effort: free sequences on a replica (gone already is fine)."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await replica.rpc.Release(verifier_pb2.ReleaseRequest(sequence_ids=ids),
                                      timeout=10)


class DeadlineExceeded(ServiceError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


async def _together(*steps):
    """Run ``steps`` concurrently; if one raises, the others still finish before the
    error propagates, so no verification outlives the step that started it."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _accepted(tokens: list[int], parents: list[int], emitted: list[int]) -> tuple[int, bool]:
    """How many of a tree's tokens the emitted ones follow from the root, and whether that
    is settled (a mismatch or a leaf reached, not the end of what was emitted so far).
    Exact for greedy steps; for sampled ones it is the same event in distribution, since
    a one-hot draft is accepted exactly when the LLM's sample is its token."""
    node, depth = ROOT, 0
    while True:
        children = [j for j, p in enumerate(parents) if p == node]
        if not children:
            return depth, True
        if depth == len(emitted):
            return depth, False
        node = next((j for j in children if tokens[j] == emitted[depth]), None)
        if node is None:
            return depth, True
        depth += 1


def _logprobs(result) -> list[common_pb2.TokenLogprob]:
    """A Prefill or Decode result's one logprob, if it carries one."""
    return [result.logprob] if result.HasField("logprob") else []


def _sampling_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, min_p=p.min_p)
    if p.top_p != 1.0:
        msg.top_p = p.top_p
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg

"""The router's Prometheus metrics: it sees every request and every accepted token, so its
``/metrics`` alone answers an operator's questions about load, latency and speculation.

Request metrics as vLLM names them (prefix ``specinfer:``), the ``spec_decode_*`` counters
with vLLM's meaning (a *draft* is one speculative step of one sequence; its draft tokens
are the tree's nodes; accepted tokens are the step's tokens past the first, the LLM's own,
so a step that emitted n tokens accepted n - 1 at positions 0..n-2), and what only
specinfer has: steps per speculation mode, Speculate and Step latency by tree
size, replica health and failovers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.router.request import GenRequest
from specinfer.metrics import (
    LATENCY_BUCKETS,
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    new_registry,
    tree_size,
)

LABEL = ["model_name"]
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tools")
FINISH_REASONS = ("stop", "length", "abort", "error")
ROLES = ("verifier", "speculator")


class RouterMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        self.model_name = model_name
        r, m = self.registry, {"model_name": model_name}

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, LABEL + list(labels), registry=r)

        def histogram(name: str, doc: str, buckets, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(PREFIX + name, doc, LABEL + list(labels), buckets=buckets,
                             registry=r)

        self._running = Gauge(PREFIX + "num_requests_running",
                              "Requests in the running batch (prefilled, generating).",
                              LABEL, registry=r)
        self._waiting = Gauge(PREFIX + "num_requests_waiting",
                              "Requests queued for verifier capacity.", LABEL, registry=r)
        self.ttft = histogram("time_to_first_token_seconds",
                              "From arrival to the first generated token.",
                              LATENCY_BUCKETS).labels(**m)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time per generated token after the first: a step's wall time "
                             "shared among the tokens it emitted.", LATENCY_BUCKETS).labels(**m)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "From arrival to the last token.",
                             REQUEST_LATENCY_BUCKETS).labels(**m)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "From arrival to admission into the batch.",
                                    REQUEST_LATENCY_BUCKETS).labels(**m)
        self.request_prompt = histogram("request_prompt_tokens",
                                        "Prompt tokens per finished request.",
                                        TOKEN_BUCKETS).labels(**m)
        self.request_generation = histogram("request_generation_tokens",
                                            "Generated tokens per finished request.",
                                            TOKEN_BUCKETS).labels(**m)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests "
                                     "(cached or not).").labels(**m)
        # vLLM's prefix-cache counters (tokens), summed over the verifiers' prefills.
        self.prefix_queries = counter("prefix_cache_queries", "Tokens prefilled, looked up "
                                      "in the verifiers' prefix caches.").labels(**m)
        self.prefix_hits = counter("prefix_cache_hits", "Tokens prefilled whose KV a "
                                   "verifier's prefix cache held.").labels(**m)
        self.generation_tokens = counter("generation_tokens",
                                         "Tokens generated (streamed to clients).").labels(**m)
        self.success = counter("request_success", "Requests ended, by finish reason (stop, "
                               "length, abort: cancelled or timed out; error).",
                               ("finished_reason",))
        self.drafts = counter("spec_decode_num_drafts",
                              "Speculative steps (one per sequence and step with a tree)."
                              ).labels(**m)
        self.draft_tokens = counter("spec_decode_num_draft_tokens",
                                    "Draft tokens verified (the trees' nodes).").labels(**m)
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted (emitted past a step's first "
                                       "token).").labels(**m)
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each depth of the tree "
                                        "(position 0: the first draft token).", ("position",))
        self.steps = counter("steps", "Decoding steps of the running batch, by speculation "
                             "mode (plain: no tree).", ("mode",))
        self.draft_latency = histogram("draft_latency_seconds",
                                       "Speculate calls to the speculator pool, by node "
                                       "budget per tree (an upper bound).", LATENCY_BUCKETS,
                                       ("tree_nodes",))
        self.verify_latency = histogram("verify_latency_seconds",
                                        "Prefill and Step calls, by nodes per tree (an upper "
                                        "bound; 0: every row plain).", LATENCY_BUCKETS,
                                        ("rpc", "tree_nodes"))
        self.replica_healthy = Gauge(PREFIX + "replica_healthy",
                                     "1 while the router routes to a replica, 0 while it is "
                                     "failed over.", LABEL + ["role", "replica"], registry=r)
        self.failovers = counter("failovers", "Replicas failed over (sequences moved or a "
                                 "step decoded without drafts).", ("role",))
        self.structured = counter("structured_requests", "Requests with structured output, "
                                  "by constraint kind (json_schema, json_object, regex, "
                                  "choice, grammar, tools).", ("kind",))
        # Series with known label values exist at 0 from the start: a panel or an alert
        # over them reads 0, not "no data", before the first event.
        for kind in STRUCTURED_KINDS:
            self.structured.labels(kind=kind, **m)
        for reason in FINISH_REASONS:
            self.success.labels(finished_reason=reason, **m)
        for role in ROLES:
            self.failovers.labels(role=role, **m)
        self._labels = m

    def known_modes(self, names: list[str]) -> None:
        """The speculation modes' step counters, at 0 until their first step."""
        for name in ("plain", *names):
            self.steps.labels(mode=name, **self._labels)

    def watch_queues(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        """Read the batch and queue sizes at scrape time."""
        self._running.labels(**self._labels).set_function(running)
        self._waiting.labels(**self._labels).set_function(waiting)

    # --- a request's life ----------------------------------------------------------

    def admitted(self, req: GenRequest, now: float) -> None:
        """Its first admission (a failover's re-prefill is not a new one)."""
        if not req.admitted_at:
            req.admitted_at = now
            self.queue_time.observe(now - req.created)
            if req.constraint is not None:
                kind = "tools" if req.tools is not None else req.constraint.kind
                self.structured.labels(kind=kind, **self._labels).inc()

    def prefilled(self, req: GenRequest, tokens: int, cached: int) -> None:
        """A prefill of ``tokens`` tokens (a re-prefill's too), ``cached`` of them reused."""
        self.prefix_queries.inc(tokens)
        self.prefix_hits.inc(cached)
        if not req.prompt_counted:
            req.prompt_counted = True
            self.prompt_tokens.inc(len(req.prompt_ids))

    def emitted(self, req: GenRequest, new: int, now: float) -> None:
        """``new`` tokens went to the client at ``now``."""
        if not new:
            return
        self.generation_tokens.inc(new)
        if not req.last_token_at:
            self.ttft.observe(now - req.created)
        else:
            gap = (now - req.last_token_at) / new
            for _ in range(new):
                self.itl.observe(gap)
        req.last_token_at = now

    def speculated(self, drafted_nodes: int, new: int) -> None:
        """A step of one sequence that verified a tree of ``drafted_nodes`` and emitted
        ``new`` tokens."""
        if drafted_nodes <= 0:
            return
        self.drafts.inc()
        self.draft_tokens.inc(drafted_nodes)
        if new > 1:
            self.accepted_tokens.inc(new - 1)
            for position in range(new - 1):
                self.accepted_per_pos.labels(position=str(position), **self._labels).inc()

    def ended(self, req: GenRequest, reason: str, now: float) -> None:
        """``reason``: stop, length, abort or error."""
        self.success.labels(finished_reason=reason, **self._labels).inc()
        if reason in ("stop", "length"):
            self.e2e.observe(now - req.created)
            self.request_prompt.observe(len(req.prompt_ids))
            self.request_generation.observe(len(req.generated))

    # --- steps and replicas --------------------------------------------------------

    def step(self, mode: str) -> None:
        self.steps.labels(mode=mode, **self._labels).inc()

    def drafted(self, nodes_per_tree: int, seconds: float) -> None:
        self.draft_latency.labels(tree_nodes=tree_size(nodes_per_tree),
                                  **self._labels).observe(seconds)

    def verified(self, rpc: str, nodes_per_tree: int, seconds: float) -> None:
        self.verify_latency.labels(rpc=rpc, tree_nodes=tree_size(nodes_per_tree),
                                   **self._labels).observe(seconds)

    def replica(self, role: str, address: str, healthy: Callable[[], bool]) -> None:
        """Report a replica's health, read at scrape time."""
        self.replica_healthy.labels(role=role, replica=address, **self._labels).set_function(
            lambda: float(healthy()))

    def forget_replica(self, role: str, address: str) -> None:
        """A replica discovery no longer lists: its series goes."""
        with contextlib.suppress(KeyError):
            self.replica_healthy.remove(*self._labels.values(), role, address)

    def failover(self, role: str) -> None:
        self.failovers.labels(role=role, **self._labels).inc()

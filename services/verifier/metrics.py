"""The verifier's Prometheus metrics (``--metrics-port``): its KV cache, and what each call
costs the engine. Request and speculation metrics are the router's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specinfer.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, PREFIX, new_registry, tree_size


class VerifierMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r, labels = self.registry, ["model_name"]
        self._m = {"model_name": model_name}
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc",
                              "KV cache usage: tokens live sequences hold over capacity; "
                              "1 = full (kept prefixes give way: "
                              "kv_cache_cached_tokens).", labels, registry=r).labels(**self._m)
        self.kv_capacity = Gauge(PREFIX + "kv_cache_capacity_tokens",
                                 "Tokens the KV cache holds (slots x max context).", labels,
                                 registry=r).labels(**self._m)
        self.kv_cached = Gauge(PREFIX + "kv_cache_cached_tokens",
                               "Tokens of finished sequences' KV kept for prefix reuse.",
                               labels, registry=r).labels(**self._m)
        self.sequences = Gauge(PREFIX + "verifier_sequences",
                               "Sequences in the KV cache: live, or finished and kept for "
                               "their prefix (cached).", labels + ["state"], registry=r)
        for state in ("live", "cached"):  # at 0 from the start, not from the first call
            self.sequences.labels(state=state, **self._m)
        # vLLM's prefix-cache counters (tokens), with our prefix.
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", labels,
                                      registry=r).labels(**self._m)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits",
                                   "Prompt tokens whose KV the prefix cache held (reused, "
                                   "not computed).", labels, registry=r).labels(**self._m)
        self.step_seconds = Histogram(PREFIX + "verifier_step_seconds",
                                      "Engine time per call (after queueing), by RPC and "
                                      "nodes per tree (an upper bound; 0: none).",
                                      labels + ["rpc", "tree_nodes"], buckets=LATENCY_BUCKETS,
                                      registry=r)
        self.batch_size = Histogram(PREFIX + "verifier_batch_size",
                                    "Sequences per call.", labels + ["rpc"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.prefill_tokens = Counter(PREFIX + "verifier_prefill_tokens",
                                      "Tokens prefilled (cached prefixes not counted).",
                                      labels, registry=r).labels(**self._m)
        self.riding_tokens = Counter(PREFIX + "verifier_prefill_riding_tokens",
                                     "Of the tokens prefilled, those computed inside Step "
                                     "calls' forward passes (chunked prefill beside the "
                                     "running batch).", labels, registry=r).labels(**self._m)
        self.tree_nodes = Counter(PREFIX + "verifier_tree_nodes",
                                  "Draft tree nodes verified.", labels,
                                  registry=r).labels(**self._m)

        self.forward_passes = Counter(PREFIX + "verifier_forward_passes",
                                      "LLM forward passes of Step calls: one per call, whatever "
                                      "mix of plain, tree and self-drafted rows it carries.",
                                      labels, registry=r).labels(**self._m)

        # Structured output.
        self.grammar_compile_seconds = Histogram(
            PREFIX + "grammar_compile_seconds", "Compiling a constraint's grammar for the "
            "LLM's tokenizer (cache misses only), by constraint kind.", labels + ["kind"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.grammar_cache = Counter(PREFIX + "grammar_cache_lookups",
                                     "Compiled-grammar cache lookups, by result (hit, miss).",
                                     labels + ["result"], registry=r)
        for result in ("hit", "miss"):
            self.grammar_cache.labels(result=result, **self._m)
        self.grammar_mask_seconds = Counter(
            PREFIX + "grammar_mask_seconds", "Engine time spent on constraints in Step calls: "
            "masks of every tree row, cutting trees, forced tokens.", labels,
            registry=r).labels(**self._m)
        self.grammar_forced_tokens = Counter(
            PREFIX + "grammar_forced_tokens", "Tree nodes drafted because the grammar forced "
            "their token (JSON punctuation, a schema's keys).", labels,
            registry=r).labels(**self._m)

    _grammar_seen = (0.0, 0)

    def grammar(self, kind: str, compile_s: float) -> None:
        """A constraint looked up (``compile_s`` 0: found in the cache)."""
        self.grammar_cache.labels(result="miss" if compile_s else "hit", **self._m).inc()
        if compile_s:
            self.grammar_compile_seconds.labels(kind=kind, **self._m).observe(compile_s)

    def grammar_step(self, seconds_total: float, forced_total: int) -> None:
        """The engine's running totals of constraint time and forced tokens."""
        self.grammar_mask_seconds.inc(max(seconds_total - self._grammar_seen[0], 0.0))
        self.grammar_forced_tokens.inc(max(forced_total - self._grammar_seen[1], 0))
        self._grammar_seen = (seconds_total, forced_total)

    def call(self, rpc: str, batch: int, nodes_per_tree: int, seconds: float) -> None:
        self.step_seconds.labels(rpc=rpc, tree_nodes=tree_size(nodes_per_tree),
                                 **self._m).observe(seconds)
        self.batch_size.labels(rpc=rpc, **self._m).observe(batch)

    def cache(self, engine) -> None:
        """The KV cache's state, read on the engine's thread after a call."""
        capacity = engine.capacity_tokens
        self.kv_capacity.set(capacity)
        self.kv_usage.set(engine.used_tokens / capacity if capacity else 0.0)
        self.kv_cached.set(engine.cached_tokens)
        self.sequences.labels(state="live", **self._m).set(len(engine.sequences))
        self.sequences.labels(state="cached", **self._m).set(len(engine.kept))

"""The speculator's Prometheus metrics (``--metrics-port``): what drafting costs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from specinfer.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, PREFIX, new_registry, tree_size


class SpeculatorMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r, labels = self.registry, ["model_name"]
        self._m = {"model_name": model_name}
        self.seconds = Histogram(PREFIX + "speculate_seconds",
                                 "Drafting time per Speculate call (after queueing), by node "
                                 "budget per tree (an upper bound).",
                                 labels + ["tree_nodes"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(PREFIX + "speculate_batch_size", "Sequences per call.",
                                    labels, buckets=BATCH_BUCKETS,
                                    registry=r).labels(**self._m)
        self.tree_nodes = Counter(PREFIX + "speculator_tree_nodes", "Draft tree nodes made.",
                                  labels, registry=r).labels(**self._m)

    def call(self, batch: int, budget: int, nodes: int, seconds: float) -> None:
        self.seconds.labels(tree_nodes=tree_size(budget), **self._m).observe(seconds)
        self.batch_size.observe(batch)
        self.tree_nodes.inc(nodes)

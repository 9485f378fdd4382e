"""Speculation modes and the adaptive policy that picks one per step (no torch: the CLI
takes the mode names from here).

A mode says who drafts a step's trees and their shape. Mode 0 is plain decoding, so the
index the policy chooses is an index into the router's tuple of modes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


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
    draft_head: bool = False
    # With in_verifier: the speculator's SSM trees too (half the node budget), merged in
    # the verifier with its own drafts under the one budget (VerifyItem tree + draft_nodes).
    merge_speculator: bool = False
    # Mode 0: no tree at all, one token per step.
    plain: bool = False


PLAIN = SpeculationMode("plain", plain=True)
TREE = SpeculationMode("tree")
TREE_OVERLAP = SpeculationMode("tree-overlap", overlap=True)


# What adaptive speculation chooses from besides plain decoding (mode 0). Model-free drafts
# (corpus datastore, prompt lookup) cost almost nothing to make, so small trees of them can
# pay where SSM trees do not (a CPU verifier, a large batch); which mode wins is measured.
LOOKUP = SpeculationMode("lookup-2", max_nodes=2, in_verifier=True)
# The verifier's draft head: its tree (the verifier's --head-tree, at most --head-nodes)
# and model-free drafts, in one tree of up to 16 nodes (bench/speculator.py measures it;
# 8 nodes accept fewer and, on a 2-core CPU, ran no faster); no Speculate call either.
HEAD = SpeculationMode("head", max_nodes=16, in_verifier=True, draft_head=True)
# The paper's merge: the SSM pool's trees, the draft head's and the model-free drafts in one
# tree of up to 24 nodes, verified at once (each source's q recorded for MSS). The SSMs
# draft only their own trees (the verifier adds the model-free drafts), each 3 children
# then one more level: the best of the shapes bench/speculator.py --merged-shapes tried.
MERGED = SpeculationMode("merged", expansion=(3, 1), max_nodes=24, in_verifier=True,
                         draft_head=True, merge_speculator=True)
# The same with two micro-batches: the speculator drafts one's SSM trees while the verifier
# runs the other's step (batches of 2 or more sequences).
MERGED_OVERLAP = dataclasses.replace(MERGED, name="merged-overlap", overlap=True)
ADAPTIVE_MODES = (
    PLAIN,
    LOOKUP,
    SpeculationMode("lookup-6", max_nodes=6, in_verifier=True),
    HEAD,
    TREE,
    TREE_OVERLAP,
    MERGED,
    MERGED_OVERLAP,
)
# --speculation: adaptive, or fixed modes: on each step the first of them that can run on
# the batch (plain decoding where none can).
SPECULATION_CHOICES = {"adaptive": ADAPTIVE_MODES, "always": (PLAIN, TREE),
                       "overlap": (PLAIN, TREE_OVERLAP), "lookup": (PLAIN, LOOKUP),
                       "head": (PLAIN, HEAD), "merged": (PLAIN, MERGED_OVERLAP, MERGED)}


class SpeculationPolicy:
    """Decides, step by step, which speculation mode pays for the current batch.

    Speculation trades extra work (drafting, a wider verification) for more tokens per LLM
    step; whether that wins depends on the batch, on how well the drafts fit the text and
    on the hardware. So it is measured, not assumed. A mode's rate (mode 0 is plain
    decoding) on a batch is the tokens it is expected to emit over the seconds its step is
    expected to take:

    - seconds per step are measured per mode, batch-size bucket (1, 2, 3-4, 5-8, ...) and
      kind of batch (all greedy or not): they depend on the batch and the hardware, and
      vary little from step to step;
    - tokens per sequence and step are exactly 1 for plain decoding; for a mode they
      depend on how well its drafts fit the text, not on the batch, so they are measured
      per mode over all batch sizes (with a longer memory: they are noisy) and per
      sequence, each sequence's own count shrunk toward the pooled one by
      ``prior_steps``: drafts that keep missing one sequence stop costing it, drafts that
      fit another keep it speculating.

    Each step takes the fastest mode (a challenger must beat the current choice by
    ``margin``, so noise does not flip it back and forth). Each other mode is tried every
    ``explore_every`` steps, so an estimate that went stale is corrected; a mode whose
    tries keep losing is tried half as often each time, down to one step in
    ``max_explore_every``, and a mode that loses by far is tried less often from the
    start: a try of a mode at a fraction f of the best rate costs about 1/f - 1 steps,
    kept under ``explore_cost`` of the steps between tries."""

    def __init__(self, modes: int = 2, explore_every: int = 16, smoothing: float = 0.03,
                 max_explore_every: int = 128, margin: float = 0.03,
                 explore_cost: float = 0.01, yield_smoothing: float = 0.02,
                 prior_steps: float = 2.0) -> None:
        self.mode_count = modes
        self.explore_cost = explore_cost
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.smoothing = smoothing
        self.yield_smoothing = yield_smoothing
        self.prior_steps = prior_steps
        self.margin = margin
        # (bucket, greedy, mode) -> discounted [seconds, steps]
        self.times: dict[tuple[int, bool, int], list[float]] = {}
        # (greedy, mode) -> discounted [tokens per sequence, steps]; (sequence id, mode) ->
        # the sequence's own [tokens, steps]
        self.yields: dict[tuple[bool, int], list[float]] = {}
        self.sequences: dict[tuple[str, int], list[float]] = {}
        self.choice: dict[tuple[int, bool], int] = {}
        # (bucket, greedy, mode) -> steps between tries of a non-chosen mode, steps to go
        self.interval: dict[tuple[int, bool, int], int] = {}
        self.countdown: dict[tuple[int, bool, int], int] = {}

    @staticmethod
    def _key(batch: int, greedy: bool) -> tuple[int, bool]:
        return 1 << max(0, batch - 1).bit_length(), greedy

    def tokens_per_step(self, greedy: bool, mode: int, sequence: str | None = None) -> float:
        """Expected tokens one sequence emits in a step of ``mode``."""
        if mode == 0:
            return 1.0
        pooled = self.yields.get((greedy, mode))
        prior = pooled[0] / pooled[1] if pooled else 1.0
        own = self.sequences.get((sequence, mode)) if sequence is not None else None
        if own is None:
            return prior
        return (own[0] + self.prior_steps * prior) / (own[1] + self.prior_steps)

    def rate(self, key: tuple[int, bool], mode: int, batch: int | None = None,
             sequences: tuple[str, ...] = ()) -> float | None:
        """Expected tokens per second of ``mode`` on a batch of ``batch`` sequences
        (default: the bucket's size) of which ``sequences`` speculate; None if not measured yet."""
        t = self.times.get((*key, mode))
        if t is None or (mode and (key[1], mode) not in self.yields):
            return None
        batch = batch or key[0]
        tokens = (batch - len(sequences)) * self.tokens_per_step(key[1], mode) + sum(
            self.tokens_per_step(key[1], mode, seq) for seq in sequences)
        return tokens / (t[0] / t[1])

    def choose(self, batch: int, greedy: bool, skip: frozenset[int] = frozenset(),
               sequences: tuple[str, ...] = ()) -> int:
        """The mode for this step; modes in ``skip`` cannot run on this batch (e.g.
        micro-batch overlap on one sequence) and are neither chosen nor counted down. ``sequences``:
        the ids of the batch's speculating sequences, for their own measured yields."""
        key = self._key(batch, greedy)
        rates = [None if mode in skip else self.rate(key, mode, batch, sequences)
                 for mode in range(self.mode_count)]
        # Measure every mode first (the speculating ones, then plain decoding), except one
        # that lost by far at the next smaller batch size: speculation pays less as the
        # batch grows, so it starts as a loser here and is only tried rarely.
        for mode in [*range(1, self.mode_count), 0]:
            if mode not in skip and rates[mode] is None and not self._lost_below(key, mode):
                return mode
        known = [mode for mode in range(self.mode_count) if rates[mode] is not None]
        current = self.choice.get(key)
        best = max(known, key=lambda mode: (rates[mode], -mode))
        if current in skip:
            return best  # the usual choice cannot run on this batch: the best that can
        if current is None or rates[best] > rates[current] * (1 + self.margin):
            if current is not None:
                log.info("speculation policy: new choice", extra={
                    "batch_bucket": key[0], "greedy": key[1], "mode": best,
                    "tokens_per_s": [None if r is None else round(r, 1) for r in rates]})
                self._try_after((*key, current), self.explore_every)
            self.choice[key] = current = best
            for mode in range(self.mode_count):
                if (*key, mode) not in self.countdown:
                    self._try_after((*key, mode), self.explore_every if mode in known
                                    else self.max_explore_every)
        due = None
        for mode in range(self.mode_count):
            if mode != current and mode not in skip and (*key, mode) in self.countdown:
                self.countdown[(*key, mode)] -= 1
                if self.countdown[(*key, mode)] <= 0 and due is None:
                    due = mode
        if due is None:
            return current
        slot = (*key, due)
        self._try_after(slot, min(max(2 * self.interval[slot], self._affordable(rates, due)),
                                  self.max_explore_every))
        return due

    def _lost_below(self, key: tuple[int, bool], mode: int, by: float = 0.7) -> bool:
        """Whether ``mode`` ran below ``by`` times the best mode at the nearest smaller
        batch size where it was measured."""
        if mode == 0:
            return False
        bucket = key[0] // 2
        while bucket >= 1:
            smaller = (bucket, key[1])
            mine = self.rate(smaller, mode)
            if mine is not None:
                rates = [self.rate(smaller, a) for a in range(self.mode_count)]
                return mine < by * max(r for r in rates if r is not None)
            bucket //= 2
        return False

    def _affordable(self, rates: list[float | None], mode: int) -> int:
        """Steps between tries of ``mode`` that keep their cost under ``explore_cost``."""
        best = max(r for r in rates if r is not None)
        rate = rates[mode]
        loss = best / rate - 1 if rate else float("inf")
        return int(min(self.max_explore_every, loss / self.explore_cost))

    def _try_after(self, slot: tuple[int, bool, int], steps: int) -> None:
        self.interval[slot] = self.countdown[slot] = steps

    def record(self, batch: int, greedy: bool, mode: int, seconds: float,
               per_sequence: dict[str, int] | None = None) -> None:
        """A step of ``mode`` on ``batch`` sequences took ``seconds``; ``per_sequence``: the
        tokens each speculating sequence emitted, if they measure the mode's drafts."""
        if seconds <= 0:
            return
        key = self._key(batch, greedy)
        _discount(self.times.setdefault((*key, mode), [0.0, 0.0]), seconds, self.smoothing)
        for seq, n in (per_sequence or {}).items():
            self.record_yield(greedy, mode, seq, n)
        current = self.choice.get(key)
        if current is not None and mode != current and (self.rate(key, mode) or 0) > \
                (self.rate(key, current) or 0):
            self._try_after((*key, mode), self.explore_every)  # it may have caught up

    def record_yield(self, greedy: bool, mode: int, sequence: str, tokens: int) -> None:
        """A step of ``mode`` emitted (or, for a shadow draft, would have emitted)
        ``tokens`` for ``sequence``."""
        if mode == 0:
            return
        _discount(self.yields.setdefault((greedy, mode), [0.0, 0.0]), tokens,
                  self.yield_smoothing)
        _discount(self.sequences.setdefault((sequence, mode), [0.0, 0.0]), tokens,
                  self.yield_smoothing)

    def forget(self, sequence: str) -> None:
        """Drop a finished sequence's own measurements."""
        for mode in range(1, self.mode_count):
            self.sequences.pop((sequence, mode), None)


def _discount(acc: list[float], value: float, smoothing: float) -> None:
    """Discounted running sums [value, count]: their ratio is a mean that forgets."""
    acc[0] = (1 - smoothing) * acc[0] + value
    acc[1] = (1 - smoothing) * acc[1] + 1

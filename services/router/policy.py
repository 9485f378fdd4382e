"""Speculation modes, the per-sequence plans they turn into, and the adaptive policy that
picks one per step (no torch: the CLI takes the mode names from here).

A mode says who drafts a step's trees and their shape; ``plan_step`` turns it into each
sequence's ``StepPlan`` (the speculator's tree, the verifier's own draft sources and node
budget), which is all the scheduler and the verifier read. Mode 0 is plain decoding, so
the index the policy chooses is an index into the router's tuple of modes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from specinfer.plans import DraftPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeculationMode:
    """One way to speculate, as data: who drafts a step's trees, and their shape. A mode
    with neither the speculator nor own sources is plain decoding."""

    name: str
    # The speculator pool's SSM trees (a Speculate call per step).
    speculator: bool = False
    # The verifier's own draft sources, by name (Info.draft_sources), in merge order.
    sources: tuple[str, ...] = ()
    expansion: tuple[int, ...] = ()  # the SSM trees' shape; () = the router's --expansion
    max_nodes: int = 0  # the tree's node cap; 0 = the router's per-step budget
    # Split the speculating batch into two micro-batches and draft for one while the other
    # steps: pays where drafting and verifying do not share the same cores.
    overlap: bool = False
    # Measured without running it: every step drafts (unverified) the tree of its sources
    # for the next step, and what the sequence then emits shows how it would have fared.
    # For cheap deterministic sources only.
    shadow: bool = False

    @property
    def plain(self) -> bool:
        return not self.speculator and not self.sources


NO_DRAFTS = DraftPlan()


@dataclass(frozen=True)
class SpeculatorPlan:
    """The tree a sequence asks of the speculator pool this step."""

    max_nodes: int
    expansion: tuple[int, ...] = ()  # () = the speculator's default
    # Its SSMs' drafts only: the verifier adds the model-free drafts itself.
    ssm_only: bool = False


@dataclass(frozen=True)
class StepPlan:
    """One sequence's part of a step: its mode (an index into the router's modes), the
    speculator's tree if any, the verifier's own drafts, and the shadow draft that measures
    the shadow modes."""

    mode: int = 0
    speculator: SpeculatorPlan | None = None
    draft: DraftPlan = NO_DRAFTS
    shadow: DraftPlan = NO_DRAFTS

    @property
    def speculates(self) -> bool:
        return self.speculator is not None or bool(self.draft)


PLAIN = SpeculationMode("plain")
TREE = SpeculationMode("tree", speculator=True)
TREE_OVERLAP = SpeculationMode("tree-overlap", speculator=True, overlap=True)


# What adaptive speculation chooses from besides plain decoding (mode 0). Model-free drafts
# (corpus datastore, prompt lookup) cost almost nothing to make, so small trees of them can
# pay where SSM trees do not (a CPU verifier, a large batch); which mode wins is measured.
LOOKUP = SpeculationMode("lookup-2", sources=("model_free",), max_nodes=2, shadow=True)
# The verifier's draft head: its tree (the verifier's --head-tree, at most --head-nodes)
# and model-free drafts, in one tree of up to 16 nodes (bench/speculator.py measures it;
# 8 nodes accept fewer and, on a 2-core CPU, ran no faster); no Speculate call either.
HEAD = SpeculationMode("head", sources=("head", "model_free"), max_nodes=16)
# The paper's merge: the SSM pool's trees (half the budget), the draft head's and the
# model-free drafts in one tree of up to 24 nodes, verified at once (each source's q
# recorded for MSS). The SSMs draft only their own trees (the verifier adds the model-free
# drafts), each 3 children then one more level: the best of the shapes
# bench/speculator.py --merged-shapes tried.
MERGED = SpeculationMode("merged", speculator=True, sources=("head", "model_free"),
                         expansion=(3, 1), max_nodes=24)
# The same with two micro-batches: the speculator drafts one's SSM trees while the verifier
# runs the other's step (batches of 2 or more sequences).
MERGED_OVERLAP = dataclasses.replace(MERGED, name="merged-overlap", overlap=True)
ADAPTIVE_MODES = (
    PLAIN,
    LOOKUP,
    SpeculationMode("lookup-6", sources=("model_free",), max_nodes=6, shadow=True),
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


@dataclass(frozen=True)
class Budgets:
    """What bounds a sequence's tree: the router's flags and its replica's limits."""

    expansion: tuple[int, ...] = ()  # --expansion; () = the speculator's default
    max_nodes: int = 0  # --max-nodes; 0 = each replica's max_tree_nodes
    # A larger batch amortises the LLM's weights over more sequences, so each speculating
    # sequence gets a smaller tree: this many nodes over their count, at least ``min_nodes``.
    step_nodes: int = 64
    min_nodes: int = 4


def plan_step(mode: SpeculationMode, index: int, speculating: int, room: int,
              budgets: Budgets, shadow: DraftPlan = NO_DRAFTS) -> StepPlan:
    """A speculating sequence's plan under ``mode`` (``index`` in the router's modes), in a
    step where ``speculating`` sequences speculate; ``room``: the most nodes its replica
    and context allow. ``shadow``: the shadow draft asked of it."""
    if mode.plain or room <= 0:
        return StepPlan(shadow=shadow)
    nodes = min(room, max(budgets.min_nodes, budgets.step_nodes // max(1, speculating)))
    if budgets.max_nodes:
        nodes = min(nodes, budgets.max_nodes)
    if mode.max_nodes:
        nodes = min(nodes, mode.max_nodes)
    speculator = None
    if mode.speculator:
        # Merged with own sources: the SSMs draft half of a capped budget, the verifier's
        # sources fill the rest (the sampled drafts are never cut, so they must fit).
        ssm_nodes = min(nodes, mode.max_nodes // 2) if mode.sources and mode.max_nodes \
            else nodes
        speculator = SpeculatorPlan(ssm_nodes, mode.expansion or budgets.expansion,
                                    ssm_only="model_free" in mode.sources)
    return StepPlan(index, speculator, DraftPlan(mode.sources, nodes) if mode.sources
                    else NO_DRAFTS, shadow)


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

    def current(self, batch: int, greedy: bool) -> int | None:
        """The mode chosen for batches of ``batch`` sequences, if one has been."""
        return self.choice.get(self._key(batch, greedy))

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
             sequences: tuple[str, ...] = (), at_most: int | None = None) -> float | None:
        """Expected tokens per second of ``mode`` on a batch of ``batch`` sequences
        (default: the bucket's size) of which ``sequences`` speculate; with ``at_most``,
        only that many of them do (those it expects most of, ``best``) and every other
        sequence decodes plain. None if not measured yet."""
        t = self.times.get((*key, mode))
        if t is None or (mode and (key[1], mode) not in self.yields):
            return None
        batch = batch or key[0]
        if at_most is not None and mode:
            best = self.best(key[1], mode, sequences, at_most)
            tokens = batch - len(best) + sum(self.tokens_per_step(key[1], mode, seq)
                                             for seq in best)
        else:
            tokens = (batch - len(sequences)) * self.tokens_per_step(key[1], mode) + sum(
                self.tokens_per_step(key[1], mode, seq) for seq in sequences)
        return tokens / (t[0] / t[1])

    def best(self, greedy: bool, mode: int, sequences: tuple[str, ...],
             at_most: int) -> tuple[str, ...]:
        """The ``at_most`` of ``sequences`` whose drafts ``mode`` expects most tokens from
        (ties: in the order given)."""
        ranked = sorted(sequences, key=lambda seq: -self.tokens_per_step(greedy, mode, seq))
        return tuple(ranked[:at_most])

    def choose(self, batch: int, greedy: bool, skip: frozenset[int] = frozenset(),
               sequences: tuple[str, ...] = (), at_most: int | None = None) -> int:
        """The mode for this step; modes in ``skip`` cannot run on this batch (e.g.
        micro-batch overlap on one sequence) and are neither chosen nor counted down.
        ``sequences``: the ids of the batch's sequences that may speculate, for their own
        measured yields; ``at_most``: only that many of them may (``best``), the rest of
        the batch decodes plain in the same step."""
        key = self._key(batch, greedy)
        rates = [None if mode in skip else self.rate(key, mode, batch, sequences, at_most)
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
               per_sequence: dict[str, int] | None = None, disturbed: bool = False) -> None:
        """A step of ``mode`` on ``batch`` sequences took ``seconds``; ``per_sequence``: the
        tokens each speculating sequence emitted, if they measure the mode's drafts.
        ``disturbed``: the step shared its verifier with a prefill, so its time is the
        prefill's too; it counts only for a mode not timed yet at this batch size (a
        prefill chunk costs up to a few steps here: one such time in a rarely tried mode's
        estimate swung the choice at 4 and 8 streams)."""
        if seconds <= 0:
            return
        key = self._key(batch, greedy)
        if not disturbed or (*key, mode) not in self.times:
            _discount(self.times.setdefault((*key, mode), [0.0, 0.0]), seconds,
                      self.smoothing)
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

"""What each sequence does in a step: the speculation mode the policy picks for the batch
(or the one fixed mode), which sequences speculate under it, and each one's ``StepPlan``
(``policy.plan_step``) with its shadow draft. The scheduler asks once per iteration and
sees only the plans."""

from __future__ import annotations

from services.router.config import RouterConfig
from services.router.drafting import SpeculatorPool
from services.router.policy import (
    NO_DRAFTS,
    SPECULATION_CHOICES,
    Budgets,
    SpeculationMode,
    SpeculationPolicy,
    StepPlan,
    plan_step,
)
from services.router.replicas import ReplicaSet
from services.router.request import GenRequest
from specinfer.plans import DraftPlan

Plans = dict[str, StepPlan]  # by sequence id


class StepPlanner:
    def __init__(self, config: RouterConfig, replicas: ReplicaSet, speculators: SpeculatorPool,
                 budgets: Budgets | None = None) -> None:
        self.replicas, self.speculators = replicas, speculators
        # Speculating sequences per step, at most: in a larger batch the policy speculates
        # for those whose drafts pay best (or none) and the rest decode plain, in the same
        # forward pass.
        self.spec_max_batch = config.spec_max_batch
        self.budgets = budgets or Budgets()
        self.modes = SPECULATION_CHOICES[config.speculation]  # mode 0: plain decoding
        adaptive = config.speculation == "adaptive"
        self.policy = SpeculationPolicy(len(self.modes)) if adaptive else None
        # Shadow modes are measured on every step, not only when they run: the verifier
        # drafts (without verifying) the largest of their trees for the next step, and
        # what the sequence then emits shows how each would have fared.
        self.shadow_modes = [(i, m.max_nodes) for i, m in enumerate(self.modes)
                             if m.shadow] if adaptive else []
        self.shadow = DraftPlan(
            tuple(dict.fromkeys(s for i, _ in self.shadow_modes for s in self.modes[i].sources)),
            max((n for _, n in self.shadow_modes), default=0))
        self.turn = 0  # steps planned: whose turn it is to draft a shadow tree

    def plan(self, batch: list[GenRequest], greedy: bool) -> tuple[int, Plans]:
        """This step's mode and every sequence's plan in it. Sequences that asked for
        speculation and have room for a tree may speculate; in a batch of more than
        ``spec_max_batch`` sequences only that many do (the adaptive policy picks those
        whose drafts pay best under each mode, and whether any speculating pays at all),
        the rest decode plain in the same forward pass."""
        candidates = [r for r in batch if r.speculation and self.room(r) > 1]
        # Shadow drafts cost the verifier ~2-4% of a step at 8 sequences (measured on this
        # CPU): past spec_max_batch, only that many sequences draft one a step, in turn.
        self.turn += 1
        measured = batch if len(batch) <= self.spec_max_batch else [
            batch[(self.turn * self.spec_max_batch + k) % len(batch)]
            for k in range(self.spec_max_batch)]
        shadow = {r.id: NO_DRAFTS for r in batch} | {r.id: self._shadow(r) for r in measured}
        index, chosen = self._choose(batch, candidates, greedy)
        mode = self.modes[index]
        plans = {r.id: StepPlan(shadow=shadow[r.id]) for r in batch}
        for r in chosen:
            plans[r.id] = plan_step(mode, index, len(chosen), self.room(r), self.budgets,
                                    shadow[r.id])
        return index, plans

    def _choose(self, batch: list[GenRequest], candidates: list[GenRequest],
                greedy: bool) -> tuple[int, list[GenRequest]]:
        """The index of this step's mode and the sequences that speculate under it: the
        policy's choice by measured speed at this batch size, or the one forced mode where
        it can run (fixed modes speculate only up to ``spec_max_batch`` sequences)."""
        if not candidates:
            return 0, []
        if self.policy is None:
            if len(batch) > self.spec_max_batch:
                return 0, []
            index = next((i for i, m in enumerate(self.modes) if i
                          and self._can_run(m, len(candidates))), 0)
            return index, candidates if index else []
        ids = tuple(r.id for r in candidates)
        # Past spec_max_batch sequences: at most that many speculate (partial steps).
        partial = len(batch) > self.spec_max_batch
        at_most = min(len(ids), self.spec_max_batch)
        if at_most == 0:
            return 0, []
        skip = {i for i, m in enumerate(self.modes) if not self._can_run(m, at_most)}
        if partial:
            # Only the mode that wins where every sequence speculates (spec_max_batch of
            # them) is weighed against plain decoding: trying every mode on large batches
            # cost more than it found (8 streams, 2-core CPU: 0.82x off, exploring).
            best = self.policy.current(self.spec_max_batch, greedy)
            skip |= {i for i in range(1, len(self.modes)) if i != best}
        index = self.policy.choose(len(batch), greedy, frozenset(skip), ids,
                                   at_most if partial else None)
        if not index:
            return 0, []
        chosen = set(self.policy.best(greedy, index, ids, at_most) if partial else ids)
        return index, [r for r in candidates if r.id in chosen]

    def _can_run(self, mode: SpeculationMode, speculating: int) -> bool:
        if mode.plain:
            return True
        if mode.overlap and speculating < 2:
            return False
        if mode.speculator and not self.speculators.available():
            return False
        return self.replicas.have_sources(mode.sources)

    def room(self, req: GenRequest) -> int:
        """The most tree nodes ``req``'s replica and context allow this step."""
        replica = req.replica
        return min(replica.max_tree_nodes, replica.max_context - len(req.history) - 1)

    def _shadow(self, req: GenRequest) -> DraftPlan:
        """The shadow draft asked of ``req`` (for the shadow modes' measurements)."""
        if not self.shadow or not req.speculation or req.replica is None \
                or not req.replica.has_sources(self.shadow.sources):
            return NO_DRAFTS
        return DraftPlan(self.shadow.sources,
                         min(self.shadow.max_nodes, req.replica.max_tree_nodes))


"""A verifier's own drafts for one step of one sequence, as the router plans them and the
verifier carries them out (no torch: the router imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftPlan:
    """Which of the verifier's own sources draft a sequence's tree this step, and the most
    nodes of that tree (with the tree sent along, if any). No sources: no own drafts."""

    sources: tuple[str, ...] = ()
    max_nodes: int = 0

    def __bool__(self) -> bool:
        return bool(self.sources) and self.max_nodes > 0

"""Every draft source behind one interface: ``Drafter.propose(requests) -> trees``.

Sources: small speculative models (``ssm.SSMDrafter``), the draft head on the LLM's own
features (``head.FeatureDrafter``), and the model-free drafts (``model_free.ModelFreeDrafter``:
prompt lookup in the sequence's own tokens and the corpus n-gram datastore). A drafter
proposes one token tree per request, below the request's last context token, within the
request's node budget; each node records which source drafted it and the proposal it was
drawn from (a one-hot for deterministic drafts), as stochastic verification needs.

A source the verifier runs on the sequences it holds (``OwnSource``) is named in a step's
``DraftPlan``: adding one is a module here that implements it, built by the verifier's
engine factory, and its name in the router's speculation modes; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specinfer.plans import DraftPlan
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree

__all__ = ["DraftPlan", "DraftRequest", "Drafter", "OwnSource"]


@dataclass
class DraftRequest:
    sequence_id: str
    context: list[int]  # prompt + generated; the last token is the tree's root
    expansion: list[int] = field(default_factory=lambda: [1, 1, 3, 1, 1, 1, 1, 1])
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    dynamic: bool = False  # greedy requests only
    max_nodes: int = 64
    # A feature drafter's input (``head.FeatureDrafter``): the LLM's features of every
    # context token but the root, ``[len(context) - 1, hidden]``.
    features: torch.Tensor | None = None
    # A constrained sequence's grammar, for drafting at the source: the tokens it allows
    # after the root and a path of draft tokens below it (a bitmask row over LLM token ids,
    # ``specinfer.grammar.token_bits`` reads it). A drafter that takes it drafts only
    # allowed tokens and records its distribution masked and renormalised as their
    # proposals; None: no constraint.
    allowed: Callable[[Sequence[int]], torch.Tensor] | None = None


class Drafter(Protocol):
    """A draft source. ``source``: the id its drafts carry in the trees it proposes."""

    source: int

    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        """One tree per request, in order, each of at most ``request.max_nodes`` nodes."""
        ...

    def forget(self, sequence_id: str) -> None:
        """Drop whatever is kept for a finished sequence (a cache, nothing else)."""
        ...


@runtime_checkable
class OwnSource(Protocol):
    """A draft source the verifier runs itself, on the history (and, if ``needs_features``,
    the LLM's features) of a sequence it holds. ``sampled``: its drafts are samples with
    their proposals (stochastic sequences draw from the sequence's generator), so a tree
    is never cut below what it proposed; otherwise they are deterministic (one-hot
    proposals), merged best first and cut to the budget."""

    name: str
    sampled: bool
    needs_features: bool

    @property
    def sources(self) -> int:
        """How many draft-source ids its trees use (from ``source`` on)."""
        ...

    def bind(self, source: int, vocab_size: int) -> None:
        """Number its drafts from ``source``; drop drafts outside the LLM's vocabulary."""
        ...

    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        ...

    def forget(self, sequence_id: str) -> None:
        ...

    # A source with ``needs_features`` also has ``feature_buffer(length) -> Tensor``: room
    # for that many tokens' features, in the format it reads them.

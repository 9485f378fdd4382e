"""Model-free drafts: the corpus datastore and prompt lookup, merged into one tree.

These drafts need no model and cost microseconds, so they are made wherever the token
history already is: in the speculator beside the SSMs, and in the verifier itself (a Step
plan's ``model_free`` source), which spares the router a Speculate call, and the
history's transfer, on every step of the model-free speculation modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from specinfer.drafting import DraftRequest
from specinfer.drafting.datastore import NgramDatastore
from specinfer.drafting.prompt_lookup import prompt_lookup_tree
from specinfer.tree import TokenTree, merge_trees


@dataclass
class ModelFreeDrafter:
    # As the verifier's own source (``specinfer.drafting.OwnSource``).
    name: ClassVar[str] = "model_free"
    sampled: ClassVar[bool] = False
    needs_features: ClassVar[bool] = False

    datastore: NgramDatastore | None = None
    prompt_lookup: bool = True  # in the sequence's own tokens
    prompt_lookup_depth: int = 6
    prompt_lookup_branches: int = 2
    datastore_depth: int = 3
    source: int = 0  # draft source ids: prompt lookup's, then the datastore's
    vocab_size: int | None = None  # datastore drafts outside it are dropped

    @property
    def prompt_lookup_source(self) -> int:
        return self.source

    @property
    def datastore_source(self) -> int:
        return self.source + (1 if self.prompt_lookup else 0)

    @property
    def sources(self) -> int:
        return (1 if self.prompt_lookup else 0) + (1 if self.datastore is not None else 0)

    def bind(self, source: int, vocab_size: int) -> None:
        self.source, self.vocab_size = source, vocab_size

    def propose(self, requests: list[DraftRequest]) -> list[TokenTree]:
        return [self.tree(r.context, r.max_nodes) for r in requests]

    def forget(self, sequence_id: str) -> None:
        """Nothing is kept per sequence: the drafts come from the context alone."""

    def tree(self, context: Sequence[int], max_nodes: int) -> TokenTree:
        """One tree of at most ``max_nodes`` nodes below ``context``'s last token. The
        drafts are deterministic (one-hot proposals), so the merged tree may be cut to the
        budget; the best evidence comes first: the corpus datastore, then prompt lookup."""
        if max_nodes <= 0:
            return TokenTree()
        trees = []
        if self.datastore is not None:
            trees.append(self.datastore.tree(context, self.datastore_depth,
                                             self.datastore_source, self.vocab_size))
        if self.prompt_lookup:
            trees.append(prompt_lookup_tree(context, self.prompt_lookup_depth,
                                            branches=self.prompt_lookup_branches,
                                            source=self.prompt_lookup_source,
                                            max_nodes=max_nodes))
        return merge_trees(trees, max_nodes=max_nodes)

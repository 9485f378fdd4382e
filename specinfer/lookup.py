"""Model-free drafting: the corpus datastore and prompt lookup, merged into one tree.

These drafts need no model and cost microseconds, so they are made wherever the token
history already is: in the speculator beside the SSMs, and in the verifier itself
(``VerifyItem.draft_nodes``), which spares the router a Speculate call, and the history's
transfer, on every step of the model-free speculation modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specinfer.datastore import NgramDatastore
from specinfer.ngram import ngram_tree
from specinfer.tree import TokenTree, merge_trees


@dataclass
class LookupDrafter:
    datastore: NgramDatastore | None = None
    ngram: bool = True  # prompt lookup in the sequence's own tokens
    ngram_depth: int = 6
    ngram_branches: int = 2
    datastore_depth: int = 3
    first_source: int = 0  # draft source ids: prompt lookup's, then the datastore's

    @property
    def ngram_source(self) -> int:
        return self.first_source

    @property
    def datastore_source(self) -> int:
        return self.first_source + (1 if self.ngram else 0)

    @property
    def sources(self) -> int:
        return (1 if self.ngram else 0) + (1 if self.datastore is not None else 0)

    def tree(self, context: Sequence[int], max_nodes: int,
             vocab_size: int | None = None) -> TokenTree:
        """One tree of at most ``max_nodes`` nodes below ``context``'s last token. The
        drafts are deterministic (one-hot proposals), so the merged tree may be cut to the
        budget; the best evidence comes first: the corpus datastore, then prompt lookup."""
        if max_nodes <= 0:
            return TokenTree()
        trees = []
        if self.datastore is not None:
            trees.append(self.datastore.tree(context, self.datastore_depth,
                                             self.datastore_source, vocab_size))
        if self.ngram:
            trees.append(ngram_tree(context, self.ngram_depth, branches=self.ngram_branches,
                                    source=self.ngram_source, max_nodes=max_nodes))
        return merge_trees(trees, max_nodes=max_nodes)

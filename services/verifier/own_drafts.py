"""The trees a verifier drafts itself, for Verify items that ask for them (``draft_nodes``)
instead of sending one: model-free drafts from the sequence's own tokens, the draft head's
tree on the LLM's features, and the merge of those with a tree the router sent (the
speculator's SSM trees in the merged mode)."""

from __future__ import annotations

import dataclasses

from services.verifier.sequence import EngineConfig, SequenceState
from specinfer.drafting import DraftRequest
from specinfer.drafting.head import FeatureDrafter
from specinfer.drafting.model_free import ModelFreeDrafter
from specinfer.tree import TokenTree, merge_trees


class OwnDrafts:
    """``model_free`` (sources numbered from its own ``source``), then the draft ``head``
    (the next source number), then a sent tree's sources after both: distinct sources,
    as MSS needs."""

    def __init__(self, model_free: ModelFreeDrafter | None, head: FeatureDrafter | None,
                 vocab_size: int, config: EngineConfig) -> None:
        self.model_free = dataclasses.replace(model_free or ModelFreeDrafter(),
                                              vocab_size=vocab_size)
        self.head = head
        if head is not None:
            head.source = self.model_free.source + self.model_free.sources
        self.config = config

    def merged_tree(self, seq: SequenceState, nodes: int, head: TokenTree | None,
                    sent: TokenTree) -> TokenTree:
        """The verifier's own drafts for a step, at most ``nodes`` nodes: the draft head's
        tree, then the tree the router sent (the speculator's, its sources numbered after
        the verifier's own), then model-free drafts in what room is left. Sampled drafts
        come first and are never cut (cutting one but keeping a later sample of the same
        source would bias MSS); only the one-hot model-free drafts are."""
        # The head drafted at most nodes - len(sent): the sampled drafts all fit.
        sampled = merge_trees([t for t in (head, self.after_own_sources(sent))
                               if t is not None and len(t)])
        return merge_trees([sampled, self.model_free_tree(seq, nodes)], max_nodes=nodes)

    def after_own_sources(self, tree: TokenTree) -> TokenTree:
        """``tree`` with its draft sources renumbered after the verifier's own (model-free,
        then the draft head): a merged tree's sources must be distinct for MSS."""
        if not len(tree):
            return tree
        base = self.model_free.source + self.model_free.sources + (self.head is not None)
        out = TokenTree()
        for tok, parent, drafts in zip(tree.tokens, tree.parents, tree.drafts, strict=True):
            out.add(parent, tok, [dataclasses.replace(d, source=d.source + base)
                                  for d in drafts])
        return out

    def head_trees(self, seqs: list[SequenceState], budgets: list[int],
                   draft_head: list[bool]) -> dict[int, TokenTree]:
        """The draft head's trees (one batched call), by item index."""
        rows = [i for i, (n, h) in enumerate(zip(budgets, draft_head, strict=True)) if n > 0 and h]
        if not rows:
            return {}
        cfg = self.config
        requests = [DraftRequest(seqs[i].id, seqs[i].tokens, list(cfg.head_expansion),
                                 seqs[i].params, seqs[i].generator, cfg.head_dynamic,
                                 min(budgets[i], cfg.head_nodes),
                                 seqs[i].features[: seqs[i].cached])
                    for i in rows]
        return dict(zip(rows, self.head.propose(requests), strict=True))

    def model_free_tree(self, seq: SequenceState, nodes: int) -> TokenTree:
        """The model-free tree of at most ``nodes`` nodes below the sequence's last token,
        reused if drafted already for these tokens: a smaller budget takes its first nodes
        (the drafts are merged best first, so that is the smaller budget's tree)."""
        kept = seq.model_free_draft
        if kept is not None and kept[0] == len(seq.tokens) and nodes <= kept[1]:
            return merge_trees([kept[2]], max_nodes=nodes)
        tree = self.model_free.tree(seq.tokens, nodes)
        seq.model_free_draft = (len(seq.tokens), nodes, tree)
        return tree

"""The trees a verifier drafts itself, by each Step item's plan: its own draft sources
(``specinfer.drafting.OwnSource``: the model-free drafts, the draft head on the LLM's
features, ...) merged with the tree the router sent (the speculator's), within the plan's
node budget. The engine knows sources only by this interface: a new one is a module in
``specinfer/drafting/`` that the engine factory builds, and its name in a plan."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.verifier.sequence import SequenceState
from specinfer.drafting import DraftPlan, DraftRequest, OwnSource
from specinfer.errors import InvalidArgument
from specinfer.tree import TokenTree, merge_trees, renumber_sources


class OwnDrafts:
    """The verifier's sources, each given distinct draft-source ids in the order listed
    (MSS needs every draft's source distinct); a sent tree's sources are numbered after
    them all."""

    def __init__(self, sources: Sequence[OwnSource], vocab_size: int) -> None:
        self.by_name: dict[str, OwnSource] = {}
        first = 0
        for source in sources:
            if source.name in self.by_name:
                raise ValueError(f"two draft sources named {source.name!r}")
            source.bind(first, vocab_size)
            first += source.sources
            self.by_name[source.name] = source
        self.sent_base = first  # a sent tree's sources start here

    @property
    def needs_features(self) -> bool:
        """Whether a source reads the LLM's features (the engine then keeps them)."""
        return any(s.needs_features for s in self.by_name.values())

    def feature_buffer(self, length: int) -> torch.Tensor:
        """Room for ``length`` tokens' features, as the sources that read them keep them."""
        return next(s for s in self.by_name.values() if s.needs_features).feature_buffer(length)

    def describe(self) -> list[tuple[str, bool]]:
        """(name, sampled) of each source, for Info."""
        return [(s.name, s.sampled) for s in self.by_name.values()]

    def check(self, field: str, plan: DraftPlan, shadow: bool = False) -> None:
        """Refuse a plan naming a source this verifier lacks (or, for a shadow draft, a
        sampled one: those are drawn from the sequence's generator, which only a verified
        step may advance)."""
        for name in plan.sources:
            source = self.by_name.get(name)
            if source is None:
                raise InvalidArgument(f"{field}.sources", f"no draft source {name!r} here "
                                      f"(Info.draft_sources: {sorted(self.by_name)})")
            if shadow and source.sampled:
                raise InvalidArgument(f"{field}.sources", f"{name!r} is sampled: a shadow "
                                      "draft takes deterministic sources only")

    def trees(self, seqs: list[SequenceState], plans: list[DraftPlan], budgets: list[int],
              sent: list[TokenTree]) -> list[TokenTree]:
        """Each item's tree for this step, at most ``budgets[i]`` nodes: its plan's sampled
        sources' trees (in plan order, each in the room the ones before and the sent tree
        leave), then the sent tree (sources renumbered after the verifier's own), then its
        deterministic sources' drafts in what room is left. Sampled drafts are never cut
        (cutting one but keeping a later sample of the same source would bias MSS); the
        deterministic ones are. An item with no own sources keeps its sent tree."""
        sampled: list[list[TokenTree]] = [[] for _ in seqs]
        room = [n - len(t) if p.sources else 0 for n, t, p in zip(budgets, sent, plans,
                                                                  strict=True)]
        names = dict.fromkeys(n for p in plans for n in p.sources)  # first-seen order
        for name in names:
            source = self.by_name[name]
            if not source.sampled:
                continue
            rows = [i for i, p in enumerate(plans) if name in p.sources and room[i] > 0]
            if not rows:
                continue
            drafted = source.propose([self._request(seqs[i], room[i], source) for i in rows])
            for i, tree in zip(rows, drafted, strict=True):
                sampled[i].append(tree)
                room[i] -= len(tree)
        out = []
        for i, (seq, plan, nodes) in enumerate(zip(seqs, plans, budgets, strict=True)):
            if not plan.sources:
                out.append(sent[i])
                continue
            kept = merge_trees([t for t in (*sampled[i], renumber_sources(sent[i],
                                                                           self.sent_base))
                                if len(t)])
            out.append(merge_trees([kept, self.deterministic_tree(seq, plan.sources, nodes)],
                                   max_nodes=nodes))
        return out

    def deterministic_tree(self, seq: SequenceState, names: Sequence[str],
                           nodes: int) -> TokenTree:
        """The merged tree of the deterministic sources among ``names``, at most ``nodes``
        nodes below the sequence's last token, reused if drafted already for these tokens
        (a shadow draft is the next step's tree): a smaller budget takes its first nodes
        (the drafts are merged best first, so that is the smaller budget's tree)."""
        names = tuple(n for n in names if not self.by_name[n].sampled)
        if not names or nodes <= 0:
            return TokenTree()
        kept = seq.kept_draft
        if kept is not None and kept[:2] == (names, len(seq.tokens)) and nodes <= kept[2]:
            return merge_trees([kept[3]], max_nodes=nodes)
        trees = [self.by_name[n].propose([self._request(seq, nodes, self.by_name[n])])[0]
                 for n in names]
        tree = merge_trees(trees, max_nodes=nodes)
        seq.kept_draft = (names, len(seq.tokens), nodes, tree)
        return tree

    @staticmethod
    def _request(seq: SequenceState, nodes: int, source: OwnSource) -> DraftRequest:
        return DraftRequest(seq.id, seq.tokens, params=seq.params, generator=seq.generator,
                            max_nodes=nodes, features=seq.features[: seq.cached]
                            if source.needs_features else None,
                            allowed=seq.grammar.allowed_words if seq.grammar else None)

    def forget(self, sequence_id: str) -> None:
        for source in self.by_name.values():
            source.forget(sequence_id)

"""Token trees: construction by expansion, merging, and the batched tree-attention layout.

A ``TokenTree`` holds the candidate continuations of one sequence. Its root is the
sequence's last verified token and is *not* a node; ``parents[i] == -1`` marks a child of
the root. Nodes are stored so that a parent precedes its children, and ``depth`` is 1 for a
child of the root. Each node carries the drafts that proposed it (docs/architecture.md,
"Token trees").

For the LLM's forward pass a batch of trees is laid out as queries ``[root, node 0, node 1,
...]`` per sequence (query 0 is the root): ``TreeBatch`` gives tokens, position ids
(``prefix_len + depth``) and the ancestor relation from which ``attention_mask`` builds the
topology-aware 4-D additive mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

ROOT = -1


@dataclass(frozen=True)
class Draft:
    """One proposal of a node's token: the source, its draw order at the parent, and the
    exact sparse distribution ``q`` the token was drawn from."""

    source: int
    rank: int
    q_ids: tuple[int, ...]
    q_probs: tuple[float, ...]

    def prob(self, token: int) -> float:
        for t, p in zip(self.q_ids, self.q_probs, strict=True):
            if t == token:
                return p
        return 0.0

    def dense(self, vocab_size: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        q = torch.zeros(vocab_size, dtype=dtype)
        q[list(self.q_ids)] = torch.tensor(self.q_probs, dtype=dtype)
        return q

    @staticmethod
    def one_hot(source: int, rank: int, token: int) -> Draft:
        return Draft(source, rank, (token,), (1.0,))


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    drafts: list[list[Draft]] = field(default_factory=list)
    # (parent, token) -> node; equal paths collapse into one node.
    _index: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, drafts: Sequence[Draft] = ()) -> int:
        """Add (or find) the child of ``parent`` with ``token``; append ``drafts`` to it."""
        if not (parent == ROOT or 0 <= parent < len(self.tokens)):
            raise ValueError(f"parent {parent} is not a node of the tree")
        key = (parent, int(token))
        node = self._index.get(key)
        if node is None:
            node = len(self.tokens)
            self._index[key] = node
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
            self.drafts.append([])
        self.drafts[node].extend(drafts)
        return node

    def child(self, parent: int, token: int) -> int | None:
        return self._index.get((parent, int(token)))

    def children(self, parent: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == parent]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def paths(self) -> set[tuple[int, ...]]:
        """Every root-to-node token path (prefixes included)."""
        return {tuple(self.path_tokens(i)) for i in range(len(self))}

    @classmethod
    def from_arrays(
        cls,
        tokens: Sequence[int],
        parents: Sequence[int],
        drafts: Sequence[Sequence[Draft]] | None = None,
    ) -> TokenTree:
        """Build from flat arrays, validating them (parents precede children, no
        duplicate (parent, token) pairs)."""
        if len(tokens) != len(parents):
            raise ValueError(f"tree.parents has {len(parents)} entries, tokens has {len(tokens)}")
        if drafts is not None and len(drafts) not in (0, len(tokens)):
            raise ValueError(f"tree.drafts has {len(drafts)} entries, tokens has {len(tokens)}")
        tree = cls()
        for i, (tok, par) in enumerate(zip(tokens, parents, strict=True)):
            if not (par == ROOT or 0 <= par < i):
                raise ValueError(f"tree.parents[{i}] = {par}: a parent must precede its child")
            if tree.child(par, tok) is not None:
                raise ValueError(f"tree node {i} duplicates token {tok} under parent {par}")
            tree.add(par, tok, drafts[i] if drafts else ())
        return tree

    @classmethod
    def chain(cls, tokens: Sequence[int], source: int = 0) -> TokenTree:
        """A sequence-shaped tree (one deterministic draft per node)."""
        tree, node = cls(), ROOT
        for tok in tokens:
            node = tree.add(node, tok, [Draft.one_hot(source, 0, tok)])
        return tree

    def ancestors(self) -> torch.Tensor:
        """``[n, n]`` bool: ``a[i, j]`` iff node j is node i or one of its ancestors."""
        n = len(self)
        anc = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p != ROOT:
                anc[i] |= anc[p]  # parents precede children, so row p is complete
        return anc


def accepted_depth(tokens: Sequence[int], parents: Sequence[int],
                   emitted: Sequence[int]) -> tuple[int, bool]:
    """How many nodes of a tree (flat ``tokens``/``parents``) the ``emitted`` tokens follow
    from the root, and whether that is settled (a mismatch or a leaf reached, not the end
    of what was emitted so far). This is what a step verifying the tree would have
    accepted: exactly for greedy steps; for sampled ones the same event in distribution,
    since a one-hot draft is accepted exactly when the LLM's sample is its token."""
    node, depth = ROOT, 0
    while True:
        children = [j for j, p in enumerate(parents) if p == node]
        if not children:
            return depth, True
        if depth == len(emitted):
            return depth, False
        node = next((j for j in children if tokens[j] == emitted[depth]), None)
        if node is None:
            return depth, True
        depth += 1


def merge_trees(trees: Sequence[TokenTree], max_nodes: int | None = None) -> TokenTree:
    """The tree holding exactly the union of the trees' paths; drafts of equal paths are
    concatenated in the order of ``trees``. With ``max_nodes``, nodes are taken in that
    order until the budget is full (a node's ancestors always come first). Only cut trees
    of deterministic (one-hot) drafts: dropping a sampled draft but keeping a later sample
    of the same source would bias stochastic verification."""
    merged = TokenTree()
    for tree in trees:
        remap: list[int | None] = []
        for tok, par, drafts in zip(tree.tokens, tree.parents, tree.drafts, strict=True):
            parent = ROOT if par == ROOT else remap[par]
            full = max_nodes is not None and len(merged) >= max_nodes
            if parent is None or (full and merged.child(parent, tok) is None):
                remap.append(None)  # over budget: this node and its subtree are left out
                continue
            remap.append(merged.add(parent, tok, drafts))
    return merged


def renumber_sources(tree: TokenTree, base: int) -> TokenTree:
    """``tree`` with every draft's source id shifted by ``base``: a tree drafted elsewhere,
    merged with the verifier's own drafts, must keep its sources distinct from theirs."""
    if not len(tree) or base == 0:
        return tree
    out = TokenTree()
    for tok, parent, drafts in zip(tree.tokens, tree.parents, tree.drafts, strict=True):
        out.add(parent, tok, [dataclasses.replace(d, source=d.source + base) for d in drafts])
    return out


# A draft function maps a batch of paths (token lists below the root; [] is the root
# itself) to the drafter's next-token probabilities, shape [len(paths), vocab].
DraftFn = Callable[[list[list[int]]], torch.Tensor]


def expand_level(
    tree: TokenTree,
    frontier: Sequence[int],
    probs: torch.Tensor,
    width: int,
    *,
    source: int = 0,
    sample: bool = False,
    replacement: bool = True,
    generator: torch.Generator | None = None,
    token_ids: torch.Tensor | None = None,
) -> list[int]:
    """Give each frontier node ``width`` children drawn from its row of ``probs``
    (``[len(frontier), V]``, the drafter's next-token distribution); returns the new
    frontier.

    Greedy (``sample=False``): the top-k tokens, each a deterministic draft with a one-hot
    ``q`` (so the tree is also valid for stochastic verification). Stochastic: children are
    *sampled*, i.i.d. (``replacement=True``) or without replacement, where each draft's ``q``
    is the renormalised remainder after the earlier draws at that node. ``probs`` must be
    the distribution to sample from (temperature / truncation applied); its exact support
    is recorded. ``token_ids`` maps the columns of ``probs`` to token ids (a drafter with a
    reduced vocabulary); by default column j is token j.
    """
    probs = probs.to(torch.float64)
    ids_of = (lambda cols: cols) if token_ids is None else (
        lambda cols: token_ids[torch.as_tensor(cols, dtype=torch.long)].tolist())
    next_frontier: list[int] = []
    for row, parent in enumerate(frontier):
        p = probs[row]
        if not sample:  # tokens of probability 0 (masked out) are never drafted
            top = torch.topk(p, min(width, p.numel()))
            top = ids_of(top.indices[top.values > 0].tolist())
            for rank, tok in enumerate(top):
                next_frontier.append(tree.add(parent, tok, [Draft.one_hot(source, rank, tok)]))
            continue
        # Work on the support only: drafts record it exactly, and a truncated draft
        # distribution keeps it small.
        ids = torch.nonzero(p > 0).squeeze(1)
        q_ids, w = tuple(ids_of(ids.tolist())), p[ids]
        w = w / w.sum()
        for rank in range(width):
            if not q_ids:
                break
            j = int(torch.multinomial(w, 1, generator=generator))
            tok = q_ids[j]
            node = tree.add(parent, tok, [Draft(source, rank, q_ids, tuple(w.tolist()))])
            if node not in next_frontier:  # a repeated i.i.d. draw reuses its node
                next_frontier.append(node)
            if not replacement:  # the next draw comes from the renormalised remainder
                q_ids = q_ids[:j] + q_ids[j + 1 :]
                w = torch.cat([w[:j], w[j + 1 :]])
                if not q_ids or w.sum() <= 0:
                    break
                w = w / w.sum()
    return next_frontier


def expand_tree(
    draft_fn: DraftFn,
    expansion: Sequence[int],
    *,
    source: int = 0,
    sample: bool = False,
    replacement: bool = True,
    generator: torch.Generator | None = None,
) -> TokenTree:
    """Grow a tree level by level: at depth d every frontier node gets ``expansion[d]``
    children (see ``expand_level``)."""
    tree = TokenTree()
    frontier = [ROOT]
    for width in expansion:
        if width <= 0 or not frontier:
            break
        probs = draft_fn([tree.path_tokens(n) if n != ROOT else [] for n in frontier])
        frontier = expand_level(tree, frontier, probs, width, source=source, sample=sample,
                                replacement=replacement, generator=generator)
    return tree


@dataclass
class TreeBatch:
    """A batch of trees laid out for one forward pass. Query 0 of each row is the root
    (the last verified token); query 1 + i is node i. Rows are padded to the longest tree:
    padding queries see only themselves and the prefix."""

    tokens: torch.Tensor  # [B, Q] int64
    position_ids: torch.Tensor  # [B, Q] int64
    ancestors: torch.Tensor  # [B, Q, Q] bool: query i may see query j
    prefix_lens: torch.Tensor  # [B] int64: tokens already in each sequence's KV cache

    @classmethod
    def build(
        cls,
        trees: Sequence[TokenTree],
        root_tokens: Sequence[int],
        prefix_lens: Sequence[int],
    ) -> TreeBatch:
        b = len(trees)
        q = 1 + max((len(t) for t in trees), default=0)
        tokens = torch.zeros(b, q, dtype=torch.long)
        depth = torch.zeros(b, q, dtype=torch.long)
        anc = torch.eye(q, dtype=torch.bool).repeat(b, 1, 1)
        for row, (tree, root) in enumerate(zip(trees, root_tokens, strict=True)):
            n = len(tree)
            tokens[row, 0] = root
            if n:
                tokens[row, 1 : n + 1] = torch.tensor(tree.tokens)
                depth[row, 1 : n + 1] = torch.tensor(tree.depths)
                anc[row, 1 : n + 1, 1 : n + 1] = tree.ancestors()
                anc[row, 1 : n + 1, 0] = True  # every node descends from the root
        prefix = torch.tensor(list(prefix_lens), dtype=torch.long)
        return cls(tokens, prefix[:, None] + depth, anc, prefix)

    def attention_mask(
        self,
        key_len: int,
        query_offsets: torch.Tensor | int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The topology-aware additive mask ``[B, 1, Q, key_len]``.

        Keys ``[0, prefix_len)`` of a row hold its verified prefix; the queries' own K/V sit
        at keys ``[offset, offset + Q)``, where ``query_offsets`` is the row's write position
        (default: right after its prefix, as in a per-sequence cache slot; pass the padded
        prefix length for a cache that appends at one position for the whole batch).
        A query sees its row's prefix, its ancestors and itself; nothing else.
        """
        return additive_mask(self.visibility(key_len, query_offsets), dtype)

    def visibility(
        self, key_len: int, query_offsets: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The boolean form of ``attention_mask``: ``[B, Q, key_len]``, True = may attend."""
        b, q = self.tokens.shape
        if query_offsets is None:
            offsets = self.prefix_lens
        elif isinstance(query_offsets, int):
            offsets = torch.full((b,), query_offsets, dtype=torch.long)
        else:
            offsets = query_offsets.to(torch.long)
        if bool((offsets < self.prefix_lens).any()) or bool((offsets + q > key_len).any()):
            raise ValueError("tree queries must sit after the prefix and inside key_len")
        keys = torch.arange(key_len)
        visible = (keys[None, :] < self.prefix_lens[:, None])[:, None, :].expand(b, q, key_len)
        visible = visible.clone()
        # Scatter each row's ancestor block to its key offset.
        cols = offsets[:, None] + torch.arange(q)[None, :]  # [B, Q]
        visible.scatter_(2, cols[:, None, :].expand(b, q, q), self.ancestors)
        return visible


def additive_mask(visible: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool ``[B, Q, K]`` → SDPA's additive ``[B, 1, Q, K]`` on ``visible``'s device: 0 where
    visible, dtype's min elsewhere."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None]

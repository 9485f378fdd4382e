"""Prompt-lookup (n-gram) drafting: no model, only the sequence's own tokens.

The last n tokens of the context (n from ``max_n`` down to ``min_n``) are looked up in the
earlier context; the tokens that followed each match are proposed as a chain. Distinct
continuations of the most recent matches become branches of one tree. The drafts are
deterministic, so each records a one-hot proposal: valid for greedy and for stochastic
(MSS) verification alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from specinfer.tree import ROOT, Draft, TokenTree


def ngram_tree(
    context: Sequence[int],
    depth: int,
    *,
    branches: int = 2,
    max_n: int = 4,
    min_n: int = 1,
    source: int = 0,
    max_nodes: int = 64,
) -> TokenTree:
    tree = TokenTree()
    if depth <= 0 or len(context) < 2:
        return tree
    ctx = list(context)
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
        key = ctx[-n:]
        # Most recent match first; a match must leave at least one following token.
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start : start + n] != key:
                continue
            cont = tuple(ctx[start + n : start + n + depth])
            if not cont or cont in seen:
                continue
            seen.add(cont)
            rank = len(seen) - 1
            node = ROOT
            for tok in cont:
                if len(tree) >= max_nodes and tree.child(node, tok) is None:
                    return tree
                node = tree.add(node, tok, [Draft.one_hot(source, rank, tok)])
            if len(seen) >= branches:
                return tree
        if seen:  # longer matches are better evidence: stop at the longest n that matched
            return tree
    return tree

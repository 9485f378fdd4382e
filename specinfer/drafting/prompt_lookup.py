"""Prompt-lookup drafting (n-gram matches in the context): no model, only the sequence's own tokens.

The last n tokens of the context (n from ``max_n`` down to ``min_n``) are looked up in the
earlier context; the tokens that followed each match are proposed as a chain. Distinct
continuations of the most recent matches become branches of one tree. The drafts are
deterministic, so each records a one-hot proposal: valid for greedy and for stochastic
(MSS) verification alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from specinfer.tree import ROOT, Draft, TokenTree


def prompt_lookup_tree(
    context: Sequence[int],
    depth: int,
    *,
    branches: int = 2,
    max_n: int = 4,
    min_n: int = 1,
    source: int = 0,
    max_nodes: int = 64,
) -> TokenTree:
    if depth <= 0 or len(context) < 2:
        return TokenTree()
    ctx = list(context)
    conts: list[tuple[int, ...]] = []  # one per branch, most recent match first
    for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
        key = ctx[-n:]
        # Most recent match first; a match must leave at least one following token.
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start : start + n] != key:
                continue
            _add_continuation(conts, tuple(ctx[start + n : start + n + depth]))
            if len(conts) >= branches:
                break
        if conts:  # longer matches are better evidence: stop at the longest n that matched
            break
    tree = TokenTree()
    for rank, cont in enumerate(conts):
        node = ROOT
        for tok in cont:
            if len(tree) >= max_nodes and tree.child(node, tok) is None:
                return tree
            node = tree.add(node, tok, [Draft.one_hot(source, rank, tok)])
    return tree


def _add_continuation(conts: list[tuple[int, ...]], cont: tuple[int, ...]) -> None:
    """A match near the end of the context has a cut-short continuation; one that only
    extends (or repeats) a branch already found lengthens it instead of taking a branch."""
    for i, known in enumerate(conts):
        if known[: len(cont)] == cont:
            return
        if cont[: len(known)] == known:
            conts[i] = cont
            return
    conts.append(cont)

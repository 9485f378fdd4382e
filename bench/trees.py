"""Token trees for benchmarks and tests: random shapes (costs), and trees that hold a known
continuation among decoys (exactness: the verifier must accept exactly its own tokens)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specinfer.tree import ROOT, Draft, TokenTree


def random_tree(n: int, vocab: int, gen: torch.Generator) -> TokenTree:
    """``n`` nodes, each under a uniformly chosen earlier node (or the root)."""
    tree = TokenTree()
    while len(tree) < n:
        parent = int(torch.randint(-1, len(tree), (1,), generator=gen)) if len(tree) else -1
        tree.add(parent, int(torch.randint(0, vocab, (1,), generator=gen)))
    return tree


def decoy_tree(truth: list[int], vocab: int, gen: torch.Generator) -> TokenTree:
    """A tree holding ``truth`` (the LLM's own continuation) among random decoys at random
    positions, going wrong at a random depth: accepted paths are often not the leftmost.
    Each node carries a one-hot draft (sampled speculation can verify it too)."""
    tree, node = TokenTree(), ROOT
    cut = int(torch.randint(0, len(truth) + 1, (1,), generator=gen))
    for d, tok in enumerate(truth):
        decoys = torch.randint(0, vocab, (2,), generator=gen).tolist()
        real = tok if d < cut else decoys[0]
        order = [*decoys, real] if torch.rand(1, generator=gen) < 0.7 else [real, *decoys]
        nxt = node
        for t in order:
            child = tree.add(node, t, [Draft.one_hot(0, 0, t)])
            if t == real:
                nxt = child
        node = nxt
    return tree


def reference_oracle(pairs: Sequence[tuple[list[int], list[int]]], vocab: int, seed: int,
                     depth: int = 5) -> Callable[[list[list[int]]], list[TokenTree]]:
    """Trees for a batch (``generate_local``'s ``trees``): each history's (prompt,
    reference continuation) pair is found by its prompt (sequences leave the batch as they
    finish), and the next ``depth`` reference tokens go into a ``decoy_tree``."""
    gen = torch.Generator().manual_seed(seed)

    def trees(histories: list[list[int]]) -> list[TokenTree]:
        out = []
        for h in histories:
            prompt, continuation = next((p, c) for p, c in pairs if h[:len(p)] == p)
            done = len(h) - len(prompt)
            out.append(decoy_tree(continuation[done: done + depth], vocab, gen))
        return out

    return trees

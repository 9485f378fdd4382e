"""Tree verification (docs/architecture.md, "Verification"): greedy and multi-step
speculative sampling (MSS).

Both take the LLM's output for a ``TreeBatch`` row: row 0 is the distribution after the
root (the last verified token), row 1 + i the distribution after node i. Both return the
accepted tokens, the LLM's bonus token last, and the accepted node indices, which the
verifier uses to keep only the accepted path's K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specinfer.sampling import SamplingParams, sample, target_probs, uniform
from specinfer.tree import ROOT, Draft, TokenTree


@dataclass(frozen=True)
class Accepted:
    tokens: list[int]  # accepted draft tokens, then the bonus token
    nodes: list[int]  # tree node index of each accepted draft token (len(tokens) - 1)


def verify_greedy(argmax: torch.Tensor, tree: TokenTree) -> Accepted:
    """Walk down while a child's token equals the LLM's argmax, then append the argmax.

    ``argmax``: ``[>= 1 + len(tree)]`` token ids, the LLM's argmax after the root and
    after each node.
    """
    best = argmax.tolist()
    node, tokens, nodes = ROOT, [], []
    while True:
        token = best[node + 1]
        tokens.append(token)
        child = tree.child(node, token)
        if child is None:
            return Accepted(tokens, nodes)
        nodes.append(child)
        node = child


def _drafts_in_order(tree: TokenTree, node: int) -> list[tuple[int, Draft]]:
    """The drafts of ``node``'s children in the order they were drawn: by source, then by
    draw rank. Never by value: sorting i.i.d. drafts by probability biases the output."""
    pairs = [(c, d) for c in tree.children(node) for d in tree.drafts[c]]
    pairs.sort(key=lambda cd: (cd[1].source, cd[1].rank))
    return pairs


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(max(0, p - q))``: the target after a draft from ``q`` is rejected.

    If ``p <= q`` everywhere (only when p == q up to rounding, where rejection has
    probability ~0), ``p`` is returned unchanged.
    """
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 1e-12 else p


def verify_stochastic(
    probs: torch.Tensor,
    tree: TokenTree,
    generator: torch.Generator | None,
    vocab_size: int | None = None,
) -> Accepted:
    """Multi-step speculative sampling. ``probs``: ``[>= 1 + len(tree), V]``, the request's
    target distributions (logits processors applied) after the root and after each node.

    At node u with target p, try its children's drafts in draw order: draft x from q is
    accepted with probability min(1, p(x) / q(x)); on rejection p ← normalize(max(0, p − q)).
    If every draft is rejected (or u is a leaf) the bonus token is sampled from p.
    The output has exactly the target distribution provided each draft really was drawn
    from the q it records, given the drafts drawn before it.
    """
    vocab = vocab_size or probs.shape[-1]
    node, tokens, nodes = ROOT, [], []
    while True:
        p = probs[node + 1, :vocab].to(torch.float64)
        accepted = None
        for child, draft in _drafts_in_order(tree, node):
            x = tree.tokens[child]
            qx = draft.prob(x)
            if qx <= 0:
                raise ValueError(f"draft of node {child} gives its own token probability 0")
            if uniform(generator) * qx < float(p[x]):
                accepted = child
                break
            p = residual(p, draft.dense(vocab))
        if accepted is None:
            tokens.append(sample(p, generator))
            return Accepted(tokens, nodes)
        tokens.append(tree.tokens[accepted])
        nodes.append(accepted)
        node = accepted


def verify_batch(
    logits: torch.Tensor,
    trees: Sequence[TokenTree],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[Accepted]:
    """Verify a batch: greedy rows by argmax, the others by MSS on their target
    distribution. ``logits``: ``[B, Q, V]`` for a ``TreeBatch``."""
    argmax = logits.argmax(-1).cpu()
    out = []
    for b, (tree, sp, gen) in enumerate(zip(trees, params, generators, strict=True)):
        if sp.greedy:
            out.append(verify_greedy(argmax[b], tree))
        else:
            rows = logits[b, : 1 + len(tree)]
            out.append(verify_stochastic(target_probs(rows, sp).cpu(), tree, gen))
    return out

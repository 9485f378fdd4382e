"""Token-tree invariants: construction, merging, paths, ancestor masks, batch layout."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.tree import (
    ROOT,
    Draft,
    TokenTree,
    TreeBatch,
    accepted_depth,
    expand_tree,
    merge_trees,
)

# A tree is described by the token paths inserted into it (each a list of small ids so
# that shared prefixes and collisions are common).
paths_strategy = st.lists(
    st.lists(st.integers(0, 4), min_size=1, max_size=5), min_size=0, max_size=12
)


def tree_from_paths(paths: list[list[int]], source: int = 0) -> TokenTree:
    tree = TokenTree()
    for rank, path in enumerate(paths):
        node = ROOT
        for tok in path:
            node = tree.add(node, tok, [Draft.one_hot(source, rank, tok)])
    return tree


def prefix_closure(paths: list[list[int]]) -> set[tuple[int, ...]]:
    return {tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}


@given(paths_strategy)
def test_tree_holds_exactly_the_inserted_paths(paths):
    tree = tree_from_paths(paths)
    assert tree.paths() == prefix_closure(paths)
    # Parent precedes child, depth = parent depth + 1, no duplicate (parent, token).
    seen = set()
    for i, (tok, par, dep) in enumerate(zip(tree.tokens, tree.parents, tree.depths, strict=True)):
        assert par < i
        assert dep == (1 if par == ROOT else tree.depths[par] + 1)
        assert (par, tok) not in seen
        seen.add((par, tok))
    assert len(tree) == len(prefix_closure(paths))


@given(st.lists(paths_strategy, min_size=1, max_size=4))
def test_merge_is_the_union_of_paths_and_concatenates_drafts(path_sets):
    trees = [tree_from_paths(p, source=s) for s, p in enumerate(path_sets)]
    merged = merge_trees(trees)
    assert merged.paths() == set().union(*(t.paths() for t in trees))
    # Every draft of every input node lands on the merged node with the same path.
    for s, tree in enumerate(trees):
        for i in range(len(tree)):
            path = tree.path_tokens(i)
            node = ROOT
            for tok in path:
                node = merged.child(node, tok)
            assert all(d in merged.drafts[node] for d in tree.drafts[i])
            assert all(d.source == s for d in tree.drafts[i])
    total = sum(len(d) for t in trees for d in t.drafts)
    assert sum(len(d) for d in merged.drafts) == total


@given(paths_strategy)
def test_ancestor_mask_is_exactly_path_membership(paths):
    tree = tree_from_paths(paths)
    anc = tree.ancestors()
    for i in range(len(tree)):
        expected = set(tree.path(i))
        assert {j for j in range(len(tree)) if anc[i, j]} == expected


@settings(max_examples=40)
@given(
    st.lists(st.tuples(paths_strategy, st.integers(0, 6)), min_size=1, max_size=4),
    st.booleans(),
)
def test_batch_mask_sees_prefix_ancestors_and_self_only(rows, shared_offset):
    trees = [tree_from_paths(p) for p, _ in rows]
    prefix = [n for _, n in rows]
    batch = TreeBatch.build(trees, [7] * len(trees), prefix)
    q = batch.tokens.shape[1]
    offset = max(prefix) if shared_offset else None
    key_len = max(prefix) + q + 2
    vis = batch.visibility(key_len, offset)
    mask = batch.attention_mask(key_len, offset)
    assert mask.shape == (len(trees), 1, q, key_len)
    assert torch.equal(mask[:, 0] == 0, vis)
    for b, tree in enumerate(trees):
        base = offset if offset is not None else prefix[b]
        for qi in range(q):
            if qi == 0:
                own = {0}  # the root sees only itself (and the prefix)
            elif qi <= len(tree):
                own = {0} | {1 + j for j in tree.path(qi - 1)}
            else:
                own = {qi}  # padding
            expected = set(range(prefix[b])) | {base + j for j in own}
            assert {k for k in range(key_len) if vis[b, qi, k]} == expected
        # Position id = prefix length + depth.
        assert batch.position_ids[b, 0] == prefix[b]
        for i, d in enumerate(tree.depths):
            assert batch.position_ids[b, 1 + i] == prefix[b] + d
            assert batch.tokens[b, 1 + i] == tree.tokens[i]


def test_from_arrays_rejects_malformed_trees():
    with pytest.raises(ValueError, match="precede"):
        TokenTree.from_arrays([1, 2], [1, ROOT])
    with pytest.raises(ValueError, match="duplicates"):
        TokenTree.from_arrays([1, 1], [ROOT, ROOT])
    with pytest.raises(ValueError, match="parents"):
        TokenTree.from_arrays([1, 2], [ROOT])
    tree = TokenTree.from_arrays([1, 2, 3], [ROOT, 0, ROOT])
    assert tree.depths == [1, 2, 1]


def test_greedy_expansion_follows_the_config():
    vocab = 10

    def draft_fn(paths):
        # Deterministic distribution that prefers tokens (len(path) + k) % vocab.
        rows = []
        for path in paths:
            logits = -torch.arange(vocab, dtype=torch.float64)
            rows.append(torch.roll(logits, len(path) + sum(path)).softmax(0))
        return torch.stack(rows)

    tree = expand_tree(draft_fn, [1, 1, 3, 1])
    # 1 + 1 + 3 + 3 nodes, the paper's shape.
    assert len(tree) == 8
    assert [tree.depths.count(d) for d in (1, 2, 3, 4)] == [1, 1, 3, 3]
    for i, drafts in enumerate(tree.drafts):
        assert drafts[0].q_ids == (tree.tokens[i],) and drafts[0].q_probs == (1.0,)
        expected = torch.topk(draft_fn([tree.path_tokens(tree.parents[i]) if tree.parents[i] >= 0
                                        else []])[0], 3).indices.tolist()
        assert tree.tokens[i] in expected


@pytest.mark.parametrize("replacement", [True, False])
def test_sampled_expansion_records_the_distribution_drawn_from(replacement):
    vocab = 6
    base = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0], dtype=torch.float64)

    def draft_fn(paths):
        return base.repeat(len(paths), 1)

    g = torch.Generator().manual_seed(0)
    tree = expand_tree(draft_fn, [3, 2], sample=True, replacement=replacement, generator=g)
    for parent in [ROOT, *range(len(tree))]:
        drafts = [(d, tree.tokens[c]) for c in tree.children(parent) for d in tree.drafts[c]]
        drafts.sort(key=lambda dt: dt[0].rank)
        q = base.clone()
        for draft, tok in drafts:
            assert torch.allclose(draft.dense(vocab), q / q.sum())
            assert draft.prob(tok) > 0
            if not replacement:
                q[tok] = 0
    if not replacement:
        # Without replacement the root's children are distinct draws: 3 nodes.
        assert len(tree.children(ROOT)) == 3


def test_a_shadow_draft_counts_the_tokens_a_step_would_have_accepted():
    # Root -> 5 -> 6 -> 7, and root -> 8.
    tokens, parents = [5, 6, 8, 7], [-1, 0, -1, 1]
    assert accepted_depth(tokens, parents, [5, 6, 7, 9]) == (3, True)  # a leaf reached
    assert accepted_depth(tokens, parents, [5, 9]) == (1, True)  # a mismatch
    assert accepted_depth(tokens, parents, [8]) == (1, True)
    assert accepted_depth(tokens, parents, [5, 6]) == (2, False)  # not settled yet
    assert accepted_depth(tokens[:2], parents[:2], [5, 6]) == (2, True)  # a 2-node budget
    assert accepted_depth([], [], []) == (0, True)

"""Verification: greedy picks the longest matching path; MSS is lossless.

The MSS tests decode the first two tokens of a sequence many times with speculation
(random target and draft distributions over a small vocabulary, trees of depth >= 2,
1–3 drafters) and compare the empirical joint distribution of (token 1, token 2) with the
exact target p(t1) * p(t2 | t1) by a chi-square goodness-of-fit test.

Tolerance: with N = 6,000 samples (seeded, so the result is deterministic) each lossless
configuration must give chi-square p-value > 1e-3 and total-variation distance < 0.05
(sampling noise alone is ~0.02 here); the negative controls (a wrong residual, drafts tried
most-likely-first) must give p-value < 1e-6 and TV > 0.1 on the same test (they measure ~0.3).
"""

from functools import cache

import pytest
import torch
from scipy.stats import chisquare

import specinfer.verification as verification
from specinfer.sampling import SamplingParams, target_probs
from specinfer.tree import ROOT, Draft, TokenTree, expand_tree, merge_trees
from specinfer.verification import verify_batch, verify_greedy, verify_stochastic

VOCAB = 5
N_SAMPLES = 6_000


@cache
def raw_logits(owner: int, context: tuple[int, ...]) -> torch.Tensor:
    """A fixed random next-token logit vector per (model, context)."""
    g = torch.Generator().manual_seed(hash((owner, context)) % 2**31)
    return torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5


@cache
def llm_probs(context: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    return target_probs(raw_logits(-1, context), params).double()


@cache
def ssm_probs(source: int, context: tuple[int, ...], top_p: float) -> torch.Tensor:
    return target_probs(raw_logits(source, context), SamplingParams(1.0, top_p=top_p)).double()


# (name, drafters, expansion, target params); a drafter is (mode, draft top_p) with mode
# "iid" (sampled with replacement), "wor" (without replacement) or "onehot" (top-k).
CONFIGS = [
    ("one iid drafter", [("iid", 1.0)], [2, 2], SamplingParams(1.0)),
    ("one wor drafter", [("wor", 1.0)], [3, 2], SamplingParams(1.0)),
    ("three mixed drafters", [("iid", 1.0), ("wor", 0.9), ("onehot", 1.0)], [2, 1, 1],
     SamplingParams(1.0)),
    ("two drafters, truncated target", [("iid", 0.8), ("wor", 1.0)], [2, 2],
     SamplingParams(0.7, top_p=0.8)),
    ("one-hot drafts, top-k target", [("onehot", 1.0), ("onehot", 0.7)], [2, 2],
     SamplingParams(1.3, top_k=3)),
]


def speculative_two_tokens(drafters, expansion, params, gen) -> tuple[int, int]:
    """Decode until two tokens are emitted, one tree verification per step."""
    history: list[int] = []
    while len(history) < 2:
        trees = []
        for source, (mode, top_p) in enumerate(drafters):
            def draft_fn(paths, source=source, top_p=top_p, history=history):
                return torch.stack([ssm_probs(source, tuple(history + p), top_p) for p in paths])
            trees.append(expand_tree(draft_fn, expansion, source=source, sample=mode != "onehot",
                                     replacement=mode == "iid", generator=gen))
        tree = merge_trees(trees)
        rows = [llm_probs(tuple(history), params)]
        rows += [llm_probs(tuple(history + tree.path_tokens(i)), params) for i in range(len(tree))]
        history += verify_stochastic(torch.stack(rows), tree, gen).tokens
    return history[0], history[1]


def mss_pvalue(drafters, expansion, params, seed=1234) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(N_SAMPLES):
        a, b = speculative_two_tokens(drafters, expansion, params, gen)
        counts[a, b] += 1
    p1 = llm_probs((), params)
    expected = torch.stack([p1[a] * llm_probs((a,), params) for a in range(VOCAB)]) * N_SAMPLES
    obs, exp = counts.flatten().double(), expected.flatten()
    assert obs[exp == 0].sum() == 0, "emitted a token the target gives probability 0"
    big = exp >= 5
    obs_cells = torch.cat([obs[big], obs[~big].sum()[None]])
    exp_cells = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_cells > 0
    obs_cells, exp_cells = obs_cells[keep], exp_cells[keep]
    exp_cells *= obs_cells.sum() / exp_cells.sum()  # guard float rounding
    tv = 0.5 * float((obs / N_SAMPLES - exp / N_SAMPLES).abs().sum())
    return float(chisquare(obs_cells.numpy(), exp_cells.numpy()).pvalue), tv


@pytest.mark.parametrize("name,drafters,expansion,params", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_mss_first_two_tokens_match_the_target(name, drafters, expansion, params):
    pvalue, tv = mss_pvalue(drafters, expansion, params)
    assert pvalue > 1e-3, f"{name}: chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert tv < 0.05, f"{name}: TV={tv:.4f}"


def test_wrong_residual_fails_the_same_test(monkeypatch):
    # Negative control: on rejection keep p instead of normalize(max(0, p - q)).
    monkeypatch.setattr(verification, "residual", lambda p, q: p)
    pvalue, tv = mss_pvalue([("iid", 1.0)], [2, 2], SamplingParams(1.0))
    assert pvalue < 1e-6 and tv > 0.1, f"wrong residual undetected: p={pvalue:.2e}, TV={tv:.4f}"


def test_sorting_drafts_by_probability_is_detected(monkeypatch):
    # Negative control: trying i.i.d. drafts most-likely-first biases the output.
    def by_value(tree, node):
        pairs = [(c, d) for c in tree.children(node) for d in tree.drafts[c]]
        return sorted(pairs, key=lambda cd: -cd[1].prob(tree.tokens[cd[0]]))

    monkeypatch.setattr(verification, "_drafts_in_order", by_value)
    pvalue, tv = mss_pvalue([("iid", 1.0)], [4, 1], SamplingParams(1.0))
    assert pvalue < 1e-6 and tv > 0.1, f"sorted drafts undetected: p={pvalue:.2e}, TV={tv:.4f}"


def test_one_hot_draft_equal_to_target_is_alwaysaccepted_depth():
    tree = TokenTree()
    tree.add(ROOT, 2, [Draft.one_hot(0, 0, 2)])
    probs = torch.zeros(2, VOCAB, dtype=torch.float64)
    probs[0, 2] = 1.0
    probs[1, 4] = 1.0
    out = verify_stochastic(probs, tree, torch.Generator().manual_seed(0))
    assert out.tokens == [2, 4] and out.nodes == [0]


# --- greedy -----------------------------------------------------------------------------


def chain_tree(paths):
    tree = TokenTree()
    for path in paths:
        node = ROOT
        for tok in path:
            node = tree.add(node, tok, [Draft.one_hot(0, 0, tok)])
    return tree


def test_greedy_accepts_the_longest_matching_path_and_the_bonus():
    # Tree: 1-2-3, 1-4-5-6, 7. The LLM continues 1, 4, 5, then 9.
    tree = chain_tree([[1, 2, 3], [1, 4, 5, 6], [7]])
    llm_next = {(): 1, (1,): 4, (1, 4): 5, (1, 4, 5): 9}
    argmax = torch.tensor(
        [llm_next[()]] + [llm_next.get(tuple(tree.path_tokens(i)), 0) for i in range(len(tree))]
    )
    out = verify_greedy(argmax, tree)
    assert out.tokens == [1, 4, 5, 9]
    assert [tree.tokens[n] for n in out.nodes] == [1, 4, 5]


def test_greedy_with_no_match_emits_only_the_bonus():
    tree = chain_tree([[1, 2], [3]])
    out = verify_greedy(torch.tensor([8, 0, 0, 0]), tree)
    assert out.tokens == [8] and out.nodes == []


def test_greedy_on_an_empty_tree_is_incremental_decoding():
    out = verify_greedy(torch.tensor([6]), TokenTree())
    assert out.tokens == [6] and out.nodes == []


def test_verify_batch_mixes_greedy_and_stochastic_rows():
    trees = [chain_tree([[1, 2]]), chain_tree([[3]])]
    logits = torch.full((2, 3, VOCAB), -10.0)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 4] = 10.0  # row 0: 1, 2, then 4
    logits[1, 0, 3] = 10.0  # row 1: 3 is almost certain, then the bonus
    logits[1, 1, 0] = 10.0
    params = [SamplingParams(), SamplingParams(temperature=0.5, seed=3)]
    gens = [None, params[1].make_generator()]
    out = verify_batch(logits, trees, params, gens)
    assert out[0].tokens == [1, 2, 4] and out[0].nodes == [0, 1]
    assert out[1].tokens == [3, 0] and out[1].nodes == [0]

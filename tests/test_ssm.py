"""The SSM drafter: cached tree drafting equals uncached expansion, cache hits equal
misses, and stochastic drafts record the distribution they were drawn from."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from specinfer.drafting import DraftRequest
from specinfer.drafting.ssm import SSMDrafter
from specinfer.sampling import SamplingParams, target_probs
from specinfer.tree import ROOT, expand_tree


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


def uncached_probs(model, context):
    def draft_fn(paths):
        with torch.no_grad():
            return torch.stack([model(torch.tensor([context + p])).logits[0, -1].softmax(-1)
                                for p in paths])
    return draft_fn


@pytest.mark.parametrize("expansion", [[1, 1, 3, 1, 1], [2, 2, 2], [4, 1, 1, 1]])
def test_greedy_tree_equals_uncached_expansion_and_hits_equal_misses(hf_model, expansion):
    drafter = SSMDrafter(hf_model, slots=2, max_context=128)
    contexts = [[5, 6, 7, 8, 9], list(range(20, 45))]
    reqs = [DraftRequest(f"s{i}", c, expansion) for i, c in enumerate(contexts)]
    miss = drafter.propose(reqs)
    for ctx, tree in zip(contexts, miss, strict=True):
        ref = expand_tree(uncached_probs(hf_model, ctx), expansion)
        assert tree.tokens == ref.tokens and tree.parents == ref.parents
    # Hit: the contexts grow by two tokens; the slot holds the old prefix.
    grown = [c + [3, 4] for c in contexts]
    hit = drafter.propose([DraftRequest(f"s{i}", c, expansion) for i, c in enumerate(grown)])
    cold = SSMDrafter(hf_model, slots=2, max_context=128)
    fresh = cold.propose([DraftRequest(f"s{i}", c, expansion) for i, c in enumerate(grown)])
    for a, b in zip(hit, fresh, strict=True):
        assert a.tokens == b.tokens and a.parents == b.parents
    # Stale entry: a context that diverges from the cached one.
    stale = drafter.propose([DraftRequest("s0", [5, 6, 1, 1, 2, 3], expansion)])[0]
    ref = expand_tree(uncached_probs(hf_model, [5, 6, 1, 1, 2, 3]), expansion)
    assert stale.tokens == ref.tokens


def test_stochastic_drafts_record_the_distribution_sampled_from(hf_model):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    drafter = SSMDrafter(hf_model, slots=1, max_context=128, draft_top_k=16)
    ctx = [9, 8, 7, 6]
    tree = drafter.propose([DraftRequest("s", ctx, [3, 2], params,
                                         torch.Generator().manual_seed(0))])[0]
    for node in range(len(tree)):
        parent = tree.parents[node]
        path = tree.path_tokens(parent) if parent != ROOT else []
        with torch.no_grad():
            logits = hf_model(torch.tensor([ctx + path])).logits[0, -1]
        expected = target_probs(logits, SamplingParams(0.8, top_k=16, top_p=0.9)).double()
        for d in tree.drafts[node]:
            assert torch.allclose(d.dense(expected.numel()), expected, atol=1e-5)
            assert d.prob(tree.tokens[node]) > 0


def test_node_budget_is_respected(hf_model):
    drafter = SSMDrafter(hf_model, slots=1, max_context=128, max_tree_nodes=10)
    tree = drafter.propose([DraftRequest("s", [1, 2, 3], [4, 4, 4])])[0]
    assert len(tree) <= 10


def test_dynamic_tree_keeps_the_most_probable_nodes(hf_model):
    drafter = SSMDrafter(hf_model, slots=1, max_context=128, dynamic_beam=3, dynamic_top_k=3,
                         dynamic_depth=4)
    ctx = [4, 5, 6, 7]
    tree = drafter.propose([DraftRequest("s", ctx, dynamic=True, max_nodes=12)])[0]
    assert len(tree) == 12
    draft_fn = uncached_probs(hf_model, ctx)
    # Every node is among its parent's top-3 under the uncached model; the root's top-1
    # is kept.
    for node in range(len(tree)):
        parent = tree.parents[node]
        probs = draft_fn([tree.path_tokens(parent) if parent != ROOT else []])[0]
        assert tree.tokens[node] in torch.topk(probs, 3).indices.tolist()
    top1 = int(draft_fn([[]])[0].argmax())
    assert tree.child(ROOT, top1) is not None


def test_prune_keeps_the_most_probable_ancestor_closed_nodes():
    from specinfer.tree import TokenTree
    tree = TokenTree()
    a = tree.add(ROOT, 1)      # 0.9
    b = tree.add(ROOT, 2)      # 0.1
    c = tree.add(a, 3)         # 0.9 * 0.8
    tree.add(b, 4)             # 0.1 * 0.9
    d = tree.add(c, 5)         # 0.9 * 0.8 * 0.7
    scores = [math.log(x) for x in (0.9, 0.1, 0.72, 0.09, 0.504)]
    kept = SSMDrafter._prune(tree, scores, 3)
    assert kept.paths() == {(1,), (1, 3), (1, 3, 5)}
    assert d == 4 and len(SSMDrafter._prune(tree, scores, 10)) == 5


def test_stochastic_requests_ignore_dynamic_and_stay_valid(hf_model):
    drafter = SSMDrafter(hf_model, slots=1, max_context=128)
    params = SamplingParams(temperature=1.0, seed=3)
    tree = drafter.propose([DraftRequest("s", [1, 2], [2, 2], params,
                                         torch.Generator().manual_seed(1), dynamic=True)])[0]
    assert all(len(d) >= 1 and d[0].q_ids for d in tree.drafts)
    assert max(tree.depths) == 2


def test_reduced_vocabulary_drafts_stay_in_it_and_record_their_distribution(hf_model):
    import copy

    vocab = hf_model.config.vocab_size
    vocab_ids = torch.arange(0, vocab, 3)
    small = copy.deepcopy(hf_model)
    small.lm_head = torch.nn.Linear(small.config.hidden_size, len(vocab_ids), bias=False)
    small.lm_head.weight.data = hf_model.lm_head.weight[vocab_ids].clone()
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[vocab_ids] = False

    def masked_logits(context):
        with torch.no_grad():
            return hf_model(torch.tensor([context])).logits[0, -1].masked_fill(outside, -math.inf)

    drafter = SSMDrafter(small, slots=1, max_context=128, draft_top_k=16, vocab_ids=vocab_ids,
                         llm_vocab_size=vocab)
    ctx = [9, 8, 7, 6]
    greedy = drafter.propose([DraftRequest("g", ctx, [2, 2])])[0]
    ref = expand_tree(lambda paths: torch.stack([masked_logits(ctx + p).softmax(-1)
                                                 for p in paths]), [2, 2])
    assert greedy.tokens == ref.tokens and greedy.parents == ref.parents
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    tree = drafter.propose([DraftRequest("s", ctx, [3, 2], params,
                                         torch.Generator().manual_seed(0))])[0]
    assert set(tree.tokens) <= set(vocab_ids.tolist())
    for node in range(len(tree)):
        parent = tree.parents[node]
        path = tree.path_tokens(parent) if parent != ROOT else []
        expected = target_probs(masked_logits(ctx + path),
                                SamplingParams(0.8, top_k=16, top_p=0.9)).double()
        for d in tree.drafts[node]:
            assert torch.allclose(d.dense(vocab), expected, atol=1e-5)


def test_fp16_drafter_hits_equal_misses(tiny_llama):
    contexts = [[5, 6, 7, 8, 9], list(range(20, 45))]
    warm = SSMDrafter.load(tiny_llama, slots=2, max_context=128)
    assert "quantized" in type(warm.runtime.model.lm_head).__module__
    warm.propose([DraftRequest(f"s{i}", c, [2, 2, 1]) for i, c in enumerate(contexts)])
    grown = [c + [3, 4] for c in contexts]
    hit = warm.propose([DraftRequest(f"s{i}", c, [2, 2, 1]) for i, c in enumerate(grown)])
    cold = SSMDrafter.load(tiny_llama, slots=2, max_context=128)
    miss = cold.propose([DraftRequest(f"s{i}", c, [2, 2, 1]) for i, c in enumerate(grown)])
    for a, b in zip(hit, miss, strict=True):
        assert a.tokens == b.tokens and a.parents == b.parents

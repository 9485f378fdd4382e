"""Tree attention equals incremental decoding on a tiny random Llama.

A batch of trees of different shapes and prefix lengths is scored in one forward pass over
a KV cache with the topology-aware 4-D mask; every node's logits must equal those of
decoding its path token by token (max abs diff <= 1e-4).
"""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specinfer.tree import ROOT, TokenTree, TreeBatch, expand_tree

TOL = 1e-4
VOCAB = 97


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval()


def random_tree(seed: int, expansion: list[int]) -> TokenTree:
    gen = torch.Generator().manual_seed(seed)

    def draft_fn(paths):
        return torch.softmax(torch.randn(len(paths), VOCAB, generator=gen) * 3, -1)

    return expand_tree(draft_fn, expansion, sample=True, replacement=True, generator=gen)


def incremental_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits after the last token, decoding one token at a time over a cache."""
    cache = DynamicCache(config=model.config)
    for pos, tok in enumerate(tokens):
        out = model(torch.tensor([[tok]]), cache=cache, position_ids=torch.tensor([[pos]]),
                    use_cache=True)
    return out.logits[0, -1]


@torch.no_grad()
@pytest.mark.parametrize("shapes", [
    [[1, 1, 3, 1, 1], [2, 2, 1], [4]],
    [[3, 2, 2], [], [1, 1, 1, 1, 1, 1], [2, 1]],
])
def test_tree_logits_equal_sequential_decoding(model, shapes):
    gen = torch.Generator().manual_seed(len(shapes))
    b = len(shapes)
    prefix_lens = [int(x) for x in torch.randint(1, 12, (b,), generator=gen)]
    prefixes = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in prefix_lens]
    roots = torch.randint(0, VOCAB, (b,), generator=gen).tolist()
    trees = [random_tree(10 + i, exp) for i, exp in enumerate(shapes)]

    # Batched prefill, right-padded: each prefix is a chain "tree" at position 0.
    pmax = max(prefix_lens)
    prefill = TreeBatch.build([TokenTree.chain(p[1:]) for p in prefixes],
                              [p[0] for p in prefixes], [0] * b)
    cache = DynamicCache(config=model.config)
    model(prefill.tokens, cache=cache, position_ids=prefill.position_ids,
          attention_mask=prefill.attention_mask(pmax, 0), use_cache=True)

    # One forward for all trees; the cache appends them after the padded prefix.
    batch = TreeBatch.build(trees, roots, prefix_lens)
    q = batch.tokens.shape[1]
    mask = batch.attention_mask(pmax + q, query_offsets=pmax)
    logits = model(batch.tokens, cache=cache, position_ids=batch.position_ids,
                   attention_mask=mask, use_cache=True).logits

    worst = 0.0
    for row, tree in enumerate(trees):
        context = prefixes[row] + [roots[row]]
        for node in [ROOT, *range(len(tree))]:
            path = tree.path_tokens(node) if node != ROOT else []
            ref = incremental_logits(model, context + path)
            diff = (logits[row, 1 + node] - ref).abs().max().item()
            worst = max(worst, diff)
    assert worst <= TOL, f"max abs logit difference {worst:.2e} > {TOL}"

"""The draft head on the LLM's features: its tree-attention drafting agrees with its training
form, the verifier's feature bookkeeping feeds it the right features, and verification
with its drafts stays exact."""

from __future__ import annotations

import pytest
import torch

from services.verifier.engine import EngineConfig, PrefillSpec, StepItem
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.drafting import DraftPlan, DraftRequest
from specinfer.drafting.head import DraftHead, FeatureDrafter, load_head
from specinfer.errors import InvalidArgument
from specinfer.models import load_model
from specinfer.sampling import SamplingParams
from specinfer.training.head import head_forward, save_head
from specinfer.tree import TokenTree


def _random_head(llm, vocab_ids: torch.Tensor, seed: int = 0) -> DraftHead:
    """An untrained head with its fc scrambled, so every input matters."""
    head = DraftHead(llm, vocab_ids)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.fc.weight.add_(torch.randn(head.fc.weight.shape, generator=gen) * 0.3)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return load_model(tiny_llama)


@torch.inference_mode()
def _features(llm, tokens: list[int]) -> torch.Tensor:
    return llm.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]


@torch.inference_mode()
def test_tree_drafting_matches_the_training_form(llm):
    """A chain drafted on the KV-cached runtime picks, level by level, the argmax of the
    training-form forward over (feature of the token before, token): level 1 from the
    LLM's features, deeper levels from the head's own normed output."""
    vocab_ids = torch.arange(3, 128, 2)
    head = _random_head(llm, vocab_ids)
    context = [5, 17, 42, 9, 77, 31, 64, 8]
    feats = _features(llm, context)
    drafter = FeatureDrafter(head, dtype="fp32", slots=2, max_context=64)
    tree = drafter.propose([DraftRequest("s", context, [1, 1, 1],
                                         features=feats[:-1])])[0]
    assert len(tree) == 3 and tree.parents == [-1, 0, 1]
    inputs, tokens = feats[:-1], list(context[1:])
    for drafted in tree.tokens:
        normed, logits, _ = head_forward(head, inputs[None], torch.tensor([tokens]))
        assert drafted == int(vocab_ids[logits[0, -1].argmax()])
        inputs = torch.cat([inputs, normed[0, -1:]])
        tokens.append(drafted)
    # A cache hit (the same sequence, two more tokens) drafts what a cold drafter does.
    longer = context + [tree.tokens[0], 11]
    more = _features(llm, longer)
    warm = drafter.propose([DraftRequest("s", longer, [2, 1], features=more[:-1])])[0]
    cold = FeatureDrafter(head, dtype="fp32", slots=1, max_context=64).propose(
        [DraftRequest("s", longer, [2, 1], features=more[:-1])])[0]
    assert warm.tokens == cold.tokens and warm.parents == cold.parents
    with pytest.raises(ValueError, match="features"):
        drafter.propose([DraftRequest("s", context, [1], features=feats)])


@torch.inference_mode()
def test_unrolled_training_levels_are_draft_chains(llm):
    """Level u of the unrolled training form at position i equals a chain drafted u levels
    past the true context that ends at i - u (the LLM's features there, the head's own
    after), recomputed step by step with plain causal attention."""
    from specinfer.training.head import _unrolled

    head = _random_head(llm, torch.arange(3, 128, 2), seed=1)
    ids = [5, 17, 42, 9, 77, 31, 64, 8, 99, 12]
    feats = _features(llm, ids)[:-1]
    tokens = torch.tensor(ids[1:])
    levels = _unrolled(head, feats[None], tokens[None], 3)
    for u in range(3):
        for i in range(u, len(tokens)):
            inputs, toks = feats[: i - u + 1], tokens[: i - u + 1]
            for step in range(u + 1):
                normed, logits, _ = head_forward(head, inputs[None], toks[None])
                inputs = torch.cat([inputs, normed[0, -1:]])
                toks = tokens[: i - u + step + 2]
            assert torch.allclose(levels[u][1][0, i], logits[0, -1], atol=1e-4), (u, i)
            assert torch.allclose(levels[u][0][0, i], normed[0, -1], atol=1e-4), (u, i)


HEAD_PLAN = DraftPlan(("head", "model_free"), 8)  # what the head mode asks for


@pytest.fixture(scope="module")
def head_engine(tiny_llama, llm, tmp_path_factory):
    path = tmp_path_factory.mktemp("head") / "head"
    save_head(_random_head(llm, torch.arange(0, 128)), path, tiny_llama, {})
    return build_engine(tiny_llama, EngineConfig(max_context=256, slots=4, max_tree_nodes=16,
                                                 head_expansion=(2, 1, 1)), head=str(path))


def test_the_verifier_feeds_the_head_the_llms_features(head_engine, llm):
    """After prefill and after each verification, the features the verifier keeps for a
    sequence are the LLM's own (recomputed here from scratch)."""
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    head_engine.prefill([PrefillSpec("f", prompt)])
    try:
        seq = head_engine.sequences["f"]
        for _ in range(4):
            head_engine.step([StepItem("f", seq.root,
                                       draft=DraftPlan(("head", "model_free"), 6))])
        want = _features(llm, seq.tokens[:-1])
        torch.testing.assert_close(seq.features[: seq.cached], want, atol=1e-4, rtol=1e-4)
    finally:
        head_engine.release(["f"])


def test_verification_with_head_drafts_is_exact(head_engine):
    """Greedy output with the head's trees equals plain decoding, token for token, and the
    head's drafts are accepted at least sometimes."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 60, 61]]
    for prompt in prompts:
        plain = generate_local(head_engine, [prompt], 40)[0]
        spec = generate_local(head_engine, [prompt], 40, draft=HEAD_PLAN)[0]
        assert spec.token_ids == plain.token_ids
        assert spec.steps < len(spec.token_ids)  # some step accepted a draft
    sampled = generate_local(head_engine, prompts, 30, draft=HEAD_PLAN,
                             params=SamplingParams(temperature=0.8, seed=3))
    assert all(len(r.token_ids) == 30 for r in sampled)


def test_the_head_drafts_its_share_dynamic_for_greedy_static_for_sampled(head_engine):
    """The head's tree takes at most ``head_nodes`` of a step's budget: for a greedy
    sequence the most probable paths (dynamic), for a sampled one the static expansion."""
    head = head_engine.drafts.by_name["head"]
    saved = (head.max_nodes, head.dynamic)
    only_head = DraftPlan(("head",), 16)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    head_engine.prefill([PrefillSpec("g", prompt),
                         PrefillSpec("t", prompt, SamplingParams(temperature=0.8, seed=1))])
    try:
        seqs = [head_engine.sequences["g"], head_engine.sequences["t"]]
        head.max_nodes, head.dynamic = 5, True
        greedy, sampled = head_engine.drafts.trees(seqs, [only_head] * 2, [16, 16],
                                                   [TokenTree()] * 2)
        want = head.drafter.propose([DraftRequest("x", seqs[0].tokens, [2, 1, 1], dynamic=True,
                                             max_nodes=5,
                                             features=seqs[0].features[: seqs[0].cached])])[0]
        assert greedy.paths() == want.paths() and len(greedy) == 5
        assert len(sampled) <= 5 and len(sampled.children(-1)) <= 2
        assert max(sampled.depths) <= 3
        head.dynamic = False
        static = head_engine.drafts.trees(seqs[:1], [only_head], [16], [TokenTree()])[0]
        assert sorted(static.depths) == [1, 1, 2, 2, 3]  # (2, 1, 1) cut to 5 nodes
    finally:
        head.max_nodes, head.dynamic = saved
        head_engine.release(["g", "t"])
        head.forget("x")


def test_asking_a_verifier_without_a_head_for_its_drafts_fails(tiny_llama):
    engine = build_engine(tiny_llama, EngineConfig(max_context=64, slots=1))
    engine.prefill([PrefillSpec("s", [1, 2, 3])])
    root = engine.sequences["s"].root
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.draft\.sources"):
        engine.step([StepItem("s", root, draft=DraftPlan(("head", "model_free"), 4))])
    assert engine.info()["draft_sources"] == [("model_free", False)]


def test_a_head_for_another_llm_is_refused(tiny_llama, tmp_path):
    save_head(DraftHead(load_model(tiny_llama), torch.arange(10)), tmp_path / "h", tiny_llama, {})
    other = load_model(tiny_llama)
    other.config.hidden_size = 96  # as a wider LLM would have
    with pytest.raises(ValueError, match="hidden size"):
        load_head(tmp_path / "h", other)
    with pytest.raises(ValueError, match="head.json"):
        load_head(tmp_path, other)


def test_training_targets_are_exactly_the_answer_positions():
    """Output i reads the feature of token i and token i+1 and is trained on the LLM's
    feature of token i+1 (its next token, i+2): only where that token is answer text."""
    from specinfer.training.examples import answer_example
    from specinfer.training.head import _batch

    item = answer_example({"prompt": [5, 6, 7], "answer": [8, 9]})
    assert item["ids"] == [5, 6, 7, 8, 9] and item["pos"] == [2, 3]  # 7 -> 8, 8 -> 9
    hidden = 4
    examples = [{"ids": torch.tensor(item["ids"]), "pos": torch.tensor(item["pos"]),
                 "features": torch.arange(5 * hidden, dtype=torch.float).view(5, hidden)},
                # Two assistant turns in one conversation, shorter than the batch width.
                {"ids": torch.arange(4), "pos": torch.tensor([0, 2]),
                 "features": torch.ones(4, hidden)}]
    feats, tokens, target, mask = _batch(examples)
    assert mask.tolist() == [[False, True, True, False], [False, True, False, False]]
    assert tokens[0].tolist() == [6, 7, 8, 9]
    assert torch.equal(target[0, 1], examples[0]["features"][2])
    assert torch.equal(feats[0, 1], examples[0]["features"][1])


def test_train_head_rejects_bad_settings_naming_the_flag(tmp_path):
    from specinfer.models import ModelError
    from specinfer.training.head import HeadConfig, train_head_pipeline

    for field, value, flag in [("levels", 0, "--levels"), ("epochs", 0.0, "--epochs"),
                               ("conversation_positions", -1, "--conversation-positions")]:
        cfg = HeadConfig(data=tmp_path, out=tmp_path / "out", **{field: value})
        with pytest.raises(ModelError, match=flag):
            train_head_pipeline(cfg)
    with pytest.raises(ModelError, match="--data"):  # no boost-tune run there
        train_head_pipeline(HeadConfig(data=tmp_path, out=tmp_path / "out"))

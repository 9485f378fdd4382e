"""The verifier engine on a tiny random Llama, in float32 and in bfloat16: exactness of
batched tree verification (against transformers in float32, against plain decoding in
bfloat16), KV compaction, sampling, capacity, sessions and request validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.trees import decoy_tree
from services.verifier.engine import EngineConfig, PrefillSpec, StepItem
from services.verifier.executor import Executor, ForwardArgs
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.drafting import DraftPlan
from specinfer.errors import InvalidArgument, OutOfRange, ResourceExhausted
from specinfer.placement import resolve
from specinfer.sampling import SamplingParams
from specinfer.tree import ROOT, TokenTree, TreeBatch


def model_free(nodes: int) -> DraftPlan:
    """A plan that has the verifier draft with its model-free source alone."""
    return DraftPlan(("model_free",), nodes)

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


CONFIG = EngineConfig(max_context=128, slots=4, max_tree_nodes=24)


@pytest.fixture(params=["float32", "bfloat16"])
def engine(tiny_llama, request):
    """Every test in both CPU formats; float32 is checked against transformers, bfloat16
    against the same format's plain decoding (``greedy``, ``fresh_logits``)."""
    return build_engine(tiny_llama, CONFIG, placement=resolve("cpu", request.param))


@pytest.fixture()
def plain_engine(tiny_llama, engine):
    """A second engine in the engine's format: the reference outside float32."""
    return build_engine(tiny_llama, CONFIG, placement=engine.executor.runtime.placement)


@pytest.fixture()
def greedy(engine, hf_model, plain_engine):
    """Greedy continuation of a prompt: transformers in float32, plain decoding in the
    engine's format otherwise (bit-identical to speculation there, by batch invariance)."""
    if engine.executor.dtype == "float32":
        return lambda prompt, n: hf_greedy(hf_model, prompt, n)
    return lambda prompt, n: generate_local(plain_engine, [prompt], n)[0].token_ids


@pytest.fixture()
def fresh_logits(engine, hf_model, plain_engine):
    """The last position's logits after a fresh forward of ``tokens``."""
    if engine.executor.dtype == "float32":
        def hf(tokens):
            with torch.no_grad():
                return hf_model(torch.tensor([tokens])).logits[0, -1]
        return hf

    def own(tokens):
        tree = TokenTree.chain(tokens[1:])
        batch = TreeBatch.build([tree], [tokens[0]], [0])
        return plain_engine.executor.forward(ForwardArgs(
            batch.tokens, batch.position_ids, torch.tensor([0]), torch.tensor([0]),
            batch.visibility(len(tokens)), last_only=True))[0, -1]
    return own


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def noisy_oracle(model, seed: int, depth: int = 4):
    """Trees around the LLM's true continuation (computed here, uncached)."""
    gen = torch.Generator().manual_seed(seed)

    def trees(histories: list[list[int]]) -> list[TokenTree]:
        out = []
        for hist in histories:
            ctx = list(hist)
            with torch.no_grad():
                for _ in range(depth):
                    ctx.append(int(model(torch.tensor([ctx])).logits[0, -1].argmax()))
            out.append(decoy_tree(ctx[len(hist):], model.config.vocab_size, gen))
        return out

    return trees


@pytest.mark.slow  # long generations against transformers', in both dtypes
def test_batched_speculative_greedy_equals_transformers_generate(engine, hf_model, greedy):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 17, 9, 30)]
    results = generate_local(engine, prompts, 40, trees=noisy_oracle(hf_model, 1))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == greedy(prompt, 40)
    # Speculation really accepted several tokens per step.
    steps = sum(r.steps for r in results)
    assert sum(len(r.token_ids) - 1 for r in results) > 1.5 * steps


def test_min_tokens_greedy_with_speculation_equals_without(engine, hf_model, plain_engine):
    """vLLM's min_tokens: the suppressed ids (here the plain greedy answer's own next
    tokens, so suppression changes it) never come before min_tokens, may after, and
    speculative output equals plain decoding with the same parameters."""
    prompt = [5, 9, 2, 77, 31]
    free = generate_local(plain_engine, [prompt], 12, stop_token_ids=[])[0].token_ids
    params = SamplingParams(min_tokens=6, min_tokens_stop_ids=tuple(free[:3]))
    plain = generate_local(plain_engine, [prompt], 12, params=params, stop_token_ids=[])[0]
    fast = generate_local(engine, [prompt], 12, trees=noisy_oracle(hf_model, 3),
                          params=params, stop_token_ids=[])[0]
    assert fast.token_ids == plain.token_ids != free
    assert not set(plain.token_ids[:6]) & set(free[:3])
    assert fast.steps < len(fast.token_ids) - 1  # drafts were accepted


def test_incremental_decoding_equals_transformers_generate(engine, greedy):
    prompts = [[5, 9, 2, 77], [3] * 12]
    results = generate_local(engine, prompts, 25)  # a batch of 2 against one at a time
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == greedy(prompt, 25)
        assert res.accepted_per_step == [1] * 24


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_llms_log_softmax_at_each_accepted_token(engine, hf_model,
                                                                  temperature):
    if engine.executor.dtype != "float32":
        pytest.skip("compares with transformers' float32 log-softmax")
    """Speculative steps report, for every emitted token (accepted drafts and the bonus),
    its log-probability and the top 3 under the LLM at that position: the rows of the
    accepted path, not of the tree's other nodes."""
    prompts = [[5, 9, 2, 77], [3] * 12]
    params = SamplingParams(temperature=temperature, seed=4, logprobs=3)
    results = generate_local(engine, prompts, 24, trees=noisy_oracle(hf_model, 2),
                             params=params)
    assert sum(r.steps for r in results) < sum(len(r.token_ids) - 1 for r in results)
    for prompt, res in zip(prompts, results, strict=True):
        assert len(res.logprobs) == len(res.token_ids)
        with torch.no_grad():
            seq = torch.tensor([prompt + res.token_ids])
            logp = torch.log_softmax(hf_model(seq).logits[0].float(), -1)
        for i, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs, strict=True)):
            row = logp[len(prompt) - 1 + i]
            assert lp.logprob == pytest.approx(float(row[tok]), abs=TOL)
            top = row.topk(3)
            assert list(lp.top_ids) == top.indices.tolist()
            assert list(lp.top_logprobs) == pytest.approx(top.values.tolist(), abs=TOL)
    plain = generate_local(engine, prompts[:1], 4, trees=noisy_oracle(hf_model, 2))
    assert plain[0].logprobs == []


def test_kv_after_a_non_leftmost_path_equals_a_fresh_prefill(engine, greedy, fresh_logits):
    prompt = [7, 3, 99, 45, 12, 8]
    first = engine.prefill([PrefillSpec("s", prompt)])[0].token
    truth = greedy(prompt + [first], 3)
    # Root's children: two decoys, then the truth; under it a decoy, then the truth.
    tree = TokenTree()
    for t in (truth[0] ^ 1, truth[0] ^ 2):
        tree.add(ROOT, t)
    a = tree.add(ROOT, truth[0])
    tree.add(a, truth[1] ^ 1)
    b = tree.add(a, truth[1])
    tree.add(b, truth[2] ^ 3)
    out = engine.step([StepItem("s", first, tree)])[0]
    assert out.accepted_nodes == [a, b] and out.tokens == truth
    seq = engine.sequences["s"]
    logits = engine.executor.forward(ForwardArgs(
        torch.tensor([[seq.root]]), torch.tensor([[seq.cached]]), torch.tensor([seq.slot]),
        torch.tensor([seq.cached]), None,
    ))[0, -1]
    fresh = fresh_logits(seq.tokens)
    assert (logits - fresh).abs().max().item() <= TOL


def test_the_local_executor_is_an_executor_with_features(engine):
    """It has every member the engine reads (``Executor``); the features are every query's,
    kept only by a forward that asks for them."""
    ex = engine.executor
    assert isinstance(ex, Executor) and ex.healthy and (ex.tp, ex.pp) == (1, 1)
    args = ForwardArgs(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]]), torch.tensor([0]),
                       torch.tensor([0]), None, features=True)
    assert ex.forward(args).shape == (1, 3, ex.vocab_size)
    hidden = ex.runtime.config.hidden_size
    assert ex.features.shape == (1, 3, hidden)
    assert ex.forward(dataclasses.replace(args, last_only=True)).shape == (1, 1, ex.vocab_size)
    assert ex.features.shape == (1, 3, hidden)  # every query's, though one row's logits
    ex.forward(dataclasses.replace(args, features=False))
    assert ex.features is None


def test_padded_rows_run_their_real_queries_only_with_the_same_logits(engine):
    """A batch of rows of unequal length (a tree beside a row decoding one token) runs its
    linears on the real queries only (``ForwardArgs.lengths``): their logits and features
    are the padded forward's (to rounding; in bfloat16 bit for bit, the kernels being
    batch-invariant), padding's come back zero."""
    ex = engine.executor
    trees = [TokenTree.chain([5, 6, 7, 8]), TokenTree(), TokenTree.chain([9])]
    batch = TreeBatch.build(trees, [1, 2, 3], [0, 10, 20])
    args = ForwardArgs(batch.tokens, batch.position_ids, torch.tensor([0, 1, 2]),
                       batch.prefix_lens, batch.visibility(25), features=True)
    padded = ex.forward(args)
    padded_features = ex.features
    lengths = torch.tensor([5, 1, 2])
    packed = ex.forward(dataclasses.replace(args, lengths=lengths))
    real = torch.arange(5)[None, :] < lengths[:, None]
    tol = TOL if ex.dtype == "float32" else 0.0
    assert (packed[real] - padded[real]).abs().max().item() <= tol
    assert (ex.features[real] - padded_features[real]).abs().max().item() <= tol
    assert not packed[~real].any() and not ex.features[~real].any()


def test_a_prefill_rides_in_steps_and_changes_nothing(engine, greedy):
    """Prefill chunks computed inside the steps' forward passes (``ride_prefill``), beside
    a tree row and a plain row: every output is what it is alone, and the riding prompt's
    first token is its own greedy one; an aborted riding job frees its slots."""
    engine.config = dataclasses.replace(engine.config, prefill_chunk=16)
    assert engine.rides_prefill
    prompts = {"a": [3, 1, 4, 1, 5], "b": [2, 7, 1, 8]}
    firsts = {o.sequence_id: o.token for o in engine.prefill(
        [PrefillSpec(sid, p) for sid, p in prompts.items()])}
    truth = {sid: greedy(p, 32) for sid, p in prompts.items()}
    long_prompt = [(5 * i) % 97 + 2 for i in range(90)]
    job = engine.begin_prefill([PrefillSpec("long", long_prompt)])
    engine.ride_prefill(job)
    out = {sid: [t] for sid, t in firsts.items()}
    steps = 0
    while not job.outs and steps < 20:
        tree = TokenTree.chain(truth["a"][len(out["a"]):len(out["a"]) + 2])
        for r in engine.step([StepItem("a", out["a"][-1], tree), StepItem("b", out["b"][-1])]):
            out[r.sequence_id] += r.tokens
        steps += 1
    assert engine.riding_tokens == 90 and job.outs
    assert steps >= 5  # 16 tokens a step (the budget's least), the last 10 with the 5th
    out["b"] += engine.step([StepItem("b", out["b"][-1])])[0].tokens
    assert not engine.riding  # a finished job leaves at the next step
    assert job.outs[0].token == greedy(long_prompt, 1)[0]
    assert out["a"] == truth["a"][:len(out["a"])] and out["b"] == truth["b"][:len(out["b"])]
    assert len(out["a"]) > steps  # the tree row accepted its drafts
    tokens = [job.outs[0].token]  # the riding sequence goes on as any other
    for _ in range(3):
        tokens += engine.step([StepItem("long", tokens[-1])])[0].tokens
    assert tokens == greedy(long_prompt, 4)
    free = len(engine.free_slots) + len(engine.kept)
    job = engine.begin_prefill([PrefillSpec("gone", long_prompt)])
    engine.ride_prefill(job)
    out["b"] += engine.step([StepItem("b", out["b"][-1])])[0].tokens
    engine.abort_prefill(job)
    assert len(engine.free_slots) + len(engine.kept) == free and not engine.riding


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    a = generate_local(engine, [[1, 2, 3]], 20, params=params)[0].token_ids
    b = generate_local(engine, [[1, 2, 3]], 20, params=params)[0].token_ids
    c = generate_local(engine, [[1, 2, 3]], 20, params=SamplingParams(0.9, top_p=0.95,
                                                                       seed=43))[0].token_ids
    assert a == b and a != c


def test_capacity_is_refused_cleanly_and_freed_on_release(engine):
    engine.prefill([PrefillSpec(f"s{i}", [1, 2, 3]) for i in range(4)])
    with pytest.raises(ResourceExhausted):
        engine.prefill([PrefillSpec("extra", [1, 2, 3])])
    assert set(engine.sequences) == {f"s{i}" for i in range(4)}  # nothing lost
    assert engine.release(["s0"]) == 1
    engine.prefill([PrefillSpec("extra", [1, 2, 3])])
    assert engine.info()["live_sequences"] == 4


def test_session_prefix_is_reused_and_output_unchanged(engine, greedy):
    turn1 = [4, 8, 15, 16, 23, 42]
    out1 = engine.prefill([PrefillSpec("t1", turn1, session_id="chat")])[0]
    engine.step([StepItem("t1", out1.token)])
    history = engine.sequences["t1"].tokens
    engine.release(["t1"], keep_for_session=True)
    turn2 = history + [9, 10, 11]
    out2 = engine.prefill([PrefillSpec("t2", turn2, session_id="chat")])[0]
    assert out2.reused_tokens == len(history) - 1  # all but the last token were cached
    assert out2.token == greedy(turn2, 1)[0]


@pytest.mark.parametrize("make,field", [
    (lambda e, root: [("nope", root, TokenTree())], "items[0].sequence_id"),
    (lambda e, root: [("s", root + 1, TokenTree())], "items[0].root_token"),
    (lambda e, root: [("s", root, TokenTree.chain([500]))], "items[0].tree.tokens[0]"),
    (lambda e, root: [("s", root, TokenTree.chain(list(range(30))))], "items[0].tree"),
    (lambda e, root: [("s", root, TokenTree()), ("s", root, TokenTree())], "items.sequence_id"),
])
def test_bad_step_requests_name_the_field_and_change_nothing(engine, make, field):
    root = engine.prefill([PrefillSpec("s", [1, 2, 3])])[0].token
    before = list(engine.sequences["s"].tokens)
    with pytest.raises(InvalidArgument) as err:
        engine.step([StepItem(*item) for item in make(engine, root)])
    assert err.value.field == field
    assert engine.sequences["s"].tokens == before
    assert engine.step([StepItem("s", root)])[0].tokens  # still serving


def test_bad_prefill_requests(engine):
    with pytest.raises(InvalidArgument, match="token_ids"):
        engine.prefill([PrefillSpec("a", [])])
    with pytest.raises(InvalidArgument, match=r"token_ids\[1\]"):
        engine.prefill([PrefillSpec("a", [1, 128])])
    with pytest.raises(InvalidArgument, match="max_context"):
        engine.prefill([PrefillSpec("a", [1] * 128)])
    engine.prefill([PrefillSpec("a", [1])])
    with pytest.raises(InvalidArgument, match="already live"):
        engine.prefill([PrefillSpec("a", [1])])


def test_context_limit_is_out_of_range(engine):
    root = engine.prefill([PrefillSpec("s", [1] * 120)])[0].token
    with pytest.raises(OutOfRange):
        engine.step([StepItem("s", root, TokenTree.chain([1] * 10))])


def test_trees_drafted_by_the_verifier_keep_greedy_output(engine, greedy):
    """Step items whose plan has the verifier draft get model-free trees from the
    sequence's own tokens, within the budget; the output is plain greedy decoding's."""
    prompt = [5, 6, 7, 8, 9] * 5 + [5, 6]
    root = engine.prefill([PrefillSpec("s", prompt)])[0].token
    tokens, drafted, shadow = [root], [], None
    while len(tokens) < 30:
        out = engine.step([StepItem("s", tokens[-1], draft=model_free(3),
                                    shadow=model_free(3))])[0]
        assert out.drafted_nodes <= 3
        if shadow is not None:  # the shadow draft was this step's tree
            assert out.drafted_nodes == len(shadow)
        shadow = out.next_draft
        drafted.append(out.drafted_nodes)
        tokens += out.tokens
    assert tokens[:30] == greedy(prompt, 30)
    assert sum(drafted) > 0
    assert engine.step([StepItem("s", tokens[-1])])[0].next_draft is None
    assert len(engine.step([StepItem("s", engine.sequences["s"].root,
                                     shadow=model_free(2))])[0].next_draft) <= 2


@pytest.mark.parametrize("tree,draft,shadow,field,message", [
    (TokenTree.chain([1, 2, 3]), model_free(2), DraftPlan(), "tree",
     "do not fit in draft.max_nodes 2"),
    (TokenTree(), model_free(25), DraftPlan(), "draft.max_nodes", "outside"),
    (TokenTree(), DraftPlan(), model_free(25), "shadow.max_nodes", "outside"),
    (TokenTree(), DraftPlan(("head",), 4), DraftPlan(), "draft.sources", "no draft source"),
    (TokenTree(), DraftPlan(), DraftPlan(("ngram",), 4), "shadow.sources", "no draft source"),
])
def test_bad_draft_plans_name_the_field(engine, tree, draft, shadow, field, message):
    root = engine.prefill([PrefillSpec("s", [1, 2, 3])])[0].token
    with pytest.raises(InvalidArgument, match=message) as err:
        engine.step([StepItem("s", root, tree, draft, shadow)])
    assert err.value.field == f"items[0].{field}"
    assert engine.sequences["s"].tokens == [1, 2, 3, root]


def test_a_sent_tree_with_a_draft_plan_is_merged_with_the_verifiers_drafts(engine, greedy):
    """Tree and draft plan together: the sent tree (its sources renumbered after the
    verifier's own) plus model-free drafts in the room left; greedy output unchanged."""
    prompt = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]
    root = engine.prefill([PrefillSpec("m", prompt)])[0].token
    try:
        tokens = [root]
        sent = TokenTree.chain([3, 4])
        out = engine.step([StepItem("m", root, sent, model_free(6))])[0]
        assert 2 <= out.drafted_nodes <= 6  # the sent chain, model-free drafts if any
        tokens += out.tokens
        assert tokens == greedy(prompt, len(tokens))
        own = engine.drafts.sent_base
        merged = engine.drafts.trees([engine.sequences["m"]], [model_free(6)], [6],
                                     [TokenTree.chain([3, 4])])[0]
        assert {d.source for node in merged.drafts[:2] for d in node} >= {own}
    finally:
        engine.release(["m"])


def test_a_prefill_in_chunks_interleaves_with_steps_and_changes_nothing(engine, greedy):
    """A long prompt computed a chunk at a time, steps of a live sequence in between: both
    outputs are what they are alone; a job aborted midway frees its slots."""
    engine.config = dataclasses.replace(engine.config, prefill_chunk=16)
    live = engine.prefill([PrefillSpec("live", [3, 1, 4, 1, 5])])[0]
    long_prompt = [(5 * i) % 97 + 2 for i in range(90)]
    job = engine.begin_prefill([PrefillSpec("long", long_prompt),
                                PrefillSpec("short", [2, 7, 1])])
    tokens, root, chunks = [live.token], live.token, 0
    while not engine.advance_prefill(job):
        chunks += 1
        root = engine.step([StepItem("live", root)])[0].tokens[-1]
        tokens.append(root)
    assert chunks == 5  # 16 tokens a call, the last 10 (at most 16 // 2 left) with "short"
    first = {o.sequence_id: o.token for o in job.outs}
    assert first["long"] == greedy(long_prompt, 1)[0]
    assert first["short"] == greedy([2, 7, 1], 1)[0]
    assert tokens == greedy([3, 1, 4, 1, 5], len(tokens))
    free = len(engine.free_slots) + len(engine.kept)
    job = engine.begin_prefill([PrefillSpec("gone", long_prompt)])
    engine.advance_prefill(job)
    engine.abort_prefill(job)
    assert len(engine.free_slots) + len(engine.kept) == free and "gone" not in engine.sequences
    assert engine.prefill([PrefillSpec("gone", [1, 2])])[0].sequence_id == "gone"

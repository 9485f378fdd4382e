"""The speculator: merged trees from an SSM pool and the n-gram drafter, and the gRPC
service's answers to good and bad requests."""

from __future__ import annotations

import grpc
import pytest
from conftest import save_tiny_llama
from servers import start

from services.speculator.engine import SpeculateSpec, SpeculatorEngine
from specinfer.drafting import DraftRequest
from specinfer.drafting.prompt_lookup import prompt_lookup_tree
from specinfer.drafting.ssm import SSMDrafter
from specinfer.models import load_ssm
from specinfer.sampling import SamplingParams
from specinfer.v1 import common_pb2, speculator_pb2, speculator_pb2_grpc
from specinfer.wire import tree_from_proto


@pytest.fixture(scope="module")
def second_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-b"), seed=1, layers=2)


def drafter(ref, source):
    model, vocab_ids = load_ssm(ref)
    return SSMDrafter(model, source, slots=4, max_context=128, vocab_ids=vocab_ids)


def test_merged_tree_is_the_union_of_every_source(tiny_llama, second_llama):
    engine = SpeculatorEngine([drafter(tiny_llama, 0), drafter(second_llama, 1)], 128,
                              expansion=[2, 2, 1], max_nodes=60)
    context = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    merged = engine.speculate([SpeculateSpec("s", context)])[0]
    alone = [drafter(ref, i).propose([DraftRequest("x", context, [2, 2, 1], max_nodes=20)])[0]
             for i, ref in enumerate((tiny_llama, second_llama))]
    lookup = prompt_lookup_tree(context, 6, branches=2, source=2, max_nodes=20)
    assert len(lookup) > 0
    assert merged.paths() == alone[0].paths() | alone[1].paths() | lookup.paths()
    sources = {d.source for drafts in merged.drafts for d in drafts}
    assert sources == {0, 1, 2}


def test_ssm_only_trees_give_the_whole_budget_to_the_ssms(tiny_llama, second_llama):
    """ssm_only (the router's merged mode, whose verifier adds the model-free drafts): no
    prompt-lookup drafts, and the SSMs share the whole node budget."""
    engine = SpeculatorEngine([drafter(tiny_llama, 0), drafter(second_llama, 1)], 128,
                              max_nodes=60)
    context = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    shared = engine.speculate([SpeculateSpec("a", context, expansion=[1] * 6, max_nodes=12)])[0]
    only = engine.speculate([SpeculateSpec("b", context, expansion=[1] * 6, max_nodes=12,
                                           ssm_only=True)])[0]
    alone = [drafter(ref, i).propose([DraftRequest("x", context, [1] * 6, max_nodes=6)])[0]
             for i, ref in enumerate((tiny_llama, second_llama))]
    assert only.paths() == alone[0].paths() | alone[1].paths()
    assert {d.source for drafts in only.drafts for d in drafts} == {0, 1}
    assert 2 in {d.source for drafts in shared.drafts for d in drafts}  # lookup drafts
    assert max(map(len, only.paths())) == 6 > max(map(len, shared.paths()))


def test_truncated_ssm_reference(tiny_llama):
    model, vocab_ids = load_ssm(f"{tiny_llama}#layers=2")
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    assert vocab_ids is None


def test_prompt_lookup_tree_follows_earlier_occurrences():
    tree = prompt_lookup_tree([1, 2, 3, 4, 9, 1, 2, 3, 7, 1, 2, 3], 3, branches=2)
    assert tree.paths() == {(7,), (7, 1), (7, 1, 2), (4,), (4, 9), (4, 9, 1)}
    assert len(prompt_lookup_tree([1, 2, 3], 4)) == 0


@pytest.fixture(scope="module")
def speculator(tiny_speculator):
    channel = grpc.insecure_channel(tiny_speculator)
    yield speculator_pb2_grpc.SpeculatorStub(channel)
    channel.close()


def call(stub, context, sampling=None, **tree):
    req = speculator_pb2.SpeculateRequest(items=[speculator_pb2.SpeculateItem(
        sequence_id="s", context=context, sampling=sampling or common_pb2.SamplingParams(),
        tree=speculator_pb2.TreeConfig(**tree))])
    return stub.Speculate(req, timeout=30)


@pytest.mark.processes
def test_service_trees_are_identical_on_cache_hit_and_miss(speculator):
    first = tree_from_proto(call(speculator, [3, 4, 5, 6]).results[0].tree)
    again = tree_from_proto(call(speculator, [3, 4, 5, 6]).results[0].tree)
    assert first.tokens == again.tokens and first.parents == again.parents
    assert len(first) == 1 + 2 + 2
    stoch = call(speculator, [3, 4, 5, 6], common_pb2.SamplingParams(temperature=0.8, seed=5))
    tree = tree_from_proto(stoch.results[0].tree)
    assert all(d and abs(sum(d[0].q_probs) - 1) < 1e-4 for d in tree.drafts)


@pytest.mark.processes
@pytest.mark.parametrize("kwargs,field", [
    (dict(context=[]), "context"),
    (dict(context=[1, 500]), "context"),
    (dict(context=[1], sampling=common_pb2.SamplingParams(temperature=-1)), "temperature"),
    (dict(context=[1], sampling=common_pb2.SamplingParams(temperature=1, top_p=2)), "top_p"),
    (dict(context=[1], max_nodes=1000), "max_nodes"),
    (dict(context=[1], expansion=[8, 8]), "expansion"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(speculator, kwargs, field):
    with pytest.raises(grpc.RpcError) as err:
        call(speculator, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert call(speculator, [1, 2]).results  # still serving


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(temperature=1, min_p=2)


def test_prompt_lookup_continuations_cut_short_by_the_context_end_are_lengthened():
    """The most recent match of a repeated token leaves one token to follow it; later
    matches extend that branch instead of taking the second one."""
    tree = prompt_lookup_tree([5, 9, 9, 9, 9, 9], 4, branches=2, max_n=1)
    assert tree.paths() == {(9,), (9, 9), (9, 9, 9), (9, 9, 9, 9)}
    tree = prompt_lookup_tree([4, 7, 4, 8, 8, 4], 3, branches=2, max_n=1)
    assert tree.paths() == {(8,), (8, 8), (8, 8, 4), (7,), (7, 4), (7, 4, 8)}


def test_expansion_flags_are_checked_and_name_the_flag():
    from services.flags import parse_expansion
    from specinfer.models import ModelError

    assert parse_expansion("1, 0,3", "--expansion", min_width=0) == [1, 0, 3]
    assert parse_expansion("2,1,1,1", "--head-expansion") == [2, 1, 1, 1]
    for text, flag, low in [("1,0", "--head-expansion", 1), ("1,17", "--expansion", 0),
                            ("1,x", "--expansion", 0), ("", "--head-expansion", 1),
                            ("-1", "--expansion", 0)]:
        with pytest.raises(ModelError, match=flag):
            parse_expansion(text, flag, min_width=low)


def test_benchmark_length_profile_counts_steps_begun_before_the_cut():
    from types import SimpleNamespace

    from bench.speculator import prefix_acceptance, repeated_ngrams

    runs = [SimpleNamespace(accepted_per_step=[1, 3, 2, 4]),  # 1, 4, 6, 10 tokens done
            SimpleNamespace(accepted_per_step=[2, 2])]
    # cut 4: steps 1-2 of run 1 (4 tokens), both of run 2 (4 tokens) -> 8 / 4
    assert prefix_acceptance(runs, [4, 5, 100]) == {4: 2.0, 5: 10 / 5, 100: 14 / 6}
    # answer 4-grams (3,4,1,2) new, (4,1,2,3) new, (1,2,3,4) seen in the prompt
    assert repeated_ngrams([1, 2, 3, 4, 1], [2, 3, 4]) == (1, 3)


def test_verifier_refuses_a_head_share_outside_its_tree_budget(capsys):
    from services.cli import main

    for value in ("0", "65"):  # --max-tree-nodes defaults to 64
        assert main(["serve", "verifier", "--head-nodes", value]) == 2
        assert "--head-nodes" in capsys.readouterr().err


@pytest.mark.processes
def test_speculate_is_unavailable_until_the_ssms_are_loaded(tiny_chat_llm):
    """From the moment it listens until its SSMs are loaded, Speculate answers UNAVAILABLE
    with a message (not an internal error); then it drafts."""
    import time

    speculator = start("speculator", "--llm", tiny_chat_llm, "--ssm",
                       f"{tiny_chat_llm}#layers=1", "--datastore", "none", "--max-context", "64")
    channel = grpc.insecure_channel(speculator.addr)
    stub = speculator_pb2_grpc.SpeculatorStub(channel)
    request = speculator_pb2.SpeculateRequest(items=[speculator_pb2.SpeculateItem(
        sequence_id="x", context=[5, 6, 7, 5, 6], tree=speculator_pb2.TreeConfig(max_nodes=4))])
    refusals, reply = [], None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                reply = stub.Speculate(request, timeout=5)
                break
            except grpc.RpcError as exc:
                refusals.append((exc.code(), exc.details()))
            time.sleep(0.02)
        assert reply is not None and reply.results[0].sequence_id == "x"
        assert {code for code, _ in refusals} <= {grpc.StatusCode.UNAVAILABLE}, refusals
        assert all(details for _, details in refusals)
        # Not only refused connections: the service itself answered while loading.
        assert any("loading" in details for _, details in refusals), refusals
    finally:
        channel.close()
        speculator.stop()


def test_a_speculate_call_holds_at_most_max_items_sequences():
    from services.speculator.server import MAX_ITEMS, specs_from_proto
    from specinfer.errors import InvalidArgument
    from specinfer.v1 import speculator_pb2

    def request(n: int) -> speculator_pb2.SpeculateRequest:
        return speculator_pb2.SpeculateRequest(items=[
            speculator_pb2.SpeculateItem(sequence_id=f"s{i}", context=[1, 2])
            for i in range(n)])

    assert len(specs_from_proto(request(MAX_ITEMS))) == MAX_ITEMS
    with pytest.raises(InvalidArgument, match="items"):
        specs_from_proto(request(MAX_ITEMS + 1))


def test_constrained_drafts_are_masked_by_the_grammar(tiny_chat_llm):
    """Two SSMs (on threads) draft a constrained sequence only what the grammar allows
    after each node (greedy and sampled); the matcher kept between calls is advanced by the
    new tokens and gives the trees a fresh engine gives; a released sequence's matcher is
    dropped; a history the constraint does not follow leaves the drafts unmasked."""
    from specinfer.constraints import Constraint
    from specinfer.grammar import allowed, compiler_for
    from specinfer.models import llm_eos_ids, load_tokenizer

    def engine():
        return SpeculatorEngine([drafter(tiny_chat_llm, 0), drafter(tiny_chat_llm, 1)], 49152,
                                prompt_lookup=False, expansion=[3, 2, 1], max_nodes=24,
                                grammars=compiler_for(tiny_chat_llm, 49152,
                                                      llm_eos_ids(tiny_chat_llm)))
    tok = load_tokenizer(tiny_chat_llm)
    c = Constraint("regex", r"(yes|no), because [a-z ]{1,20}\.")
    prompt = tok.encode("Answer:")
    warm = engine()
    check = warm.grammars
    for params in (SamplingParams(), SamplingParams(1.0, seed=4)):
        for generated in ([tok.encode("yes")[0]], tok.encode("yes, because")):
            spec = SpeculateSpec("s", prompt + generated, params, constraint=c,
                                 prompt_length=len(prompt))
            tree = warm.speculate([spec])[0]
            assert tree.paths() == engine().speculate([spec])[0].paths()
            grammar = check.start(c, generated)
            assert len(tree) >= 3
            for node in range(len(tree)):
                path = tree.path_tokens(node)
                assert allowed(grammar.allowed_words(path[:-1]), path[-1]), path
        warm.forget(["s"])
        assert "s" not in warm.sequence_grammars
    off = SpeculateSpec("t", prompt + tok.encode("maybe"), SamplingParams(), constraint=c,
                        prompt_length=len(prompt))
    assert len(warm.speculate([off])[0]) > 0 and warm.grammar(off) is None

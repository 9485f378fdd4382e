"""Corpus drafts: the n-gram datastore's lookups, chains and trees, its ShareGPT build, and
how the speculator merges model-free drafts under a node budget."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import save_tiny_llama

from services.speculator.engine import SpeculateSpec, SpeculatorEngine
from specinfer.drafting.datastore import NgramDatastore, sharegpt_datastore
from specinfer.drafting.ssm import SSMDrafter
from specinfer.models import load_ssm
from specinfer.tree import Draft, TokenTree, merge_trees

CORPUS = [
    [1, 2, 3, 4, 5],
    [1, 2, 3, 4, 5],
    [1, 2, 3, 4, 6],
    [9, 2, 3, 7],
    [9, 2, 3, 7],
    [8, 8, 8],
    [10, 11],
]


def test_most_frequent_continuation_of_the_longest_known_context():
    store = NgramDatastore.build(CORPUS, max_n=3, min_count=2)
    assert store.next_token([1, 2, 3]) == 4  # seen 3 times after 1 2 3
    assert store.next_token([2, 3, 4]) == 5  # 5 twice, 6 once
    assert store.next_token([9, 2, 3]) == 7  # the 3-token context decides, not "2 3" alone
    assert store.next_token([5, 2, 3]) == 4  # unknown 3-gram: backs off to "2 3" (4 x3, 7 x2)
    assert store.next_token([6]) is None  # nothing follows 6
    assert store.next_token([10]) is None  # "10 -> 11" seen once: below min_count
    assert NgramDatastore.build(CORPUS, max_n=3, min_count=1).next_token([10]) == 11
    assert store.next_token([7, 8, 8]) == 8  # "8 8 -> 8" once, but "8 -> 8" twice


def test_drafts_chain_and_trees_record_one_hot_proposals():
    store = NgramDatastore.build(CORPUS, max_n=3, min_count=2)
    assert store.draft([7, 1, 2], 5) == [3, 4, 5]  # stops where nothing is known
    assert store.draft([1], 2) == [2, 3]
    tree = store.tree([1, 2], 3, source=5)
    assert tree.paths() == {(3,), (3, 4), (3, 4, 5)}
    assert all(d == [Draft.one_hot(5, 0, t)] for d, t in zip(tree.drafts, tree.tokens,
                                                                  strict=True))
    assert store.tree([1, 2], 3, source=5, vocab_size=4).paths() == {(3,)}  # 4 is outside


def test_save_and_load_round_trip(tmp_path):
    store = NgramDatastore.build(CORPUS, max_n=3, min_count=1)
    store.save(tmp_path / "ds.npz")
    loaded = NgramDatastore.load(tmp_path / "ds.npz")
    assert len(loaded) == len(store)
    for n, (keys, nexts) in store.tables.items():
        assert np.array_equal(loaded.tables[n][0], keys)
        assert np.array_equal(loaded.tables[n][1], nexts)


def test_sharegpt_datastore_is_built_once_then_cached(tmp_chat_tokenizer, tmp_path):
    store = sharegpt_datastore(tmp_chat_tokenizer, max_tokens=30_000, cache_dir=tmp_path)
    assert len(store) > 1000
    assert len(list(tmp_path.glob("*.npz"))) == 1
    again = sharegpt_datastore(tmp_chat_tokenizer, max_tokens=30_000, cache_dir=tmp_path)
    assert len(again) == len(store)
    # Common English continues as English does.
    ids = tmp_chat_tokenizer("Thank you for your")["input_ids"]
    assert store.next_token(ids) is not None


@pytest.fixture(scope="module")
def tmp_chat_tokenizer(tiny_chat_llm):
    from specinfer.models import load_tokenizer

    return load_tokenizer(tiny_chat_llm)


def test_merge_under_a_budget_keeps_the_first_trees_nodes_first():
    a, b = TokenTree.chain([1, 2, 3], source=0), TokenTree.chain([1, 5, 6], source=1)
    assert merge_trees([a, b], max_nodes=4).paths() == {(1,), (1, 2), (1, 2, 3), (1, 5)}
    assert merge_trees([b, a], max_nodes=2).paths() == {(1,), (1, 5)}
    assert merge_trees([a, b]).paths() == a.paths() | b.paths()


def test_speculator_model_free_drafts_fit_the_budget_and_skip_the_ssms(tmp_path):
    ref = save_tiny_llama(tmp_path / "ssm", layers=2)
    model, vocab_ids = load_ssm(ref)
    ssm = SSMDrafter(model, 0, slots=2, max_context=64, vocab_ids=vocab_ids)
    store = NgramDatastore.build([[5, 6, 7, 8, 9]] * 2, max_n=2)
    engine = SpeculatorEngine([ssm], 128, expansion=[2, 1], max_nodes=16, datastore=store,
                              prompt_lookup_depth=3, prompt_lookup_branches=1)
    context = [1, 2, 3, 1, 2, 4, 5, 6]
    cheap = engine.speculate([SpeculateSpec("s", context, expansion=[0], max_nodes=16)])[0]
    assert {d.source for ds in cheap.drafts for d in ds} == {2}  # the datastore; no SSM
    assert cheap.paths() == {(7,), (7, 8), (7, 8, 9)}  # datastore; prompt lookup has nothing
    assert "s" not in ssm.entries  # the SSM did not even run
    small = engine.speculate([SpeculateSpec("t", context, expansion=[0], max_nodes=2)])[0]
    assert small.paths() == {(7,), (7, 8)}
    full = engine.speculate([SpeculateSpec("u", context, max_nodes=15)])[0]
    assert 0 in {d.source for ds in full.drafts for d in ds}
    assert cheap.paths() <= full.paths()


def test_a_smaller_lookup_budget_is_the_first_nodes_of_a_larger_one():
    """The verifier reuses a shadow draft as the next step's tree, cut to that step's
    budget: this holds only because the merged model-free tree is built best first."""
    from specinfer.drafting.model_free import ModelFreeDrafter

    store = NgramDatastore.build([[5, 6, 7, 8, 9], [1, 2, 3, 7, 4]] * 2, max_n=2)
    drafter = ModelFreeDrafter(store, prompt_lookup_depth=4, prompt_lookup_branches=2,
                              datastore_depth=3)
    for context in ([1, 2, 3, 1, 2, 4, 5, 6], [7, 8, 9, 7, 4, 7, 8], [9, 9, 9, 9]):
        big = drafter.tree(context, 8)
        for n in range(1, 9):
            small = drafter.tree(context, n)
            cut = merge_trees([big], max_nodes=n)
            assert (small.tokens, small.parents) == (cut.tokens, cut.parents)

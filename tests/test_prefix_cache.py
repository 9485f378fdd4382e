"""Automatic prefix caching on the verifier engine (tiny random Llama): the block index,
greedy output identical with caching on and off in every CPU format (a prefix held by a
live sequence, by a finished one, in part, after a restart), the draft head's features
reused with the KV, eviction under pressure, tenants' salts, and no speculation tax."""

from __future__ import annotations

import pytest
import torch

from services.verifier.engine import EngineConfig, PrefillSpec, StepItem
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from services.verifier.prefix_cache import PrefixIndex
from specinfer.drafting import DraftPlan
from specinfer.errors import ResourceExhausted
from specinfer.placement import resolve

CONFIG = EngineConfig(max_context=160, slots=4, max_tree_nodes=16, block_size=8)
SYSTEM = [(7 * i + 3) % 120 + 5 for i in range(45)]  # a shared "system prompt"


def engine_for(llm: str, fmt: str = "float32", caching: bool = True, **kw):
    placement = resolve("cpu", quantize="int8") if fmt == "int8" else resolve("cpu", fmt)
    config = EngineConfig(**{**CONFIG.__dict__, "prefix_caching": caching, **kw})
    return build_engine(llm, config, placement=placement)


def test_the_index_finds_whole_blocks_and_compares_tokens():
    index = PrefixIndex(4, "model|float32")
    held = list(range(1, 15))  # 3 whole blocks and 2 tokens
    index.index(0, held, len(held), "")
    assert index.lookup(held[:12] + [99], "") == (12, 0)
    assert index.lookup(held[:12], "") == (8, 0)  # the last token is always computed
    assert index.lookup(held[:6] + [99] * 6, "") == (4, 0)  # diverges in block 2
    assert index.lookup([1, 2, 3], "") == (0, None)  # shorter than a block
    assert index.lookup(held, "tenant-b") == (0, None)  # another salt shares nothing
    # A hash that names a slot holding other tokens (a collision) is a miss.
    index.index(1, [50, 51, 52, 53, 54], 5, "")
    third = index.hashes(held, "", 3)[2]
    index.by_hash[third] = {1}
    assert index.lookup(held, "") == (0, None)
    index.by_hash[third] = {0}
    index.drop(0)
    index.drop(1)
    assert not index.by_hash and not index.held


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_greedy_output_is_the_same_with_caching_on_and_off(tiny_llama, fmt):
    """Each prompt shares SYSTEM (a prefix held by a live sequence, then by finished ones)
    or part of it; against the same format's uncached run. The last, after a restart (a
    fresh engine), reuses nothing and still matches."""
    prompts = [SYSTEM + [9, 10, 11], SYSTEM + [12, 13], SYSTEM[:20] + [14, 15, 16, 17],
               SYSTEM + [9, 10, 11, 18]]
    off = engine_for(tiny_llama, fmt, caching=False)
    want = [generate_local(off, [p], 12)[0].token_ids for p in prompts]
    on = engine_for(tiny_llama, fmt)
    first = generate_local(on, prompts[:2], 12)  # in one batch: the second reuses the first
    assert [r.token_ids for r in first] == want[:2]
    got = [generate_local(on, [p], 12)[0].token_ids for p in prompts[2:]]
    assert got == want[2:]
    out = on.prefill([PrefillSpec("again", prompts[1])])[0]
    assert out.reused_tokens == 40  # 5 whole blocks of the 46 - 1 tokens computable
    assert out.token == want[1][0]
    restarted = engine_for(tiny_llama, fmt)
    assert restarted.prefill([PrefillSpec("r", prompts[0])])[0].reused_tokens == 0


def test_a_finished_sequence_is_reused_and_gives_way_to_new_ones(tiny_llama):
    engine = engine_for(tiny_llama, slots=2)
    a = engine.prefill([PrefillSpec("a", SYSTEM + [1])])[0]
    engine.step([StepItem("a", a.token)])
    engine.release(["a"])
    assert engine.info()["kv_cached_tokens"] == len(SYSTEM) + 2  # prompt, 1st, stepped
    b = engine.prefill([PrefillSpec("b", SYSTEM + [2, 3])])[0]
    assert b.reused_tokens == 40  # copied into the free slot; "a"'s stays kept
    assert len(engine.kept) == 1
    engine.prefill([PrefillSpec("c", [5, 6, 7])])  # no free slot: "a"'s prefix gives way
    assert not engine.kept and set(engine.sequences) == {"b", "c"}
    with pytest.raises(ResourceExhausted, match="KV cache full"):
        engine.prefill([PrefillSpec("d", [1, 2, 3])])
    assert set(engine.sequences) == {"b", "c"}  # nothing live was touched
    engine.release(["b"])
    # The last slot, kept by "b", holds the prefix "e" needs: taken as it is.
    assert engine.prefill([PrefillSpec("e", SYSTEM + [4])])[0].reused_tokens == 40


def test_eviction_under_pressure_keeps_admitting(tiny_llama):
    """Every slot filled with kept prefixes: new sequences are still admitted, the least
    recently kept prefix first."""
    engine = engine_for(tiny_llama)
    for i in range(4):
        generate_local(engine, [[i + 1] * 20 + [50 + i]], 2)
    assert len(engine.kept) == 4 and not engine.free_slots
    oldest = next(iter(engine.kept.values())).tokens
    out = engine.prefill([PrefillSpec(f"n{i}", [99, i + 1, 3]) for i in range(3)])
    assert len(out) == 3 and len(engine.kept) == 1
    assert next(iter(engine.kept.values())).tokens != oldest
    assert engine.info()["kv_free_tokens"] == engine.capacity_tokens - engine.used_tokens


def test_salts_keep_tenants_apart(tiny_llama):
    engine = engine_for(tiny_llama)
    generate_local(engine, [SYSTEM + [1]], 2)
    assert engine.prefill([PrefillSpec("x", SYSTEM + [2], cache_salt="tenant")])[0] \
        .reused_tokens == 0
    assert engine.prefill([PrefillSpec("y", SYSTEM + [3])])[0].reused_tokens == 40
    assert engine.prefill([PrefillSpec("z", SYSTEM + [4], cache_salt="tenant")])[0] \
        .reused_tokens == 40


def test_speculation_pays_no_tax_and_the_head_drafts_the_same(tiny_chat_llm, tiny_chat_head):
    """Only accepted tokens are indexed (a tree's tokens never are): the same workload
    reuses the same tokens with speculation on and off; a cache hit hands the draft head
    the features it would have computed, so its trees accept the same tokens per step as
    with caching off."""
    prompts = [SYSTEM + [9, 10], SYSTEM + [9, 10, 11], SYSTEM[:30] + [12], SYSTEM + [13]]

    def run(caching: bool, draft: DraftPlan | None):
        engine = build_engine(tiny_chat_llm, EngineConfig(
            max_context=160, slots=4, max_tree_nodes=16, block_size=8,
            prefix_caching=caching), head=tiny_chat_head)
        out = [generate_local(engine, [p], 24, draft=draft)[0] for p in prompts]
        return [r.reused_tokens for r in out], [(r.token_ids, r.accepted_per_step) for r in out]

    plan = DraftPlan(("head", "model_free"), 12)
    spec_hits, spec_steps = run(True, plan)
    plain_hits, plain_steps = run(True, None)
    assert spec_hits == plain_hits and sum(spec_hits) > 100
    assert [t for t, _ in spec_steps] == [t for t, _ in plain_steps]
    assert any(max(acc) > 1 for _, acc in spec_steps)
    cold_hits, cold_steps = run(False, plan)
    assert sum(cold_hits) == 0 and cold_steps == spec_steps


def test_a_hit_hands_the_draft_head_the_features_a_miss_computes(tiny_chat_llm,
                                                                 tiny_chat_head):
    features = []
    for caching in (True, False):
        engine = build_engine(tiny_chat_llm, EngineConfig(
            max_context=160, slots=4, max_tree_nodes=16, block_size=8,
            prefix_caching=caching), head=tiny_chat_head)
        generate_local(engine, [SYSTEM + [9]], 4)
        out = engine.prefill([PrefillSpec("s", SYSTEM + [10, 11])])[0]
        assert out.reused_tokens == (40 if caching else 0)
        seq = engine.sequences["s"]
        features.append(seq.features[: seq.cached].float())
    assert torch.allclose(features[0], features[1], atol=1e-5)

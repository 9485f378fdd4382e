"""Boost-tuning end to end on a tiny LLM (SmolLM2's tokenizer, random small weights) and a
tiny slice of the ShareGPT prompts: the trained pool must match the LLM more often than
the untrained truncation, and the written SSMs load and draft."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from specinfer.data import mtbench_questions, select_conversations
from specinfer.drafting import DraftRequest
from specinfer.drafting.head import load_head
from specinfer.drafting.ssm import SSMDrafter
from specinfer.models import load_model, load_ssm
from specinfer.training.boost import (
    BoostConfig,
    boost_tune,
    llm_top1,
    load_chunks,
)
from specinfer.training.examples import answer_example
from specinfer.training.head import HeadConfig, head_covers, train_head_pipeline


def test_prompts_exclude_mtbench():
    conversations, held = select_conversations(500, 50)
    train = [turns[0]["value"].strip() for turns in conversations]
    assert len(train) == 500 and len(held) == 50 and not set(train) & set(held)
    banned = {t.strip().lower() for q in mtbench_questions() for t in q["turns"]}
    assert not {p.lower() for p in train + held} & banned


@pytest.mark.slow  # trains a pool of SSMs and a draft head
@pytest.mark.matrix  # 45 s: the training pipeline end to end (its parts are tested here)
def test_boost_tuning_improves_the_pool_and_writes_loadable_ssms(tiny_chat_llm, tmp_path):
    cfg = BoostConfig(llm=tiny_chat_llm, out=tmp_path / "pool", pool_size=2, layers=1,
                      vocab=512, prompts=64, heldout=16, distill_tokens=4000, max_seq=128,
                      new_tokens=24, gen_batch=16, chunk=16, epochs=4, train_batch=8, lr=3e-3,
                      max_minutes=10.0)  # a bound that never binds: all 64 answers
    report = boost_tune(cfg)
    assert report["vocab"] > 20  # the LLM's answers are varied enough to learn from
    best = report["ssms"][-1]["pool_heldout_match"]
    assert best > report["untrained_match"] + 0.1, report
    assert json.loads((tmp_path / "pool" / "report.json").read_text()) == report
    # Resumable: a second run reuses the data and the trained SSMs.
    assert boost_tune(cfg)["ssms"] == report["ssms"]
    model, vocab_ids = load_ssm(str(tmp_path / "pool" / "ssm-1"))
    assert model.config.num_hidden_layers == 1 and len(vocab_ids) == report["vocab"]
    tree = SSMDrafter(model, vocab_ids=vocab_ids, llm_vocab_size=49152, max_context=256,
                      slots=1).propose([DraftRequest("s", [1, 2, 3], [2, 1])])[0]
    assert len(tree) == 4 and set(tree.tokens) <= set(vocab_ids.tolist())

    # A draft head on the LLM's features, from this run's answers: it learns to match the
    # LLM (this random LLM's flat distributions are hard to match: 0.08 against 0.0 here),
    # shares the pool's vocabulary, and is written loadable.
    head_report = train_head_pipeline(HeadConfig(data=tmp_path / "pool", out=tmp_path / "head",
                                                 epochs=20, lr=5e-3,
                                                 conversation_positions=2000))
    assert head_report["heldout_match"]["level1"] > \
        head_report["untrained_match"]["level1"] + 0.04, head_report
    head = load_head(tmp_path / "head" / "head", load_model(tiny_chat_llm))
    assert torch.equal(head.vocab_ids, vocab_ids.long())
    # Continued training starts from that head: with a zero learning rate it stays it (up
    # to float16 rounding); a fresh head would be back at the untrained rate.
    again = train_head_pipeline(HeadConfig(data=tmp_path / "pool", out=tmp_path / "head2",
                                           epochs=0.1, lr=0.0, conversation_positions=0,
                                           init=tmp_path / "head" / "head"))
    for level in ("level1", "level2"):
        assert abs(again["init_match"][level] - head_report["heldout_match"][level]) < 0.02
        assert abs(again["heldout_match"][level] - head_report["heldout_match"][level]) < 0.02
    with pytest.raises(ValueError, match="--init"):
        train_head_pipeline(HeadConfig(data=tmp_path / "pool", out=tmp_path / "head3",
                                       init=tmp_path / "pool"))

    # Boosting against that head (--complement): what the run counts as covered is the
    # head's own level-1 agreement on the held-out answers (the same positions; the head
    # run reads bfloat16 features, hence the tolerance), a wider top-k covers more, and the
    # pool together with the head covers more than either.
    held = [answer_example(s) for s in load_chunks(cfg, "heldout")]
    want = [llm_top1(e) for e in held]
    top1, top3 = (head_covers(head, held, want, k) for k in (1, 3))
    share = sum(int(h.sum()) for h in top1) / sum(len(h) for h in top1)
    assert abs(share - head_report["heldout_match"]["level1"]) < 0.03, share
    assert all(bool((wide >= narrow).all()) for wide, narrow in zip(top3, top1, strict=True))
    comp = tmp_path / "comp"
    comp.mkdir()
    shutil.copytree(tmp_path / "pool" / "data", comp / "data")
    shutil.copy(tmp_path / "pool" / "prompts.json", comp / "prompts.json")
    comp_cfg = dataclasses.replace(cfg, out=comp, epochs=1, complement=tmp_path / "head" / "head")
    comp_report = boost_tune(comp_cfg)
    covered = comp_report["complement"]["heldout_covered"]
    assert abs(covered - share) < 0.01, comp_report
    last = comp_report["ssms"][-1]
    assert last["with_head_heldout_match"] >= max(covered, last["pool_heldout_match"])
    assert last["with_head_heldout_match"] > covered, comp_report  # the pool adds hits
    with pytest.raises(ValueError, match="--complement"):
        boost_tune(dataclasses.replace(comp_cfg, out=tmp_path / "bad0",
                                       complement=tmp_path / "pool"))

    # Warm start: a new pool continues from this one's SSMs and vocabulary. With a zero
    # learning rate its SSMs match the LLM as the earlier ones did (up to int8 rounding);
    # a cold start would be back at the untrained rate.
    warm = tmp_path / "warm"
    warm.mkdir()
    shutil.copytree(tmp_path / "pool" / "data", warm / "data")
    shutil.copy(tmp_path / "pool" / "prompts.json", warm / "prompts.json")
    warm_cfg = dataclasses.replace(cfg, out=warm, init=tmp_path / "pool", lr=0.0, epochs=0.1)
    warm_report = boost_tune(warm_cfg)
    assert warm_report["vocab"] == report["vocab"]
    for earlier, now in zip(report["ssms"], warm_report["ssms"], strict=True):
        assert abs(now["heldout_match"] - earlier["heldout_match"]) < 0.02, warm_report
    assert (load_ssm(str(warm / "ssm-1"))[1] == vocab_ids).all()
    with pytest.raises(ValueError, match="fewer than --layers 2"):
        boost_tune(dataclasses.replace(warm_cfg, out=tmp_path / "bad", layers=2))


def test_warm_start_cuts_a_deeper_pool_to_the_layers_asked(tiny_chat_llm, tmp_path):
    import torch

    from specinfer.training.boost import init_ssm, save_ssm, start_ssm

    vocab_ids = torch.arange(0, 600, 3)
    cfg = BoostConfig(llm=tiny_chat_llm, out=tmp_path / "new", layers=2)
    save_ssm(init_ssm(tiny_chat_llm, 2, vocab_ids), vocab_ids, cfg, tmp_path / "old" / "ssm-1",
             {"pool_index": 1})
    deep, _ = load_ssm(str(tmp_path / "old" / "ssm-1"))
    shallow = start_ssm(dataclasses.replace(cfg, layers=1, init=tmp_path / "old"), 1, vocab_ids)
    assert shallow.config.num_hidden_layers == 1 and len(shallow.model.layers) == 1
    kept, source = shallow.state_dict(), deep.state_dict()
    assert not any(".layers.1." in name for name in kept)
    for name, tensor in kept.items():  # layer 0, the norm and the head come from the deep SSM
        assert torch.equal(tensor, source[name]), name

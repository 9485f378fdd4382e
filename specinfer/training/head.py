"""Training the draft head (``specinfer train-head``; the head itself is
``specinfer.drafting.head.DraftHead``).

Training data, from a ``specinfer boost-tune`` run (ShareGPT, MT-Bench removed): the LLM's
own greedy answers to the run's training prompts (``data/train-*.pt``), then ShareGPT
conversations teacher-forced (the run's training split, then more under the same filter:
the LLM reads the ShareGPT assistant turns, as EAGLE trains on a fixed dataset); the LLM's
features are computed once and cached. Loss: the LLM's next-token distribution (over
``vocab_ids``) plus a feature regression, with uniform noise on the input features as
EAGLE does, at draft level 1 and at deeper levels unrolled as a draft chain sees them
(the head's own features, EAGLE-3's training-time test). Held out: the LLM's answers to
the run's held-out prompts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specinfer.data import select_conversations
from specinfer.drafting.head import HEAD_MANIFEST, DraftHead, load_head
from specinfer.layers import rotate_half
from specinfer.models import ModelError, load_model, load_tokenizer, pool_vocab
from specinfer.training.examples import (
    answer_example,
    conversation_examples,
    hidden_batches,
    optimizer_step,
)

log = logging.getLogger(__name__)


def head_forward(head: DraftHead, features: torch.Tensor, tokens: torch.Tensor,
                 earlier: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Training form, over whole sequences: ``features [B, T, H]`` (of the token before
    each of ``tokens [B, T]``) to (normed outputs, logits over ``vocab_ids``, this
    pass's keys and values). Plain causal attention reads the LLM's features; with the
    keys and values of ``earlier`` passes (pass 1 on the LLM's features, then each
    deeper level), position i is the last node of a chain drafted ``len(earlier)``
    levels past the true context, as a draft tree sees it (``unrolled_attention``)."""
    body = head.llm.model
    x = head.fc(torch.cat([features, body.embed_tokens(tokens)], -1))
    b, t, _ = x.shape
    cos, sin = body.rotary_emb(x, torch.arange(t)[None].expand(b, t))
    cos, sin = cos[:, None], sin[:, None]
    attn, head_dim = head.layer.self_attn, head.layer.self_attn.head_dim
    y = head.layer.input_layernorm(x)
    q, k, v = (proj(y).view(b, t, -1, head_dim).transpose(1, 2)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    if earlier:
        out = unrolled_attention(q, [*earlier, (k, v)])
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    x = x + head.layer.mlp(head.layer.post_attention_layernorm(x))
    normed = body.norm(x)
    return normed, head.lm_head(normed), (k, v)


def unrolled_attention(q: torch.Tensor, passes: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> torch.Tensor:
    """Attention of pass s = ``len(passes)`` (queries ``q [B, heads, T, D]``) as the
    s-th level of a chain: position i was drafted from the true context up to position
    i - s + 1 (pass 1's keys there), then one node per level (pass u's key at position
    i - s + u). EAGLE-3's "training-time test", written out."""
    s, t = len(passes), q.shape[2]
    group = q.shape[1] // passes[0][0].shape[1]
    keys = [k.repeat_interleave(group, 1) for k, _ in passes]
    values = [v.repeat_interleave(group, 1) for _, v in passes]
    scale = q.shape[-1] ** -0.5

    def shifted(x: torch.Tensor, by: int) -> torch.Tensor:  # row i holds x's row i - by
        return F.pad(x, (0, 0, by, 0))[:, :, :t]

    context = (q @ keys[0].transpose(-1, -2)) * scale
    allowed = torch.ones(t, t, dtype=torch.bool).tril(-(s - 1))
    scores = [context.masked_fill(~allowed, float("-inf"))]
    rows = torch.arange(t)[:, None]
    for u in range(2, s + 1):
        node = (q * shifted(keys[u - 1], s - u)).sum(-1, keepdim=True) * scale
        scores.append(node.masked_fill(rows < s - u, float("-inf")))
    weights = torch.cat(scores, -1).softmax(-1)
    out = weights[..., :t] @ values[0]
    for u in range(2, s + 1):
        out = out + weights[..., t + u - 2 : t + u - 1] * shifted(values[u - 1], s - u)
    return out


def save_head(head: DraftHead, path: Path, llm_ref: str, report: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous()
             for k, v in head.state_dict().items() if not k.startswith("lm_head.")}
    state["vocab_ids"] = head.vocab_ids.to(torch.int32)
    save_file(state, str(path / "head.safetensors"))
    (path / HEAD_MANIFEST).write_text(json.dumps({
        "base": llm_ref, "weights": "head.safetensors", "vocab_size": len(head.vocab_ids),
        "hidden_size": head.fc.out_features}, indent=2))
    (path / "report.json").write_text(json.dumps(report, indent=2))


@dataclasses.dataclass
class HeadConfig:
    data: Path  # a boost-tune output directory: its data/train-*.pt and heldout-*.pt
    out: Path
    llm: str = ""  # default: the boost-tune run's
    epochs: float = 1.5
    lr: float = 2e-3
    batch: int = 8
    feature_weight: float = 1.0  # the regression loss's weight (the distribution's is 1)
    noise: float = 0.1  # uniform noise on input features, [-noise/2, noise/2]
    # Draft levels trained: level u reads the head's own features of level u - 1, with
    # attention as a chain drafted that deep sees it (level 1's loss weighs 1).
    levels: int = 2
    deeper_weight: float = 0.5
    seed: int = 0
    # Teacher-forced conversations beside the answers: the boost-tune run's training
    # conversations, then more of ShareGPT, in chunks of 64 until this many assistant
    # positions (0: none).
    conversation_positions: int = 1_200_000
    max_seq: int = 512  # conversations are cut to this many tokens
    init: Path | None = None  # continue training this head (its vocabulary is kept)


@torch.inference_mode()
def llm_features(llm, sequences: list[list[int]], batch: int = 8) -> list[torch.Tensor]:
    """The LLM's normed last hidden state of every token, per sequence (bfloat16)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # 2x faster; noise is trained in
        for idx, _, hidden in hidden_batches(llm, sequences, batch):
            for j, i in enumerate(idx):
                out[i] = hidden[j, : len(sequences[i])].to(torch.bfloat16).clone()
    return out


def training_conversations(run: Path) -> list[tuple[str, list[list[dict]]]]:
    """A boost-tune run's training conversations (its ``prompts.json``), then the rest of
    ShareGPT under the same filter (English, MT-Bench removed), less the run's held-out
    prompts: named groups, in a fixed order."""
    split = json.loads((run / "prompts.json").read_text())
    taken = {p.strip().lower() for p in split["heldout"]}
    taken |= {t[0]["value"].strip().lower() for t in split["train"]}
    everything, _ = select_conversations(prompts=10**9, heldout=0)
    rest = [t for t in everything if t[0]["value"].strip().lower() not in taken]
    return [("conversations", split["train"]), ("sharegpt", rest)]


def _examples(llm, sources: list[tuple[str, Callable[[], list[dict]]]], cache: Path,
              desc: str, max_positions: int = 0) -> list[dict]:
    """Examples (``ids``, ``pos``, ``features``) from named sources of ``ids``/``pos``
    items, the LLM's features cached per source so an interrupted run resumes; stops
    after ``max_positions`` training positions (0: all)."""
    cache.mkdir(parents=True, exist_ok=True)
    out: list[dict] = []
    positions = 0
    for name, load in tqdm(sources, desc=desc, unit="chunk"):
        if max_positions and positions >= max_positions:
            break
        cached = cache / f"{name}.pt"
        if not cached.exists():
            items = load()
            feats = llm_features(llm, [e["ids"] for e in items])
            items = [{"ids": torch.tensor(e["ids"]), "pos": torch.tensor(e["pos"]),
                      "features": f} for e, f in zip(items, feats, strict=True)]
            tmp = cached.with_suffix(".tmp")
            torch.save(items, tmp)
            tmp.replace(cached)
        chunk = torch.load(cached)
        out.extend(chunk)
        positions += sum(len(e["pos"]) for e in chunk)
    return out


def _batch(examples: list[dict]):
    """Inputs (feature of token j-1, token j), targets (the LLM's feature of token j) and
    the training mask (outputs whose target feature is at a training position) for a
    padded batch."""
    width = max(len(e["ids"]) for e in examples) - 1
    hidden = examples[0]["features"].shape[-1]
    feats = torch.zeros(len(examples), width, hidden)
    target = torch.zeros(len(examples), width, hidden)
    tokens = torch.zeros(len(examples), width, dtype=torch.long)
    answer = torch.zeros(len(examples), width, dtype=torch.bool)
    for j, e in enumerate(examples):
        n = len(e["ids"]) - 1
        feats[j, :n] = e["features"][:n].float()
        target[j, :n] = e["features"][1:].float()
        tokens[j, :n] = e["ids"][1:]
        # Output i's target is the feature at position i + 1.
        pos = e["pos"][(e["pos"] >= 1) & (e["pos"] <= n)]
        answer[j, pos - 1] = True
    return feats, tokens, target, answer


def _unrolled(head: DraftHead, feats: torch.Tensor, tokens: torch.Tensor, levels: int):
    """(normed, logits) of each draft level: level 1 reads the LLM's features; level u
    reads the head's own output of level u - 1 for the token before (its parent), with
    attention as a chain drafted u - 1 levels past the true context."""
    inputs, earlier, out = feats, [], []
    for _ in range(levels):
        normed, logits, kv = head_forward(head, inputs, tokens, earlier)
        out.append((normed, logits))
        earlier.append(kv)
        inputs = torch.cat([feats[:, :1], normed[:, :-1]], 1)
    return out


@torch.no_grad()
def head_match(head: DraftHead, examples: list[dict], levels: int = 3) -> dict[str, float]:
    """How often the head's top-1 is the LLM's greedy next token at answer positions, per
    draft level (``level1`` from the LLM's features; deeper levels from the head's own, as
    a draft chain reads them; each given that the tokens before it are right)."""
    weight = head.llm.lm_head.weight
    hits, total = [0] * levels, [0] * levels
    for start in range(0, len(examples), 8):
        feats, tokens, target, answer = _batch(examples[start : start + 8])
        want = (target @ weight.T).argmax(-1)
        for u, (_, logits) in enumerate(_unrolled(head, feats, tokens, levels)):
            valid = answer.clone()
            valid[:, :u] = False  # no chain u levels deep ends there
            hits[u] += int(((head.vocab_ids[logits.argmax(-1)] == want) & valid).sum())
            total[u] += int(valid.sum())
    return {**{f"level{u + 1}": hits[u] / max(1, total[u]) for u in range(levels)},
            "positions": total[0]}


@torch.no_grad()  # not inference_mode: boost-tuning updates the masks in place
def head_covers(head: DraftHead, examples: list[dict], want: list[torch.Tensor], topk: int,
                batch: int = 8) -> list[torch.Tensor]:
    """Per example, whether the LLM's token ``want`` at each of its positions is among the
    head's level-1 top-``topk`` there (the head reading the LLM's own features, as the
    verifier drafts): what a draft head's tree already covers, so that an SSM pool can be
    boost-tuned on the rest. Position 0 has no feature before it: never covered."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(examples)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for idx, ids, hidden in hidden_batches(head.llm, [e["ids"] for e in examples], batch):
            # Output t reads (feature of token t, token t + 1): it predicts position t + 1.
            _, logits, _ = head_forward(head, hidden[:, :-1], ids[:, 1:])
            top = head.vocab_ids[logits.float().topk(topk, dim=-1).indices]
            for j, i in enumerate(idx):
                pos = torch.as_tensor(examples[i]["pos"])
                hit = torch.zeros(len(pos), dtype=torch.bool)
                inner = pos >= 1
                hit[inner] = (top[j, pos[inner] - 1] == want[i][inner, None]).any(-1)
                out[i] = hit
    return out


def train_head(head: DraftHead, examples: list[dict], cfg: HeadConfig) -> None:
    params = [p for n, p in head.named_parameters() if not n.startswith("lm_head.")]
    for p in params:
        p.requires_grad_(True)
    head.train()
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    batches = [order[i : i + cfg.batch] for i in range(0, len(order), cfg.batch)]
    steps = max(1, math.ceil(len(batches) * cfg.epochs))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps,
                                                pct_start=0.05)
    rng = random.Random(cfg.seed)
    head_rows = head.lm_head.weight
    bar = tqdm(total=steps, desc="draft head", unit="step")
    done = 0
    while done < steps:
        rng.shuffle(batches)
        for chosen in batches[: steps - done]:
            feats, tokens, target, answer = _batch([examples[i] for i in chosen])
            feats = feats + cfg.noise * (torch.rand_like(feats) - 0.5)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                levels = _unrolled(head, feats, tokens, cfg.levels)
            losses = []
            for u, (normed, logits) in enumerate(levels):
                valid = answer.clone()
                valid[:, :u] = False
                with torch.no_grad():
                    want = (target[valid] @ head_rows.T).softmax(-1)
                ce = -(want * F.log_softmax(logits[valid].float(), -1)).sum(-1).mean()
                reg = F.smooth_l1_loss(normed[valid].float(), target[valid])
                losses.append((ce + cfg.feature_weight * reg) * (1.0 if u == 0 else
                                                                 cfg.deeper_weight))
            optimizer_step(opt, sched, params, sum(losses))
            done += 1
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses).item():.3f}")
    bar.close()
    head.eval().requires_grad_(False)


def train_head_pipeline(cfg: HeadConfig) -> dict:
    """The LLM's features over a boost-tune run's answers and training conversations, a
    trained head, and its report (held out: the answers to the run's held-out prompts)."""
    for flag, value, ok in [("--levels", cfg.levels, cfg.levels >= 1),
                            ("--epochs", cfg.epochs, cfg.epochs > 0),
                            ("--conversation-positions", cfg.conversation_positions,
                             cfg.conversation_positions >= 0)]:
        if not ok:
            raise ModelError(f"{flag}: {value} is out of range (levels >= 1, epochs > 0, "
                             "conversation positions >= 0)")
    data = cfg.data / "data"
    train_chunks = sorted(data.glob("train-*.pt"))
    held_chunks = sorted(data.glob("heldout-*.pt"))
    if not train_chunks or not held_chunks:
        raise ModelError(f"--data {str(cfg.data)!r}: no LLM answers there (data/train-*.pt "
                         "and data/heldout-*.pt, written by `specinfer boost-tune "
                         "--max-minutes M`)")
    if cfg.init is not None and not (cfg.init / HEAD_MANIFEST).exists():
        raise ModelError(f"--init {str(cfg.init)!r}: no {HEAD_MANIFEST} there (a "
                         "`specinfer train-head` output's head/ directory)")
    if cfg.init is None and not (cfg.data / "ssm-1").exists():
        raise ModelError(f"--data {str(cfg.data)!r}: no trained ssm-1 whose vocabulary the "
                         "head shares")
    llm_ref = cfg.llm or json.loads((cfg.data / "report.json").read_text())["llm"]
    torch.manual_seed(cfg.seed)
    llm = load_model(llm_ref)
    head = load_head(cfg.init, llm) if cfg.init else DraftHead(llm, pool_vocab(cfg.data))
    vocab_ids = head.vocab_ids

    def answers(path: Path) -> tuple[str, Callable[[], list[dict]]]:
        return path.stem, lambda: [answer_example(s) for s in torch.load(path)]

    cache = cfg.out / "features"
    train = _examples(llm, [answers(p) for p in train_chunks], cache, "LLM features (answers)")
    if cfg.conversation_positions:
        tokenizer = load_tokenizer(llm_ref)
        sources = []
        for name, conversations in training_conversations(cfg.data):
            chunks = [conversations[i : i + 64] for i in range(0, len(conversations), 64)]
            sources += [(f"{name}-{k:05d}",
                         lambda c=c: conversation_examples(tokenizer, c, cfg.max_seq))
                        for k, c in enumerate(chunks)]
        train += _examples(llm, sources, cache, "LLM features (conversations)",
                           cfg.conversation_positions)
    held = _examples(llm, [answers(p) for p in held_chunks], cache, "LLM features (held-out)")
    before = head_match(head, held)
    train_head(head, train, cfg)
    report = {"llm": llm_ref, "vocab": len(vocab_ids), "epochs": cfg.epochs, "lr": cfg.lr,
              "init": str(cfg.init) if cfg.init else None,
              "levels": cfg.levels, "train_sequences": len(train),
              "train_positions": sum(len(e["pos"]) for e in train),
              "heldout_match": head_match(head, held),
              "init_match" if cfg.init else "untrained_match": before,
              "conversation_positions": cfg.conversation_positions,
              "data": f"the LLM's greedy answers in {cfg.data}/data (boost-tune), then "
                      f"ShareGPT conversations teacher-forced ({cfg.data}/prompts.json's "
                      "training split first; MT-Bench and held-out prompts removed)"}
    save_head(head, cfg.out / "head", llm_ref, report)
    log.info("draft head trained", extra={"heldout_match": report["heldout_match"]})
    return report

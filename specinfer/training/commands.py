"""The training commands' flags: ``specinfer boost-tune`` and ``specinfer train-head``."""

from __future__ import annotations

import argparse

from specinfer.models import DEFAULT_LLM


def add_boost_args(p: argparse.ArgumentParser) -> None:
    from specinfer.training.boost import BoostConfig

    d = BoostConfig(llm=DEFAULT_LLM, out=None)
    p.add_argument("--llm", default=DEFAULT_LLM)
    p.add_argument("--out", required=True, help="output directory (resumable)")
    p.add_argument("--pool-size", type=int, default=d.pool_size)
    p.add_argument("--layers", type=int, default=d.layers, help="decoder layers per SSM")
    p.add_argument("--vocab", type=int, default=d.vocab, help="SSM head vocabulary size")
    p.add_argument("--prompts", type=int, default=d.prompts,
                   help="training conversations to draw from")
    p.add_argument("--heldout", type=int, default=d.heldout, help="held-out prompts")
    p.add_argument("--distill-tokens", type=int, default=d.distill_tokens,
                   help="assistant tokens whose LLM distributions are learned (0 = all)")
    p.add_argument("--topk", type=int, default=d.topk, help="LLM probabilities kept per token")
    p.add_argument("--max-seq", type=int, default=d.max_seq, help="tokens per conversation")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens)
    p.add_argument("--gen-batch", type=int, default=d.gen_batch)
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="also generate on-policy training answers for this long (0 = none)")
    p.add_argument("--init", default=None,
                   help="warm start: an earlier pool directory whose SSMs (cut to --layers) "
                        "and vocabulary continue training on this run's data")
    p.add_argument("--complement", default=None, metavar="HEADDIR",
                   help="boost against a draft head (e.g. the bundled head/): positions where "
                        "its level-1 top-k has the LLM's top-1 count as covered, so the pool "
                        "learns what the merged mode's head tree misses")
    p.add_argument("--complement-topk", type=int, default=d.complement_topk,
                   help="the head's top-k that counts as covering a position")


def boost_tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specinfer.training.boost import BoostConfig, boost_tune

    cfg = BoostConfig(llm=args.llm, out=Path(args.out), pool_size=args.pool_size,
                      layers=args.layers, vocab=args.vocab, prompts=args.prompts,
                      heldout=args.heldout, distill_tokens=args.distill_tokens,
                      topk=args.topk, max_seq=args.max_seq, new_tokens=args.new_tokens,
                      gen_batch=args.gen_batch, epochs=args.epochs, lr=args.lr,
                      max_minutes=args.max_minutes,
                      init=Path(args.init) if args.init else None,
                      complement=Path(args.complement) if args.complement else None,
                      complement_topk=args.complement_topk)
    report = boost_tune(cfg)
    import json

    print(json.dumps(report, indent=2))
    return 0


def add_head_args(p: argparse.ArgumentParser) -> None:
    from specinfer.training.head import HeadConfig

    d = HeadConfig(data=None, out=None)
    p.add_argument("--data", required=True,
                   help="a boost-tune output directory with the LLM's answers (data/train-*.pt, "
                        "from --max-minutes) and a trained ssm-1 (whose vocabulary it shares)")
    p.add_argument("--out", required=True, help="output directory; the head goes to OUT/head")
    p.add_argument("--llm", default="", help="default: the boost-tune run's LLM")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--conversation-positions", type=int, default=d.conversation_positions,
                   help="also train on ShareGPT conversations, teacher-forced (the run's "
                        "training split in prompts.json first, then the rest of the filtered "
                        "set), in chunks of 64 conversations until this many assistant "
                        "positions (0: none)")
    p.add_argument("--levels", type=int, default=d.levels,
                   help="draft levels trained (deeper ones read the head's own features)")
    p.add_argument("--init", default=None,
                   help="continue training a head (a train-head output's head/ directory; "
                        "its vocabulary is kept)")


def train_head(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from specinfer.training.head import HeadConfig, train_head_pipeline

    report = train_head_pipeline(HeadConfig(data=Path(args.data), out=Path(args.out),
                                            llm=args.llm, epochs=args.epochs, lr=args.lr,
                                            conversation_positions=args.conversation_positions,
                                            levels=args.levels,
                                            init=Path(args.init) if args.init else None))
    print(json.dumps(report, indent=2))
    return 0

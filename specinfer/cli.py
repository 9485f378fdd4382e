"""The ``specinfer`` command (DESIGN.md §6)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from specinfer.models import DEFAULT_LLM, ModelError

log = logging.getLogger("specinfer")
# The router's --speculation modes (services.router.scheduler.SPECULATION_CHOICES; named
# here so the CLI starts without importing torch).
SPECULATION = ("adaptive", "always", "overlap", "lookup", "head")
DATASTORE_CHOICES = ("auto (the ShareGPT datastore for the LLM's tokenizer, built once and "
                     "cached; none if the LLM has no tokenizer), none, or a saved .npz")


def _add_verifier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM, help="model directory, .gguf file or alias")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50053)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (DeepSpeed AutoTP)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="pipeline micro-batches per step (pp > 1)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--slots", type=int, default=8, help="sequences held in the KV cache at once")
    p.add_argument("--max-tree-nodes", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0 = auto)")
    p.add_argument("--datastore", default="auto",
                   help="corpus drafts for Verify items that ask the verifier to draft: " +
                        DATASTORE_CHOICES)
    p.add_argument("--draft-head", default="auto",
                   help="a draft head on the LLM's features (specinfer train-head): auto (the "
                        "bundled one for the LLM, if any, with --tp 1 --pp 1), none, or a "
                        "directory")
    p.add_argument("--head-tree", choices=("dynamic", "static"), default="dynamic",
                   help="the draft head's tree for greedy sequences: dynamic (its most "
                        "probable paths, EAGLE-2 style) or static (--head-expansion); "
                        "sampled sequences always get the static one")
    p.add_argument("--head-expansion", default="2,1,1,1",
                   help="the draft head's static tree: children per level (default: 2 "
                        "candidates, each continued by a chain of 3)")
    p.add_argument("--head-nodes", type=int, default=8,
                   help="the most nodes of a step's tree the draft head drafts; model-free "
                        "drafts fill the rest of the step's budget")


def serve_verifier(args: argparse.Namespace) -> int:
    from services.verifier.engine import EngineConfig
    from services.verifier.parallel import build_engine
    from services.verifier.server import serve

    expansion = tuple(_expansion(args.head_expansion, "--head-expansion"))
    if not 1 <= args.head_nodes <= args.max_tree_nodes:
        raise ModelError(f"--head-nodes must be in 1..--max-tree-nodes "
                         f"({args.max_tree_nodes}); got {args.head_nodes}")
    config = EngineConfig(max_context=args.max_context, slots=args.slots,
                          max_tree_nodes=args.max_tree_nodes, prefill_chunk=args.prefill_chunk,
                          head_expansion=expansion, head_dynamic=args.head_tree == "dynamic",
                          head_nodes=args.head_nodes)
    head = _draft_head(args.draft_head, args.llm, args.tp * args.pp > 1)

    def build():
        from specinfer.lookup import LookupDrafter

        drafter = LookupDrafter(_datastore(args.datastore, args.llm))
        return build_engine(args.llm, config, tp=args.tp, pp=args.pp,
                            micro_batches=args.micro_batches, threads=args.threads,
                            drafter=drafter, head=head)

    asyncio.run(serve(build, args.host, args.port))
    return 0


def _expansion(text: str, flag: str, min_width: int = 1) -> list[int]:
    """Tree widths per level from ``1,1,3,1``; the speculator's may be 0 (model-free drafts
    only)."""
    try:
        widths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        widths = []
    if not widths or any(not min_width <= w <= 16 for w in widths):
        raise ModelError(f"{flag} must list tree widths in {min_width}..16, e.g. 1,1,3,1; "
                         f"got {text!r}")
    return widths


def _draft_head(ref: str, llm: str, parallel: bool) -> str | None:
    """The draft head directory --draft-head names, or None."""
    from pathlib import Path

    from specinfer.head import HEAD_MANIFEST, bundled_head

    if ref == "none":
        return None
    if ref == "auto":
        path = bundled_head(llm)
        if path is not None and parallel:
            log.info("draft head off: it reads the LLM's features in one process (tp = pp = 1)")
            return None
        return str(path) if path else None
    if parallel:
        raise ModelError("--draft-head needs --tp 1 --pp 1 (it reads the LLM's features in "
                         "the verifier's own process)")
    if not (Path(ref).expanduser() / HEAD_MANIFEST).exists():
        raise ModelError(f"--draft-head {ref!r}: no {HEAD_MANIFEST} there (auto, none or a "
                         "directory written by `specinfer train-head`)")
    return ref


def _add_speculator_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM, help="the LLM the SSMs draft for")
    p.add_argument("--ssm", action="append", default=None,
                   help="an SSM (repeatable): a boost-tune output directory, a model, or "
                        "LLM#layers=N; default: the bundled pool if present")
    p.add_argument("--ssm-dtype", choices=["fp16", "int8", "fp32"], default="fp16",
                   help="SSM linears: fp16 (default; exact cache hits), int8 (fastest; "
                        "drafts may vary with the batch at near-ties) or fp32")
    p.add_argument("--no-ngram", action="store_true", help="disable prompt-lookup drafts")
    p.add_argument("--datastore", default="auto", help="corpus drafts: " + DATASTORE_CHOICES)
    p.add_argument("--expansion", default=None,
                   help="children per level of a static tree (default: the speculator's, "
                        "chosen by bench/speculator.py)")
    p.add_argument("--max-nodes", type=int, default=64, help="node budget per tree")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--slots", type=int, default=16, help="sequences with cached SSM KV")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--threads", type=int, default=0)


def build_speculator(args: argparse.Namespace):
    import torch

    from services.speculator.engine import SpeculatorEngine
    from specinfer.models import default_pool
    from specinfer.ssm import SSMDrafter

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from specinfer.models import materialize

    refs = args.ssm if args.ssm is not None else default_pool(args.llm)
    vocab = AutoConfig.from_pretrained(materialize(args.llm)).vocab_size
    pool = [SSMDrafter.load(ref, source, dtype=args.ssm_dtype, llm_vocab_size=vocab,
                            slots=args.slots, max_context=args.max_context,
                            max_tree_nodes=args.max_nodes)
            for source, ref in enumerate(refs)]
    expansion = _expansion(args.expansion, "--expansion", 0) if args.expansion else None
    datastore = _datastore(args.datastore, args.llm)
    log.info("speculator ready", extra={"ssms": len(pool), "ngram": not args.no_ngram,
                                        "datastore": 0 if datastore is None else len(datastore),
                                        "expansion": expansion})
    return SpeculatorEngine(pool, vocab, ngram=not args.no_ngram, expansion=expansion,
                            max_nodes=args.max_nodes, datastore=datastore)


def _datastore(choice: str, llm: str):
    from pathlib import Path

    from specinfer.datastore import NgramDatastore, sharegpt_datastore
    from specinfer.models import load_tokenizer

    if choice == "none":
        return None
    if choice != "auto":
        return NgramDatastore.load(Path(choice))
    try:
        tokenizer = load_tokenizer(llm)
    except (OSError, ValueError) as e:
        log.info("no datastore: the LLM has no tokenizer", extra={"error": str(e)[:200]})
        return None
    log.info("loading the ShareGPT datastore (built on first use, about a minute)")
    return sharegpt_datastore(tokenizer)


def serve_speculator(args: argparse.Namespace) -> int:
    from services.speculator.server import serve

    asyncio.run(serve(lambda: build_speculator(args), args.host, args.port))
    return 0


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM, help="for the tokenizer and chat template")
    p.add_argument("--model-name", default="", help="name in the API (default: --llm)")
    p.add_argument("--verifier", action="append", required=True, help="verifier address")
    p.add_argument("--speculator", action="append", default=[], help="speculator address")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI API port (0 = off)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests at most")
    p.add_argument("--spec-max-batch", type=int, default=2,
                   help="above this many live sequences, decode without speculation (below, "
                        "the router measures whether speculating pays). The default is "
                        "measured on a 2-core CPU verifier, where speculating batches of 4 "
                        "lost in every run and the policy's short tries did not always see "
                        "it; raise it where verifying wider batches is cheap (a GPU)")
    p.add_argument("--speculation", choices=SPECULATION, default="adaptive",
                   help="adaptive: per batch size, the mode that measures fastest (plain "
                        "steps included); always: the SSM tree on every step; overlap: the "
                        "SSM tree, drafting for one micro-batch while the other is verified; "
                        "lookup: 2 model-free draft tokens drafted by the verifier, every step; "
                        "head: the verifier's draft head and model-free drafts (16 nodes), "
                        "every step")


def serve_router(args: argparse.Namespace) -> int:
    from services.router.server import serve

    asyncio.run(serve(args, args.host, args.port, args.http_port))
    return 0


def _add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM)
    p.add_argument("--ssm", action="append", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--verifiers", type=int, default=1)
    p.add_argument("--speculators", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--expansion", default=None, help="the speculator's static tree")
    p.add_argument("--draft-head", default="auto", help="the verifiers' draft head: auto, "
                   "none or a directory (see serve verifier)")
    p.add_argument("--datastore", default="auto", help="the speculators' and verifiers' "
                   "corpus drafts: auto, none or a saved .npz")
    p.add_argument("--speculation", choices=SPECULATION, default="adaptive")


def up(args: argparse.Namespace) -> int:
    from specinfer.stack import run_stack

    return run_stack(args)


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--no-speculation", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=600.0)


def generate(args: argparse.Namespace) -> int:
    import json
    import time

    from specinfer.client import Client, SpecInferError

    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, speculation=not args.no_speculation)
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    start = time.perf_counter()
    try:
        with Client(args.addr, timeout=args.timeout) as client:
            if args.json:
                out = client.generate(prompt, **kwargs)
                elapsed = time.perf_counter() - start
                print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                                  "finish_reason": out.finish_reason, "steps": out.steps,
                                  "accepted_per_step": out.accepted_per_step,
                                  "speculative_steps": out.stats.speculative_steps,
                                  "speculate_s": round(out.stats.speculate_s, 4),
                                  "verify_s": round(out.stats.verify_s, 4),
                                  "prompt_tokens": out.prompt_tokens,
                                  "elapsed_s": round(elapsed, 4),
                                  "tokens_per_s": round(len(out.token_ids) / elapsed, 2),
                                  "dtype": out.dtype}))
            else:
                for chunk in client.stream(prompt, **kwargs):
                    print(chunk.text, end="", flush=True)
                print()
    except SpecInferError as exc:
        print(f"specinfer: {exc}", file=sys.stderr)
        return 1
    return 0


def _add_boost_args(p: argparse.ArgumentParser) -> None:
    from specinfer.boost import BoostConfig

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


def boost(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specinfer.boost import BoostConfig, boost_tune

    cfg = BoostConfig(llm=args.llm, out=Path(args.out), pool_size=args.pool_size,
                      layers=args.layers, vocab=args.vocab, prompts=args.prompts,
                      heldout=args.heldout, distill_tokens=args.distill_tokens,
                      topk=args.topk, max_seq=args.max_seq, new_tokens=args.new_tokens,
                      gen_batch=args.gen_batch, epochs=args.epochs, lr=args.lr,
                      max_minutes=args.max_minutes,
                      init=Path(args.init) if args.init else None)
    report = boost_tune(cfg)
    import json

    print(json.dumps(report, indent=2))
    return 0


def _add_head_args(p: argparse.ArgumentParser) -> None:
    from specinfer.head import HeadConfig

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

    from specinfer.head import HeadConfig, train_head_pipeline

    report = train_head_pipeline(HeadConfig(data=Path(args.data), out=Path(args.out),
                                            llm=args.llm, epochs=args.epochs, lr=args.lr,
                                            conversation_positions=args.conversation_positions,
                                            levels=args.levels,
                                            init=Path(args.init) if args.init else None))
    print(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specinfer", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve_p = sub.add_parser("serve", help="run one service, as the Helm chart does")
    roles = serve_p.add_subparsers(dest="role", required=True)
    _add_verifier_args(roles.add_parser("verifier", help="the LLM and its KV cache"))
    _add_speculator_args(roles.add_parser("speculator", help="SSMs and drafters: token trees"))

    _add_router_args(roles.add_parser("router", help="the public API and the scheduler"))
    _add_boost_args(sub.add_parser("boost-tune", help="train a boost-tuned SSM pool"))
    _add_head_args(sub.add_parser("train-head", help="train a draft head on the LLM's features "
                                  "from a boost-tune run's data"))
    _add_up_args(sub.add_parser("up", help="the whole stack on this machine"))
    _add_generate_args(sub.add_parser("generate", help="generate through a running stack"))

    args = parser.parse_args(argv)
    from specinfer.logs import setup_logging

    setup_logging(f"{args.command}-{getattr(args, 'role', '')}".strip("-"), args.log_level)
    try:
        if args.command == "serve" and args.role == "verifier":
            return serve_verifier(args)
        if args.command == "serve" and args.role == "speculator":
            return serve_speculator(args)
        if args.command == "serve" and args.role == "router":
            return serve_router(args)
        if args.command == "boost-tune":
            return boost(args)
        if args.command == "train-head":
            return train_head(args)
        if args.command == "up":
            return up(args)
        if args.command == "generate":
            return generate(args)
    except ModelError as exc:
        print(f"specinfer: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""``specinfer serve speculator``: the speculator's flags and how it is built."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.flags import DATASTORE_CHOICES, load_datastore, parse_expansion
from specinfer import metrics, tls, tracing
from specinfer.models import DEFAULT_LLM
from specinfer.placement import add_flags as add_placement_flags
from specinfer.placement import from_flags

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM, help="the LLM the SSMs draft for")
    p.add_argument("--ssm", action="append", default=None,
                   help="an SSM (repeatable): a boost-tune output directory, a model, or "
                        "LLM#layers=N; default: the bundled pool if present")
    p.add_argument("--ssm-dtype", choices=["fp16", "int8", "fp32"], default="fp16",
                   help="SSM linears with the default placement (CPU, float32): fbgemm fp16 "
                        "(default; exact cache hits), int8 (drafts may vary with the batch "
                        "at near-ties) or fp32; other --dtype/--quantize choices run the "
                        "SSMs in that format instead")
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
    add_placement_flags(p)
    tls.add_flags(p)
    tracing.add_flags(p)
    metrics.add_flags(p, "drafting times")


def build(args: argparse.Namespace):
    import torch
    from transformers import AutoConfig

    from services.speculator.engine import SpeculatorEngine
    from specinfer.drafting.ssm import SSMDrafter
    from specinfer.models import default_pool, materialize

    if args.threads:
        torch.set_num_threads(args.threads)
    refs = args.ssm if args.ssm is not None else default_pool(args.llm)
    vocab = AutoConfig.from_pretrained(materialize(args.llm)).vocab_size
    placement = from_flags(args)
    pool = [SSMDrafter.load(ref, source, dtype=args.ssm_dtype, llm_vocab_size=vocab,
                            slots=args.slots, max_context=args.max_context,
                            max_tree_nodes=args.max_nodes, placement=placement)
            for source, ref in enumerate(refs)]
    expansion = parse_expansion(args.expansion, "--expansion", 0) if args.expansion else None
    datastore = load_datastore(args.datastore, args.llm)
    log.info("speculator ready", extra={"ssms": len(pool), "prompt_lookup": not args.no_ngram,
                                        "datastore": 0 if datastore is None else len(datastore),
                                        "expansion": expansion})
    return SpeculatorEngine(pool, vocab, prompt_lookup=not args.no_ngram, expansion=expansion,
                            max_nodes=args.max_nodes, datastore=datastore)


def run(args: argparse.Namespace) -> int:
    from services.speculator.metrics import SpeculatorMetrics
    from services.speculator.server import serve

    from_flags(args)  # fail on bad placement flags before serving
    config = tls.from_flags(args)
    tracing.setup_tracing("speculator", args.otlp_traces_endpoint)
    speculator_metrics = SpeculatorMetrics(args.llm)
    metrics.serve_metrics(speculator_metrics.registry, args.host, args.metrics_port)
    asyncio.run(serve(lambda: build(args), args.host, args.port, metrics=speculator_metrics,
                      credentials=tls.server_credentials_from(config)))
    return 0

"""``specinfer serve verifier``: the verifier's flags and how it is built."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.flags import DATASTORE_CHOICES, load_datastore, parse_expansion
from specinfer import metrics, tls, tracing
from specinfer.models import DEFAULT_LLM, ModelError
from specinfer.placement import add_flags as add_placement_flags
from specinfer.placement import from_flags

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM, help="model directory, .gguf file or alias")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50053)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (DeepSpeed AutoTP)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="pipeline micro-batches per step (pp > 1)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's pipeline stage when the stages run on separate machines "
                        "or pods (default: LWS_WORKER_INDEX or RANK from the environment); "
                        "node 0 serves gRPC, the others follow it")
    p.add_argument("--master-addr", default=None,
                   help="node 0's address (default: LWS_LEADER_ADDRESS or MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=None,
                   help="node 0's rendezvous port (default: MASTER_PORT or 29500)")
    p.add_argument("--rank-timeout", type=float, default=30.0,
                   help="seconds a rank may go unheard before the verifier reports it lost "
                        "(UNAVAILABLE, NOT_SERVING)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--slots", type=int, default=8, help="sequences held in the KV cache at once")
    p.add_argument("--max-tree-nodes", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0 = auto)")
    add_placement_flags(p)
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
    p.add_argument("--sequence-lease", type=float, default=30.0,
                   help="seconds a live sequence may go untouched by its router before it is "
                        "freed (the router died: a router steps its sequences far more often); "
                        "0 = never")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds to keep serving live sequences (NOT_SERVING, no "
                        "new ones) while routers move them to other replicas; keep the pod's "
                        "termination grace period above it")
    p.add_argument("--head-nodes", type=int, default=8,
                   help="the most nodes of a step's tree the draft head drafts; model-free "
                        "drafts fill the rest of the step's budget")
    tls.add_flags(p)
    tracing.add_flags(p)
    metrics.add_flags(p, "KV cache usage, step times")


def run(args: argparse.Namespace) -> int:
    from services.verifier.engine import EngineConfig
    from services.verifier.factory import build_engine
    from services.verifier.metrics import VerifierMetrics
    from services.verifier.parallel import rendezvous_from, run_stage
    from services.verifier.server import serve

    expansion = tuple(parse_expansion(args.head_expansion, "--head-expansion"))
    if not 1 <= args.head_nodes <= args.max_tree_nodes:
        raise ModelError(f"--head-nodes must be in 1..--max-tree-nodes "
                         f"({args.max_tree_nodes}); got {args.head_nodes}")
    config = EngineConfig(max_context=args.max_context, slots=args.slots,
                          max_tree_nodes=args.max_tree_nodes, prefill_chunk=args.prefill_chunk,
                          head_expansion=expansion, head_dynamic=args.head_tree == "dynamic",
                          head_nodes=args.head_nodes, sequence_lease_s=args.sequence_lease)
    if args.sequence_lease < 0:
        raise ModelError(f"--sequence-lease must be >= 0 seconds; got {args.sequence_lease}")
    head = _draft_head(args.draft_head, args.llm, args.tp * args.pp > 1)
    placement = from_flags(args)
    tls_config = tls.from_flags(args)
    if args.drain_timeout < 0:
        raise ModelError(f"--drain-timeout must be >= 0 seconds; got {args.drain_timeout}")
    if args.rank_timeout <= 0:
        raise ModelError(f"--rank-timeout must be > 0 seconds; got {args.rank_timeout}")
    meet = rendezvous_from(args.node_rank, args.master_addr, args.master_port, args.pp,
                           args.rank_timeout)
    if meet is not None and meet.node_rank > 0:  # a follower node: no gRPC here
        return run_stage(args.tp, args.pp, meet, args.threads, placement.cuda)

    def build():
        from specinfer.drafting.model_free import ModelFreeDrafter

        drafter = ModelFreeDrafter(load_datastore(args.datastore, args.llm))
        return build_engine(args.llm, config, tp=args.tp, pp=args.pp,
                            micro_batches=args.micro_batches, threads=args.threads,
                            drafter=drafter, head=head, placement=placement, meet=meet)

    tracing.setup_tracing("verifier", args.otlp_traces_endpoint)
    verifier_metrics = VerifierMetrics(args.llm)
    metrics.serve_metrics(verifier_metrics.registry, args.host, args.metrics_port)
    asyncio.run(serve(build, args.host, args.port, metrics=verifier_metrics,
                      credentials=tls.server_credentials_from(tls_config),
                      drain_timeout_s=args.drain_timeout))
    return 0


def _draft_head(ref: str, llm: str, parallel: bool) -> str | None:
    """The draft head directory --draft-head names, or None."""
    from pathlib import Path

    from specinfer.drafting.head import HEAD_MANIFEST, bundled_head

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

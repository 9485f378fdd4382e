"""``specinfer serve router``: the router's flags and how it is put together (tokenizer,
scheduler, the gRPC servicer and the OpenAI HTTP API)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.router import auth, discovery, limits
from services.router.policy import SPECULATION_CHOICES
from specinfer import metrics, tls, tracing
from specinfer.models import DEFAULT_LLM, ModelError

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default=DEFAULT_LLM, help="for the tokenizer and chat template")
    p.add_argument("--model-name", default="", help="name in the API (default: --llm)")
    p.add_argument("--verifier", action="append", required=True,
                   help="verifier address (repeatable); with --discovery dns a name resolving "
                        "to every replica, with kubernetes a Service: SERVICE[.NS][:PORT]")
    p.add_argument("--speculator", action="append", default=[],
                   help="speculator address (repeatable), named as --verifier is")
    discovery.add_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI API port (0 = off)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests at most")
    p.add_argument("--queue-timeout", type=float, default=60.0,
                   help="seconds a request may wait for verifier capacity before it is turned "
                        "away (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After); keep it above "
                        "the verifiers' --sequence-lease plus a step, so slots a dead router "
                        "held come back first")
    p.add_argument("--speculate-timeout", type=_positive_seconds, default=2.0,
                   help="seconds one Speculate call may hold a step; past it the step "
                        "decodes without that speculator's trees and it is skipped for 5 s. "
                        "2 s is ~20x the slowest speculation step measured on a 2-core CPU, "
                        "so only a stuck or overloaded speculator hits it")
    p.add_argument("--speculate-rpc", choices=("stream", "unary"), default="stream",
                   help="how drafts are asked for: stream (one SpeculateStream per "
                        "speculator, each step sending only the tokens accepted since the "
                        "last) or unary (Speculate with each sequence's whole history)")
    p.add_argument("--spec-max-batch", type=int, default=2,
                   help="above this many live sequences, decode without speculation (below, "
                        "the router measures whether speculating pays). The default is "
                        "measured on a 2-core CPU verifier, where speculating batches of 4 "
                        "lost in every run and the policy's short tries did not always see "
                        "it; raise it where verifying wider batches is cheap (a GPU)")
    p.add_argument("--speculation", choices=tuple(SPECULATION_CHOICES), default="adaptive",
                   help="adaptive: per batch size, the mode that measures fastest (plain "
                        "steps included); always: the SSM tree on every step; overlap: the "
                        "SSM tree, drafting for one micro-batch while the other is verified; "
                        "lookup: 2 model-free draft tokens drafted by the verifier, every step; "
                        "head: the verifier's draft head and model-free drafts (16 nodes), "
                        "every step")
    auth.add_flags(p)
    limits.add_flags(p)
    tls.add_flags(p)
    tracing.add_flags(p)
    metrics.add_flags(p, "default: on the OpenAI API's --http-port; this port serves them "
                         "too, e.g. with --http-port 0")


def run(args: argparse.Namespace) -> int:
    # Settings that cannot work stop the router here (exit 2), before it listens.
    args.limits = limits.from_flags(args)
    args.tls = tls.from_flags(args)
    args.keys = auth.ApiKeys.from_flags(args.api_key)
    try:
        args.discovery_source = discovery.from_flags(args, args.verifier, args.speculator)
    except discovery.DiscoveryError as exc:
        raise ModelError(str(exc)) from exc
    tracing.setup_tracing("router", args.otlp_traces_endpoint)
    try:
        asyncio.run(serve(args))
    except discovery.DiscoveryError as exc:  # e.g. a kubeconfig that cannot be loaded
        raise ModelError(str(exc)) from exc
    return 0


async def serve(args: argparse.Namespace, grace_s: float = 10.0) -> None:
    from services.router.frontend import Frontend
    from services.router.metrics import RouterMetrics
    from services.router.openai_http import start_http
    from services.router.scheduler import Scheduler
    from services.router.server import RouterServicer
    from specinfer.grpc_server import Service
    from specinfer.models import load_tokenizer
    from specinfer.v1 import router_pb2, router_pb2_grpc

    # The public listener: TLS without client certificates (API keys authenticate callers);
    # a request message past --max-body-bytes is refused by gRPC (RESOURCE_EXHAUSTED).
    service = Service("router", args.host, args.port,
                      args.tls.server_credentials(mutual=False) if args.tls else None,
                      [("grpc.max_receive_message_length", args.limits.max_body_bytes)])
    streams = limits.KeyStreams(args.limits.max_streams_per_key)
    servicer = RouterServicer(args.keys, streams)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, service.server)
    service.add(router_pb2.DESCRIPTOR.services_by_name["Router"].full_name)
    await service.start()
    loop = asyncio.get_running_loop()
    tokenizer = await loop.run_in_executor(None, load_tokenizer, args.llm)
    model_name = args.model_name or args.llm
    router_metrics = RouterMetrics(model_name)
    metrics.serve_metrics(router_metrics.registry, args.host, args.metrics_port)
    # The replicas come from discovery (static: the flags' addresses), at start and later.
    scheduler = Scheduler([], [],
                          eos_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                          else [],
                          max_waiting=args.max_waiting, spec_max_batch=args.spec_max_batch,
                          speculation=args.speculation, queue_timeout_s=args.queue_timeout,
                          speculate_timeout_s=args.speculate_timeout,
                          speculate_stream=args.speculate_rpc == "stream",
                          detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          metrics=router_metrics, tls=args.tls)
    source = args.discovery_source

    def on_change(role: str, addresses: frozenset[str]) -> None:
        pool = scheduler.replicas if role == "verifier" else scheduler.speculators
        pool.update(addresses)

    await source.start(on_change)
    # Static addresses: NOT_SERVING until a verifier answers. Discovered pools may be
    # scaled to zero: serve at once, queue requests until a verifier joins (the queue is
    # what num_requests_waiting shows the autoscaler), the LLM's own config standing in
    # for the verifier's facts until then.
    wait = args.discovery == "static"
    info = await scheduler.start(wait_for_verifier=wait)
    adopt = None
    if info is None:
        info = await loop.run_in_executor(None, _llm_facts, args.llm)
    frontend = Frontend(tokenizer, model_name, info["vocab_size"], info["dtype"], args.limits)
    if info["dtype"] == "unknown":
        adopt = asyncio.ensure_future(_adopt_first_verifier(scheduler.replicas, frontend))
    servicer.scheduler, servicer.fe = scheduler, frontend
    http = None
    if args.http_port:
        http = await start_http(scheduler, frontend, args.host, args.http_port,
                                router_metrics.registry, args.keys, streams,
                                args.metrics_auth,
                                args.tls.ssl_context() if args.tls else None)
    await service.set_serving()
    log.info("router ready", extra={"api_keys": len(args.keys), "tls": args.tls is not None,
                                    "mutual_tls": bool(args.tls and args.tls.mutual)})

    async def stop() -> None:
        if adopt is not None:
            adopt.cancel()
        await source.close()
        if http is not None:
            await http.cleanup()
        await scheduler.close()

    await service.run_until_signal(grace_s, on_stop=stop)


def _llm_facts(llm: str) -> dict:
    """What the router needs of the model before a verifier has answered."""
    from transformers import AutoConfig

    from specinfer.models import materialize

    config = AutoConfig.from_pretrained(materialize(llm))
    return {"vocab_size": config.vocab_size, "dtype": "unknown"}


async def _adopt_first_verifier(replicas, frontend) -> None:
    """Once the first verifier joins, requests are checked against its facts."""
    await replicas.joined.wait()
    frontend.vocab_size, frontend.dtype = replicas.info.vocab_size, replicas.info.dtype
    log.info("first verifier joined", extra={"vocab_size": frontend.vocab_size,
                                              "dtype": frontend.dtype})


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds; got {text}")
    return value

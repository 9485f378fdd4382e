"""``specinfer serve router``: how the router is put together from its config (config.py):
tokenizer, scheduler, the gRPC servicer and the OpenAI HTTP API."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from services.router import auth, discovery
from services.router.config import RouterConfig
from services.router.limits import KeyStreams
from specinfer import metrics, tls, tracing
from specinfer.models import ModelError

log = logging.getLogger(__name__)


def run(config: RouterConfig) -> int:
    # Settings that cannot work stop the router here (exit 2), before it listens.
    tls_config = tls.from_flags(config.tls)
    keys = auth.ApiKeys.from_flags(list(config.api_key))
    try:
        source = discovery.from_flags(config.discovery, config.verifier, config.speculator)
    except discovery.DiscoveryError as exc:
        raise ModelError(str(exc)) from exc
    tracing.setup_tracing("router", config.otlp_traces_endpoint)
    try:
        asyncio.run(serve(config, tls_config, keys, source))
    except discovery.DiscoveryError as exc:  # e.g. a kubeconfig that cannot be loaded
        raise ModelError(str(exc)) from exc
    return 0


async def serve(config: RouterConfig, tls_config: tls.TlsConfig | None, keys: auth.ApiKeys,
                source: discovery.Discovery, grace_s: float = 10.0) -> None:
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
    service = Service("router", config.host, config.port,
                      tls_config.server_credentials(mutual=False) if tls_config else None,
                      [("grpc.max_receive_message_length", config.limits.max_body_bytes)])
    streams = KeyStreams(config.limits.max_streams_per_key)
    servicer = RouterServicer(keys, streams)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, service.server)
    service.add(router_pb2.DESCRIPTOR.services_by_name["Router"].full_name)
    await service.start()
    loop = asyncio.get_running_loop()
    tokenizer = await loop.run_in_executor(None, load_tokenizer, config.llm)
    if config.chat_template:
        try:
            tokenizer.chat_template = Path(config.chat_template).read_text()
        except OSError as exc:
            raise SystemExit(f"--chat-template: {exc}") from None
    model_name = config.model_name or config.llm
    router_metrics = RouterMetrics(model_name)
    metrics.serve_metrics(router_metrics.registry, config.host, config.metrics_port)
    # The replicas come from discovery (static: the flags' addresses), at start and later.
    scheduler = Scheduler(config, eos_ids=[tokenizer.eos_token_id]
                          if tokenizer.eos_token_id is not None else [],
                          detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          metrics=router_metrics, tls=tls_config)

    def on_change(role: str, addresses: frozenset[str]) -> None:
        pool = scheduler.replicas if role == "verifier" else scheduler.speculators
        pool.update(addresses)

    await source.start(on_change)
    # Static addresses: NOT_SERVING until a verifier answers. Discovered pools may be
    # scaled to zero: serve at once, queue requests until a verifier joins (the queue is
    # what num_requests_waiting shows the autoscaler), the LLM's own config standing in
    # for the verifier's facts until then.
    wait = config.discovery.mode == "static"
    info = await scheduler.start(wait_for_verifier=wait)
    adopt = None
    if info is None:
        info = await loop.run_in_executor(None, _llm_facts, config.llm)
    frontend = Frontend(tokenizer, model_name, info["vocab_size"], info["dtype"], config.limits)
    if info["dtype"] == "unknown":
        adopt = asyncio.ensure_future(_adopt_first_verifier(scheduler.replicas, frontend))
    servicer.scheduler, servicer.fe = scheduler, frontend
    http = None
    if config.http_port:
        http = await start_http(scheduler, frontend, config.host, config.http_port,
                                router_metrics.registry, keys, streams,
                                config.metrics_auth,
                                tls_config.ssl_context() if tls_config else None)
    await service.set_serving()
    log.info("router ready", extra={"api_keys": len(keys), "tls": tls_config is not None,
                                    "mutual_tls": bool(tls_config and tls_config.mutual)})

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


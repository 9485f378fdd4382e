"""``serve router``'s flags, declared once: the router's command line, what ``up`` forwards
to it, and what its composition root (main.py) and scheduler are built from."""

from __future__ import annotations

from dataclasses import dataclass

from services.router.auth import ENV as API_KEY_ENV
from services.router.discovery import DiscoveryFlags
from services.router.limits import Limits
from services.router.policy import SPECULATION_CHOICES
from specinfer import metrics, tracing
from specinfer.config import Flags, flag, group
from specinfer.models import DEFAULT_LLM
from specinfer.tls import TlsFlags


@dataclass(frozen=True)
class RouterConfig(Flags):
    """``serve router``'s flags: what the router, its scheduler and its APIs are built from."""

    llm: str = flag(DEFAULT_LLM, "for the tokenizer and chat template")
    model_name: str = flag("", "name in the API (default: --llm)")
    chat_template: str = flag("", "a Jinja chat template file used instead of the model's "
                              "(as vLLM's --chat-template); a template that reads `tools` "
                              "renders tool prompts itself", metavar="FILE")
    verifier: tuple[str, ...] = flag(
        (), "verifier address (repeatable); with --discovery dns a name resolving to every "
        "replica, with kubernetes a Service: SERVICE[.NS][:PORT]", repeatable=True,
        required=True)
    speculator: tuple[str, ...] = flag((), "speculator address (repeatable), named as "
                                       "--verifier is", repeatable=True)
    discovery: DiscoveryFlags = group(DiscoveryFlags)
    host: str = flag("127.0.0.1")
    port: int = flag(50051)
    http_port: int = flag(8000, "OpenAI API port (0 = off)")
    max_waiting: int = flag(64, "queued requests at most")
    routing: str = flag("prefix", "a new sequence's verifier (sessions stay on theirs): "
                        "prefix (where its prompt's prefix is cached, weighed against load) "
                        "or load (the least loaded)", choices=("prefix", "load"))
    prefix_load_margin: float = flag(0.25, "a new sequence goes to the verifier caching the "
                                     "longest prefix of its prompt unless that one's load "
                                     "(live sequences over capacity) exceeds the least "
                                     "loaded one's by more than this", minimum=0)
    queue_timeout: float = flag(60.0, "seconds a request may wait for verifier capacity before "
                                "it is turned away (RESOURCE_EXHAUSTED / HTTP 429 with "
                                "Retry-After); keep it above the verifiers' --sequence-lease "
                                "plus a step, so slots a dead router held come back first")
    speculate_timeout: float = flag(2.0, "seconds one Speculate call may hold a step; past it "
                                    "the step decodes without that speculator's trees and it "
                                    "is skipped for 5 s. 2 s is ~20x the slowest speculation "
                                    "step measured on a 2-core CPU, so only a stuck or "
                                    "overloaded speculator hits it", above=0, unit="seconds")
    speculate_rpc: str = flag("stream", "how drafts are asked for: stream (one "
                              "SpeculateStream per speculator, each step sending only the "
                              "tokens accepted since the last) or unary (Speculate with each "
                              "sequence's whole history)", choices=("stream", "unary"))
    spec_max_batch: int = flag(2, "speculating sequences per step, at most: in a larger batch "
                               "the adaptive policy speculates for this many (those whose "
                               "drafts pay best) if it measures that faster, and the rest "
                               "decode plain in the same forward pass (fixed modes decode "
                               "the whole batch plain); 0 = no speculation past one "
                               "sequence. Raise it where verifying wider trees is cheap (a "
                               "GPU)")
    speculation: str = flag("adaptive", "adaptive: per batch size, the mode that measures "
                            "fastest (plain steps included); always: the SSM tree on every "
                            "step; overlap: the SSM tree, drafting for one micro-batch while "
                            "the other is verified; lookup: 2 model-free draft tokens drafted "
                            "by the verifier, every step; head: the verifier's draft head and "
                            "model-free drafts (16 nodes), every step",
                            choices=tuple(SPECULATION_CHOICES))
    api_key: tuple[str, ...] = flag((), f"require this key (repeatable; also {API_KEY_ENV}, "
                                    "comma-separated) on the OpenAI API (Authorization: Bearer "
                                    "KEY) and the gRPC API (metadata authorization: Bearer "
                                    "KEY)", repeatable=True, metavar="KEY")
    metrics_auth: bool = flag(False, "/metrics requires an API key too (default: open, for "
                              "scrapers)")
    limits: Limits = group(Limits)
    tls: TlsFlags = group(TlsFlags)
    otlp_traces_endpoint: str | None = tracing.endpoint_flag()
    metrics_port: int = metrics.port_flag("default: on the OpenAI API's --http-port; this "
                                          "port serves them too, e.g. with --http-port 0")

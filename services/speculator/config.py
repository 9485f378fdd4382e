"""``serve speculator``'s flags, declared once: its command line, what ``up`` forwards to
it, and what its composition root (main.py) builds the speculator from."""

from __future__ import annotations

from dataclasses import dataclass

from services.flags import DATASTORE_CHOICES, parse_expansion
from specinfer import metrics, tracing
from specinfer.config import Flags, flag, group
from specinfer.models import DEFAULT_LLM
from specinfer.placement import PlacementFlags
from specinfer.tls import TlsFlags


@dataclass(frozen=True)
class SpeculatorConfig(Flags):
    """``serve speculator``'s flags."""

    llm: str = flag(DEFAULT_LLM, "the LLM the SSMs draft for")
    ssm: tuple[str, ...] | None = flag(None, "an SSM (repeatable): a boost-tune output "
                                       "directory, a model, or LLM#layers=N; default: the "
                                       "bundled pool if present", repeatable=True)
    ssm_dtype: str = flag("fp16", "SSM linears with the default placement (CPU, float32): "
                          "fbgemm fp16 (default; exact cache hits), int8 (drafts may vary with "
                          "the batch at near-ties) or fp32; other --dtype/--quantize choices "
                          "run the SSMs in that format instead", choices=("fp16", "int8", "fp32"))
    no_ngram: bool = flag(False, "disable prompt-lookup drafts")
    datastore: str = flag("auto", "corpus drafts: " + DATASTORE_CHOICES)
    expansion: str | None = flag(None, "children per level of a static tree (default: the "
                                 "speculator's, chosen by bench/speculator.py)")
    max_nodes: int = flag(64, "node budget per tree")
    max_context: int = flag(2048)
    slots: int = flag(16, "sequences with cached SSM KV")
    host: str = flag("127.0.0.1")
    port: int = flag(50052)
    threads: int = flag(0)
    placement: PlacementFlags = group(PlacementFlags)
    tls: TlsFlags = group(TlsFlags)
    otlp_traces_endpoint: str | None = tracing.endpoint_flag()
    metrics_port: int = metrics.port_flag("drafting times")

    def check(self) -> None:
        self.expansion_widths()  # ModelError naming --expansion

    def expansion_widths(self) -> list[int] | None:
        """The static tree's widths per level (None: the speculator's own)."""
        return parse_expansion(self.expansion, "--expansion", 0) if self.expansion else None

"""``specinfer serve verifier``: how the verifier is built from its config (config.py)."""

from __future__ import annotations

import asyncio
import logging

from services.flags import load_datastore
from services.verifier.config import VerifierConfig
from specinfer import metrics, tls, tracing
from specinfer.models import ModelError

log = logging.getLogger(__name__)


def run(config: VerifierConfig) -> int:
    from services.verifier.engine import EngineConfig
    from services.verifier.factory import build_engine
    from services.verifier.metrics import VerifierMetrics
    from services.verifier.parallel import rendezvous_from, run_stage
    from services.verifier.server import serve

    engine_config = EngineConfig(
        max_context=config.max_context, slots=config.slots,
        max_tree_nodes=config.max_tree_nodes, prefill_chunk=config.prefill_chunk,
        prefill_step_ratio=config.prefill_step_ratio,
        head_expansion=config.head_widths(), head_dynamic=config.head_tree == "dynamic",
        head_nodes=config.head_nodes, sequence_lease_s=config.sequence_lease,
        prefix_caching=not config.no_prefix_caching, block_size=config.block_size)
    head = _draft_head(config.draft_head, config.llm, config.tp * config.pp > 1)
    placement = config.placement.resolve()
    tls_config = tls.from_flags(config.tls)
    meet = rendezvous_from(config.node_rank, config.master_addr, config.master_port, config.pp,
                           config.rank_timeout)
    if meet is not None and meet.node_rank > 0:  # a follower node: no gRPC here
        return run_stage(config.tp, config.pp, meet, config.threads, placement.cuda)

    def build():
        from specinfer.drafting.model_free import ModelFreeDrafter

        drafter = ModelFreeDrafter(load_datastore(config.datastore, config.llm))
        return build_engine(config.llm, engine_config, tp=config.tp, pp=config.pp,
                            micro_batches=config.micro_batches, threads=config.threads,
                            drafter=drafter, head=head, placement=placement, meet=meet)

    tracing.setup_tracing("verifier", config.otlp_traces_endpoint)
    verifier_metrics = VerifierMetrics(config.llm)
    metrics.serve_metrics(verifier_metrics.registry, config.host, config.metrics_port)
    asyncio.run(serve(build, config.host, config.port, metrics=verifier_metrics,
                      credentials=tls.server_credentials_from(tls_config),
                      drain_timeout_s=config.drain_timeout))
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

"""``specinfer serve speculator``: how the speculator is built from its config (config.py)."""

from __future__ import annotations

import asyncio
import logging

from services.flags import load_datastore
from services.speculator.config import SpeculatorConfig
from specinfer import metrics, tls, tracing

log = logging.getLogger(__name__)


def build(config: SpeculatorConfig):
    import torch
    from transformers import AutoConfig

    from services.speculator.engine import SpeculatorEngine
    from specinfer.drafting.ssm import SSMDrafter
    from specinfer.grammar import compiler_for
    from specinfer.models import default_pool, llm_eos_ids, materialize

    if config.threads:
        torch.set_num_threads(config.threads)
    refs = config.ssm if config.ssm is not None else default_pool(config.llm)
    vocab = AutoConfig.from_pretrained(materialize(config.llm)).vocab_size
    placement = config.placement.resolve()
    pool = [SSMDrafter.load(ref, source, dtype=config.ssm_dtype, llm_vocab_size=vocab,
                            slots=config.slots, max_context=config.max_context,
                            max_tree_nodes=config.max_nodes, placement=placement)
            for source, ref in enumerate(refs)]
    expansion = config.expansion_widths()
    datastore = load_datastore(config.datastore, config.llm)
    log.info("speculator ready", extra={"ssms": len(pool), "prompt_lookup": not config.no_ngram,
                                        "datastore": 0 if datastore is None else len(datastore),
                                        "expansion": expansion})
    return SpeculatorEngine(pool, vocab, prompt_lookup=not config.no_ngram, expansion=expansion,
                            max_nodes=config.max_nodes, datastore=datastore,
                            grammars=compiler_for(config.llm, vocab, llm_eos_ids(config.llm)))


def run(config: SpeculatorConfig) -> int:
    from services.speculator.metrics import SpeculatorMetrics
    from services.speculator.server import serve

    config.placement.resolve()  # fail on bad placement flags before serving
    tls_config = tls.from_flags(config.tls)
    tracing.setup_tracing("speculator", config.otlp_traces_endpoint)
    speculator_metrics = SpeculatorMetrics(config.llm)
    metrics.serve_metrics(speculator_metrics.registry, config.host, config.metrics_port)
    asyncio.run(serve(lambda: build(config), config.host, config.port, metrics=speculator_metrics,
                      credentials=tls.server_credentials_from(tls_config)))
    return 0

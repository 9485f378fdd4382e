"""The verifier engine over its executor: the whole model in this process, or tensor- and
pipeline-parallel ranks (``services.verifier.parallel``). Every engine is built here."""

from __future__ import annotations

import torch

from services.verifier.engine import EngineConfig, VerifierEngine, eos_ids, slot_len
from services.verifier.executor import LocalExecutor
from services.verifier.parallel import Rendezvous, start_ranks
from specinfer.drafting import OwnSource
from specinfer.drafting.head import FeatureDrafter, HeadSource, load_head
from specinfer.drafting.model_free import ModelFreeDrafter
from specinfer.grammar import compiler_for
from specinfer.models import load_model
from specinfer.placement import Placement
from specinfer.runtime import LlamaRuntime


def build_engine(llm: str, config: EngineConfig, tp: int = 1, pp: int = 1,
                 micro_batches: int = 2, threads: int = 0,
                 drafter: ModelFreeDrafter | None = None, head: str | None = None,
                 placement: Placement | None = None, meet: Rendezvous | None = None
                 ) -> VerifierEngine:
    """A verifier engine over ``tp * pp`` ranks; this process becomes rank 0. ``head``: a
    draft head directory (``specinfer train-head``; tp = pp = 1 only). ``meet``: the
    multi-node rendezvous (this process is node 0's first rank), else every rank runs
    here."""
    placement = placement or Placement()
    if tp < 1 or pp < 1:
        raise ValueError("--tp and --pp must be >= 1")
    if head and tp * pp > 1:
        raise ValueError("a draft head needs --tp 1 --pp 1")
    if tp * pp > 1:
        executor = start_ranks(llm, config, tp, pp, micro_batches, threads, placement, meet)
        return VerifierEngine(executor, config, llm, executor.eos_token_ids,
                              [drafter or ModelFreeDrafter()],
                              compiler_for(llm, executor.vocab_size,
                                               executor.eos_token_ids))
    if threads:
        torch.set_num_threads(threads)
    model = load_model(llm)
    runtime = LlamaRuntime.from_model(model, config.slots, slot_len(config),
                                      placement=placement)
    runtime.capture_graphs(config.max_tree_nodes + 1)
    # The verifier's own draft sources (``specinfer.drafting.OwnSource``), by the names
    # Step plans give them; a new source is built here.
    sources: list[OwnSource] = [drafter or ModelFreeDrafter()]
    if head:
        sources.append(HeadSource(
            FeatureDrafter(load_head(head, model), slots=config.slots,
                           max_context=config.max_context,
                           max_tree_nodes=config.max_tree_nodes, placement=placement),
            config.head_expansion, config.head_dynamic, config.head_nodes))
    executor = LocalExecutor(runtime)
    return VerifierEngine(executor, config, llm, eos_ids(model), sources,
                          compiler_for(llm, executor.vocab_size, eos_ids(model)))



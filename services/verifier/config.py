"""``serve verifier``'s flags, declared once: its command line, what ``up`` forwards to it,
and what its composition root (main.py) builds the verifier from."""

from __future__ import annotations

from dataclasses import dataclass

from services.flags import DATASTORE_CHOICES, parse_expansion
from specinfer import metrics, tracing
from specinfer.config import Flags, flag, group
from specinfer.models import DEFAULT_LLM, ModelError
from specinfer.placement import PlacementFlags
from specinfer.tls import TlsFlags


@dataclass(frozen=True)
class VerifierConfig(Flags):
    """``serve verifier``'s flags."""

    llm: str = flag(DEFAULT_LLM, "model directory, .gguf file or alias")
    host: str = flag("127.0.0.1")
    port: int = flag(50053)
    tp: int = flag(1, "tensor-parallel ranks (DeepSpeed AutoTP)")
    pp: int = flag(1, "pipeline stages")
    micro_batches: int = flag(2, "pipeline micro-batches per step (pp > 1)")
    node_rank: int | None = flag(None, "this node's pipeline stage when the stages run on "
                                 "separate machines or pods (default: LWS_WORKER_INDEX or RANK "
                                 "from the environment); node 0 serves gRPC, the others follow "
                                 "it", type=int)
    master_addr: str | None = flag(None, "node 0's address (default: LWS_LEADER_ADDRESS or "
                                   "MASTER_ADDR)")
    master_port: int | None = flag(None, "node 0's rendezvous port (default: MASTER_PORT or "
                                   "29500)", type=int)
    rank_timeout: float = flag(30.0, "seconds a rank may go unheard before the verifier "
                               "reports it lost (UNAVAILABLE, NOT_SERVING)", above=0,
                               unit="seconds")
    max_context: int = flag(2048)
    slots: int = flag(8, "sequences held in the KV cache at once")
    max_tree_nodes: int = flag(64)
    prefill_chunk: int = flag(256, "prompt tokens computed per engine call while no sequence "
                              "is live (a prefill is computed a chunk at a time)", minimum=1)
    prefill_step_ratio: float = flag(0.5, "while sequences are live, a prefill computes this "
                                     "many of their steps' time between two of their steps "
                                     "(their next token waits that much longer; at least 16 "
                                     "tokens); 0: the whole prompt at once (they wait for "
                                     "it)", minimum=0)
    no_prefix_caching: bool = flag(False, "turn off automatic prefix caching (finished "
                                   "sequences' KV kept and reused by prompts that share "
                                   "a prefix with it)")
    block_size: int = flag(16, "prefix caching's block: prompts share cached KV in whole "
                           "blocks of this many tokens", minimum=1)
    threads: int = flag(0, "torch threads per rank (0 = auto)")
    placement: PlacementFlags = group(PlacementFlags)
    datastore: str = flag("auto", "corpus drafts for Step items whose plan has the verifier "
                          "draft (its model_free source): " + DATASTORE_CHOICES)
    draft_head: str = flag("auto", "a draft head on the LLM's features (specinfer "
                           "train-head): auto (the bundled one for the LLM, if any, with --tp 1 "
                           "--pp 1), none, or a directory")
    head_tree: str = flag("dynamic", "the draft head's tree for greedy sequences: dynamic (its "
                          "most probable paths, EAGLE-2 style) or static (--head-expansion); "
                          "sampled sequences always get the static one",
                          choices=("dynamic", "static"))
    head_expansion: str = flag("2,1,1,1", "the draft head's static tree: children per level "
                               "(default: 2 candidates, each continued by a chain of 3)")
    sequence_lease: float = flag(30.0, "seconds a live sequence may go untouched by its router "
                                 "before it is freed (the router died: a router steps its "
                                 "sequences far more often); 0 = never", minimum=0,
                                 unit="seconds")
    drain_timeout: float = flag(30.0, "on SIGTERM: seconds to keep serving live sequences "
                                "(NOT_SERVING, no new ones) while routers move them to other "
                                "replicas; keep the pod's termination grace period above it",
                                minimum=0, unit="seconds")
    head_nodes: int = flag(8, "the most nodes of a step's tree the draft head drafts; "
                           "model-free drafts fill the rest of the step's budget")
    tls: TlsFlags = group(TlsFlags)
    otlp_traces_endpoint: str | None = tracing.endpoint_flag()
    metrics_port: int = metrics.port_flag("KV cache usage, step times")

    def check(self) -> None:
        self.head_widths()  # ModelError naming --head-expansion
        if not 1 <= self.head_nodes <= self.max_tree_nodes:
            raise ModelError(f"--head-nodes must be in 1..--max-tree-nodes "
                             f"({self.max_tree_nodes}); got {self.head_nodes}")

    def head_widths(self) -> tuple[int, ...]:
        """The draft head's static tree: widths per level."""
        return tuple(parse_expansion(self.head_expansion, "--head-expansion"))

"""The speculator engine: one merged token tree per sequence from a pool of SSMs and the
model-free drafters. Stateless: each SSM's per-sequence KV cache is an optimisation only.

Draft sources are numbered: SSM i is source i, then the prompt-lookup (n-gram) drafter,
then the corpus datastore (``specinfer.drafting.datastore``), each if enabled.
Each SSM gets its own share of the node budget, so the merged tree respects it without
cutting sampled drafts out of a source's order (which MSS relies on); the model-free
sources' deterministic drafts share the rest and are cut to it.

A constrained sequence's SSM drafts are masked at the source (``specinfer.grammar``): the
speculator keeps each such sequence's matcher (a cache like the SSM KV: rebuilt from the
generated tokens when missing), advanced by the tokens each call adds. A constraint it
cannot follow (no tokenizer, a compile that fails) leaves the drafts unmasked: the verifier
cuts them to the grammar, so the output is the same either way.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specinfer.constraints import Constraint, InvalidConstraint
from specinfer.drafting import DraftRequest
from specinfer.drafting.datastore import NgramDatastore
from specinfer.drafting.model_free import ModelFreeDrafter
from specinfer.drafting.ssm import SSMDrafter
from specinfer.errors import InvalidArgument, check_token_ids
from specinfer.grammar import GrammarCompiler, SequenceGrammar
from specinfer.sampling import SamplingParams
from specinfer.tree import TokenTree, merge_trees

# The SSM tree (the router's "tree" mode): chains of 3 per SSM measured fastest among SSM
# trees here (bench/speculator.py, bench/results/speculator); wider trees accept more
# (w4-d3: 1.88) but cost more to draft and verify. On a CPU verifier no SSM tree beats
# plain decoding; the router's model-free "lookup" modes (expansion [0]) do.
DEFAULT_EXPANSION = [1, 1, 1]
GRAMMARS_KEPT = 256  # constrained sequences whose matcher is kept between calls

log = logging.getLogger(__name__)


@dataclass
class SpeculateSpec:
    sequence_id: str
    context: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    expansion: list[int] = field(default_factory=list)  # empty = server default
    max_nodes: int = 0  # 0 = server default
    dynamic: bool = False
    ssm_only: bool = False  # no model-free drafts: the SSMs share the whole budget
    constraint: Constraint | None = None  # structured output, after the prompt's tokens
    prompt_length: int = 0


class SpeculatorEngine:
    def __init__(self, pool: list[SSMDrafter], vocab_size: int, *, prompt_lookup: bool = True,
                 expansion: list[int] | None = None, max_nodes: int = 64,
                 prompt_lookup_depth: int = 6, prompt_lookup_branches: int = 2,
                 datastore: NgramDatastore | None = None, datastore_depth: int = 3,
                 grammars: GrammarCompiler | None = None) -> None:
        self.pool = pool
        self.grammars = grammars  # None: constraints are ignored (drafts unmasked)
        # sequence id -> (constraint key, its matcher after the generated tokens it has
        # consumed, those tokens); LRU order.
        self.sequence_grammars: OrderedDict[str, tuple[str, SequenceGrammar, list[int]]] = \
            OrderedDict()
        # The SSMs draft concurrently: their forwards are small (a few rows), so torch's
        # intra-op threads leave cores idle that another SSM can use (torch releases the
        # GIL inside its kernels).
        self.threads = ThreadPoolExecutor(len(pool), "ssm") if len(pool) > 1 else None
        self.vocab_size = vocab_size
        self.expansion = expansion or DEFAULT_EXPANSION
        self.max_nodes = max_nodes
        self.model_free = ModelFreeDrafter(datastore, prompt_lookup, prompt_lookup_depth,
                                           prompt_lookup_branches,
                                           datastore_depth, source=len(pool),
                                           vocab_size=vocab_size)

    def validate(self, specs: list[SpeculateSpec]) -> None:
        for i, s in enumerate(specs):
            if not s.sequence_id:
                raise InvalidArgument(f"items[{i}].sequence_id", "must not be empty")
            if not s.context:
                raise InvalidArgument(f"items[{i}].context", "must hold at least the root token")
            check_token_ids(f"items[{i}].context", s.context, self.vocab_size)
            if s.max_nodes > self.max_nodes:
                raise InvalidArgument(f"items[{i}].tree.max_nodes",
                                      f"{s.max_nodes} exceeds the server's budget {self.max_nodes}")
            if any(w > 16 for w in s.expansion) or len(s.expansion) > 32:
                raise InvalidArgument(f"items[{i}].tree.expansion",
                                      "at most 32 levels of at most 16 children")
            if sum(_level_sizes(s.expansion)) > self.max_nodes:
                raise InvalidArgument(f"items[{i}].tree.expansion",
                                      f"a tree of {sum(_level_sizes(s.expansion))} nodes exceeds "
                                      f"the budget {self.max_nodes}")
            if s.constraint is not None and not 0 < s.prompt_length <= len(s.context):
                raise InvalidArgument(f"items[{i}].prompt_length",
                                      f"{s.prompt_length} is outside [1, {len(s.context)}] "
                                      "(the context's length)")

    def forget(self, sequence_ids: list[str]) -> None:
        """Free the SSM KV slots of sequences that ended (a cache: nothing else changes)."""
        for sequence_id in sequence_ids:
            self.sequence_grammars.pop(sequence_id, None)
            for ssm in self.pool:
                ssm.forget(sequence_id)

    def grammar(self, spec: SpeculateSpec) -> SequenceGrammar | None:
        """The sequence's matcher after its generated tokens (kept from its last call and
        advanced, or built), or None: no constraint, or one this speculator cannot follow."""
        if spec.constraint is None or self.grammars is None:
            return None
        generated = spec.context[spec.prompt_length:]
        key = spec.constraint.key
        kept = self.sequence_grammars.pop(spec.sequence_id, None)
        try:
            if kept is not None and kept[0] == key and generated[:len(kept[2])] == kept[2] \
                    and not kept[1].broken:
                grammar = kept[1]
                grammar.advance(generated[len(kept[2]):])
            else:
                grammar = self.grammars.start(spec.constraint, generated)
        except InvalidConstraint as exc:
            log.warning("a constraint the speculator cannot follow: its drafts are unmasked",
                        extra={"error": str(exc)[:200]})
            return None
        self.sequence_grammars[spec.sequence_id] = (key, grammar, generated)
        while len(self.sequence_grammars) > GRAMMARS_KEPT:
            self.sequence_grammars.popitem(last=False)
        return grammar

    def speculate(self, specs: list[SpeculateSpec]) -> list[TokenTree]:
        """Each sequence's merged tree, within its node budget. An expansion of only zeros
        (e.g. ``[0]``) skips the SSMs: only the model-free drafts, at almost no cost."""
        self.validate(specs)
        budgets = [(s.max_nodes or self.max_nodes) for s in specs]
        use_ssm = [any(w > 0 for w in (s.expansion or self.expansion)) for s in specs]
        cheap = [0 if s.ssm_only else self.model_free.sources for s in specs]
        shares = [max(1, b // max(1, c + (len(self.pool) if ssm else 0)))
                  for b, c, ssm in zip(budgets, cheap, use_ssm, strict=True)]
        trees: list[list[TokenTree]] = [[] for _ in specs]

        # Model-free drafts first: deterministic, so they may be cut to their share.
        for i, s in enumerate(specs):
            if cheap[i]:
                trees[i].append(self.model_free.tree(s.context, shares[i] * cheap[i]))

        drafting = [i for i, ssm in enumerate(use_ssm) if ssm]
        grammars = {i: self.grammar(specs[i]) for i in drafting}

        def draft(source: int) -> list[TokenTree]:
            return self.pool[source].propose([
                DraftRequest(specs[i].sequence_id, specs[i].context,
                             specs[i].expansion or self.expansion, specs[i].params,
                             _generator(specs[i], source), specs[i].dynamic, shares[i],
                             allowed=grammars[i].allowed_words if grammars[i] else None)
                for i in drafting])

        if drafting:
            sources = range(len(self.pool))
            drafted = self.threads.map(draft, sources) if self.threads else map(draft, sources)
            for source_trees in drafted:  # in source order: merging is deterministic
                for i, tree in zip(drafting, source_trees, strict=True):
                    trees[i].append(tree)
        return [merge_trees(t) for t in trees]


def _level_sizes(expansion: list[int]) -> list[int]:
    sizes, width = [], 1
    for w in expansion:
        width *= w
        sizes.append(width)
    return sizes


def _generator(spec: SpeculateSpec, source: int) -> torch.Generator | None:
    """Stateless but reproducible: a seeded request drafts from a stream derived from its
    seed, the context length and the source."""
    if spec.params.greedy:
        return None
    g = torch.Generator()
    if spec.params.seed is None:
        g.seed()
    else:
        key = f"{spec.params.seed}:{len(spec.context)}:{source}".encode()
        g.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)
    return g

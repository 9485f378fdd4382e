"""The verifier engine: sequences, KV slots, tree verification, decoding (admission and
prefill: ``prefill.py``, which it inherits).

Cache invariant: between calls a sequence's cache slot holds every token of the sequence
except its last generated one (the *root*); the next Step feeds the root together with
the sequence's tree. After verification only the accepted path's K/V is kept, contiguous after
the prefix (``KVCache.compact``).

Every request is validated in full before any state changes, so a bad item fails its call
without touching other sequences.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.verifier.executor import Executor, ForwardArgs
from services.verifier.own_drafts import OwnDrafts
from services.verifier.prefill import (  # noqa: F401 (PrefillSpec, PrefillOut: the engine's API)
    Prefiller,
    PrefillJob,
    PrefillOut,
    PrefillSpec,
    chain_args,
    discount_rate,
)
from services.verifier.prefix_cache import PrefixIndex
from services.verifier.sequence import EngineConfig, SequenceState, SessionEntry
from specinfer.drafting import DraftPlan, OwnSource
from specinfer.errors import (
    InvalidArgument,
    NotFound,
    OutOfRange,
    check_token_ids,
)
from specinfer.grammar import GrammarCompiler, mask_logits
from specinfer.models import eos_list
from specinfer.sampling import (
    SamplingParams,
    TokenLogprob,
    process_logits,
    sample,
    target_probs,
    token_logprobs,
)
from specinfer.tree import TokenTree, TreeBatch
from specinfer.verification import Accepted, verify_batch

log = logging.getLogger(__name__)


@dataclass
class StepItem:
    """One sequence's part of a step: its last token (checked against the verifier's
    record), a tree drafted elsewhere (empty: none), the verifier's own drafts for it, and
    an unverified shadow draft for the next step (deterministic sources only); ``forced``:
    draft its grammar's forced tokens even without a tree or a plan."""

    sequence_id: str
    root_token: int
    tree: TokenTree = field(default_factory=TokenTree)
    draft: DraftPlan = DraftPlan()
    shadow: DraftPlan = DraftPlan()
    forced: bool = False


@dataclass
class StepOut:
    sequence_id: str
    tokens: list[int]
    accepted_nodes: list[int]
    cached_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if asked for
    drafted_nodes: int = 0  # the tree's nodes, sent or drafted here
    next_draft: TokenTree | None = None  # the shadow tree for the next step, if asked for


class VerifierEngine(Prefiller):
    def __init__(self, executor: Executor, config: EngineConfig, model_name: str = "",
                 eos_token_ids: list[int] | None = None,
                 sources: Sequence[OwnSource] = (),
                 grammars: GrammarCompiler | None = None) -> None:
        self.executor = executor
        # Structured output's grammars, compiled for the LLM's tokenizer (None: no
        # tokenizer here, constraints are refused).
        self.grammars = grammars
        self.vocab_size = executor.vocab_size
        # The trees Step items' plans ask the verifier to draft.
        self.drafts = OwnDrafts(sources, self.vocab_size)
        if self.drafts.needs_features and (executor.tp != 1 or executor.pp != 1):
            raise ValueError("a draft source that reads the LLM's features needs them in this "
                             "process: tensor and pipeline parallel degree 1")
        self.forward_passes = 0  # Step calls' forward passes (one each)
        # Structured output's cost in Step calls (seconds) and the tree nodes it forced.
        self.grammar_seconds = 0.0
        self.forced_tokens = 0
        self.config = config
        self.model_name = model_name
        self.eos_token_ids = eos_token_ids or []
        self.sequences: dict[str, SequenceState] = {}
        self.last_touched = time.monotonic()  # the last Prefill or Step (read from any thread)
        # Finished sequences' slots kept for their prefixes (by session id, else by
        # sequence id), LRU order: taken back when a slot is needed.
        self.kept: OrderedDict[str, SessionEntry] = OrderedDict()
        self.free_slots = list(range(config.slots))[::-1]
        # Prefill calls under way (begin_prefill ... advance_prefill): their sequence ids,
        # and the slots they will take (counted against admission).
        self.prefilling: set[str] = set()
        self.reserved = 0
        # Prefill calls whose chunks ride in the steps' forward passes (ride_prefill).
        self.riding: list[PrefillJob] = []
        self.riding_tokens = 0  # prompt tokens computed that way
        # Measured, as discounted sums [amount, seconds]: prompt tokens computed, and Step
        # calls (the prefill budget while sequences are live: _prefill_budget).
        self.prefill_rate = [0.0, 0.0]
        self.step_rate = [0.0, 0.0]  # steps without a prefill chunk
        self.ride_rate = [0.0, 0.0]  # prompt tokens riding in steps, and the time they added
        # Automatic prefix caching (prefix_cache.py); None: off (sessions still reuse).
        self.prefixes = PrefixIndex(config.block_size, f"{model_name}|{executor.dtype}") \
            if config.prefix_caching else None

    # --- capacity -------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.config.slots * self.config.max_context

    @property
    def used_tokens(self) -> int:
        """Tokens live sequences hold. Kept prefixes are not counted: they give their
        slots to new sequences first (``cached_tokens``)."""
        return sum(s.cached + 1 for s in self.sequences.values())

    @property
    def cached_tokens(self) -> int:
        """Tokens finished sequences' kept slots hold for their prefixes."""
        return sum(len(e.tokens) for e in self.kept.values())

    # --- validation -------------------------------------------------------------------

    def _live(self, name: str, sequence_id: str) -> SequenceState:
        seq = self.sequences.get(sequence_id)
        if seq is None:
            raise NotFound(name, f"unknown sequence {sequence_id!r} (never prefilled, "
                           "released, or freed after its lease)")
        return seq

    def _check_unique(self, ids: list[str]) -> None:
        if len(set(ids)) != len(ids):
            raise InvalidArgument("items.sequence_id", "a sequence appears twice in one request")

    def _logprobs(self, logits: torch.Tensor, rows: list[int], tokens: list[int],
                  params: SamplingParams) -> list[TokenLogprob]:
        """``tokens[i]``'s log-probability under ``logits[rows[i]]``, if asked for."""
        if params.logprobs is None:
            return []
        return token_logprobs(logits[rows, : self.vocab_size].cpu(), tokens, params.logprobs)

    @staticmethod
    def _pick(logits: torch.Tensor, params: SamplingParams, gen) -> int:
        if params.greedy:
            return int(logits.argmax())
        return sample(target_probs(logits, params), gen)

    # --- the step ---------------------------------------------------------------------

    def step(self, items: list[StepItem]) -> list[StepOut]:
        """One decoding step of a batch, in one forward pass: each item's tree (sent,
        drafted here by its plan, both merged, or none: one token decoded) verified
        greedily or by MSS. An item's shadow plan also drafts, unverified, the tree of its
        deterministic sources for the next step."""
        seqs, budgets = self._check_step(items)
        if not items:  # an empty batch: nothing to run (a forward of none would fail)
            return []
        started, rode = time.perf_counter(), self.riding_tokens
        try:
            return self._step(items, seqs, budgets)
        finally:
            seconds, rode = time.perf_counter() - started, self.riding_tokens - rode
            if not rode:
                discount_rate(self.step_rate, 1, seconds)
            elif self.step_rate[0]:  # what the chunk added to a step: its tokens' cost
                discount_rate(self.ride_rate, rode,
                              max(0.0, seconds - self.step_rate[1] / self.step_rate[0]))

    def _step(self, items: list[StepItem], seqs: list[SequenceState], budgets: list[int]
              ) -> list[StepOut]:
        drafting_masks = sum(s.grammar.seconds for s in seqs if s.grammar)
        trees = self.drafts.trees(seqs, [it.draft for it in items], budgets,
                                  [it.tree for it in items])
        start = time.perf_counter()
        masks = self._constrain(seqs, items, trees, budgets)
        constrained = any(m is not None for m in masks)
        self.grammar_seconds += (time.perf_counter() - start) if constrained else 0.0
        self.grammar_seconds += sum(s.grammar.seconds for s in seqs if s.grammar) \
            - drafting_masks  # the drafters' masks (drafted at the source)
        now = time.monotonic()
        for seq in seqs:
            seq.touched = now
        self.last_touched = now
        batch = TreeBatch.build(trees, [s.root for s in seqs], [s.cached for s in seqs])
        q = batch.tokens.shape[1]
        key_len = int(batch.prefix_lens.max()) + q
        visible = None if len(seqs) == 1 and q == 1 else batch.visibility(key_len)
        args = ForwardArgs(
            batch.tokens, batch.position_ids, torch.tensor([s.slot for s in seqs]),
            batch.prefix_lens, visible, features=self.drafts.needs_features,
            lengths=torch.tensor([1 + len(t) for t in trees]),
        )
        ride = self._ride_chunk() if self.riding else None
        if ride is None:
            logits = self.executor.forward(args)
        else:  # a prefill chunk in the same pass over the weights
            job, item, chunk = ride
            logits, chunk_logits = self.executor.forward_with_chunk(
                args, chain_args(item.slot, item.done, chunk, item.features is not None))
            self._chunk_computed(job, item, chunk, chunk_logits, self.executor.chunk_features)
            self.riding_tokens += len(chunk)
        self.forward_passes += 1
        start = time.perf_counter()
        processed = self._processed(logits, seqs, trees, masks)
        self.grammar_seconds += (time.perf_counter() - start) if constrained else 0.0
        results = verify_batch(processed, trees,
                               [s.params for s in seqs], [s.generator for s in seqs])
        outs = [self._accept(seq, tree, acc, logits[b], b)
                for b, (seq, tree, acc) in enumerate(zip(seqs, trees, results, strict=True))]
        for seq, out, item in zip(seqs, outs, items, strict=True):
            if item.shadow:
                out.next_draft = self.drafts.deterministic_tree(
                    seq, item.shadow.sources, min(item.shadow.max_nodes,
                                                  self.config.max_context - seq.cached - 1))
        return outs

    def _check_step(self, items: list[StepItem]) -> tuple[list[SequenceState], list[int]]:
        """Every item checked before anything changes (a bad one fails the call alone);
        returns the items' sequences and their trees' node budgets (0: no own drafts)."""
        self._check_unique([it.sequence_id for it in items])
        limit = self.config.max_tree_nodes
        seqs, budgets = [], []
        for i, item in enumerate(items):
            seq = self._live(f"items[{i}].sequence_id", item.sequence_id)
            if item.root_token != seq.root:
                raise InvalidArgument(f"items[{i}].root_token", f"is {item.root_token}, but "
                                      f"the sequence's last token is {seq.root}")
            tree = item.tree
            for name, plan in (("draft", item.draft), ("shadow", item.shadow)):
                if not 0 <= plan.max_nodes <= limit:
                    raise InvalidArgument(f"items[{i}].{name}.max_nodes", f"{plan.max_nodes} "
                                          f"is outside [0, {limit}]")
                self.drafts.check(f"items[{i}].{name}", plan, shadow=name == "shadow")
            if len(tree) > limit:
                raise InvalidArgument(f"items[{i}].tree", f"{len(tree)} nodes exceed the budget "
                                      f"of {limit}")
            check_token_ids(f"items[{i}].tree.tokens", tree.tokens, self.vocab_size)
            if seq.cached + 1 + len(tree) > self.config.max_context:
                raise OutOfRange(f"items[{i}]: sequence {item.sequence_id!r} would exceed "
                                 f"max_context {self.config.max_context}")
            if not seq.params.greedy and any(not d for d in tree.drafts):
                raise InvalidArgument(f"items[{i}].tree.drafts",
                                      "stochastic verification needs every node's drafts")
            budget = min(item.draft.max_nodes, self.config.max_context - seq.cached - 1) \
                if item.draft else 0
            if budget and len(tree) > budget:
                raise InvalidArgument(f"items[{i}].tree", f"{len(tree)} nodes do not fit in "
                                      f"draft.max_nodes {budget}: a merged step's tree must")
            seqs.append(seq)
            budgets.append(budget)
        return seqs, budgets

    def _constrain(self, seqs: list[SequenceState], items: list[StepItem],
                   trees: list[TokenTree], budgets: list[int]) -> list[torch.Tensor | None]:
        """Constrained sequences' trees cut to their grammar and, for a speculating item
        (one with a tree, a draft plan or ``forced``), extended by the tokens the grammar
        forces within its node budget; returns each item's row masks (None:
        unconstrained)."""
        masks: list[torch.Tensor | None] = []
        for i, (seq, item) in enumerate(zip(seqs, items, strict=True)):
            if seq.grammar is None:
                masks.append(None)
                continue
            speculates = len(item.tree) > 0 or bool(item.draft) or item.forced
            limit = (budgets[i] or self.config.max_tree_nodes) if speculates else 0
            limit = min(limit, self.config.max_context - seq.cached - 1)
            forced = seq.grammar.forced_tokens
            trees[i], rows = seq.grammar.shape(trees[i], seq.params.greedy,
                                               limit - len(trees[i]))
            self.forced_tokens += seq.grammar.forced_tokens - forced
            masks.append(rows)
        return masks

    @staticmethod
    def _processed(logits: torch.Tensor, seqs: list[SequenceState], trees: list[TokenTree],
                   masks: list[torch.Tensor | None]) -> torch.Tensor:
        """The logits verification reads: each sequence's processors applied to its tree's
        rows, row 1 + i with node i and its ancestors counted as generated (the text a
        step accepting node i would have produced), then its grammar's mask of each row,
        so the target distribution at every node is the one plain decoding would have
        there."""
        if not any(s.params.processes_logits or m is not None for s, m in zip(seqs, masks,
                                                                           strict=True)):
            return logits
        out = logits.float().cpu().clone()  # processors index on the host; raw stays
        for b, (seq, tree, mask) in enumerate(zip(seqs, trees, masks, strict=True)):
            rows = 1 + len(tree)
            if seq.params.processes_logits:
                paths = [[]] + [tree.path_tokens(i) for i in range(len(tree))]
                out[b, :rows] = process_logits(
                    out[b, :rows], seq.params, seq.tokens[: seq.prompt_length],
                    seq.tokens[seq.prompt_length:], paths)
            if mask is not None:
                mask_logits(out[b, :rows], logits[b, :rows].cpu(), mask)
        return out

    def _accept(self, seq: SequenceState, tree: TokenTree, acc: Accepted,
                logits: torch.Tensor, row: int) -> StepOut:
        base = seq.cached + 1  # the root's K/V sits at seq.cached
        src = [base + n for n in acc.nodes]
        dst = list(range(base, base + len(acc.nodes)))
        self.executor.compact(seq.slot, src, dst)
        # Token i was chosen from the distribution after the root (i = 0) or after the
        # accepted node before it: rows 0 and 1 + node of the tree batch.
        rows = [0] + [1 + n for n in acc.nodes]
        if seq.features is not None:  # the root and the accepted nodes are cached now
            seq.features[seq.cached : seq.cached + len(rows)] = self.executor.features[row, rows]
        seq.tokens.extend(acc.tokens)
        self._index(seq)
        if seq.grammar is not None:
            seq.grammar.advance(acc.tokens)
        return StepOut(seq.id, acc.tokens, acc.nodes, seq.cached,
                       self._logprobs(logits, rows, acc.tokens, seq.params), len(tree))

    def _index(self, seq: SequenceState) -> None:
        """The prefix index learns the sequence's cached tokens (its new full blocks)."""
        if self.prefixes is not None:
            self.prefixes.index(seq.slot, seq.tokens, seq.cached, seq.cache_salt)

    # --- lifetime ---------------------------------------------------------------------

    def release(self, sequence_ids: list[str], keep_for_session: bool = False) -> int:
        """End sequences. A sequence's slot is kept for its prefix (LRU, until a new
        sequence needs the slot) with prefix caching on, or for its session when asked
        (``keep_for_session``, a session id); else freed."""
        released = 0
        for sid in sequence_ids:
            seq = self.sequences.pop(sid, None)
            if seq is None:
                continue
            released += 1
            self.drafts.forget(sid)
            key = seq.session_id if keep_for_session and seq.session_id else \
                f"sequence:{sid}" if self.prefixes is not None else None
            if key is None:
                self._free(seq.slot)
                continue
            old = self.kept.pop(key, None)
            if old is not None:  # the session's earlier turn: this one holds more
                self._free(old.slot)
            self.kept[key] = SessionEntry(seq.slot, seq.tokens[:-1], seq.features,
                                          seq.cache_salt)
            if self.prefixes is not None:  # the same blocks, now of a finished sequence
                self.prefixes.keep(seq.slot, self.kept[key].tokens)
        return released

    def _free(self, slot: int) -> None:
        if self.prefixes is not None:
            self.prefixes.drop(slot)
        self.free_slots.append(slot)

    def expire(self) -> list[str]:
        """Free every live sequence no call has touched for the lease time; returns their
        ids. Sessions kept for prefix reuse are not live: they go only under pressure."""
        lease = self.config.sequence_lease_s
        if lease <= 0:
            return []
        now = time.monotonic()
        stale = [sid for sid, seq in self.sequences.items() if now - seq.touched > lease]
        if stale:
            log.warning("freeing sequences past their lease (their router is gone)",
                        extra={"sequences": len(stale), "lease_s": lease})
            self.release(stale)
        return stale

    def info(self) -> dict:
        return {
            "model": self.model_name,
            "vocab_size": self.vocab_size,
            "max_context": self.config.max_context,
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_free_tokens": self.capacity_tokens - self.used_tokens,
            "kv_cached_tokens": self.cached_tokens,
            "prefix_block_size": self.prefixes.block_size if self.prefixes else 0,
            "dtype": self.executor.dtype,
            "device": str(self.executor.device),
            "tensor_parallel": self.executor.tp,
            "pipeline_parallel": self.executor.pp,
            "max_tree_nodes": self.config.max_tree_nodes,
            "eos_token_ids": self.eos_token_ids,
            "live_sequences": len(self.sequences),
            "draft_sources": self.drafts.describe(),
            "sequence_lease_seconds": self.config.sequence_lease_s,
        }


def slot_len(config: EngineConfig) -> int:
    # Room for a full context plus padding queries of the widest batch row.
    return config.max_context + config.max_tree_nodes + 1


def eos_ids(model) -> list[int]:
    return eos_list(model.generation_config.eos_token_id if model.generation_config else None,
                    model.config)

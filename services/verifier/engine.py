"""The verifier engine: sequences, KV slots, prefill, tree verification, decoding.

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
from services.verifier.sequence import EngineConfig, SequenceState, SessionEntry
from specinfer.constraints import Constraint, InvalidConstraint
from specinfer.drafting import DraftPlan, OwnSource
from specinfer.errors import (
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    check_token_ids,
)
from specinfer.grammar import GrammarCompiler, SequenceGrammar, mask_logits
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
class PrefillSpec:
    sequence_id: str
    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    session_id: str = ""
    prompt_length: int | None = None  # None: all of token_ids (else the rest was generated)
    constraint: Constraint | None = None  # structured output


@dataclass
class PrefillOut:
    sequence_id: str
    token: int
    reused_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # [] unless asked for


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


class VerifierEngine:
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
        self.sessions: OrderedDict[str, SessionEntry] = OrderedDict()  # LRU order
        self.free_slots = list(range(config.slots))[::-1]

    # --- capacity -------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.config.slots * self.config.max_context

    @property
    def used_tokens(self) -> int:
        live = sum(s.cached + 1 for s in self.sequences.values())
        return live + sum(len(e.tokens) for e in self.sessions.values())

    def _take_slot(self, session_id: str) -> tuple[int, list[int], torch.Tensor | None]:
        """A slot for a new sequence: its session's kept slot, a free one, or the least
        recently used session's. Returns the slot, the tokens already cached in it and
        their features (with a draft head)."""
        if session_id and session_id in self.sessions:
            entry = self.sessions.pop(session_id)
            return entry.slot, entry.tokens, entry.features
        if self.free_slots:
            return self.free_slots.pop(), [], None
        if self.sessions:
            evicted, entry = self.sessions.popitem(last=False)
            log.info("evicting session cache to admit a sequence", extra={"session": evicted})
            return entry.slot, [], None
        raise ResourceExhausted(
            f"KV cache full: {len(self.sequences)} live sequences hold all "
            f"{self.config.slots} slots ({self.capacity_tokens} tokens); retry later"
        )

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

    # --- prefill ----------------------------------------------------------------------

    def prefill(self, specs: list[PrefillSpec]) -> list[PrefillOut]:
        self.expire()  # a dead router's sequences give their slots back first
        self._check_unique([s.sequence_id for s in specs])
        for i, spec in enumerate(specs):
            if not spec.sequence_id:
                raise InvalidArgument(f"items[{i}].sequence_id", "must not be empty")
            if spec.sequence_id in self.sequences:
                raise InvalidArgument(f"items[{i}].sequence_id",
                                      f"sequence {spec.sequence_id!r} is already live")
            if not spec.token_ids:
                raise InvalidArgument(f"items[{i}].token_ids", "the prompt is empty")
            if len(spec.token_ids) >= self.config.max_context:
                raise InvalidArgument(
                    f"items[{i}].token_ids",
                    f"prompt of {len(spec.token_ids)} tokens leaves no room to generate "
                    f"(max_context {self.config.max_context})",
                )
            check_token_ids(f"items[{i}].token_ids", spec.token_ids, self.vocab_size)
            check_token_ids(f"items[{i}].sampling.logit_bias",
                            [t for t, _ in spec.params.logit_bias], self.vocab_size)
            if spec.prompt_length is not None \
                    and not 1 <= spec.prompt_length <= len(spec.token_ids):
                raise InvalidArgument(f"items[{i}].prompt_length",
                                      f"{spec.prompt_length} is outside [1, "
                                      f"{len(spec.token_ids)}] (the token_ids sent)")
        grammars = [self._grammar(f"items[{i}].constraint", spec) for i, spec in enumerate(specs)]
        reusable = sum(1 for s in specs if s.session_id in self.sessions)
        if len(specs) - reusable > len(self.free_slots) + len(self.sessions) - reusable:
            raise ResourceExhausted(
                f"KV cache full: {len(specs)} new sequences, {len(self.free_slots)} free slots "
                f"of {self.config.slots}; retry later"
            )
        return [self._prefill_one(spec, g) for spec, g in zip(specs, grammars, strict=True)]

    def _grammar(self, field: str, spec: PrefillSpec) -> SequenceGrammar | None:
        """The sequence's matcher after its generated tokens (a re-prefill's), or None."""
        if spec.constraint is None:
            return None
        if self.grammars is None:
            raise InvalidArgument(field, "this verifier has no tokenizer for constraints")
        generated = spec.token_ids[spec.prompt_length or len(spec.token_ids):]
        try:
            return self.grammars.start(spec.constraint, generated, field)
        except InvalidConstraint as exc:
            raise InvalidArgument(field, str(exc).removeprefix(field + ": ")) from None

    def _prefill_one(self, spec: PrefillSpec, grammar: SequenceGrammar | None) -> PrefillOut:
        slot, kept, kept_features = self._take_slot(spec.session_id)
        prompt = spec.token_ids
        reuse = 0
        while reuse < min(len(kept), len(prompt) - 1) and kept[reuse] == prompt[reuse]:
            reuse += 1
        features = None
        if self.drafts.needs_features:
            features = self.drafts.feature_buffer(self.config.max_context)
            if reuse:
                features[:reuse] = kept_features[:reuse]
        logits = None
        for start in range(reuse, len(prompt), self.config.prefill_chunk):
            chunk = prompt[start : start + self.config.prefill_chunk]
            logits = self._forward_chain(slot, start, chunk, features is not None)
            if features is not None:
                features[start : start + len(chunk)] = self.executor.features[0]
        gen = spec.params.make_generator() if not spec.params.greedy else None
        prompt_length = len(prompt) if spec.prompt_length is None else spec.prompt_length
        processed = process_logits(logits[0, -1:].cpu(), spec.params, prompt[:prompt_length],
                                   prompt[prompt_length:])
        if grammar is not None:
            masks = grammar.masks(1)
            grammar.fill(masks, 0)
            processed = mask_logits(processed.float().clone(), logits[0, -1:].cpu(), masks)
        token = self._pick(processed[0], spec.params, gen)
        if grammar is not None:
            grammar.advance([token])
        self.sequences[spec.sequence_id] = SequenceState(
            spec.sequence_id, slot, list(prompt) + [token], spec.params, gen, spec.session_id,
            prompt_length, features=features, grammar=grammar,
        )
        self.last_touched = self.sequences[spec.sequence_id].touched
        return PrefillOut(spec.sequence_id, token, reuse,
                          self._logprobs(logits[0], [-1], [token], spec.params))

    def _logprobs(self, logits: torch.Tensor, rows: list[int], tokens: list[int],
                  params: SamplingParams) -> list[TokenLogprob]:
        """``tokens[i]``'s log-probability under ``logits[rows[i]]``, if asked for."""
        if params.logprobs is None:
            return []
        return token_logprobs(logits[rows, : self.vocab_size].cpu(), tokens, params.logprobs)

    def _forward_chain(self, slot: int, start: int, chunk: list[int],
                       features: bool = False) -> torch.Tensor:
        """Causal forward of ``chunk`` at cache positions ``start...``; last row's logits
        (and with ``features``, every row's in ``executor.features``)."""
        tree = TokenTree.chain(chunk[1:])
        batch = TreeBatch.build([tree], [chunk[0]], [start])
        return self.executor.forward(ForwardArgs(
            batch.tokens, batch.position_ids, torch.tensor([slot]), torch.tensor([start]),
            batch.visibility(start + len(chunk)), last_only=True, features=features,
        ))

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
        logits = self.executor.forward(ForwardArgs(
            batch.tokens, batch.position_ids, torch.tensor([s.slot for s in seqs]),
            batch.prefix_lens, visible, features=self.drafts.needs_features,
        ))
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
        if seq.grammar is not None:
            seq.grammar.advance(acc.tokens)
        return StepOut(seq.id, acc.tokens, acc.nodes, seq.cached,
                       self._logprobs(logits, rows, acc.tokens, seq.params), len(tree))

    # --- lifetime ---------------------------------------------------------------------

    def release(self, sequence_ids: list[str], keep_for_session: bool = False) -> int:
        released = 0
        for sid in sequence_ids:
            seq = self.sequences.pop(sid, None)
            if seq is None:
                continue
            released += 1
            self.drafts.forget(sid)
            if keep_for_session and seq.session_id:
                old = self.sessions.pop(seq.session_id, None)
                if old is not None:
                    self.free_slots.append(old.slot)
                self.sessions[seq.session_id] = SessionEntry(seq.slot, seq.tokens[:-1],
                                                             seq.features)
            else:
                self.free_slots.append(seq.slot)
        return released

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

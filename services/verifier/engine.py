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
from services.verifier.prefix_cache import PrefixIndex
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
    cache_salt: str = ""  # prefixes are reused only between sequences with the same salt


@dataclass
class PrefillOut:
    sequence_id: str
    token: int
    reused_tokens: int  # prompt tokens whose KV was cached already (not computed)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # [] unless asked for


@dataclass
class PendingPrefill:
    """One sequence of a Prefill call under way: its slot once taken, and how many of
    its prompt's tokens are in the cache (reused or computed)."""

    spec: PrefillSpec
    grammar: SequenceGrammar | None
    slot: int | None = None
    done: int = 0
    reused: int = 0
    features: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # after the last token computed
    out: PrefillOut | None = None


@dataclass
class PrefillJob:
    items: list[PendingPrefill]
    outs: list[PrefillOut] = field(default_factory=list)


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
        # Finished sequences' slots kept for their prefixes (by session id, else by
        # sequence id), LRU order: taken back when a slot is needed.
        self.kept: OrderedDict[str, SessionEntry] = OrderedDict()
        self.free_slots = list(range(config.slots))[::-1]
        # Prefill calls under way (begin_prefill ... advance_prefill): their sequence ids,
        # and the slots they will take (counted against admission).
        self.prefilling: set[str] = set()
        self.reserved = 0
        # Measured, as discounted sums [amount, seconds]: prompt tokens computed, and Step
        # calls (the prefill budget while sequences are live: _prefill_budget).
        self.prefill_rate = [0.0, 0.0]
        self.step_rate = [0.0, 0.0]
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

    def _take_slot(self, spec: PrefillSpec, spare: int | None = None
                   ) -> tuple[int, int, torch.Tensor | None]:
        """A slot for a new sequence and how many of its prompt's leading tokens' KV it
        holds already: its session's kept slot (what it still shares with the prompt), or
        the longest cached prefix (prefix_cache.py) copied into a free slot, else into the
        least recently used kept slot; a kept slot holding the prefix is taken as it is
        when no other is left. Returns the slot, the tokens reused and, with a draft head,
        the features of the sequence's tokens (the reused ones filled in)."""
        prompt = spec.token_ids
        limit = len(prompt) - 1  # the last token is always computed: its logits pick
        features = self.drafts.feature_buffer(self.config.max_context) \
            if self.drafts.needs_features else None
        entry = self.kept.get(spec.session_id) if spec.session_id else None
        if entry is not None and entry.salt == spec.cache_salt:
            del self.kept[spec.session_id]
            reuse = 0
            while reuse < min(len(entry.tokens), limit) and entry.tokens[reuse] == prompt[reuse]:
                reuse += 1
            return self._reuse(entry.slot, entry.slot, reuse, entry.features, features)
        source, reuse = None, 0
        if self.prefixes is not None:
            reuse, source = self.prefixes.lookup(prompt, spec.cache_salt)
        owner = next((k for k, e in self.kept.items() if e.slot == source), None)
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victims = [k for k in self.kept if k != owner]
            if not victims and owner is None:
                raise ResourceExhausted(
                    f"KV cache full: {len(self.sequences)} live sequences hold all "
                    f"{self.config.slots} slots ({self.capacity_tokens} tokens); retry later")
            key = victims[0] if victims else owner  # the prefix's own slot, as it is
            slot = self.kept.pop(key).slot
            if key != owner:
                log.info("evicting a kept prefix to admit a sequence",
                         extra={"tokens": 0 if owner is None else reuse})
        src_features = None
        if source is not None:
            holder = self.kept.get(owner) if owner is not None else next(
                (s for s in self.sequences.values() if s.slot == source), None)
            src_features = holder.features if holder is not None else None
        return self._reuse(source if reuse else slot, slot, reuse, src_features, features)

    def _reuse(self, source: int | None, slot: int, reuse: int,
               src_features: torch.Tensor | None, features: torch.Tensor | None
               ) -> tuple[int, int, torch.Tensor | None]:
        """``slot`` holding ``source``'s first ``reuse`` tokens' KV (and features)."""
        if self.prefixes is not None:
            self.prefixes.drop(slot)  # it is about to be written
        if reuse and source != slot:
            self.executor.copy(source, slot, reuse)
        if features is not None and reuse:
            if src_features is None:  # no features to reuse: compute them with the rest
                return slot, 0, features
            features[:reuse] = src_features[:reuse]
        return slot, reuse, features

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
        """Prefill new sequences, all at once (``begin_prefill`` and ``advance_prefill``
        interleave the same work with steps)."""
        job = self.begin_prefill(specs)
        while not self.advance_prefill(job, budget=0):
            pass
        return job.outs

    def begin_prefill(self, specs: list[PrefillSpec]) -> PrefillJob:
        """Check a Prefill call and reserve its slots; ``advance_prefill`` computes it."""
        self.expire()  # a dead router's sequences give their slots back first
        self._check_unique([s.sequence_id for s in specs])
        for i, spec in enumerate(specs):
            if not spec.sequence_id:
                raise InvalidArgument(f"items[{i}].sequence_id", "must not be empty")
            if spec.sequence_id in self.sequences or spec.sequence_id in self.prefilling:
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
        room = len(self.free_slots) + len(self.kept) - self.reserved  # kept prefixes give way
        if len(specs) > room:
            raise ResourceExhausted(
                f"KV cache full: {len(specs)} new sequences, {len(self.free_slots)} free "
                f"slots of {self.config.slots} ({len(self.kept)} kept for prefixes, "
                f"{self.reserved} taken by prefills under way); retry later"
            )
        self.reserved += len(specs)
        job = PrefillJob([PendingPrefill(spec, g) for spec, g in zip(specs, grammars,
                                                                         strict=True)])
        self.prefilling.update(s.sequence_id for s in specs)
        return job

    def advance_prefill(self, job: PrefillJob, budget: int | None = None) -> bool:
        """Compute the next ``budget`` prompt tokens of a Prefill call (default:
        ``_prefill_budget``; 0: all of it), finishing each sequence whose prompt is done;
        returns whether the call is done (its outputs in ``job.outs``). A sequence takes
        its slot (and its cached prefix) when its turn comes, so it may reuse the prefix
        of one computed before it in the same call."""
        budget = self._prefill_budget() if budget is None else budget
        left = budget or None
        for item in job.items:
            if item.out is not None:
                continue
            if item.slot is None:
                item.slot, item.done, item.features = self._take_slot(item.spec)
                self.reserved -= 1
                item.reused = item.done
            prompt = item.spec.token_ids
            while item.done < len(prompt) and (left is None or left > 0):
                size = self.config.prefill_chunk if left is None else min(
                    left, self.config.prefill_chunk)
                if left is not None and len(prompt) - item.done <= self.config.prefill_chunk // 2:
                    # The rest of a prompt this short in one call: a call costs ~35 ms of
                    # weight reads before its first token on this CPU, so splitting a short
                    # prompt cost 4-stream MT-Bench ~8% of its throughput (and its TTFT).
                    size = len(prompt) - item.done
                chunk = prompt[item.done : item.done + size]
                started = time.perf_counter()
                item.logits = self._forward_chain(item.slot, item.done, chunk,
                                                  item.features is not None)
                _discount_rate(self.prefill_rate, len(chunk), time.perf_counter() - started)
                if item.features is not None:
                    item.features[item.done : item.done + len(chunk)] = \
                        self.executor.features[0]
                item.done += len(chunk)
                left = None if left is None else left - len(chunk)
            if item.done < len(prompt):
                return False
            item.out = self._first_token(item)
            job.outs.append(item.out)
            self.prefilling.discard(item.spec.sequence_id)
        return True

    def _prefill_budget(self) -> int:
        """Prompt tokens for the next engine call of a Prefill (0: all): ``prefill_chunk``
        while no live sequence waits on this verifier; else about what computes in
        ``prefill_step_ratio`` steps' time (the measured step time x prefill rate, at least
        ``MIN_PREFILL_TOKENS``), so a running stream's next token waits about that much
        longer, not for the whole prompt. (A prompt's rest of at most half
        ``prefill_chunk`` goes in one call whatever the budget.)"""
        if not self.sequences or not self.step_rate[1]:
            return self.config.prefill_chunk
        if self.config.prefill_step_ratio <= 0:
            return 0
        step_s = self.step_rate[1] / self.step_rate[0]  # seconds per step
        tokens_per_s = self.prefill_rate[0] / self.prefill_rate[1] if self.prefill_rate[1] \
            else 0.0
        tokens = int(self.config.prefill_step_ratio * step_s * tokens_per_s)
        return max(MIN_PREFILL_TOKENS, min(self.config.prefill_chunk, tokens))

    def abort_prefill(self, job: PrefillJob) -> None:
        """A Prefill call that ended before its job (the caller went away): the slots it
        took are freed, the sequences it finished released."""
        for item in job.items:
            self.prefilling.discard(item.spec.sequence_id)
            if item.out is not None:
                self.release([item.spec.sequence_id])
            elif item.slot is not None:
                self._free(item.slot)
            else:
                self.reserved -= 1
        job.items.clear()

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

    def _first_token(self, item: PendingPrefill) -> PrefillOut:
        """A prefilled sequence's first token; it is live from here."""
        spec, grammar, logits, slot = item.spec, item.grammar, item.logits, item.slot
        prompt, features = spec.token_ids, item.features
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
        seq = self.sequences[spec.sequence_id] = SequenceState(
            spec.sequence_id, slot, list(prompt) + [token], spec.params, gen, spec.session_id,
            prompt_length, features=features, grammar=grammar, cache_salt=spec.cache_salt,
        )
        self._index(seq)
        self.last_touched = seq.touched
        return PrefillOut(spec.sequence_id, token, item.reused,
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
        started = time.perf_counter()
        try:
            return self._step(items, seqs, budgets)
        finally:
            _discount_rate(self.step_rate, 1, time.perf_counter() - started)

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
            if self.prefixes is not None:  # index the same tokens, as a finished list
                self.prefixes.index(seq.slot, self.kept[key].tokens, seq.cached,
                                    seq.cache_salt)
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


MIN_PREFILL_TOKENS = 16  # a Prefill's least progress per engine call


def _discount_rate(acc: list[float], amount: float, seconds: float,
                   keep: float = 0.8) -> None:
    """Discounted sums [amount, seconds]: their ratio is a recent rate."""
    acc[0] = keep * acc[0] + amount
    acc[1] = keep * acc[1] + seconds


def slot_len(config: EngineConfig) -> int:
    # Room for a full context plus padding queries of the widest batch row.
    return config.max_context + config.max_tree_nodes + 1


def eos_ids(model) -> list[int]:
    return eos_list(model.generation_config.eos_token_id if model.generation_config else None,
                    model.config)

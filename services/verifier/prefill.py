"""Admitting new sequences: each one's slot and the cached prefix it reuses (automatic
prefix caching, ``prefix_cache.py``), then its prompt computed a chunk at a time
(``begin_prefill`` / ``advance_prefill``: the server runs each chunk as its own engine job,
so Step calls queued meanwhile run in between) and its first token. ``VerifierEngine``
inherits this; the step and the sequences' lifetime are ``engine.py``'s."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from services.verifier.executor import ForwardArgs
from services.verifier.sequence import SequenceState
from specinfer.constraints import Constraint, InvalidConstraint
from specinfer.errors import InvalidArgument, ResourceExhausted, check_token_ids
from specinfer.grammar import SequenceGrammar, mask_logits
from specinfer.sampling import SamplingParams, TokenLogprob, process_logits
from specinfer.tree import TokenTree, TreeBatch

log = logging.getLogger(__name__)

MIN_PREFILL_TOKENS = 16  # a Prefill's least progress per engine call


def discount_rate(acc: list[float], amount: float, seconds: float,
                   keep: float = 0.8) -> None:
    """Discounted sums [amount, seconds]: their ratio is a recent rate."""
    acc[0] = keep * acc[0] + amount
    acc[1] = keep * acc[1] + seconds


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
    # Why it stopped riding in steps (its next chunk could not be set up); the Prefill call
    # then computes it itself, and reports the error the usual way.
    error: Exception | None = None


class Prefiller:
    """The prefill half of ``VerifierEngine`` (it holds the state these methods use)."""

    def _take_slot(self, spec: PrefillSpec) -> tuple[int, int, torch.Tensor | None]:
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
            evicted = self.kept.pop(key)
            slot = evicted.slot
            if key != owner:  # routine at capacity (LRU): debug, not one line per admission
                log.debug("evicting a kept prefix to admit a sequence",
                          extra={"tokens": len(evicted.tokens)})
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
        while (nxt := self._next_chunk(job, left)) is not None:
            item, chunk = nxt
            started = time.perf_counter()
            logits = self._forward_chain(item.slot, item.done, chunk, item.features is not None)
            discount_rate(self.prefill_rate, len(chunk), time.perf_counter() - started)
            self._chunk_computed(job, item, chunk, logits, self.executor.features)
            left = None if left is None else left - len(chunk)
        return prefill_done(job)

    def ride_prefill(self, job: PrefillJob) -> None:
        """Compute ``job``'s prompts inside the coming steps' forward passes, a chunk each
        (``_step``), rather than in engine calls of their own: a running stream then waits
        for a chunk's tokens, not for a forward's fixed cost as well (about 35 ms of
        weight reads on this CPU, more than a 4-stream step's own tokens)."""
        if job not in self.riding:
            self.riding.append(job)

    @property
    def rides_prefill(self) -> bool:
        """Whether prefill chunks can ride in steps here (the local CPU executor, chunked
        prefill on)."""
        return getattr(self.executor, "rides_prefill", False) \
            and self.config.prefill_step_ratio > 0

    def _ride_chunk(self) -> tuple[PrefillJob, PendingPrefill, list[int]] | None:
        """The chunk of a riding Prefill this step computes, if one is under way."""
        for job in list(self.riding):
            if prefill_done(job):
                self.riding.remove(job)
                continue
            try:
                nxt = self._next_chunk(job, self._prefill_budget(riding=True))
            except Exception as exc:  # never the step's failure: the Prefill call's
                job.error = exc
                self.riding.remove(job)
                continue
            if nxt is not None:
                return job, *nxt
        return None

    def _next_chunk(self, job: PrefillJob, left: int | None
                    ) -> tuple[PendingPrefill, list[int]] | None:
        """The next sequence of ``job`` with prompt left and its next chunk (at most
        ``left`` tokens; None: ``prefill_chunk``), its slot taken first if need be; None
        when the job is done or ``left`` is spent."""
        for item in job.items:
            if item.out is not None:
                continue
            if item.slot is None:
                item.slot, item.done, item.features = self._take_slot(item.spec)
                self.reserved -= 1
                item.reused = item.done
            if left is not None and left <= 0:
                return None
            prompt = item.spec.token_ids
            size = self.config.prefill_chunk if left is None else min(
                left, self.config.prefill_chunk)
            if left is not None and len(prompt) - item.done <= self.config.prefill_chunk // 2:
                # The rest of a prompt this short in one call: a call costs ~35 ms of weight
                # reads before its first token on this CPU, so splitting a short prompt
                # cost 4-stream MT-Bench ~8% of its throughput (and its TTFT).
                size = len(prompt) - item.done
            return item, prompt[item.done : item.done + size]
        return None

    def _chunk_computed(self, job: PrefillJob, item: PendingPrefill, chunk: list[int],
                        logits: torch.Tensor, features: torch.Tensor | None) -> None:
        """``chunk`` of ``item``'s prompt is in its slot (``logits``: after its last token;
        ``features [1, len(chunk), H]``); a finished prompt picks its first token and the
        sequence is live."""
        if item.features is not None:
            item.features[item.done : item.done + len(chunk)] = features[0]
        item.done += len(chunk)
        item.logits = logits
        if item.done < len(item.spec.token_ids):
            return
        item.out = self._first_token(item)
        job.outs.append(item.out)
        self.prefilling.discard(item.spec.sequence_id)

    def _prefill_budget(self, riding: bool = False) -> int:
        """Prompt tokens for the next chunk of a Prefill (0: all): ``prefill_chunk`` while
        no live sequence waits on this verifier; else about what computes in
        ``prefill_step_ratio`` steps' time (at least ``MIN_PREFILL_TOKENS``), so a running
        stream's next token waits about that much longer, not for the whole prompt. A chunk
        riding in a step costs its tokens (``ride_rate``: measured, what riding chunks added
        to their steps); one in an engine call of its own costs a forward as well
        (``prefill_rate``). (A prompt's rest of at most half ``prefill_chunk`` goes in one
        chunk whatever the budget.)"""
        if not self.sequences or not self.step_rate[1]:
            return self.config.prefill_chunk
        if self.config.prefill_step_ratio <= 0:
            return 0
        step_s = self.step_rate[1] / self.step_rate[0]  # seconds per step
        rate = self.ride_rate if riding and self.ride_rate[1] > 0 else self.prefill_rate
        tokens_per_s = rate[0] / rate[1] if rate[1] else 0.0
        tokens = int(self.config.prefill_step_ratio * step_s * tokens_per_s)
        return max(MIN_PREFILL_TOKENS, min(self.config.prefill_chunk, tokens))

    def abort_prefill(self, job: PrefillJob) -> None:
        """A Prefill call that ended before its job (the caller went away): the slots it
        took are freed, the sequences it finished released."""
        if job in self.riding:
            self.riding.remove(job)
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

    def _forward_chain(self, slot: int, start: int, chunk: list[int],
                       features: bool = False) -> torch.Tensor:
        """Causal forward of ``chunk`` at cache positions ``start...``; last row's logits
        (and with ``features``, every row's in ``executor.features``)."""
        return self.executor.forward(chain_args(slot, start, chunk, features))


def chain_args(slot: int, start: int, chunk: list[int], features: bool = False
               ) -> ForwardArgs:
    """The forward of a prompt's ``chunk`` at cache positions ``start...`` of ``slot``:
    causal, the last query's logits (every query's features with ``features``)."""
    batch = TreeBatch.build([TokenTree.chain(chunk[1:])], [chunk[0]], [start])
    return ForwardArgs(batch.tokens, batch.position_ids, torch.tensor([slot]),
                       torch.tensor([start]), batch.visibility(start + len(chunk)),
                       last_only=True, features=features)


def prefill_done(job: PrefillJob) -> bool:
    """Whether every sequence of a Prefill call is prefilled (or the call was aborted)."""
    return all(item.out is not None for item in job.items)

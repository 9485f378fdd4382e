"""Constraints on the verifier: compiled grammars and each sequence's matcher.

``GrammarCompiler`` compiles a ``Constraint`` against the LLM's tokenizer (llguidance), off
the engine's thread, with a time limit, and caches the result by the constraint's hash (a
small LRU): a compiled grammar is a matcher in its start state that each sequence copies.

``SequenceGrammar`` is one sequence's matcher, after every token the sequence generated
(rebuilt from the history on prefill, so a re-prefill after a failover continues it).
For a step it shapes the sequence's token tree and gives each tree row its mask:

- a node whose token the grammar forbids after its ancestors is removed with its subtree,
  except a *sampled* node of a stochastic sequence: removing it would change the residual
  its rejection leaves for the siblings drawn after it (multi-step speculative sampling),
  so it stays, masked to probability 0 and so never accepted, and only its subtree goes;
- at each leaf, the tokens the grammar forces next (llguidance's fast-forward tokens: JSON
  punctuation, a schema's keys, the rest of a choice) are drafted as a chain of one-hot
  drafts, so a JSON skeleton costs no LLM step per token;
- row 0 gets the mask after the sequence's text, row 1 + i the mask after node i's path:
  what plain constrained decoding sees at that position, so greedy verification and MSS
  stay exact.

A drafter masks at the source (``allowed_words``): it drafts each node's children from its
own distribution restricted to what the grammar allows after that node's path, and records
that masked, renormalised distribution as the drafts' ``q``, so a sampled draft the grammar
forbids is never drawn. The masks it computes for a step are kept (by path) until the
sequence advances, and ``shape`` reuses them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import llguidance.hf
import torch

from specinfer.constraints import Constraint, InvalidConstraint, parser_limits
from specinfer.tree import ROOT, Draft, TokenTree

log = logging.getLogger(__name__)

# Forced-token drafts carry this source id: one-hot, so their order among a node's
# drafts does not matter to MSS; far above any real source's id.
FORCED_SOURCE = 1 << 20


class GrammarCompiler:
    """Compiled grammars for one tokenizer, cached by constraint. Thread-safe: the
    verifier's servicer compiles on a worker thread before the engine sees the request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int],
                 cache_size: int = 256, timeout_s: float = 10.0) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.hits = 0
        self.misses = 0
        self.last_compile_s = 0.0  # the last compile's seconds (0 on a cache hit)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once, on first use (~0.4 s for a 49k vocabulary)
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size,
                    eos_token=self.eos_ids[0] if len(self.eos_ids) == 1 else self.eos_ids)
            return self._tokenizer

    def compile(self, constraint: Constraint, field: str = "constraint") -> llguidance.LLMatcher:
        """The constraint's matcher in its start state (shared: callers copy it); raises
        InvalidConstraint naming ``field``."""
        key = constraint.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                self.last_compile_s = 0.0
                return cached
        grammar = constraint.check(field)
        tokenizer = self.tokenizer
        start = time.perf_counter()
        future = self._pool.submit(llguidance.LLMatcher, tokenizer, grammar, log_level=0,
                                   limits=parser_limits())
        try:
            matcher = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise InvalidConstraint(f"{field}: compiling took over {self.timeout_s:g} s "
                                    "(the limit)") from None
        if matcher.is_error():
            raise InvalidConstraint(f"{field}.{constraint.kind}: "
                                    f"{matcher.get_error().strip().splitlines()[0][:300]}")
        self.last_compile_s = time.perf_counter() - start
        with self._lock:
            self.misses += 1
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def start(self, constraint: Constraint, generated: Sequence[int],
              field: str = "constraint") -> SequenceGrammar:
        """A sequence's grammar after ``generated`` (its tokens after the prompt)."""
        grammar = SequenceGrammar(self.compile(constraint, field).deep_copy(), self.vocab_size,
                                  constraint.kind, self.eos_ids)
        if generated and not grammar.matcher.consume_tokens(list(generated)):
            raise InvalidConstraint(f"{field}: the tokens generated so far do not follow it")
        return grammar


class SequenceGrammar:
    """One sequence's matcher, after all of its generated tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, kind: str,
                 eos_ids: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.eos_ids = list(eos_ids)
        self.vocab_size = vocab_size
        self.kind = kind
        self.forced_tokens = 0  # tokens drafted because the grammar forced them
        # The matcher refused a token its own mask allowed (a library inconsistency seen
        # with choices of odd multi-byte characters): from then on only the end of
        # sequence is allowed, so the sequence ends instead of failing its whole batch.
        self.broken = False
        # Masks computed this step, by draft path below the root (drafters, then shape).
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}
        self._lock = threading.Lock()
        self.seconds = 0.0  # spent in ``allowed_words`` (the drafters' masks)

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more but the end of sequence."""
        return self.matcher.is_stopped()

    def masks(self, rows: int) -> torch.Tensor:
        """Room for ``rows`` bitmasks (a bit per token, 32 to an int32 word)."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill(self, masks: torch.Tensor, row: int) -> None:
        """``masks[row]``: the tokens allowed next in the matcher's state."""
        target = masks[row]
        if self.broken:
            target.zero_()
            for eos in self.eos_ids:
                target[eos >> 5] |= _bit(eos & 31)
            return
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(),
                                             target.numel() * target.element_size())

    def _fill_path(self, masks: torch.Tensor, row: int, path: tuple[int, ...]) -> None:
        """``fill`` for the matcher's state after ``path`` (it is in that state now),
        reusing the mask a drafter computed for the same path this step."""
        kept = self._memo.get(path)
        if kept is not None:
            masks[row] = kept
            return
        self.fill(masks, row)
        self._memo[path] = masks[row].clone()

    def allowed_words(self, path: Sequence[int]) -> torch.Tensor:
        """The tokens the grammar allows after the sequence's tokens and ``path`` (draft
        tokens below the root), as a bitmask row (``token_bits`` reads it); none if
        ``path`` leaves the grammar. The matcher ends in the state it started in."""
        start = time.perf_counter()
        key = tuple(path)
        with self._lock:  # drafters on several threads (a speculator's SSMs) share it
            words = self._memo.get(key)
            if words is None:
                words = self.masks(1)[0]
                valid = self.matcher.validate_tokens(list(key)) if key else 0
                if valid < len(key):
                    words.zero_()
                else:
                    if key and not self.matcher.consume_tokens(list(key)):
                        raise RuntimeError(f"grammar refused a valid path: "
                                           f"{self.matcher.get_error()}")
                    self.fill(words.view(1, -1), 0)
                    self.matcher.rollback(len(key))
                self._memo[key] = words
            self.seconds += time.perf_counter() - start
        return words

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume accepted tokens (each was allowed: its row was masked). Once the grammar
        has stopped, only the end of sequence was allowed: nothing is left to consume."""
        self._memo.clear()
        for token in tokens:
            if self.matcher.is_stopped() or self.broken:
                return
            if not self.matcher.consume_token(token):
                log.warning("grammar refused a token its mask allowed: the sequence ends",
                            extra={"error": (self.matcher.get_error() or "")[:200]})
                self.broken = True

    def shape(self, tree: TokenTree, greedy: bool, room: int) -> tuple[TokenTree, torch.Tensor]:
        """The tree cut to the grammar and extended by forced tokens (at most ``room`` new
        nodes), and its rows' masks ``[1 + len(tree), words]`` (module docstring)."""
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(tree.parents):
            children.setdefault(parent, []).append(node)
        masks = self.masks(1 + len(tree) + max(room, 0))
        self._fill_path(masks, 0, ())
        out = TokenTree()
        left = [max(room, 0)]

        def visit(old: int, new: int, row: int, path: tuple[int, ...]) -> None:
            kept = 0
            for child in children.get(old, ()):
                token, drafts = tree.tokens[child], tree.drafts[child]
                if allowed(masks[row], token) and self.matcher.validate_tokens([token]):
                    node = out.add(new, token, drafts)
                    self._consume(token)
                    self._fill_path(masks, 1 + node, (*path, token))
                    visit(child, node, 1 + node, (*path, token))
                    self.matcher.rollback(1)
                    kept += 1
                elif not greedy and any(len(d.q_ids) > 1 for d in drafts):
                    node = out.add(new, token, drafts)  # never accepted: masked to 0
                    masks[1 + node] = masks[row]
            if not kept and left[0] > 0:
                self._force(out, new, masks, left)

        visit(ROOT, ROOT, 0, ())
        return out, masks[: 1 + len(out)]

    def _force(self, out: TokenTree, node: int, masks: torch.Tensor, left: list[int]) -> None:
        """Append below ``node`` the chain of tokens the grammar forces in its state."""
        forced = self.matcher.compute_ff_tokens()[: left[0]]
        forced = forced[: self.matcher.validate_tokens(forced)] if forced else forced
        consumed = 0
        for token in forced:
            row = 0 if node == ROOT else 1 + node
            if not allowed(masks[row], token):
                break
            node = out.add(node, token, [Draft.one_hot(FORCED_SOURCE, 0, token)])
            self._consume(token)
            consumed += 1
            self.fill(masks, 1 + node)
        self.matcher.rollback(consumed)
        left[0] -= consumed
        self.forced_tokens += consumed

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"grammar refused an allowed token: {self.matcher.get_error()}")


def compiler_for(llm: str, vocab_size: int, eos: list[int]) -> GrammarCompiler | None:
    """Structured output's compiler for the LLM's tokenizer; None when the model has no
    tokenizer (or no end-of-sequence token): constraints are then refused (a verifier) or
    ignored (a speculator's drafts are left unmasked)."""
    from specinfer.models import load_tokenizer

    try:
        tokenizer = load_tokenizer(llm)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer: structured output is off", extra={"error": str(exc)[:200]})
        return None
    if not eos:
        log.warning("no end-of-sequence token: structured output is off")
        return None
    return GrammarCompiler(tokenizer, vocab_size, eos)


def allowed(mask: torch.Tensor, token: int) -> bool:
    """Whether ``token``'s bit is set in one bitmask row (32 tokens per int32 word)."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


_BITS = torch.arange(32, dtype=torch.int32)


def _bit(k: int) -> int:
    """Bit ``k`` of an int32 word, as a signed 32-bit value (bit 31 is negative)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k


def token_bits(words: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Whether each token of ``ids [..., M]`` is allowed by its row of bitmask ``words [...,
    W]`` (a bool each): the bits a drafter checks for its candidates only."""
    ids = ids.long()
    return ((words.gather(-1, ids >> 5) >> (ids & 31)) & 1).bool()


def unpack(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask rows ``[R, words]`` as bools ``[R, vocab_size]``."""
    return ((masks.unsqueeze(-1) >> _BITS) & 1).view(masks.shape[0], -1)[:, :vocab_size].bool()


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``logits [R, V]`` (float32, on the host) with the tokens each row's mask forbids at
    -inf, in place; a row of the bitmask per row of logits. (llguidance's own helper
    goes through torch.compile, which a CPU host may not be able to build.)"""
    logits.masked_fill_(~unpack(masks, logits.shape[-1]), float("-inf"))
    return logits


def mask_logits(processed: torch.Tensor, raw: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``processed [R, V]`` (after the sampling processors) masked to each row's grammar,
    in place. A row where the processors and the grammar together allow nothing (min_tokens
    forbids the end of sequence where the grammar allows only that) takes the ``raw``
    logits masked to the grammar: the constraint wins over min_tokens."""
    apply_masks(processed, masks)
    dead = torch.isneginf(processed).all(dim=-1)
    if bool(dead.any()):
        rows = dead.nonzero().flatten()
        processed[rows] = apply_masks(raw[rows].float().clone(), masks[rows])
    return processed


__all__ = ["FORCED_SOURCE", "GrammarCompiler", "InvalidConstraint", "SequenceGrammar",
           "allowed", "apply_masks", "compiler_for", "mask_logits", "token_bits", "unpack"]

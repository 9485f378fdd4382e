"""When a generated sequence ends, and its text, token by token: the one place that applies
max_tokens, stop tokens (EOS unless ignored, and the request's stop token ids: kept as the
last token), stop strings (the text ends before the first one; the token that completes it
is the last token kept, as one-token steps would have stopped there), and what a stream may
show (no unfinished character, no text that may be the start of a stop string).

The text is detokenized incrementally, as vLLM's detokenizer does: each token decodes a
window of recent tokens (those since the last complete character, after those before them
for the decoder's context), so a step costs what its new tokens cost, not the whole
generation, and the text equals the decode of all the tokens at every point.

No torch here: the router imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what a decoder gives for an unfinished (or invalid) UTF-8 sequence

# A tokenizer's decode of a list of ids (the router's: skip_special_tokens=True).
Decode = Callable[[list[int]], str]


def stop_token_ids(eos_ids: Collection[int], stop_ids: Collection[int],
                   ignore_eos: bool) -> frozenset[int]:
    """The ids that end a sequence: its stop token ids, and EOS unless it is ignored."""
    return frozenset(stop_ids) | (frozenset() if ignore_eos else frozenset(eos_ids))


@dataclass(frozen=True)
class Stops:
    """What ends a sequence: ``max_tokens``, any of ``token_ids``, any of ``strings``
    (non-empty: an empty one would match before the first token)."""

    max_tokens: int
    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()


class IncrementalDetokenizer:
    """The text of a growing list of tokens, ``done + pending`` equal at every point to
    ``decode`` of all of them. ``done`` never changes once written; ``pending`` is the text
    of the tokens since ``done``'s end (empty, or ending in an unfinished character, which
    a later token may complete). Each token decodes the window from the previous complete
    point on (a decoder that strips the first token's leading space, as SentencePiece's
    does, strips it in both the window and its prefix, so their difference is exact)."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._window: list[int] = []  # the tokens from the prefix offset on
        self._read = 0  # window[:read]: the prefix, whose text ends ``done``
        self._prefix_text = ""  # decode(window[:read])
        self.done = ""
        self.pending = ""

    def add(self, token: int) -> None:
        self._window.append(token)
        text = self._decode(self._window)
        new = text[len(self._prefix_text):]
        if not new or text.endswith(REPLACEMENT):
            self.pending = new
            return
        self.done += new
        self.pending = ""
        del self._window[:self._read]  # the next window starts at this one's read offset
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)


class SequenceStops:
    """A sequence's tokens checked against its ``Stops`` as steps bring them, and (given a
    ``decode``) its text: what a stream may show, and in the end the text cut before the
    first stop string. ``finish_reason``: "" while it runs, then "stop" or "length"."""

    def __init__(self, stops: Stops, decode: Decode | None = None) -> None:
        self.stops = stops
        self.count = 0  # tokens kept
        self.finish_reason = ""
        self._text = IncrementalDetokenizer(decode) if decode else None
        self._longest = max(map(len, stops.strings), default=0)

    def add(self, tokens: Sequence[int]) -> int:
        """Take a step's tokens; returns how many of them the sequence keeps (a step may
        bring tokens past its end)."""
        kept = 0
        for token in tokens:
            if self.finish_reason:
                break
            if self.count >= self.stops.max_tokens:
                self.finish_reason = "length"
                break
            self.count += 1
            kept += 1
            if self._text is not None:
                searched = len(self._text.done)
                self._text.add(token)
                if self._longest and self._cut_at_stop_string(searched):
                    self.finish_reason = "stop"
            if token in self.stops.token_ids:
                self.finish_reason = "stop"
        if not self.finish_reason and self.count >= self.stops.max_tokens:
            self.finish_reason = "length"
        return kept

    def _cut_at_stop_string(self, searched: int) -> bool:
        """Whether the text has a stop string now; if so the text ends before the first
        one. ``searched``: the length of the final text the last token's check covered."""
        text = self._text
        start = max(0, searched - self._longest + 1)
        tail = text.done[start:] + text.pending
        hits = [at for s in self.stops.strings if (at := tail.find(s)) >= 0]
        if not hits:
            return False
        text.done = text.done[:start] + tail[:min(hits)]
        text.pending = ""
        return True

    @property
    def text(self) -> str:
        """The text so far (all of it: an unfinished character shows as U+FFFD)."""
        if self._text is None:
            return ""
        return self._text.done + self._text.pending

    def shown_since(self, start: int, final: bool) -> str:
        """The text after character ``start`` that a stream may show now: all of it once
        the sequence ended (or ``final``), else without an unfinished character at its end
        and without an end that may be the start of a stop string (so no part of a stop
        string is ever streamed, as with TGI and vLLM)."""
        if self._text is None:
            return ""
        done, pending = self._text.done, self._text.pending
        if not (final or self.finish_reason):
            pending = pending.rstrip(REPLACEMENT)  # ``done`` never ends in one
            tail_start = max(0, len(done) - self._longest)
            held = self._held_back(done[tail_start:] + pending)
            if held:
                end = len(done) + len(pending) - held
                done, pending = done[:end], pending[:max(0, end - len(done))]
        if start >= len(done):
            return pending[start - len(done):]
        return done[start:] + pending

    def _held_back(self, tail: str) -> int:
        """The length of the longest end of ``tail`` that is the start of a stop string
        (shorter than the whole string: a whole one would have stopped the sequence)."""
        held = 0
        for stop in self.stops.strings:
            at = tail.find(stop[:1], max(0, len(tail) - len(stop) + 1))
            while at >= 0 and len(tail) - at > held:
                if stop.startswith(tail[at:]):
                    held = len(tail) - at
                    break
                at = tail.find(stop[:1], at + 1)
        return held

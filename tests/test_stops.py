"""Stops and text, token by token (``specinfer.stops``), with the real SmolLM2 tokenizer: the
incremental text equals the tokenizer's decode of all the tokens at every point (characters
split over tokens, invalid bytes, special tokens), and stop strings spanning tokens cut the
tokens and the text as decoding every prefix would, with no part of a stop string streamed."""

from __future__ import annotations

import random

import pytest

from specinfer.stops import IncrementalDetokenizer, SequenceStops, Stops

TEXTS = [
    "Hello world! How are you today? I'm fine, thanks.",
    "東京タワーは高いです。日本語の文章、そして中文也可以。",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ❤️ hearts.",
    "naïve café résumé Ångström Øresund ß Ελληνικά русский עברית العربية",
    "def f(x):\n    return x ** 2  # ∑ ∫ √ ≠ ≤\n\n\tindent\r\nend",
    "mixed 😀東京 a😀b 中😀文 \U0001F9D1\u200D\U0001F4BB <|im_end|> tail",
]


@pytest.fixture(scope="module")
def tokenizer():
    from specinfer.models import DEFAULT_LLM, load_tokenizer

    return load_tokenizer(DEFAULT_LLM)


@pytest.fixture(scope="module")
def sequences(tokenizer) -> list[list[int]]:
    """Token sequences that stress a detokenizer: real texts; real texts with tokens
    dropped, swapped or special tokens put in (half characters left behind); and random
    ids over the vocabulary and over the 256 one-byte tokens (mostly invalid UTF-8)."""
    from services.router.frontend import BYTE_OF_CHAR

    rng = random.Random(0)
    real = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    byte_tokens = tokenizer.convert_tokens_to_ids(list(BYTE_OF_CHAR))
    specials = sorted(tokenizer.all_special_ids)
    out = list(real)
    for _ in range(60):
        ids = list(rng.choice(real)) + list(rng.choice(real))
        for _ in range(rng.randrange(1, 6)):
            k = rng.randrange(len(ids))
            op = rng.randrange(3)
            if op == 0:
                del ids[k]
            elif op == 1:
                ids.insert(k, rng.choice(specials))
            else:
                j = rng.randrange(len(ids))
                ids[k], ids[j] = ids[j], ids[k]
        out.append(ids)
    for _ in range(60):
        out.append([rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 80))])
        out.append([rng.choice(byte_tokens + specials[:1]) for _ in range(rng.randrange(1, 80))])
    return out


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def test_incremental_text_is_the_full_decode_at_every_token(tokenizer, sequences):
    decode = _decode(tokenizer)
    multibyte = invalid = 0
    for ids in sequences:
        text = IncrementalDetokenizer(decode)
        for k, token in enumerate(ids, 1):
            text.add(token)
            assert text.done + text.pending == decode(ids[:k]), (ids[:k], text.done)
            assert not text.done.endswith("\ufffd")
        multibyte += any(ord(c) > 0x7FF for c in text.done)
        invalid += "\ufffd" in text.done + text.pending
    assert multibyte > 50 and invalid > 50  # the sequences did stress it


def _by_prefixes(decode, ids: list[int], stops: Stops) -> tuple[list[int], str, str]:
    """What decoding every prefix gives: the tokens kept, the text, the finish reason."""
    for k in range(1, min(len(ids), stops.max_tokens) + 1):
        text = decode(ids[:k])
        hits = [text.find(s) for s in stops.strings if s in text]
        if hits:
            return ids[:k], text[:min(hits)], "stop"
        if ids[k - 1] in stops.token_ids:
            return ids[:k], text, "stop"
    kept = ids[:stops.max_tokens]
    return kept, decode(kept), "length" if len(kept) == stops.max_tokens else ""


def test_stop_strings_across_tokens_cut_as_decoding_every_prefix_would(tokenizer, sequences):
    """Stop strings taken from the decoded text (so they span token boundaries, start or end
    inside a character's tokens, or never occur), stop token ids and max_tokens, the tokens
    coming in steps of 1 to 6: the tokens kept, the text and the finish reason are what
    decoding every prefix gives, and the streamed text is always a start of the final text
    (no part of a stop string is ever shown)."""
    decode = _decode(tokenizer)
    rng = random.Random(1)
    stopped = 0
    for ids in sequences:
        text = decode(ids)
        strings = []
        for _ in range(rng.randrange(0, 4)):
            at = rng.randrange(max(1, len(text)))
            piece = text[at:at + rng.randrange(1, 12)] or "zz"
            strings.append(piece if rng.random() < 0.8 else piece + "§")
        stops = Stops(rng.randrange(1, len(ids) + 3),
                      frozenset(rng.sample(ids, 1)) if rng.random() < 0.2 else frozenset(),
                      tuple(strings))
        want_ids, want_text, want_reason = _by_prefixes(decode, ids, stops)
        seq, kept, shown = SequenceStops(stops, decode), [], ""
        at = 0
        while at < len(ids) and not seq.finish_reason:
            step = ids[at:at + rng.randrange(1, 7)]
            at += len(step)
            kept += step[:seq.add(step)]
            shown += seq.shown_since(len(shown), final=False)
            assert want_text.startswith(shown), (shown, want_text, strings)
        shown += seq.shown_since(len(shown), final=True)
        assert (kept, shown, seq.finish_reason) == (want_ids, want_text, want_reason)
        assert seq.text == want_text
        stopped += want_reason == "stop" and len(want_ids) < len(ids)
    assert stopped > 30


def test_a_stream_holds_back_an_unfinished_character_and_a_stop_strings_start(tokenizer):
    """Step by step: a half emoji is not shown until its last token; text that may begin
    the stop string "abc" is held until it cannot (then shown whole) or the stream ends."""
    decode = _decode(tokenizer)
    emoji = tokenizer("😀", add_special_tokens=False)["input_ids"]
    assert len(emoji) > 1
    seq = SequenceStops(Stops(100, strings=("abc",)), decode)
    shown = []

    def step(ids: list[int], final: bool = False) -> None:
        seq.add(ids)
        shown.append(seq.shown_since(sum(map(len, shown)), final))

    step(tokenizer("xa", add_special_tokens=False)["input_ids"])
    step(emoji[:1])
    step(emoji[1:])
    step(tokenizer(" ab", add_special_tokens=False)["input_ids"])
    step([], final=True)
    assert shown == ["x", "", "a😀", " ", "ab"] and seq.finish_reason == ""

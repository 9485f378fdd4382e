"""What both public APIs share: turning their input into a ``GenRequest`` (tokenizer, chat
template, validation: each request is validated here, once) and following a request's
stream (text deltas with stop strings held back, token bytes and offsets for logprobs).
``server.py`` (gRPC) and ``openai_http.py`` (HTTP) only translate to and from their wire
formats."""

from __future__ import annotations

import codecs
import dataclasses
import functools
import math
from dataclasses import dataclass, field

from jinja2.exceptions import TemplateError

from services.router.limits import Limits
from services.router.request import GenRequest
from specinfer.chat import chat_ids
from specinfer.errors import InvalidArgument, ModelNotFound, check_token_ids
from specinfer.sampling import MAX_LOGPROBS, SamplingParams
from specinfer.v1 import router_pb2
from specinfer.wire import sampling_from_proto, sampling_on_the_wire

MAX_TOKENS_LIMIT = 1 << 20


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2 and its descendants, SmolLM2 among them) spells byte b as
    chr(b) when b is a printable Latin-1 character, else as chr(256 + k) for the k-th
    byte that is not."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


BYTE_OF_CHAR = _byte_level_alphabet()


def message_text(name: str, content: object) -> str:
    """A chat message's content as text: a string, or OpenAI's list of content parts of
    which only ``{"type": "text", "text": ...}`` can be served (joined by newlines, as
    vLLM does)."""
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidArgument(f"{name}[{j}].type", "only text parts are supported "
                                      "(this model reads text)")
            if not isinstance(part.get("text"), str):
                raise InvalidArgument(f"{name}[{j}].text", "must be a string")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise InvalidArgument(name, "must be a string or a non-empty list of text parts")
    _unicode(name, content)
    return content


@dataclass
class Frontend:
    """Tokenizer, chat template and model name: what turns API input into a GenRequest."""

    tokenizer: object
    model_name: str
    vocab_size: int
    dtype: str = "float32"
    limits: Limits = field(default_factory=Limits)
    _token_bytes: dict[int, bytes] = field(default_factory=dict, repr=False)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids as the tokenizer makes them by default (with its BOS, for the
        tokenizers that add one: what ``generate`` on ``tokenizer(text)`` sees, and what
        vLLM and TGI send); ``add_special_tokens=False``: the text's tokens alone."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidArgument("messages", "this model has no chat template (a base "
                                  "model): send a prompt to /v1/completions instead")
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant"):
                raise InvalidArgument(f"messages[{i}].role", "must be system, user or assistant")
        contents = [message_text(f"messages[{i}].content", m.get("content"))
                    for i, m in enumerate(messages)]
        try:  # the template sees role and content only, as from the gRPC API
            return chat_ids(self.tokenizer, [{"role": m["role"], "content": text}
                                             for m, text in zip(messages, contents,
                                                                strict=True)])
        except TemplateError as exc:  # e.g. a template whose roles must alternate
            raise InvalidArgument("messages", f"refused by the chat template: {exc}") from None

    @property
    def eos_ids(self) -> set[int]:
        """The end-of-sequence ids the router stops at (the tokenizer's)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return set() if eos is None else {eos}

    def with_min_tokens(self, params: SamplingParams, min_tokens: int, stop_ids: set[int],
                        ignore_eos: bool, field: str) -> SamplingParams:
        """``params`` with vLLM's ``min_tokens``: no EOS (unless ignored) and no stop token
        id before that many tokens (past max_tokens: none in the whole answer)."""
        if not 0 <= min_tokens < 2**31:
            raise InvalidArgument(field, "must be an integer in 0..2**31-1")
        if not min_tokens:
            return dataclasses.replace(params, min_tokens=0, min_tokens_stop_ids=())
        stops = stop_ids | (set() if ignore_eos else self.eos_ids)
        return dataclasses.replace(params, min_tokens=min_tokens,
                                   min_tokens_stop_ids=tuple(sorted(stops)))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Tokens ``decode(skip_special_tokens=True)`` leaves out of the text."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        return frozenset(self.tokenizer.all_special_ids) | {
            i for i, tok in added.items() if getattr(tok, "special", False)}

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """Tokens added to the vocabulary: raw text, not spelled in the BPE alphabet."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        return {i: str(getattr(tok, "content", tok)) for i, tok in added.items()}

    @functools.cached_property
    def byte_level(self) -> bool:
        """Whether the vocabulary spells tokens in the byte-level alphabet (checked on text
        that needs it: a space, a Latin-1 letter, a 4-byte emoji)."""
        sample = " é\U0001F600"
        pieces = self.tokenizer.convert_ids_to_tokens(self.encode_prompt(sample, False))
        spelled = [BYTE_OF_CHAR.get(c) for p in pieces for c in p]
        return None not in spelled and bytes(spelled) == sample.encode()

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes: raw, so a token holding part of a UTF-8 character (an
        emoji split over tokens) is exact; special tokens as their text."""
        out = self._token_bytes.get(token)
        if out is None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if token in self.added_tokens:
                out = self.added_tokens[token].encode()
            elif self.byte_level:
                out = bytes(BYTE_OF_CHAR[c] for c in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out = bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
            else:
                out = piece.replace("\u2581", " ").encode()  # SentencePiece's space
            self._token_bytes[token] = out
        return out

    def token_text(self, token: int) -> str:
        """One token's text as logprobs show it (a partial character as U+FFFD)."""
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def text_offsets(self, ids: list[int], start: int, end: int) -> list[int]:
        """Where each of ``ids[start:end]`` begins in the text of ``ids`` (special tokens
        are not in the text; a token that starts inside a character gets that character's
        offset)."""
        # Incremental: an unfinished character is held back until its last byte, and
        # invalid bytes count as U+FFFD, as in the decoded text.
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        offsets, length = [], 0
        for k, token in enumerate(ids[:end]):
            if k >= start:
                offsets.append(length)
            if token not in self.special_ids:
                length += len(decoder.decode(self.token_bytes(token)))
        return offsets

    def check_ids(self, field: str, ids: list[int]) -> None:
        check_token_ids(field, ids, self.vocab_size)

    def check_model(self, model: object) -> None:
        """A request's model: unset (None) or the one served."""
        if model is not None and model != self.model_name:
            raise ModelNotFound(str(model), self.model_name)


def request_from_proto(msg: router_pb2.GenerateRequest, fe: Frontend) -> GenRequest:
    kind = msg.WhichOneof("input")
    if kind == "prompt":
        if not msg.prompt:
            raise InvalidArgument("prompt", "must not be empty")
        ids = fe.encode_prompt(msg.prompt)
    elif kind == "prompt_token_ids":
        ids = list(msg.prompt_token_ids.ids)
        fe.check_ids("prompt_token_ids", ids)
    elif kind == "chat":
        ids = fe.encode_chat([{"role": m.role, "content": m.content}
                              for m in msg.chat.messages])
    else:
        raise InvalidArgument("input", "give prompt, prompt_token_ids or chat")
    if not ids:
        raise InvalidArgument("prompt", "tokenizes to nothing")
    fe.limits.check_prompt(kind, len(ids))
    fe.check_model(msg.model or None)  # proto3: "" is unset
    if not 0 < msg.max_tokens <= MAX_TOKENS_LIMIT:
        raise InvalidArgument("max_tokens", f"must be in 1..{MAX_TOKENS_LIMIT}")
    fe.limits.check_max_tokens("max_tokens", msg.max_tokens)
    fe.limits.check_stop("stop", list(msg.stop))
    params = sampling_from_proto(msg.sampling, "sampling")
    fe.limits.check_logprobs("sampling.logprobs", params.logprobs)
    fe.check_ids("sampling.logit_bias", [t for t, _ in params.logit_bias])
    fe.check_ids("stop_token_ids", list(msg.stop_token_ids))
    params = fe.with_min_tokens(params, params.min_tokens, set(msg.stop_token_ids),
                                msg.ignore_eos, "sampling.min_tokens")
    return GenRequest(ids, msg.max_tokens, params,
                      speculation=msg.speculation if msg.HasField("speculation") else True,
                      stop=[s for s in msg.stop if s], stop_ids=set(msg.stop_token_ids),
                      session_id=msg.session_id, ignore_eos=msg.ignore_eos,
                      operation="chat" if kind == "chat" else "text_completion")


class Generation:
    """Follows one request's events; yields (new ids, text delta, their logprobs) and ends
    with its finish."""

    def __init__(self, req: GenRequest, fe: Frontend) -> None:
        self.req, self.fe = req, fe
        self.sent_text = ""
        self.sent_tokens = 0

    def _text(self, final: bool) -> str:
        text = self.fe.decode(self.req.generated)
        for stop in self.req.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        if not final:
            text = text.rstrip("\ufffd")  # hold back an incomplete UTF-8 sequence
            # ... and text that may be the start of a stop string, so no part of a stop
            # string is ever streamed (as with TGI and vLLM).
            held = max((k for stop in self.req.stop for k in range(1, len(stop))
                        if text.endswith(stop[:k])), default=0)
            text = text[: len(text) - held]
        return text

    async def deltas(self):
        while True:
            kind, payload = await self.req.events.get()
            if kind == "error":
                raise payload
            final = kind == "done"
            text = self._text(final)
            delta = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
            self.sent_text = text if delta or final else self.sent_text
            new = payload if kind == "tokens" else []
            start, self.sent_tokens = self.sent_tokens, self.sent_tokens + len(new)
            yield new, delta, self.req.logprobs[start:self.sent_tokens]
            if final:
                return


# --- the OpenAI API's request bodies ------------------------------------------------


def _number(body: dict, name: str, default, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(name, "must be a number")
    try:
        number = kind(value)
    except (OverflowError, ValueError):  # NaN, infinities, integers past a float
        raise InvalidArgument(name, "must be a finite number") from None
    if kind is int and number != value:
        raise InvalidArgument(name, "must be an integer")
    if kind is float and not math.isfinite(number):  # (an int past a float's range is fine)
        raise InvalidArgument(name, "must be a finite number")
    return number


def _choices(body: dict, limits: Limits) -> int:
    n = _number(body, "n", 1, int)
    if not 1 <= n <= limits.max_n:
        raise InvalidArgument("n", f"must be an integer in 1..{limits.max_n} (--max-n)")
    return n


def _logprobs(body: dict, chat: bool) -> int | None:
    """Alternatives per token to report, or None for no logprobs: chat takes
    ``logprobs: true`` with ``top_logprobs: N``, completions ``logprobs: N``."""
    field = "top_logprobs" if chat else "logprobs"
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise InvalidArgument("logprobs", "must be a boolean")
        if body.get("top_logprobs") is not None and not wanted:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        if not wanted:
            return None
    elif body.get("logprobs") is None:
        return None
    top = _number(body, field, 0, int)
    if not 0 <= top <= MAX_LOGPROBS:
        raise InvalidArgument(field, f"must be an integer in 0..{MAX_LOGPROBS}")
    return top


def _params(body: dict, chat: bool) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    seed = _number(body, "seed", None, int)  # 7.0 is the integer 7, as in JSON Schema
    if seed is not None and seed < 0:
        raise InvalidArgument("seed", "must be a non-negative integer")
    try:
        return sampling_on_the_wire(SamplingParams(
            temperature=temperature, top_k=_number(body, "top_k", 0, int), top_p=top_p,
            min_p=_number(body, "min_p", 0.0), seed=seed, logprobs=_logprobs(body, chat),
            logit_bias=_logit_bias(body),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0)))
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise InvalidArgument(field, str(exc)) from exc


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys, so strings) to biases."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise InvalidArgument("logit_bias", "must be an object of token id -> bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidArgument("logit_bias", f"key {key!r} is not a token id") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgument("logit_bias", f"the bias of {key!r} must be a number")
        try:
            out[token] = float(value)
        except OverflowError:  # an integer past a float's range
            raise InvalidArgument("logit_bias", f"the bias of {key!r} must be a finite "
                                  "number") from None
    return out


# OpenAI request fields this server does not implement: refused (HTTP 400 naming the
# field) unless they hold the value that means "off". Fields that do not change the
# output (user, metadata, store, service_tier, ...) are accepted, as are fields the
# OpenAI API does not define.
UNSUPPORTED = {
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "parallel_tool_calls": lambda v: False,
    "audio": lambda v: False,
    "modalities": lambda v: v == ["text"],
    "prediction": lambda v: False,
    "reasoning_effort": lambda v: False,
    "web_search_options": lambda v: False,
    "verbosity": lambda v: False,
    "best_of": lambda v: v == 1 and not isinstance(v, bool),  # (True == 1 in Python)
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
}


def _refuse_unsupported(body: dict) -> None:
    for name, is_off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not is_off(value):
            raise InvalidArgument(name, "is not supported by this server")


def _stop(body: dict, keep_empty: bool = False) -> list[str]:
    """The stop strings; "" would stop before the first token, so it is dropped (the gRPC
    API drops it too), unless ``keep_empty`` (the limit counts what was sent)."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [_unicode(f"stop[{i}]", s) for i, s in enumerate(stop) if s or keep_empty]
    raise InvalidArgument("stop", "must be a string or a list of strings")


def openai_requests(fe: Frontend, body: dict, chat: bool) -> list[GenRequest]:
    """An OpenAI completions (or, with ``chat``, chat completions) body as scheduler
    requests, one per choice (``n``); seeded choices get seeds seed, seed+1, ... so that
    each is reproducible and they differ."""
    fe.check_model(body.get("model"))
    _refuse_unsupported(body)
    _flag(body, "stream")  # read by the HTTP layer: a bool or null, not any truthy value
    stream_usage(body)  # (likewise)
    prompts = [_chat_ids(fe, body)] if chat else _prompts_ids(fe, body)
    for k, ids in enumerate(prompts):
        fe.limits.check_prompt("messages" if chat else _prompt_field(prompts, k), len(ids))
    n = _choices(body, fe.limits)
    params = _params(body, chat)
    fe.limits.check_logprobs("top_logprobs" if chat else "logprobs", params.logprobs)
    fe.limits.check_stop("stop", _stop(body, keep_empty=True))
    fe.check_ids("logit_bias", [t for t, _ in params.logit_bias])
    fe.check_ids("stop_token_ids", sorted(_stop_token_ids(body)))
    out = []
    for k, ids in enumerate(prompts):  # OpenAI's choice index: prompt * n + choice
        for i in range(n):
            p = params if params.seed is None else dataclasses.replace(
                params, seed=(params.seed + i) % 2**64)
            req = _openai_request(body, ids, None if chat else 16, p, fe,
                                  "messages" if chat else _prompt_field(prompts, k))
            req.operation = "chat" if chat else "text_completion"
            out.append(req)
    return out


def _prompt_field(prompts: list, k: int) -> str:
    return "prompt" if len(prompts) == 1 else f"prompt[{k}]"


def _prompts_ids(fe: Frontend, body: dict) -> list[list[int]]:
    """The completions ``prompt``: a string or token ids, or a batch of either (a list of
    strings, a list of token-id lists), as OpenAI's legacy API takes it."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and prompt and all(
        isinstance(p, str) or (isinstance(p, list) and p) for p in prompt)
    special = _flag(body, "add_special_tokens") is not False  # vLLM's; default true
    if not batch:
        return [_prompt_ids(fe, "prompt", prompt, special)]
    if len(prompt) > fe.limits.max_prompts:
        raise InvalidArgument("prompt", f"{len(prompt)} prompts; at most "
                              f"{fe.limits.max_prompts} per request (--max-prompts)")
    return [_prompt_ids(fe, f"prompt[{k}]", p, special) for k, p in enumerate(prompt)]


def _prompt_ids(fe: Frontend, field: str, prompt: object, special: bool) -> list[int]:
    """One prompt's ids: text through the tokenizer (``special``: with the special tokens
    it adds, e.g. a BOS), token ids as given."""
    if isinstance(prompt, str):
        ids = fe.encode_prompt(_unicode(field, prompt), special) if prompt else []
        if prompt and not ids:  # e.g. only control characters the tokenizer drops
            raise InvalidArgument(field, "tokenizes to nothing")
        if not ids:
            raise InvalidArgument(field, "must not be empty")
        return ids
    # JSON integers: 7 and 7.0 alike (as JSON Schema has it), never true/false.
    if isinstance(prompt, list) and all(_integral(t) for t in prompt):
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidArgument(field, "must not be empty")
        fe.check_ids(field, ids)
        return ids
    raise InvalidArgument(field, "must be a string, a list of token ids, or a list of "
                                 "either (a batch)")


def _integral(value: object) -> bool:
    return not isinstance(value, bool) and (
        isinstance(value, int) or (isinstance(value, float) and value.is_integer()))


def _chat_ids(fe: Frontend, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "must be a non-empty list")
    if not all(isinstance(m, dict) for m in messages):
        raise InvalidArgument("messages", "each message must be an object")
    return fe.encode_chat(messages)


def _openai_request(body: dict, ids: list[int], default_max: int | None,
                    params: SamplingParams, fe: Frontend, field: str) -> GenRequest:
    limits = fe.limits
    if not ids:
        raise InvalidArgument(field, "must not be empty")
    given = body.get("max_completion_tokens")  # the newer name wins; null is "not given"
    if given is None:
        given = body.get("max_tokens")
    max_tokens = given if given is not None else default_max
    if max_tokens is None:  # as much as fits: the context, or --max-tokens
        max_tokens = limits.max_tokens or MAX_TOKENS_LIMIT
    if not _integral(max_tokens) or not 0 < max_tokens <= MAX_TOKENS_LIMIT:
        raise InvalidArgument("max_tokens", f"must be an integer in 1..{MAX_TOKENS_LIMIT}")
    max_tokens = int(max_tokens)  # 16.0 is 16
    if given is not None:
        limits.check_max_tokens("max_tokens", max_tokens)
    spec = _flag(body, "speculation")
    stop_ids, ignore_eos = _stop_token_ids(body), bool(_flag(body, "ignore_eos"))
    params = fe.with_min_tokens(params, _number(body, "min_tokens", 0, int), stop_ids,
                                ignore_eos, "min_tokens")
    return GenRequest(ids, max_tokens, params, speculation=spec is not False,
                      stop=_stop(body), stop_ids=stop_ids, ignore_eos=ignore_eos,
                      session_id=_user(body))


def _stop_token_ids(body: dict) -> set[int]:
    """vLLM's ``stop_token_ids``: token ids that end the request as EOS does (checked
    against the vocabulary in ``openai_requests``)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return set()
    if not isinstance(ids, list) or not all(_integral(t) for t in ids):
        raise InvalidArgument("stop_token_ids", "must be a list of token ids")
    return {int(t) for t in ids}


def stream_usage(body: dict) -> bool:
    """OpenAI's ``stream_options.include_usage``: whether a stream ends with a usage chunk
    (its ``choices`` empty, which clients reading ``choices[0]`` of every chunk do not
    expect unless they asked for it)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidArgument("stream_options", "must be an object")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise InvalidArgument("stream_options.include_usage", "must be a boolean")
    return bool(include)


def _flag(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidArgument(name, "must be a boolean")
    return value


def _user(body: dict) -> str:
    """OpenAI's ``user`` (a string): the session key that keeps a conversation's KV."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidArgument("user", "must be a string")
    return _unicode("user", user or "")


def _unicode(field: str, text: str) -> str:
    """``text``, if UTF-8 can hold it: JSON's escapes can spell lone surrogates
    (``"\\ud800"``), which the tokenizer, hashing and protobuf all refuse."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(field, "is not valid Unicode (a lone surrogate)") from None
    return text

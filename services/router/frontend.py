"""What both public APIs share: turning their input into a ``GenRequest`` (tokenizer, chat
template, validation: each request is validated here, once) and following a request's
stream (text deltas with stop strings held back, token bytes and offsets for logprobs).
``server.py`` (gRPC) and ``openai_http.py`` (HTTP, its bodies read by ``openai_request.py``)
only translate to and from their wire formats."""

from __future__ import annotations

import codecs
import dataclasses
import functools
from dataclasses import dataclass, field

from jinja2.exceptions import TemplateError

from services.router.limits import Limits
from services.router.request import GenRequest
from services.router.tools import (
    Tools,
    assistant_tool_calls,
    render_messages,
    template_knows_tools,
    tools_from_proto,
)
from specinfer.chat import chat_ids
from specinfer.constraints import Constraint, InvalidConstraint
from specinfer.errors import InvalidArgument, ModelNotFound, check_token_ids
from specinfer.sampling import SamplingParams
from specinfer.stops import stop_token_ids
from specinfer.v1 import router_pb2
from specinfer.wire import constraint_from_proto, sampling_from_proto

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
    check_unicode(name, content)
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
    _checked: dict[str, None] = field(default_factory=dict, repr=False)  # constraint keys

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids as the tokenizer makes them by default (with its BOS, for the
        tokenizers that add one: what ``generate`` on ``tokenizer(text)`` sees, and what
        vLLM and TGI send); ``add_special_tokens=False``: the text's tokens alone."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[dict], tools: Tools | None = None) -> list[int]:
        """Chat messages through the template; with ``tools``, the tools in the prompt,
        assistant turns' ``tool_calls`` and ``tool`` turns (``services.router.tools``)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidArgument("messages", "this model has no chat template (a base "
                                  "model): send a prompt to /v1/completions instead")
        turns, call_ids = [], set()
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant", "tool"):
                raise InvalidArgument(f"messages[{i}].role",
                                      "must be system, user, assistant or tool")
            turn = {"role": m["role"]}
            if m.get("tool_calls") is not None and m["role"] != "assistant":
                raise InvalidArgument(f"messages[{i}].tool_calls",
                                      "only assistant messages carry tool calls")
            if m["role"] == "assistant" and m.get("tool_calls") is not None:
                turn["tool_calls"] = assistant_tool_calls(f"messages[{i}].tool_calls",
                                                          m["tool_calls"])
                call_ids |= {c.get("id") for c in m["tool_calls"]}
                turn["content"] = "" if m.get("content") is None else \
                    message_text(f"messages[{i}].content", m["content"])
            else:
                turn["content"] = message_text(f"messages[{i}].content", m.get("content"))
            if m.get("tool_call_id") is not None:
                if not isinstance(m["tool_call_id"], str):
                    raise InvalidArgument(f"messages[{i}].tool_call_id", "must be a string")
                turn["tool_call_id"] = check_unicode(f"messages[{i}].tool_call_id",
                                                     m["tool_call_id"])
            if m["role"] == "tool" and turn.get("tool_call_id") not in call_ids:
                raise InvalidArgument(f"messages[{i}].tool_call_id",
                                      "must be the id of a tool call an assistant message "
                                      "made before it")
            turns.append(turn)
        native = template_knows_tools(template)
        try:  # the template sees role and content (and tool calls) only
            return chat_ids(self.tokenizer, render_messages(turns, tools, native),
                            tools=[{"type": "function", "function": f}
                                   for f in tools.functions] if tools and native else None)
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
        stops = stop_token_ids(self.eos_ids, stop_ids, ignore_eos)
        return dataclasses.replace(params, min_tokens=min_tokens,
                                   min_tokens_stop_ids=tuple(sorted(stops)))

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

    def check_constraint(self, constraint: Constraint | None, field: str) -> None:
        """A structured-output constraint compiles (checked here, without the tokenizer,
        so a bad one is refused before it is scheduled; the verifier compiles it for its
        own tokenizer). Checks are cached by the constraint's hash."""
        if constraint is None or constraint.key in self._checked:
            return
        try:
            constraint.check(field)
        except InvalidConstraint as exc:
            message = str(exc).removeprefix(field).lstrip(".: ")
            raise InvalidArgument(field, message or str(exc)) from None
        self._checked[constraint.key] = None
        while len(self._checked) > 1024:
            self._checked.pop(next(iter(self._checked)))

    def with_tools(self, tools: Tools | None, constraint: Constraint | None
                   ) -> Constraint | None:
        """A request's one constraint: its own (a response format), or the grammar of
        calls its ``tools`` make (unless ``tool_choice`` is none)."""
        if tools is None or tools.choice == "none":
            return constraint
        if constraint is not None:
            raise InvalidArgument("tools", "a request takes one constraint: tools, or a "
                                  "response format")
        constraint = tools.constraint()
        self.check_constraint(constraint, "tools")
        return constraint

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
        tools = tools_from_proto(msg)
        ids = fe.encode_chat([_message(m) for m in msg.chat.messages], tools)
    else:
        raise InvalidArgument("input", "give prompt, prompt_token_ids or chat")
    if not ids:
        raise InvalidArgument("prompt", "tokenizes to nothing")
    if kind != "chat":
        tools = None
        given = [name for name, present in (("tools", bool(msg.tools)),
                                            ("tool_choice", msg.HasField("tool_choice")),
                                            ("parallel_tool_calls",
                                             msg.HasField("parallel_tool_calls")))
                 if present]
        if given:
            raise InvalidArgument(given[0], "only chat input calls tools")
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
    constraint = constraint_from_proto(msg.constraint, "constraint")
    fe.check_constraint(constraint, "constraint")
    constraint = fe.with_tools(tools, constraint)
    ignore_eos = msg.ignore_eos and constraint is None  # a constraint ends at its EOS
    params = fe.with_min_tokens(params, params.min_tokens, set(msg.stop_token_ids),
                                ignore_eos, "sampling.min_tokens")
    return GenRequest(ids, msg.max_tokens, params,
                      speculation=msg.speculation if msg.HasField("speculation") else True,
                      stop=[s for s in msg.stop if s], stop_ids=set(msg.stop_token_ids),
                      session_id=msg.session_id, ignore_eos=ignore_eos,
                      operation="chat" if kind == "chat" else "text_completion",
                      constraint=constraint, tools=tools,
                      cache_salt=cache_salt(msg.cache_salt))


def _message(m: router_pb2.ChatMessage) -> dict:
    """A gRPC chat message as an OpenAI one (what ``Frontend.encode_chat`` takes)."""
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


class Generation:
    """Follows one request's events; yields (new ids, text delta, their logprobs) and ends
    with its finish."""

    def __init__(self, req: GenRequest) -> None:
        self.req = req
        self._sent: list[str] = []  # the text deltas yielded
        self._sent_chars = 0
        self.sent_tokens = 0

    @property
    def sent_text(self) -> str:
        return "".join(self._sent)

    async def deltas(self):
        while True:
            kind, payload = await self.req.events.get()
            if kind == "error":
                raise payload
            final = kind == "done"
            delta = self.req.text_since(self._sent_chars, final)
            self._sent.append(delta)
            self._sent_chars += len(delta)
            new = payload if kind == "tokens" else []
            start, self.sent_tokens = self.sent_tokens, self.sent_tokens + len(new)
            yield new, delta, self.req.logprobs[start:self.sent_tokens]
            if final:
                return


MAX_SALT = 256  # characters of a cache_salt


def cache_salt(salt: object, field: str = "cache_salt") -> str:
    """vLLM's ``cache_salt`` (a string of at most MAX_SALT characters; empty: none)."""
    if salt is None:
        return ""
    if not isinstance(salt, str):
        raise InvalidArgument(field, "must be a string")
    if len(salt) > MAX_SALT:
        raise InvalidArgument(field, f"{len(salt)} characters; at most {MAX_SALT}")
    return check_unicode(field, salt)


def check_unicode(field: str, text: str) -> str:
    """``text``, if UTF-8 can hold it: JSON's escapes can spell lone surrogates
    (``"\\ud800"``), which the tokenizer, hashing and protobuf all refuse."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(field, "is not valid Unicode (a lone surrogate)") from None
    return text

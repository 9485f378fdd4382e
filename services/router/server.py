"""The router's public API: gRPC ``specinfer.v1.Router`` and an OpenAI-compatible HTTP API,
both over one scheduler (``specinfer serve router``)."""

from __future__ import annotations

import asyncio
import codecs
import functools
import logging
import time
from dataclasses import dataclass, field

import grpc

from services.router.scheduler import GenRequest, Scheduler
from specinfer.errors import InvalidArgument, ServiceError
from specinfer.grpc_server import Service, abort_on_error
from specinfer.sampling import SamplingParams
from specinfer.v1 import common_pb2, router_pb2, router_pb2_grpc
from specinfer.wire import logprob_to_proto

log = logging.getLogger(__name__)
MAX_TOKENS_LIMIT = 1 << 20


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2 and its descendants, SmolLM2 among them) spells byte b as
    chr(b) when b is a printable Latin-1 character, else as chr(256 + k) for the k-th
    byte that is not."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


BYTE_OF_CHAR = _byte_level_alphabet()


@dataclass
class Frontend:
    """Tokenizer, chat template and model name: what turns API input into a GenRequest."""

    tokenizer: object
    model_name: str
    vocab_size: int
    dtype: str = "float32"
    _token_bytes: dict[int, bytes] = field(default_factory=dict, repr=False)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        for i, m in enumerate(messages):
            if m.get("role") not in ("system", "user", "assistant"):
                raise InvalidArgument(f"messages[{i}].role", "must be system, user or assistant")
            if not isinstance(m.get("content"), str):
                raise InvalidArgument(f"messages[{i}].content", "must be a string")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

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
        pieces = self.tokenizer.convert_ids_to_tokens(self.encode_prompt(sample))
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
        for j, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidArgument(f"{field}[{j}]", f"token id {t} outside the vocabulary")


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
    if msg.model and msg.model != fe.model_name:
        raise InvalidArgument("model", f"unknown model {msg.model!r}; serving {fe.model_name!r}")
    if not 0 < msg.max_tokens <= MAX_TOKENS_LIMIT:
        raise InvalidArgument("max_tokens", f"must be in 1..{MAX_TOKENS_LIMIT}")
    try:
        params = SamplingParams.from_proto(msg.sampling)
    except ValueError as exc:
        raise InvalidArgument("sampling", str(exc)) from exc
    fe.check_ids("stop_token_ids", list(msg.stop_token_ids))
    return GenRequest(ids, msg.max_tokens, params,
                      speculation=msg.speculation if msg.HasField("speculation") else True,
                      stop=[s for s in msg.stop if s], stop_ids=set(msg.stop_token_ids),
                      session_id=msg.session_id)


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

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=len(self.req.prompt_ids),
                                completion_tokens=len(self.req.generated),
                                cached_prompt_tokens=self.req.reused_tokens)

    def stats(self) -> common_pb2.SpeculationStats:
        return common_pb2.SpeculationStats(steps=len(self.req.accepted_per_step),
                                           accepted_per_step=self.req.accepted_per_step,
                                           drafted_tokens=self.req.drafted,
                                           speculate_seconds=self.req.speculate_s,
                                           verify_seconds=self.req.verify_s,
                                           speculative_steps=self.req.speculative_steps)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.fe: Frontend | None = None

    def _start(self, request, context) -> Generation:
        if self.scheduler is None:
            raise Unavailable("the router is still starting")
        req = request_from_proto(request, self.fe)
        remaining = context.time_remaining()
        if remaining is not None:
            req.deadline = time.monotonic() + remaining
        self.scheduler.submit(req)
        return Generation(req, self.fe)

    async def Generate(self, request, context):
        """The unary form of GenerateStream: the same run, collected."""
        text, ids, logprobs, last = [], [], [], None
        async for msg in self.GenerateStream(request, context):
            text.append(msg.text)
            ids += msg.token_ids
            logprobs += msg.logprobs
            last = msg
        return router_pb2.GenerateResponse(text="".join(text), token_ids=ids,
                                           finish_reason=last.finish_reason, usage=last.usage,
                                           stats=last.stats, dtype=last.dtype,
                                           logprobs=logprobs)

    async def GenerateStream(self, request, context):
        gen = None
        try:
            gen = self._start(request, context)
            async for new, delta, logprobs in gen.deltas():
                if new or delta:
                    yield router_pb2.GenerateStreamResponse(
                        text=delta, token_ids=new,
                        logprobs=[logprob_to_proto(lp) for lp in logprobs])
            yield router_pb2.GenerateStreamResponse(finish_reason=gen.req.finish_reason,
                                                    usage=gen.usage(), stats=gen.stats(),
                                                    dtype=self.fe.dtype)
        except asyncio.CancelledError:  # the client went away: free the sequence
            if gen:
                self.scheduler.cancel(gen.req)
            raise
        except (ServiceError, ValueError, grpc.aio.AioRpcError) as exc:
            if gen:
                self.scheduler.cancel(gen.req)
            await _abort(context, exc)


class Unavailable(ServiceError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


async def _abort(context, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AioRpcError):
        await context.abort(exc.code(), exc.details() or "")
    await abort_on_error(context, exc)


async def serve(args, host: str, port: int, http_port: int, grace_s: float = 10.0) -> None:
    from specinfer.models import load_tokenizer

    service = Service("router", host, port)
    servicer = RouterServicer()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, service.server)
    service.add(router_pb2.DESCRIPTOR.services_by_name["Router"].full_name)
    await service.start()
    loop = asyncio.get_running_loop()
    tokenizer = await loop.run_in_executor(None, load_tokenizer, args.llm)
    scheduler = Scheduler(args.verifier, args.speculator or [],
                          eos_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                          else [],
                          max_waiting=args.max_waiting, spec_max_batch=args.spec_max_batch,
                          speculation=args.speculation,
                          detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    info = await _retry(scheduler.start)
    frontend = Frontend(tokenizer, args.model_name or args.llm, info["vocab_size"],
                        info["dtype"])
    servicer.scheduler, servicer.fe = scheduler, frontend
    http = None
    if http_port:
        from services.router.openai_http import start_http

        http = await start_http(scheduler, frontend, host, http_port)
    await service.set_serving()

    async def stop() -> None:
        if http is not None:
            await http.cleanup()
        await scheduler.close()

    await service.run_until_signal(grace_s, on_stop=stop)


async def _retry(fn, attempts: int = 600, delay: float = 1.0):
    """The verifiers may still be loading: keep asking until they answer."""
    for i in range(attempts):
        try:
            return await fn()
        except grpc.aio.AioRpcError:
            if i == attempts - 1:
                raise
            await asyncio.sleep(delay)

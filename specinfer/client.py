"""Client SDK for the router's gRPC API: ``Client`` (blocking) and ``AsyncClient``.

    from specinfer.client import Client
    with Client("127.0.0.1:50051") as c:
        out = c.generate("Hello", max_tokens=32)
        for chunk in c.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="")

Retries happen only on ``UNAVAILABLE`` (nothing was processed); other failures raise the
typed exception of their status code. ``api_key`` (default: ``SPECINFER_API_KEY``) is sent
as ``authorization: Bearer KEY``; ``tls_ca`` (a PEM path) or ``tls=True`` (the system's
roots) connect over TLS, ``tls_cert``/``tls_key`` present a client certificate. Where
OpenTelemetry is installed and a span is current, its W3C trace context goes with each
call (the router's spans join the caller's trace); ``metadata=[("traceparent", ...)]``
sets it by hand.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from specinfer.net import GRPC_OPTIONS
from specinfer.v1 import common_pb2, router_pb2, router_pb2_grpc


class SpecInferError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


class InvalidRequestError(SpecInferError):
    pass


class NotFoundError(InvalidRequestError):
    """The request names what the server does not have (a model it does not serve)."""


class OverloadedError(SpecInferError):
    pass


class UnavailableError(SpecInferError):
    pass


class DeadlineExceededError(SpecInferError):
    pass


class AuthenticationError(SpecInferError):
    pass


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
}


def _credentials(tls: bool, tls_ca: str | None, tls_cert: str | None,
                 tls_key: str | None) -> grpc.ChannelCredentials | None:
    if not (tls or tls_ca or tls_cert):
        return None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together")

    def read(path: str | None) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))


def _auth_metadata(api_key: str | None, metadata) -> list[tuple[str, str]] | None:
    """``metadata`` with the API key (``api_key``, else ``SPECINFER_API_KEY``'s first)."""
    key = api_key if api_key is not None else \
        os.environ.get("SPECINFER_API_KEY", "").split(",")[0].strip()
    metadata = list(metadata or ())
    if key and not any(k == "authorization" for k, _ in metadata):
        metadata.append(("authorization", f"Bearer {key}"))
    return metadata or None


_propagate = None  # opentelemetry.propagate once imported; False where it is not installed


def _with_trace_context(metadata) -> list[tuple[str, str]] | None:
    """``metadata`` plus the current span's trace context, if there is one to carry."""
    global _propagate
    if _propagate is None:
        try:
            from opentelemetry import propagate
        except ImportError:
            propagate = False
        _propagate = propagate
    metadata = list(metadata or ())
    if _propagate and not any(key == "traceparent" for key, _ in metadata):
        carrier: dict[str, str] = {}
        _propagate.inject(carrier)
        metadata += carrier.items()
    return metadata or None


def _typed(exc: grpc.RpcError) -> SpecInferError:
    return _BY_CODE.get(exc.code(), SpecInferError)(exc.code(), exc.details() or "")


@dataclass
class Stats:
    """Speculation statistics of one request (see ``SpeculationStats`` in common.proto)."""

    steps: int
    accepted_per_step: list[int]
    speculative_steps: int
    drafted_tokens: int
    speculate_s: float  # router-side wall time waiting on the speculator
    verify_s: float  # ... and on the verifier

    @classmethod
    def of(cls, msg) -> Stats:
        return cls(msg.steps, list(msg.accepted_per_step), msg.speculative_steps,
                   msg.drafted_tokens, msg.speculate_seconds, msg.verify_seconds)


@dataclass
class ToolCall:
    """A call the model made (requests with ``tools``): ``arguments`` is a JSON object as
    text, valid against the function's parameters."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """As an OpenAI ``tool_calls`` entry (for the assistant turn of a round trip)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _tool_calls(msg) -> list[ToolCall]:
    return [ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls]


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    steps: int
    accepted_per_step: list[int] = field(default_factory=list)
    dtype: str = ""
    stats: Stats | None = None
    # With logprobs=N: one specinfer.v1.TokenLogprob per token id (.logprob,
    # .top_token_ids, .top_logprobs), the LLM's raw log-softmax.
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    # With tools: the calls the answer made (finish_reason "tool_calls"); text is then
    # what it said before them.
    tool_calls: list[ToolCall] = field(default_factory=list)
    # Prompt tokens whose KV the verifier had cached (prefix caching), of prompt_tokens.
    cached_prompt_tokens: int = 0


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str = ""
    stats: Stats | None = None  # on the last chunk
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)  # whole, in one chunk
    # On the last chunk: the prompt's tokens, and those whose KV was cached.
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


def _chunk(msg) -> Chunk:
    return Chunk(msg.text, list(msg.token_ids), msg.finish_reason,
                 Stats.of(msg.stats) if msg.finish_reason else None, list(msg.logprobs),
                 _tool_calls(msg), msg.usage.prompt_tokens, msg.usage.cached_prompt_tokens)


def build_request(prompt: str | None = None, *, messages: list[dict] | None = None,
                  token_ids: list[int] | None = None, max_tokens: int = 128,
                  temperature: float = 0.0, top_p: float | None = None, top_k: int = 0,
                  min_p: float = 0.0, seed: int | None = None, stop: list[str] | None = None,
                  stop_token_ids: list[int] | None = None, speculation: bool = True,
                  session_id: str = "", model: str = "",
                  logprobs: int | None = None, logit_bias: dict[int, float] | None = None,
                  presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  repetition_penalty: float | None = None,
                  ignore_eos: bool = False, min_tokens: int = 0,
                  json_schema: dict | str | None = None, json_object: bool = False,
                  regex: str | None = None, choice: list[str] | None = None,
                  grammar: str | None = None, tools: list[dict] | None = None,
                  tool_choice: str | dict | None = None,
                  parallel_tool_calls: bool | None = None,
                  cache_salt: str = "") -> router_pb2.GenerateRequest:
    """``messages``: OpenAI chat messages (an assistant turn's ``tool_calls`` and a tool
    turn's ``tool_call_id`` included). ``tools``: OpenAI's function tools (``{"type":
    "function", "function": {"name", "description", "parameters"}}``); ``tool_choice``
    "none", "auto", "required", a function's name or OpenAI's named choice; the calls come
    back in ``Completion.tool_calls``. Structured output (at most one): ``json_schema``
    (a JSON Schema, as a dict or its JSON text), ``json_object`` (any JSON object),
    ``regex`` (the whole output matches),
    ``choice`` (exactly one of these strings), ``grammar`` (Lark, or GBNF with ``::=``).
    ``logprobs``: return each token's log-probability and this many alternatives.
    ``ignore_eos``: generate past the end-of-sequence token (fixed-length benchmarks).
    ``min_tokens``: no end-of-sequence or stop token id before this many tokens (vLLM's).
    ``logit_bias`` (token id -> bias, clamped to +-100), ``presence_penalty`` and
    ``frequency_penalty`` ([-2, 2], over the generated text) as OpenAI's,
    ``repetition_penalty`` (> 0, over prompt and generated text) as vLLM's.
    ``cache_salt``: the prompt shares cached KV only with requests of the same salt."""
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p,
                                         logit_bias=logit_bias or {},
                                         presence_penalty=presence_penalty,
                                         frequency_penalty=frequency_penalty,
                                         min_tokens=min_tokens)
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    req = router_pb2.GenerateRequest(max_tokens=max_tokens, stop=stop or [],
                                     stop_token_ids=stop_token_ids or [], sampling=sampling,
                                     speculation=speculation, session_id=session_id,
                                     model=model, ignore_eos=ignore_eos,
                                     cache_salt=cache_salt)
    constraint = _constraint(json_schema, json_object, regex, choice, grammar)
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    for tool in tools or ():
        fn = tool.get("function", tool)
        parameters = fn.get("parameters")
        req.tools.add(name=fn.get("name", ""), description=fn.get("description") or "",
                      parameters="" if parameters is None else json.dumps(parameters))
    if isinstance(tool_choice, dict):
        req.tool_choice.function = tool_choice["function"]["name"]
    elif tool_choice in ("none", "auto", "required"):
        req.tool_choice.mode = tool_choice
    elif tool_choice is not None:
        req.tool_choice.function = tool_choice
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    if messages is not None:
        req.chat.messages.extend(_chat_message(m) for m in messages)
    elif token_ids is not None:
        req.prompt_token_ids.ids.extend(token_ids)
    else:
        req.prompt = prompt or ""
    return req


def _chat_message(m: dict) -> router_pb2.ChatMessage:
    msg = router_pb2.ChatMessage(role=m["role"], content=m.get("content") or "",
                                 tool_call_id=m.get("tool_call_id") or "")
    for call in m.get("tool_calls") or ():
        fn = call["function"]
        msg.tool_calls.add(id=call.get("id", ""), name=fn["name"], arguments=fn["arguments"])
    return msg


def _constraint(json_schema, json_object, regex, choice, grammar) -> common_pb2.Constraint | None:
    given = {name: value for name, value in (
        ("json_schema", json_schema), ("json_object", json_object or None), ("regex", regex),
        ("choice", choice), ("grammar", grammar)) if value is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one constraint, not {', '.join(given)}")
    if not given:
        return None
    (name, value), = given.items()
    if name == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if name == "choice":
        return common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=list(value)))
    return common_pb2.Constraint(**{name: value})


def _completion(resp: router_pb2.GenerateResponse) -> Completion:
    return Completion(resp.text, list(resp.token_ids), resp.finish_reason,
                      resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.stats.steps,
                      list(resp.stats.accepted_per_step), resp.dtype, Stats.of(resp.stats),
                      list(resp.logprobs), _tool_calls(resp), resp.usage.cached_prompt_tokens)


class _Backoff:
    """Retrying UNAVAILABLE (the router restarting, a connection not up yet) before the
    first token: waits of 0.25 s doubling to 2 s, for up to ``budget_s`` in all. Never
    after a token was received (the caller has it: a retry would repeat it)."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.delay = 0.25

    def wait_s(self, exc: grpc.RpcError, received: bool = False) -> float | None:
        """How long to wait before trying again, or None: ``exc`` is final."""
        left = self.deadline - time.monotonic()
        if received or exc.code() != grpc.StatusCode.UNAVAILABLE or left <= 0:
            return None
        wait, self.delay = min(self.delay, left), min(2 * self.delay, 2.0)
        return wait


class Client:
    """The router's gRPC API. ``retry_seconds``: how long a call keeps retrying
    UNAVAILABLE before its first token (a router restart takes seconds); 0: never."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = 300.0,
                 retry_seconds: float = 30.0, metadata: list[tuple[str, str]] | None = None, *,
                 api_key: str | None = None, tls: bool = False, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None) -> None:
        creds = _credentials(tls, tls_ca, tls_cert, tls_key)
        self.channel = grpc.secure_channel(address, creds, options=GRPC_OPTIONS) if creds \
            else grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.timeout, self.retry_seconds = timeout, retry_seconds
        self.metadata, self.api_key = metadata, api_key

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata=None, **kwargs) -> Completion:
        req = build_request(prompt, **kwargs)
        md = _with_trace_context(_auth_metadata(self.api_key, metadata or self.metadata))
        backoff = _Backoff(self.retry_seconds)
        while True:
            try:
                return _completion(self.stub.Generate(req, timeout=timeout or self.timeout,
                                                      metadata=md))
            except grpc.RpcError as exc:
                wait = backoff.wait_s(exc)
                if wait is None:
                    raise _typed(exc) from None
                time.sleep(wait)

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               metadata=None, **kwargs) -> Iterator[Chunk]:
        req = build_request(prompt, **kwargs)
        md = _with_trace_context(_auth_metadata(self.api_key, metadata or self.metadata))
        backoff, received = _Backoff(self.retry_seconds), False
        while True:
            try:
                for msg in self.stub.GenerateStream(req, timeout=timeout or self.timeout,
                                                    metadata=md):
                    received = True
                    yield _chunk(msg)
                return
            except grpc.RpcError as exc:
                wait = backoff.wait_s(exc, received)
                if wait is None:
                    raise _typed(exc) from None
                time.sleep(wait)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """``Client``'s asyncio twin (the same arguments)."""

    def __init__(self, address: str = "127.0.0.1:50051", timeout: float | None = 300.0,
                 retry_seconds: float = 30.0, metadata: list[tuple[str, str]] | None = None, *,
                 api_key: str | None = None, tls: bool = False, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None) -> None:
        creds = _credentials(tls, tls_ca, tls_cert, tls_key)
        self.channel = grpc.aio.secure_channel(address, creds, options=GRPC_OPTIONS) \
            if creds else grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.timeout, self.retry_seconds = timeout, retry_seconds
        self.metadata, self.api_key = metadata, api_key

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       metadata=None, **kwargs) -> Completion:
        req = build_request(prompt, **kwargs)
        md = _with_trace_context(_auth_metadata(self.api_key, metadata or self.metadata))
        backoff = _Backoff(self.retry_seconds)
        while True:
            try:
                return _completion(await self.stub.Generate(
                    req, timeout=timeout or self.timeout, metadata=md))
            except grpc.aio.AioRpcError as exc:
                wait = backoff.wait_s(exc)
                if wait is None:
                    raise _typed(exc) from None
                await asyncio.sleep(wait)

    async def stream(self, prompt: str | None = None, *, timeout: float | None = None,
                     metadata=None, **kwargs) -> AsyncIterator[Chunk]:
        req = build_request(prompt, **kwargs)
        md = _with_trace_context(_auth_metadata(self.api_key, metadata or self.metadata))
        backoff, received = _Backoff(self.retry_seconds), False
        while True:
            try:
                async for msg in self.stub.GenerateStream(
                        req, timeout=timeout or self.timeout, metadata=md):
                    received = True
                    yield _chunk(msg)
                return
            except grpc.aio.AioRpcError as exc:
                wait = backoff.wait_s(exc, received)
                if wait is None:
                    raise _typed(exc) from None
                await asyncio.sleep(wait)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

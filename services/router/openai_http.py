"""OpenAI-compatible HTTP API on the router: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (``stream: true`` as server-sent events: content chunks, a usage
chunk with ``stream_options.include_usage``, then ``[DONE]``), with OpenAI-shaped errors;
``/health``; and Prometheus' ``/metrics``.
While tracing is on, each API call runs in a server span, the child of the caller's W3C
``traceparent`` header."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import Callable

import grpc
from aiohttp import web
from opentelemetry.trace import Status, StatusCode
from prometheus_client import CollectorRegistry

from services.router.auth import ApiKeys
from services.router.frontend import Frontend, Generation
from services.router.limits import KeyStreams
from services.router.openai_request import openai_requests, stream_usage
from services.router.openapi import openapi_document, openapi_handler
from services.router.request import GenRequest
from services.router.scheduler import Scheduler
from services.router.tools import CallStream, calls_finish, parse_calls
from specinfer import metrics, tracing
from specinfer.errors import InvalidArgument, ServiceError

log = logging.getLogger(__name__)


def _error(status: int, message: str, param: str | None = None,
           kind: str = "invalid_request_error",
           retry_after_s: float | None = None, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = {"Retry-After": str(math.ceil(retry_after_s))} if retry_after_s else None
    return web.json_response(body, status=status, headers=headers)


def _service_error(exc: ServiceError) -> web.Response:
    """A service error as OpenAI's error object, with its status (429s: Retry-After)."""
    kind = "rate_limit_error" if exc.http_status == 429 else \
        "invalid_request_error" if exc.http_status < 500 else "server_error"
    return _error(exc.http_status, str(exc), getattr(exc, "field", None), kind,
                  getattr(exc, "retry_after_s", None), getattr(exc, "openai_code", None))


class OpenAIApi:
    def __init__(self, scheduler: Scheduler, fe: Frontend, streams: KeyStreams) -> None:
        self.scheduler, self.fe, self.streams = scheduler, fe, streams

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.fe.model_name, "object": "model", "created": 0, "owned_by": "specinfer",
             # vLLM's: the context a request fits in (prompt + generated tokens)
             "max_model_len": self.scheduler.replicas.max_context}
        ]})

    async def _body(self, request: web.Request) -> dict:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise BodyTooLarge(exc.text or "") from None
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidArgument("body", "is not valid UTF-8") from exc
        except json.JSONDecodeError as exc:
            raise InvalidArgument("body", f"is not valid JSON: {exc.msg}") from exc
        except ValueError as exc:  # an integer past Python's 4300 digits
            raise InvalidArgument("body", "is not valid JSON: "
                                  f"{str(exc).split(':', 1)[0]}") from exc
        except RecursionError as exc:
            raise InvalidArgument("body", "is not valid JSON: nested too deeply") from exc
        if not isinstance(body, dict):
            raise InvalidArgument("body", "must be a JSON object")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            reqs = openai_requests(self.fe, body, chat)
            with self.streams.hold(request[KEY_ID], len(reqs)):
                return await self._run(request, body, reqs, chat)
        except ServiceError as exc:
            return _service_error(exc)

    async def _run(self, request: web.Request, body: dict, reqs: list[GenRequest],
                   chat: bool) -> web.StreamResponse:
        submitted: list[GenRequest] = []
        try:
            for req in reqs:
                self.scheduler.submit(req)
                submitted.append(req)
        except ServiceError as exc:
            for req in submitted:
                self.scheduler.cancel(req)
            return _service_error(exc)
        gens = [Generation(req) for req in reqs]
        # n choices per prompt (validated by openai_requests; null is 1)
        usage = functools.partial(self._usage, gens, int(body.get("n") or 1))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        try:
            if not body.get("stream"):
                return await self._whole(gens, rid, created, chat, usage)
            return await self._stream(request, gens, rid, created, chat,
                                      usage if stream_usage(body) else None)
        except (asyncio.CancelledError, ConnectionResetError):
            for req in reqs:  # the client went away
                self.scheduler.cancel(req)
            raise

    async def _whole(self, gens: list[Generation], rid: str, created: int,
                     chat: bool, usage: Callable[[], dict]) -> web.Response:
        async def drain(gen: Generation) -> None:
            async for _ in gen.deltas():
                pass

        try:
            await asyncio.gather(*(drain(g) for g in gens))
        except ServiceError as exc:
            return _service_error(exc)
        except Exception as exc:
            return _error(500, _failure(exc), kind="server_error")
        choices = []
        for i, gen in enumerate(gens):
            choice = {"index": i, "finish_reason": gen.req.finish_reason,
                      "logprobs": self._logprobs_json(gen.req, 0, len(gen.req.generated),
                                                      chat)}
            if chat and gen.req.tools is not None and gen.req.tools.calls:
                content, calls = parse_calls(gen.sent_text)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
                    choice["finish_reason"] = calls_finish(gen.req.finish_reason)
            elif chat:
                choice["message"] = {"role": "assistant", "content": gen.sent_text}
            else:
                choice["text"] = gen.sent_text
            choices.append(choice)
        return web.json_response({"id": rid, "created": created, "model": self.fe.model_name,
                                  "object": "chat.completion" if chat else "text_completion",
                                  "choices": choices, "usage": usage()})

    async def _stream(self, request: web.Request, gens: list[Generation], rid: str,
                      created: int, chat: bool, usage: Callable[[], dict] | None
                      ) -> web.StreamResponse:
        """Server-sent events: the choices' deltas interleaved, a usage chunk if asked for
        (``usage``), then ``[DONE]``."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choices, usage=None) -> None:
            data = {"id": rid, "object": obj, "created": created,
                    "model": self.fe.model_name, "choices": choices}
            if usage is not None:
                data["usage"] = usage
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())

        def choice(i: int, text: str | tuple, finish: str | None, role: bool = False,
                   tokens: tuple[int, int] = (0, 0)) -> dict:
            """``tokens``: the span of the choice's tokens this chunk carries; ``text``:
            (content, tool calls) for the chunk that carries an answer's calls."""
            logprobs = self._logprobs_json(gens[i].req, *tokens, chat) \
                if tokens[1] > tokens[0] else None
            if chat and isinstance(text, tuple):
                content, calls = text
                delta = {"content": content, "tool_calls": [
                    {"index": k, **call} for k, call in enumerate(calls)]}
                return {"index": i, "delta": delta, "finish_reason": None,
                        "logprobs": logprobs}
            if chat:
                delta = {"role": "assistant", "content": text} if role else \
                    ({"content": text} if finish is None else {})
                return {"index": i, "delta": delta, "finish_reason": finish,
                        "logprobs": logprobs}
            return {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}

        # Every choice's deltas through one queue, so n choices stream interleaved.
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            # A token whose text is held back (an incomplete UTF-8 sequence) has its
            # logprob sent with the next text.
            sent = received = 0
            calls = CallStream(gen.req.tools if chat else None)
            finish = None
            try:
                async for new, delta, _ in gen.deltas():
                    received += len(new)
                    delta, made = calls.push(delta, bool(gen.req.finish_reason))
                    if made:
                        await queue.put((i, (delta or None, made), None, (sent, received)))
                        sent, delta = received, ""
                        finish = calls_finish(gen.req.finish_reason)
                    if delta:
                        await queue.put((i, delta, None, (sent, received)))
                        sent = received
                await queue.put((i, "", finish or gen.req.finish_reason, (sent, received)))
            except Exception as exc:  # surfaced to the client as an error event
                await queue.put((i, None, exc, None))

        if chat:
            await send([choice(i, "", None, role=True) for i in range(len(gens))])
        pumps = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            open_choices = len(gens)
            while open_choices:
                i, delta, end, tokens = await queue.get()
                if delta is None:  # OpenAI streams a failure as an error event
                    error = {"message": _failure(end), "type": "server_error",
                             "param": None, "code": None}
                    await resp.write(f"data: {json.dumps({'error': error})}\n\n".encode())
                    break
                if end is None:
                    await send([choice(i, delta, None, tokens=tokens)])
                else:
                    await send([choice(i, "", end, tokens=tokens)])
                    open_choices -= 1
            else:
                if usage is not None:
                    await send([], usage=usage())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            for t in pumps:
                t.cancel()
            for g in gens:  # an error event ends the stream: free the other choices too
                if not g.req.finish_reason:
                    self.scheduler.cancel(g.req)
        return resp

    def _logprobs_json(self, req: GenRequest, start: int, end: int,
                       chat: bool) -> dict | None:
        """OpenAI's logprobs object for tokens ``start:end`` of ``req`` (chat: ``content``
        entries; completions: parallel lists), or None if it did not ask for logprobs."""
        if req.params.logprobs is None:
            return None
        ids, logprobs = req.generated[start:end], req.logprobs[start:end]
        text = self.fe.token_text
        if chat:
            def entry(token: int, logprob: float) -> dict:
                return {"token": text(token), "logprob": _finite(logprob),
                        "bytes": list(self.fe.token_bytes(token))}

            return {"content": [
                {**entry(tok, lp.logprob), "top_logprobs": [
                    entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]}
                for tok, lp in zip(ids, logprobs, strict=True)], "refusal": None}
        return {"tokens": [text(t) for t in ids],
                "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
                # The chosen token is listed too, as vLLM does.
                "top_logprobs": [{text(t): _finite(v) for t, v in
                                  [*zip(lp.top_ids, lp.top_logprobs, strict=True),
                                   (tok, lp.logprob)]}
                                 for tok, lp in zip(ids, logprobs, strict=True)],
                "text_offset": self.fe.text_offsets(req.generated, start, end)}

    @staticmethod
    def _usage(gens: list[Generation], n: int) -> dict:
        """OpenAI's usage: each prompt counted once (its ``n`` choices share it)."""
        prompt = sum(len(g.req.prompt_ids) for g in gens[::n])
        completion = sum(len(g.req.generated) for g in gens)
        steps = [s for g in gens for s in g.req.accepted_per_step]
        cached = sum(g.req.reused_tokens for g in gens[::n])
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
                "speculation": {"steps": len(steps), "accepted_per_step": steps}}


def _failure(exc: Exception) -> str:
    """What a client is told of a failed generation: a service error's message or an
    upstream status's details, never a traceback or gRPC's debug string (logged)."""
    if isinstance(exc, ServiceError):
        return str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        log.warning("generation failed", extra={"code": exc.code().name,
                                                "error": exc.debug_error_string()})
        return f"generation failed: {exc.code().name}: {exc.details() or ''}"
    log.error("generation failed", exc_info=exc)
    return f"generation failed: internal error ({type(exc).__name__})"


def _finite(logprob: float) -> float:
    """JSON has no -Infinity (or NaN); OpenAI reports an impossible token as -9999."""
    return logprob if logprob >= -9999.0 else -9999.0


@web.middleware
async def _server_span(request: web.Request, handler):
    """The API call's server span (OpenTelemetry's HTTP names), current while it runs so
    the requests it submits are its children."""
    if not request.path.startswith("/v1/"):
        return await handler(request)
    route = request.match_info.route.resource
    path = route.canonical if route is not None else request.path
    with tracing.server_span(f"{request.method} {path}", request.headers, {
            "http.request.method": request.method, "url.path": request.path,
            "http.route": path, "server.port": request.url.port or 0}) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        return response


KEY_ID = web.RequestKey("key_id", str)  # on each request: who is asking (see auth.key_id)


class BodyTooLarge(InvalidArgument):
    http_status = 413

    def __init__(self, detail: str) -> None:
        super().__init__("body", f"too large (--max-body-bytes): {detail}".rstrip(": "))


def _authenticate(keys: ApiKeys, metrics_auth: bool):
    """The API key check: every /v1/ call (and /metrics with ``metrics_auth``) needs one of
    ``keys``; 401 with OpenAI's error otherwise. The key's id goes on the request."""

    @web.middleware
    async def authenticate(request: web.Request, handler):
        if request.path.startswith("/v1/") or (metrics_auth and request.path == "/metrics"):
            try:
                request[KEY_ID] = keys.check(request.headers.get("Authorization"))
            except ServiceError as exc:
                response = _error(401, str(exc), kind="invalid_request_error")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        return await handler(request)

    return authenticate


def _metrics_endpoint(registry: CollectorRegistry):
    async def scrape(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(registry),
                            headers={"Content-Type": metrics.CONTENT_TYPE})

    return scrape


def _health_endpoint(scheduler: Scheduler):
    """vLLM's and TGI's ``/health``: 200 while a verifier can take sequences, 503 while
    none can (none joined yet, all down or draining). Open, like a probe needs it."""

    async def health(request: web.Request) -> web.Response:
        ready = sum(1 for r in scheduler.replicas.replicas if r.usable)
        status = 200 if ready else 503
        return web.json_response({"status": "ok" if ready else "unavailable",
                                  "verifiers_ready": ready}, status=status)

    return health


async def start_http(scheduler: Scheduler, fe: Frontend, host: str, port: int,
                     registry: CollectorRegistry | None = None, keys: ApiKeys | None = None,
                     streams: KeyStreams | None = None, metrics_auth: bool = False,
                     ssl_context=None) -> web.AppRunner:
    """The HTTP API on ``host:port`` (TLS with ``ssl_context``)."""
    api = OpenAIApi(scheduler, fe, streams if streams is not None else KeyStreams(1 << 30))
    middlewares = [_server_span] if tracing.enabled() else []
    middlewares.append(_authenticate(keys if keys is not None else ApiKeys([]), metrics_auth))
    app = web.Application(client_max_size=fe.limits.max_body_bytes, middlewares=middlewares)
    if registry is not None:
        app.router.add_get("/metrics", _metrics_endpoint(registry))
    app.router.add_get("/health", _health_endpoint(scheduler))
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat)
    app.router.add_get("/openapi.json", openapi_handler(lambda: openapi_document(
        fe.model_name, fe.vocab_size, scheduler.replicas.max_context, fe.limits,
        metrics=registry is not None, api_key_required=bool(keys), metrics_auth=metrics_auth)))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner

"""OpenAI-compatible HTTP API on the router: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (``stream: true`` as server-sent events: content chunks, a final
usage chunk, then ``[DONE]``), with OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from services.router.scheduler import GenRequest, Scheduler
from services.router.server import MAX_TOKENS_LIMIT, Frontend, Generation
from specinfer.errors import InvalidArgument, ServiceError
from specinfer.sampling import SamplingParams


def _error(status: int, message: str, param: str | None = None,
           kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status)


def _number(body: dict, name: str, default, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(name, "must be a number")
    if kind is int and int(value) != value:
        raise InvalidArgument(name, "must be an integer")
    return kind(value)


def _params(body: dict) -> SamplingParams:
    if _number(body, "n", 1, int) != 1:
        raise InvalidArgument("n", "only n = 1 is supported")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs"):
        raise InvalidArgument("logprobs", "log probabilities are not supported yet")
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise InvalidArgument("seed", "must be a non-negative integer")
    try:
        return SamplingParams(temperature=temperature, top_k=_number(body, "top_k", 0, int),
                              top_p=top_p, min_p=_number(body, "min_p", 0.0), seed=seed)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise InvalidArgument(field, str(exc)) from exc


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return stop
    raise InvalidArgument("stop", "must be a string or a list of up to 16 strings")


class OpenAIApi:
    def __init__(self, scheduler: Scheduler, fe: Frontend) -> None:
        self.scheduler, self.fe = scheduler, fe

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.fe.model_name, "object": "model", "created": 0, "owned_by": "specinfer"}
        ]})

    async def _body(self, request: web.Request) -> dict:
        raw = await request.read()
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidArgument("body", "is not valid UTF-8") from exc
        except json.JSONDecodeError as exc:
            raise InvalidArgument("body", f"is not valid JSON: {exc.msg}") from exc
        if not isinstance(body, dict):
            raise InvalidArgument("body", "must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.fe.model_name:
            raise InvalidArgument("model", f"unknown model {model!r}; serving "
                                  f"{self.fe.model_name!r}")
        return body

    def _request(self, body: dict, ids: list[int], default_max: int | None) -> GenRequest:
        if not ids:
            raise InvalidArgument("prompt", "must not be empty")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max))
        if max_tokens is None:
            max_tokens = MAX_TOKENS_LIMIT
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) \
                or not 0 < max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidArgument("max_tokens", f"must be an integer in 1..{MAX_TOKENS_LIMIT}")
        spec = body.get("speculation", True)
        return GenRequest(ids, max_tokens, _params(body), speculation=bool(spec),
                          stop=_stop(body), session_id=str(body.get("user") or ""))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self.fe.encode_prompt(prompt) if prompt else []
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                self.fe.check_ids("prompt", prompt)
                ids = prompt
            else:
                raise InvalidArgument("prompt", "must be a string or a list of token ids")
            req = self._request(body, ids, 16)
        except ServiceError as exc:
            return _error(exc.http_status, str(exc), getattr(exc, "field", None))
        return await self._run(request, body, req, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InvalidArgument("messages", "must be a non-empty list")
            if not all(isinstance(m, dict) for m in messages):
                raise InvalidArgument("messages", "each message must be an object")
            req = self._request(body, self.fe.encode_chat(messages), None)
        except ServiceError as exc:
            return _error(exc.http_status, str(exc), getattr(exc, "field", None))
        return await self._run(request, body, req, chat=True)

    async def _run(self, request: web.Request, body: dict, req: GenRequest,
                   chat: bool) -> web.StreamResponse:
        try:
            self.scheduler.submit(req)
        except ServiceError as exc:
            return _error(exc.http_status, str(exc), getattr(exc, "field", None),
                          "rate_limit_error" if exc.http_status == 429 else
                          "invalid_request_error")
        gen = Generation(req, self.fe)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            try:
                async for _ in gen.deltas():
                    pass
            except asyncio.CancelledError:
                self.scheduler.cancel(req)
                raise
            except Exception as exc:
                return _error(500, f"generation failed: {exc}", kind="server_error")
            choice = {"index": 0, "finish_reason": req.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": gen.sent_text}
            else:
                choice["text"] = gen.sent_text
            return web.json_response({"id": rid, "object": obj, "created": created,
                                      "model": self.fe.model_name, "choices": [choice],
                                      "usage": self._usage(gen)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choices, usage=None) -> None:
            data = {"id": rid, "object": chunk_obj, "created": created,
                    "model": self.fe.model_name, "choices": choices}
            if usage is not None:
                data["usage"] = usage
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())

        try:
            if chat:
                await send([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None}])
            async for _, delta in gen.deltas():
                if delta:
                    part = {"content": delta} if chat else None
                    await send([{"index": 0, "finish_reason": None, "logprobs": None,
                                 **({"delta": part} if chat else {"text": delta})}])
            final = {"index": 0, "finish_reason": req.finish_reason, "logprobs": None,
                     **({"delta": {}} if chat else {"text": ""})}
            await send([final])
            await send([], usage=self._usage(gen))
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            self.scheduler.cancel(req)  # the client went away
            raise
        return resp

    @staticmethod
    def _usage(gen: Generation) -> dict:
        req = gen.req
        return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.generated),
                "total_tokens": len(req.prompt_ids) + len(req.generated),
                "speculation": {"steps": len(req.accepted_per_step),
                                "accepted_per_step": req.accepted_per_step}}


async def start_http(scheduler: Scheduler, fe: Frontend, host: str,
                     port: int) -> web.AppRunner:
    api = OpenAIApi(scheduler, fe)
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

"""The OpenAPI 3.1 document of the router's HTTP API (``GET /openapi.json``): what
``openai_http.py`` serves and ``frontend.py`` validates, with the bounds a request must
keep (so that schema-driven fuzzers such as schemathesis generate requests the server must
accept, and know which answers it may give). Token-level limits (a prompt's length in
tokens, token ids below the vocabulary size) are stated where a schema can express them and
described where it cannot (a string's token count)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from services.router.frontend import MAX_TOKENS_LIMIT
from services.router.limits import Limits
from specinfer.sampling import MAX_PENALTY

FLOAT32_MAX = 3.4e38  # sampling floats travel as float32: larger ones become infinite
FLOAT32_TINY = 1e-45  # ... and smaller positive ones 0 (top_p and repetition_penalty > 0)


def _nullable(schema: dict) -> dict:
    """``schema`` or JSON null (the API treats null as "not given")."""
    return {"anyOf": [schema, {"type": "null"}]}


def _below(n: int) -> str:
    """A regex for the decimal integers 0..n-1 without leading zeros (JSON object keys
    that are token ids)."""
    top = str(n - 1)
    if len(top) == 1:
        return f"^[0-{top}]$"
    alternatives = ["[0-9]"]
    if len(top) > 2:
        alternatives.append(f"[1-9][0-9]{{1,{len(top) - 2}}}")
    # As long as the top: a prefix of it, then a smaller digit, then any digits.
    for k, digit in enumerate(top):
        low = 1 if k == 0 else 0
        if int(digit) > low:
            rest = len(top) - k - 1
            alternatives.append(f"{top[:k]}[{low}-{int(digit) - 1}]"
                                + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^(" + "|".join(alternatives) + ")$"


def _refused(off: dict, what: str) -> dict:
    """An OpenAI field this server does not implement: only its "off" value (or null) is
    accepted; anything else is a 400 naming the field."""
    return {**_nullable(off), "description": f"Not implemented: {what}"}


def _error_body() -> dict:
    return {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "enum": ["invalid_request_error", "rate_limit_error",
                                                    "authentication_error", "server_error"]},
                "param": {"type": ["string", "null"],
                          "description": "The request field at fault (e.g. max_tokens, "
                                         "messages[0].role, logit_bias[0])."},
                "code": {"type": ["string", "null"]},
            },
        }},
    }


def _errors(limits: Limits) -> dict:
    def error(description: str, headers: dict | None = None) -> dict:
        out = {"description": description,
               "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        if headers:
            out["headers"] = headers
        return out

    return {
        "400": error("Invalid request: the error's param names the field (a bad value, an "
                     "unsupported field, a prompt longer than the context)."),
        "401": error("Missing or wrong API key (when the router runs with --api-key)."),
        "404": error("The request's model is not the one served (code model_not_found)."),
        "413": error(f"The request body is larger than {limits.max_body_bytes} bytes "
                     "(--max-body-bytes)."),
        "429": error("No capacity: too many queued requests, waited past the queue "
                     "timeout, or too many requests of this API key in flight.",
                     {"Retry-After": {"description": "Seconds to wait.",
                                      "schema": {"type": "integer"}}}),
        "5XX": error("The generation failed upstream (a verifier or speculator), or the "
                     "stack is not ready."),
    }


def _sampling_properties() -> dict:
    number = {"type": "number"}
    return {
        "temperature": _nullable({**number, "minimum": 0, "maximum": FLOAT32_MAX,
                                  "description": "0 (or below 1e-5): greedy. Default 1."}),
        "top_p": _nullable({**number, "minimum": FLOAT32_TINY, "maximum": 1,
                            "description": "Nucleus sampling, in (0, 1]; the value must stay "
                                           "positive in float32. Default 1."}),
        "top_k": _nullable({"type": "integer", "minimum": 0, "maximum": 2**31 - 1,
                            "description": "0: off."}),
        "min_p": _nullable({**number, "minimum": 0, "maximum": 1}),
        "seed": _nullable({"type": "integer", "minimum": 0, "maximum": 2**64 - 1,
                           "description": "Choice i of n is seeded with seed + i."}),
        "presence_penalty": _nullable({**number, "minimum": -MAX_PENALTY,
                                       "maximum": MAX_PENALTY}),
        "frequency_penalty": _nullable({**number, "minimum": -MAX_PENALTY,
                                        "maximum": MAX_PENALTY}),
        "repetition_penalty": _nullable({**number, "minimum": FLOAT32_TINY,
                                         "maximum": FLOAT32_MAX,
                                         "description": "vLLM's; > 0, 1 = off."}),
    }


def _common_properties(model_name: str, vocab_size: int, limits: Limits) -> dict:
    most = limits.max_tokens or MAX_TOKENS_LIMIT
    stop = {"type": "string", "maxLength": limits.max_stop_chars}
    max_tokens = _nullable({"type": "integer", "minimum": 1, "maximum": most,
                            "description": "Capped to the context left after the prompt."})
    return {
        "model": {"enum": [model_name, None], "description": "The served model (or null)."},
        "max_tokens": max_tokens,
        "max_completion_tokens": {**max_tokens, "description": "Takes precedence over "
                                  "max_tokens."},
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": limits.max_n}),
        "stream": _nullable({"type": "boolean", "description": "Server-sent events."}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": _nullable({"type": "boolean", "description": "End the stream "
                                        "with a usage chunk (empty choices)."})}}),
        "stop": _nullable({"anyOf": [stop, {"type": "array",
                                            "maxItems": limits.max_stop_strings,
                                            "items": stop}]}),
        **_sampling_properties(),
        "logit_bias": _nullable({
            "type": "object", "propertyNames": {"pattern": _below(vocab_size)},
            "additionalProperties": {"type": "number"},
            "description": f"Token id (0..{vocab_size - 1}, as a string) -> bias, clamped "
                           "to +-100."}),
        "speculation": _nullable({"type": "boolean", "description": "specinfer's own: false "
                                  "decodes one token per step (default true)."}),
        "user": _nullable({"type": "string", "description": "Keeps a conversation on the "
                           "verifier holding its KV cache."}),
        "cache_salt": _nullable({"type": "string", "maxLength": 256, "description": "vLLM's: "
                                 "the prompt shares cached KV (prefix caching) only with "
                                 "requests of the same salt."}),
        "ignore_eos": _nullable({"type": "boolean", "description": "vLLM's: generate past "
                                 "the end-of-sequence token (default false)."}),
        "stop_token_ids": _nullable({"type": "array", "items": {
            "type": "integer", "minimum": 0, "maximum": vocab_size - 1},
            "description": "vLLM's: token ids that end the choice as EOS does."}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": 2**31 - 1,
                                 "description": "vLLM's: no EOS or stop token id before this "
                                                "many tokens (default 0)."}),
        **_structured_output_properties(),
        "functions": _refused({"type": "array", "maxItems": 0}, "only []."),
        "function_call": _refused({"const": "none"}, 'only "none".'),
        "modalities": _refused({"const": ["text"]}, 'only ["text"].'),
        "best_of": _refused({"const": 1}, "only 1."),
        "echo": _refused({"const": False}, "only false."),
        "suffix": _refused({"const": ""}, 'only "".'),
        **{name: _refused({"not": {}}, "only null.") for name in (
            "audio", "prediction", "reasoning_effort",
            "web_search_options", "verbosity")},
    }


def _structured_output_properties() -> dict:
    """Structured output: OpenAI's response_format, vLLM's structured_outputs and guided_*
    (one constraint a request; whether a schema, regex or grammar compiles is checked on
    arrival: a 400 naming the field)."""
    schema = {"type": "object", "description": "A JSON Schema."}
    choice = {"type": "array", "minItems": 1, "maxItems": 1024,
              "items": {"type": "string", "minLength": 1}}
    text = {"type": "string", "minLength": 1}
    kinds = {"json": {"anyOf": [schema, text]}, "regex": text, "choice": choice,
             "grammar": {**text, "description": "Lark, or GBNF (::= rules)."},
             "json_object": {"const": True}}
    return {
        "response_format": _nullable({"oneOf": [
            {"type": "object", "required": ["type"], "additionalProperties": False,
             "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"],
             "additionalProperties": False, "properties": {
                 "type": {"const": "json_schema"},
                 "json_schema": {"type": "object", "properties": {
                     "name": {"type": "string"}, "description": {"type": "string"},
                     "schema": schema, "strict": _nullable({"type": "boolean"})}}}},
        ], "description": "OpenAI's: json_object (any JSON object) or json_schema (valid "
                          "against json_schema.schema)."}),
        "structured_outputs": _nullable({
            "type": "object", "minProperties": 1, "maxProperties": 1,
            "properties": kinds, "description": "vLLM's: one of json, regex, choice, "
                                                "grammar, json_object."}),
        **{f"guided_{k}": _nullable({**kinds[k], "description": "vLLM's older spelling "
                                     f"of structured_outputs.{k}."})
           for k in ("json", "regex", "choice", "grammar")},
    }


def _tool_properties() -> dict:
    """Chat's tools (the answer is text or calls; required or named: calls only)."""
    fn = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
        "description": {"type": "string"},
        "parameters": {"type": "object", "description": "A JSON Schema."}}}
    return {
        "tools": _nullable({"type": "array", "maxItems": 128, "items": {
            "type": "object", "required": ["type", "function"],
            "properties": {"type": {"const": "function"}, "function": fn}},
            "description": "Functions the model may call (names unique)."}),
        "tool_choice": _nullable({"anyOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"}, "function": {
                    "type": "object", "required": ["name"],
                    "properties": {"name": {"type": "string"}}}}}],
            "description": "auto (default with tools), none, required or a named function "
                           "(one of tools; needs tools)."}),
        "parallel_tool_calls": _nullable({"type": "boolean", "description": "Several calls "
                                          "in one answer (default true)."}),
    }


def _request_schemas(model_name: str, vocab_size: int, max_context: int,
                     limits: Limits) -> dict:
    common = _common_properties(model_name, vocab_size, limits)
    most = min(limits.max_prompt_tokens or max_context - 1, max_context - 1)
    token_ids = {"type": "array", "minItems": 1, "maxItems": most,
                 "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    completion = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {"anyOf": [
                {"type": "string", "minLength": 1},
                token_ids,
                {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
                 "items": {"type": "string", "minLength": 1}},
                {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
                 "items": token_ids},
            ], "description": f"Text or token ids, or a batch of either (at most "
                              f"{limits.max_prompts} prompts, --max-prompts; choice index = "
                              f"prompt * n + choice); at most {most} tokens a prompt (a "
                              "longer prompt is a 400 naming it)."},
            **common,
            **{name: _refused({"not": {}}, "only null: tools are called on "
                              "/v1/chat/completions.")
               for name in ("tools", "tool_choice", "parallel_tool_calls")},
            "add_special_tokens": _nullable({"type": "boolean", "description": "vLLM's: "
                                             "text prompts get the tokenizer's special "
                                             "tokens (e.g. a BOS); default true."}),
            "logprobs": _nullable({"type": "integer", "minimum": 0,
                                   "maximum": limits.max_logprobs,
                                   "description": "Report each token's logprob and this "
                                                  "many alternatives."}),
        },
    }
    chat = {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **_tool_properties(),
            "messages": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["role", "content"],
                # a tool turn answers a call by its id; only assistants make calls
                "if": {"properties": {"role": {"const": "tool"}}},
                "then": {"required": ["tool_call_id"]},
                "properties": {"role": {"enum": ["system", "user", "assistant", "tool"]},
                               "tool_call_id": {"type": "string"},
                               "tool_calls": {"type": "array", "items": {
                                   "type": "object", "required": ["function"],
                                   "properties": {"function": {
                                       "type": "object", "required": ["name", "arguments"],
                                       "properties": {"name": {"type": "string"},
                                                      "arguments": {"type": "string",
                                                                    "pattern": "^\\{.*\\}$"}}}}}},
                               "content": {"anyOf": [{"type": "string"}, {
                                   "type": "array", "minItems": 1, "items": {
                                       "type": "object", "required": ["type", "text"],
                                       "properties": {"type": {"const": "text"},
                                                      "text": {"type": "string"}}}}],
                                   "description": "Text, or text parts (joined by "
                                                  "newlines)."}},
            }, "description": f"Rendered with the model's chat template; at most {most} "
                              "tokens in all (more: a 400 naming messages or prompt)."},
            **common,
            "logprobs": _nullable({"type": "boolean"}),
            "top_logprobs": _nullable({"type": "integer", "minimum": 0,
                                       "maximum": limits.max_logprobs,
                                       "description": "Needs logprobs: true."}),
        },
        # top_logprobs (not null) only with logprobs: true.
        "if": {"required": ["top_logprobs"],
               "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    }
    return {"CompletionRequest": completion, "ChatCompletionRequest": chat}


def _response_schemas() -> dict:
    nonneg = {"type": "integer", "minimum": 0}
    usage = {"type": "object",
             "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {"prompt_tokens": nonneg, "completion_tokens": nonneg,
                            "total_tokens": nonneg, "speculation": {
                                "type": "object", "properties": {
                                    "steps": nonneg,
                                    "accepted_per_step": {"type": "array", "items": nonneg}}}}}
    finish = {"enum": ["stop", "length", "tool_calls"]}
    top_entry = {"type": "object", "required": ["token", "logprob", "bytes"],
                 "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                                "bytes": {"type": "array", "items": {
                                    "type": "integer", "minimum": 0, "maximum": 255}}}}
    chat_logprobs = _nullable({"type": "object", "required": ["content"], "properties": {
        "content": {"type": "array", "items": {
            "allOf": [top_entry],
            "required": ["top_logprobs"],
            "properties": {"top_logprobs": {"type": "array", "items": top_entry}}}}}})
    text_logprobs = _nullable({
        "type": "object",
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": {"type": "number"}},
            "top_logprobs": {"type": "array", "items": {
                "type": "object", "additionalProperties": {"type": "number"}}},
            "text_offset": {"type": "array", "items": nonneg},
        }})

    def completion(obj: str, choice: dict) -> dict:
        return {"type": "object",
                "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {"id": {"type": "string"}, "object": {"const": obj},
                               "created": {"type": "integer"}, "model": {"type": "string"},
                               "choices": {"type": "array", "minItems": 1, "items": choice},
                               "usage": usage}}

    text_choice = {"type": "object", "required": ["index", "text", "finish_reason", "logprobs"],
                   "properties": {"index": nonneg, "text": {"type": "string"},
                                  "finish_reason": finish, "logprobs": text_logprobs}}
    call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
    chat_choice = {"type": "object",
                   "required": ["index", "message", "finish_reason", "logprobs"],
                   "properties": {"index": nonneg, "finish_reason": finish,
                                  "logprobs": chat_logprobs, "message": {
                                      "type": "object", "required": ["role", "content"],
                                      "properties": {"role": {"const": "assistant"},
                                                     "content": {"type": ["string", "null"]},
                                                     "tool_calls": {"type": "array",
                                                                    "items": call}}}}}

    def chunk(obj: str, choice: dict) -> dict:
        """A streamed chunk: deltas of some choices, or (the last) none and the usage."""
        return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                "properties": {"id": {"type": "string"}, "object": {"const": obj},
                               "created": {"type": "integer"}, "model": {"type": "string"},
                               "choices": {"type": "array", "items": choice}, "usage": usage}}

    def events(name: str) -> dict:
        """One server-sent event: a chunk, an error (then the stream ends), or [DONE]."""
        ref = "#/components/schemas/"
        return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [{"$ref": ref + name}, {"$ref": ref + "Error"}]}},
        ]}}}

    streaming = {"enum": ["stop", "length", "tool_calls", None]}
    text_delta = {**text_choice, "properties": {**text_choice["properties"],
                                                "finish_reason": streaming}}
    chat_delta = {"type": "object", "required": ["index", "delta", "finish_reason", "logprobs"],
                  "properties": {"index": nonneg, "finish_reason": streaming,
                                 "logprobs": chat_logprobs, "delta": {
                                     "type": "object",
                                     "properties": {"role": {"const": "assistant"},
                                                    "content": {"type": ["string", "null"]},
                                                    "tool_calls": {"type": "array", "items": {
                                                        **call, "required": ["index", *call[
                                                            "required"]],
                                                        "properties": {
                                                            "index": nonneg,
                                                            **call["properties"]}}}}}}}
    return {
        "Completion": completion("text_completion", text_choice),
        "ChatCompletion": completion("chat.completion", chat_choice),
        "CompletionChunk": chunk("text_completion", text_delta),
        "ChatCompletionChunk": chunk("chat.completion.chunk", chat_delta),
        "CompletionEvent": events("CompletionChunk"),
        "ChatCompletionEvent": events("ChatCompletionChunk"),
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object", "created", "owned_by"],
                "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                               "created": {"type": "integer"},
                               "owned_by": {"type": "string"},
                               "max_model_len": {"type": "integer", "minimum": 1}}}}}},
        "Error": _error_body(),
    }


def _generate_operation(summary: str, request: str, response: str, errors: dict) -> dict:
    ref = "#/components/schemas/"
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": ref + request}}}},
        "responses": {
            "200": {"description": "The completion; with stream: true, server-sent events "
                                   "(data: chunk JSON per delta, a usage chunk with "
                                   "stream_options.include_usage, an error event "
                                   "if generation fails, then data: [DONE]).",
                    "content": {"application/json": {"schema": {"$ref": ref + response}},
                                "text/event-stream": {"schema": {
                                    "$ref": ref + response + "Event"}}}},
            **errors,
        },
    }


def openapi_document(model_name: str, vocab_size: int, max_context: int,
                     limits: Limits | None = None, *, metrics: bool = True,
                     api_key_required: bool = False, metrics_auth: bool = False) -> dict:
    """The router's HTTP API for the model served (``model_name``: the only accepted
    ``model``; ``vocab_size`` and ``max_context``: the verifiers', for token ids and prompt
    lengths; ``limits``: the router's request limits). ``metrics``: whether ``/metrics`` is
    served on this port; ``api_key_required``: whether the API needs ``Authorization: Bearer
    KEY`` (``metrics_auth``: /metrics too)."""
    limits = limits if limits is not None else Limits()
    errors = _errors(limits)
    bearer = [{"bearerAuth": []}]
    # Without --api-key no credentials are needed: the empty requirement says so.
    security = bearer if api_key_required else [{}, *bearer]
    paths: dict[str, Any] = {
        "/v1/models": {"get": {
            "summary": "The served model.",
            "responses": {"200": {"description": "One model.", "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ModelList"}}}},
                "401": errors["401"]}}},
        "/v1/completions": {"post": _generate_operation(
            "Text completion (OpenAI's legacy completions).", "CompletionRequest",
            "Completion", errors)},
        "/v1/chat/completions": {"post": _generate_operation(
            "Chat completion.", "ChatCompletionRequest", "ChatCompletion", errors)},
    }
    health = {"type": "object", "required": ["status", "verifiers_ready"], "properties": {
        "status": {"type": "string", "enum": ["ok", "unavailable"]},
        "verifiers_ready": {"type": "integer", "minimum": 0}}}
    paths["/health"] = {"get": {
        "summary": "Readiness: 200 while a verifier can take sequences, 503 otherwise.",
        "security": [], "responses": {
            code: {"description": text, "content": {"application/json": {"schema": health}}}
            for code, text in (("200", "Ready."), ("503", "No verifier can take "
                                                         "sequences now."))}}}
    if metrics:
        responses = {"200": {"description": "The exposition format.",
                             "content": {"text/plain": {"schema": {"type": "string"}}}}}
        if metrics_auth:
            responses["401"] = errors["401"]
        paths["/metrics"] = {"get": {
            "summary": "Prometheus metrics (vLLM's names, prefix specinfer:).",
            "security": security if metrics_auth else [], "responses": responses}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "specinfer router", "version": "1",
                 "description": "OpenAI-compatible API of a SpecInfer serving stack."},
        "paths": paths,
        "security": security,
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": {**_request_schemas(model_name, vocab_size, max_context, limits),
                        **_response_schemas()},
        },
    }


def openapi_handler(document: Callable[[], dict]) -> Callable[
        [web.Request], Coroutine[Any, Any, web.Response]]:
    """An aiohttp handler serving ``document()`` (built per request: the verifiers'
    limits may change as replicas come and go)."""
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(document())

    return handler

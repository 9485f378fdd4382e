"""The OpenAI API's request bodies (``/v1/completions``, ``/v1/chat/completions``) as
scheduler requests: every field read and validated here, once, with errors naming the
field (``openai_http.py`` serves them; ``openapi.py`` documents the same bounds)."""

from __future__ import annotations

import dataclasses
import json
import math

from services.router.frontend import MAX_TOKENS_LIMIT, Frontend, cache_salt, check_unicode
from services.router.limits import Limits
from services.router.request import GenRequest
from services.router.tools import Tools, tools_from_body
from specinfer.constraints import Constraint
from specinfer.errors import InvalidArgument
from specinfer.sampling import MAX_LOGPROBS, SamplingParams
from specinfer.wire import sampling_on_the_wire


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
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
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


def _stop(body: dict) -> list[str]:
    """The stop strings as sent ("" too: the limit counts what was sent)."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [check_unicode(f"stop[{i}]", s) for i, s in enumerate(stop)]
    raise InvalidArgument("stop", "must be a string or a list of strings")


def openai_requests(fe: Frontend, body: dict, chat: bool) -> list[GenRequest]:
    """An OpenAI completions (or, with ``chat``, chat completions) body as scheduler
    requests, one per prompt and choice (``n``; index prompt * n + choice, as OpenAI's);
    seeded choices get seeds seed, seed+1, ... so that each is reproducible and they
    differ. The body's fields are read once; only the seed differs between choices."""
    fe.check_model(body.get("model"))
    _refuse_unsupported(body)
    _flag(body, "stream")  # read by the HTTP layer: a bool or null, not any truthy value
    stream_usage(body)  # (likewise)
    tools = tools_from_body(body) if chat else None
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if not chat and body.get(name) is not None:
            raise InvalidArgument(name, "only /v1/chat/completions calls tools")
    prompts = [_chat_ids(fe, body, tools)] if chat else _prompts_ids(fe, body)
    for k, ids in enumerate(prompts):
        fe.limits.check_prompt("messages" if chat else _prompt_field(prompts, k), len(ids))
    n = _choices(body, fe.limits)
    params = _params(body, chat)
    fe.limits.check_logprobs("top_logprobs" if chat else "logprobs", params.logprobs)
    stop = _stop(body)
    fe.limits.check_stop("stop", stop)
    fe.check_ids("logit_bias", [t for t, _ in params.logit_bias])
    stop_ids = _stop_token_ids(body)
    fe.check_ids("stop_token_ids", sorted(stop_ids))
    constraint = fe.with_tools(tools, structured_output(body, fe))
    ignore_eos = bool(_flag(body, "ignore_eos")) and constraint is None  # ends at its EOS
    params = fe.with_min_tokens(params, _number(body, "min_tokens", 0, int), stop_ids,
                                ignore_eos, "min_tokens")
    max_tokens = _max_tokens(body, None if chat else 16, fe.limits)
    speculation, session = _flag(body, "speculation") is not False, _user(body)
    salt = cache_salt(body.get("cache_salt"))
    stop = [s for s in stop if s]  # "" would stop before the first token (gRPC drops it too)
    out = []
    for ids in prompts:
        for i in range(n):
            p = params if params.seed is None else dataclasses.replace(
                params, seed=(params.seed + i) % 2**64)
            out.append(GenRequest(ids, max_tokens, p, speculation=speculation, stop=stop,
                                  stop_ids=stop_ids, ignore_eos=ignore_eos,
                                  session_id=session, constraint=constraint, tools=tools,
                                  operation="chat" if chat else "text_completion",
                                  cache_salt=salt))
    return out


# vLLM's older request fields for structured output, by constraint kind.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def structured_output(body: dict, fe: Frontend) -> Constraint | None:
    """The request's constraint, from whichever one of OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` or its ``guided_*`` fields sets one (two: a 400 naming both),
    checked to compile (a 400 naming the field it came from)."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        constraint = _response_format(fmt)
        if constraint is not None:
            found.append(("response_format.json_schema.schema"
                          if constraint.kind == "json_schema" else "response_format", constraint))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidArgument("structured_outputs", "must be an object")
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        extra = sorted(set(outputs) - set(kinds))
        if extra:  # as the OpenAPI spec says: one of its kinds, a misspelt one is an error
            raise InvalidArgument(f"structured_outputs.{extra[0]}",
                                  f"is not one of {', '.join(kinds)}")
        if len(outputs) != 1:
            raise InvalidArgument("structured_outputs", f"must set exactly one of "
                                  f"{', '.join(kinds)}")
        for key, value in outputs.items():
            if value is not None:
                if key == "json_object" and value is False:
                    continue
                found.append((f"structured_outputs.{key}",
                              _constraint(f"structured_outputs.{key}", key, value)))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _constraint(name, kind, body[name])))
    if body.get("guided_json_object"):  # (never sent with other guided fields)
        found.append(("guided_json_object", Constraint("json_object")))
    if len(found) > 1:
        raise InvalidArgument(found[1][0], f"a request takes one constraint; "
                              f"{found[0][0]} already sets one")
    if not found:
        return None
    field, constraint = found[0]
    fe.check_constraint(constraint, field)
    return constraint


def _response_format(fmt: object) -> Constraint | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidArgument("response_format", 'must be an object with a "type"')
    kind = fmt["type"]
    extra = sorted(set(fmt) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if extra:  # as the OpenAPI spec says: a misspelt field is an error, not ignored
        raise InvalidArgument(f"response_format.{extra[0]}",
                              f"is not a field of a {kind!r} response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise InvalidArgument("response_format.type",
                              f"{kind!r} is not one of text, json_object, json_schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument("response_format.json_schema", "must be an object with the "
                              "schema under \"schema\"")
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise InvalidArgument("response_format.json_schema.name", "must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidArgument("response_format.json_schema.strict", "must be a boolean")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: any JSON object then
        return Constraint("json_object")
    return _constraint("response_format.json_schema.schema", "json", schema)


def _constraint(field: str, kind: str, value: object) -> Constraint:
    """One constraint from vLLM's spelling: ``json`` (a schema, as an object or its JSON
    text), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark or GBNF)."""
    if kind == "json_object":
        if value is not True:
            raise InvalidArgument(field, "must be true")
        return Constraint("json_object")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidArgument(field, f"not JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidArgument(field, "must be a JSON Schema (an object)")
        return Constraint("json_schema", json.dumps(value, ensure_ascii=False))
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidArgument(field, "must be a list of strings")
        for i, c in enumerate(value):
            check_unicode(f"{field}[{i}]", c)
        return Constraint("choice", choices=tuple(value))
    if not isinstance(value, str):
        raise InvalidArgument(field, "must be a string")
    return Constraint(kind, check_unicode(field, value))


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
        ids = fe.encode_prompt(check_unicode(field, prompt), special) if prompt else []
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


def _chat_ids(fe: Frontend, body: dict, tools: Tools | None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "must be a non-empty list")
    if not all(isinstance(m, dict) for m in messages):
        raise InvalidArgument("messages", "each message must be an object")
    return fe.encode_chat(messages, tools)


def _max_tokens(body: dict, default: int | None, limits: Limits) -> int:
    """``max_completion_tokens`` (the newer name wins; null is "not given") or
    ``max_tokens``; without either ``default``, else as much as fits (the context, or
    --max-tokens)."""
    given = body.get("max_completion_tokens")
    if given is None:
        given = body.get("max_tokens")
    max_tokens = given if given is not None else default
    if max_tokens is None:
        max_tokens = limits.max_tokens or MAX_TOKENS_LIMIT
    if not _integral(max_tokens) or not 0 < max_tokens <= MAX_TOKENS_LIMIT:
        raise InvalidArgument("max_tokens", f"must be an integer in 1..{MAX_TOKENS_LIMIT}")
    max_tokens = int(max_tokens)  # 16.0 is 16
    if given is not None:
        limits.check_max_tokens("max_tokens", max_tokens)
    return max_tokens


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
    return check_unicode("user", user or "")

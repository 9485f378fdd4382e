"""Tool calls (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``) for chat
models: the tools rendered into the prompt, the grammar that makes an answer a valid call,
and the calls parsed back out of the answer.

A chat template that knows tools (it reads a ``tools`` variable) renders them itself. One
that does not (SmolLM2's: plain ChatML) gets the default format of Hermes-style ChatML
models, documented in docs/structured-output.md: the tools as JSON lines inside
``<tools></tools>`` in the system message, each call in the answer as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, a tool's result as a
``tool`` turn wrapped in ``<tool_response></tool_response>``.

``tool_choice``: ``none`` (no call: plain text), ``auto`` (the answer is text or calls:
once it begins ``<tool_call>``, each call is constrained to an offered function and its
parameter schema), ``required`` or a named function (the answer is one call, or several
with ``parallel_tool_calls``; nothing else).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specinfer.constraints import JSON_OPTIONS, Constraint
from specinfer.errors import InvalidArgument

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict, ...]  # each {"name", "description", "parameters"}
    choice: str = "auto"  # none, auto, required, or "function" (``name``'s)
    name: str = ""
    parallel: bool = True

    @property
    def calls(self) -> bool:
        """Whether answers are parsed for calls (``none``: never)."""
        return self.choice != "none"

    def constraint(self) -> Constraint | None:
        """The grammar the answer follows (None for ``none``)."""
        if self.choice == "none":
            return None
        offered = [f for f in self.functions if self.choice != "function"
                   or f["name"] == self.name]
        lines = ["start: calls" + (" | TEXT |" if self.choice == "auto" else ""),
                 'calls: call ("\\n" call)*' if self.parallel else "calls: call",
                 f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
                 "body: " + " | ".join(f"fn{i}" for i in range(len(offered)))]
        for i, f in enumerate(offered):
            schema = {"type": "object", "properties": {
                "name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False,
                "x-guidance": JSON_OPTIONS}
            lines.append(f"fn{i}: %json {json.dumps(schema)}")
        if self.choice == "auto":
            lines.append(f"TEXT: /{_not_a_call()}/")
        return Constraint("grammar", "\n".join(lines))


def _not_a_call() -> str:
    """A regex of the texts that do not begin with ``OPEN`` (its prefixes included)."""
    alternatives = []
    for k in range(len(OPEN)):
        alternatives.append(re.escape(OPEN[:k]) + "[^" + re.escape(OPEN[k]) + "](?s:.*)")
        if k:
            alternatives.append(re.escape(OPEN[:k]))
    return "|".join(alternatives)


def tools_from_body(body: dict) -> Tools | None:
    """The request's tools and choice, validated (errors name the field); None without
    tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgument("parallel_tool_calls", "must be a boolean")
    if tools is not None and not isinstance(tools, list):
        raise InvalidArgument("tools", "must be a list of tools")
    functions = []
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise InvalidArgument(f"tools[{i}]", 'must be {"type": "function", '
                                  '"function": {...}}')
        functions.append(function(f"tools[{i}].function", fn.get("name"),
                                  fn.get("description"), fn.get("parameters")))
    name = ""
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise InvalidArgument("tool_choice", 'a named choice is {"type": "function", '
                                  '"function": {"name": ...}}')
        choice, name = "function", fn["name"]
    return make_tools(functions, choice, name, parallel, "tool_choice.function.name")


def tools_from_proto(msg) -> Tools | None:
    """A gRPC ``GenerateRequest``'s tools, validated as ``tools_from_body`` does (errors
    name the proto's fields)."""
    functions = []
    for i, tool in enumerate(msg.tools):
        try:
            parameters = json.loads(tool.parameters) if tool.parameters else None
        except ValueError as exc:
            raise InvalidArgument(f"tools[{i}].parameters",
                                  f"must be JSON text: {exc}") from None
        functions.append(function(f"tools[{i}]", tool.name, tool.description or None,
                                  parameters))
    kind = msg.tool_choice.WhichOneof("choice")
    choice = None if kind is None else \
        ("function" if kind == "function" else msg.tool_choice.mode)
    name = msg.tool_choice.function if kind == "function" else ""
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else None
    return make_tools(functions, choice, name, parallel, "tool_choice.function")


def make_tools(functions: list[dict], choice: str | None, name: str,
               parallel: bool | None, name_field: str) -> Tools | None:
    """Validated ``Tools`` (None without functions); ``choice`` None means auto,
    "function" names ``name`` (an error about it names ``name_field``)."""
    if not functions:
        if choice not in (None, "none", "auto"):
            raise InvalidArgument("tool_choice", "needs tools")
        return None
    if len(functions) > MAX_TOOLS:
        raise InvalidArgument("tools", f"must be a list of at most {MAX_TOOLS} tools")
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidArgument("tools", "function names must be unique")
    if choice == "function" and name not in names:
        raise InvalidArgument(name_field, f"{name!r} is not one of the tools")
    if choice not in (None, "function", "none", "auto", "required"):
        raise InvalidArgument("tool_choice", 'must be "none", "auto", "required" or a named '
                              "function")
    return Tools(tuple(functions), choice or "auto", name,
                 True if parallel is None else parallel)


def function(field: str, name: object, description: object, parameters: object) -> dict:
    """One offered function, validated (``field``: where it sits in the request)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(f"{field}.name", "must be 1-64 letters, digits, '_', '.' or '-'")
    if description is not None and not isinstance(description, str):
        raise InvalidArgument(f"{field}.description", "must be a string")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{field}.parameters", "must be a JSON Schema object")
    out = {"name": name, "parameters": parameters}
    if description:
        out["description"] = description
    return out


# --- prompts ---------------------------------------------------------------------------

SYSTEM = ("You are a function calling AI model. You are provided with function signatures "
          "within <tools></tools> XML tags. You may call one or more functions to assist "
          "with the user query. Don't make assumptions about what values to plug into "
          "functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each "
          "function call return a json object with function name and arguments within "
          "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": "
          "<function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def render_messages(messages: list[dict], tools: Tools | None, native: bool) -> list[dict]:
    """OpenAI chat messages (contents already text; assistant ``tool_calls``, ``tool``
    turns) as the chat template takes them. ``native``: the template renders tools and
    tool turns itself; else the default format (module docstring)."""
    if native:
        return messages
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [f"{OPEN}\n{json.dumps(c)}\n{CLOSE}" for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools is None:
        return out
    block = SYSTEM.format(tools="\n".join(json.dumps({"type": "function", "function": f})
                                          for f in tools.functions))
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + block}, *out[1:]]
    return [{"role": "system", "content": block}, *out]


def assistant_tool_calls(field: str, calls: object) -> list[dict]:
    """An assistant message's ``tool_calls`` as ``{"name", "arguments"}`` (arguments
    parsed from their JSON string), for the prompt."""
    if not isinstance(calls, list):
        raise InvalidArgument(field, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidArgument(f"{field}[{j}].function", "must name a function")
        arguments = fn.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidArgument(f"{field}[{j}].function.arguments",
                                  "must be a JSON object, as a string")
        out.append({"name": fn["name"], "arguments": arguments})
    return out


# --- answers ---------------------------------------------------------------------------


def parse_calls(text: str) -> tuple[str | None, list[dict]]:
    """An answer's content before its calls (None when empty) and its calls as OpenAI's
    ``tool_calls``; an answer without a complete call is all content, no calls."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": json.dumps(call.get("arguments", {}))}})
    if not calls:
        return text, []
    content = text[: text.index(OPEN)].strip()
    return content or None, calls


def may_open_a_call(text: str) -> bool:
    """Whether a streamed answer's text so far may still become a call (held back)."""
    stripped = text.lstrip()
    return OPEN.startswith(stripped) or stripped.startswith(OPEN)


def calls_finish(reason: str) -> str:
    """An answer with tool calls ends with finish_reason tool_calls (unless cut short)."""
    return "tool_calls" if reason == "stop" else reason


class CallStream:
    """A streamed answer's text split into what can be sent now and its calls: with tools
    that may be called, text that may be the start of a call is held back until it is
    known not to be one; an answer that is calls yields them once, whole, at its end."""

    def __init__(self, tools: Tools | None) -> None:
        self.deciding, self.held = tools is not None and tools.calls, ""

    def push(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        """The text to send now and the calls (with the content before them in the
        text), given the answer's next ``delta`` and whether the answer has ended."""
        if not self.deciding:
            return delta, []
        self.held += delta
        if may_open_a_call(self.held) and not finished:
            return "", []
        text, self.deciding, self.held = self.held, False, ""
        content, calls = parse_calls(text)
        return (content or "", calls) if calls else (text, [])

"""Structured output through the stack (a verifier and a router as separate processes, a
tiny random Llama over SmolLM2's tokenizer, the verifier drafting prompt-lookup trees and
the grammar's forced tokens): the real ``openai`` client's ``parse()`` with a Pydantic
model, OpenAI's response_format and vLLM's structured_outputs / guided_* on both endpoints,
combined with streaming, n, seeds, logprobs, stop, ignore_eos and min_tokens, the gRPC SDK;
every answer identical with speculation on and off, and valid against its constraint."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Literal

import grpc
import jsonschema
import pytest
from servers import free_port, http_post

from specinfer.client import Client, InvalidRequestError

pytestmark = pytest.mark.processes

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "sunny": {"type": "boolean"},
    "level": {"enum": ["low", "mid", "high"]}},
    "required": ["city", "sunny", "level"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stack(processes, tiny_chat_llm):
    metrics_port = free_port()
    verifier = processes.start("verifier", "--llm", tiny_chat_llm, "--slots", "8",
                               "--max-context", "512", "--threads", "1", "--datastore", "none",
                               "--draft-head", "none", "--metrics-port", str(metrics_port))
    http_port = free_port()
    router = processes.router(tiny_chat_llm, [verifier], "--http-port", str(http_port),
                              "--speculation", "lookup")
    return {"addr": router.addr, "http": f"http://127.0.0.1:{http_port}",
            "model": tiny_chat_llm, "verifier": verifier,
            "verifier_metrics": f"http://127.0.0.1:{metrics_port}/metrics"}


def post(stack, path: str, body: dict) -> dict:
    status, payload = http_post(stack["http"] + path, json.dumps(body).encode())
    assert status == 200, payload
    return payload


def both(stack, path: str, body: dict) -> list[dict]:
    """The answer with speculation on, after checking it equals speculation off's."""
    on = post(stack, path, body)
    off = post(stack, path, {**body, "speculation": False})
    key = "message" if path.endswith("chat/completions") else "text"
    assert [c[key] for c in on["choices"]] == [c[key] for c in off["choices"]]
    return on["choices"]


def test_openai_parse_with_a_pydantic_model(stack):
    import openai
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: Literal["Paris", "Oslo", "Lima"]
        sunny: bool
        level: int = Field(ge=0, le=99)

    client = openai.OpenAI(base_url=stack["http"] + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "The weather, as JSON."}]
    out = client.chat.completions.parse(model=stack["model"], messages=messages,
                                        response_format=Weather, max_tokens=60, temperature=0)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Weather), out.choices[0]
    off = client.chat.completions.parse(model=stack["model"], messages=messages,
                                        response_format=Weather, max_tokens=60, temperature=0,
                                        extra_body={"speculation": False})
    assert off.choices[0].message.content == out.choices[0].message.content


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("name,fields,valid", [
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": SCHEMA, "strict": True}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("json_object", {"response_format": {"type": "json_object"}},
     lambda t: isinstance(json.loads(t), dict)),
    ("regex", {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,5}"}},
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t) is not None),
    ("choice", {"guided_choice": ["alpha", "beta", "gamma delta"]},
     lambda t: t in ("alpha", "beta", "gamma delta")),
    ("grammar", {"guided_grammar": 'root ::= "x=" [0-9] [0-9]? ";"'},
     lambda t: re.fullmatch(r"x=\d\d?;", t) is not None),
])
def test_every_constraint_kind_is_followed_and_speculation_changes_nothing(
        stack, path, name, fields, valid):
    chat = path.endswith("chat/completions")
    body = {"max_tokens": 80, "temperature": 0, **fields,
            **({"messages": [{"role": "user", "content": "Answer."}]} if chat
               else {"prompt": "Answer: "})}
    [choice] = both(stack, path, body)
    text = choice["message"]["content"] if chat else choice["text"]
    if choice["finish_reason"] == "stop":
        assert valid(text), text
    else:  # only a JSON object may run long on a random model
        assert name == "json_object", choice


def test_a_constraint_with_everything_else_a_request_carries(stack):
    """Greedy with n, logprobs, penalties, logit_bias, min_tokens, ignore_eos and a stop
    string: valid, identical with speculation off, and streamed identically; sampled with
    seeds: valid. (Seeded sampling is exact in distribution under speculation, not draw
    for draw: its samples are not compared.)"""
    body = {"prompt": "List: ", "max_tokens": 60, "temperature": 0, "n": 2,
            "logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": 0.3,
            "logit_bias": {"90": 5}, "min_tokens": 3, "ignore_eos": True, "stop": ["]]"],
            "guided_json": {"type": "array", "items": {"enum": ["a", "b", "cc"]},
                            "maxItems": 5}}
    choices = both(stack, "/v1/completions", body)
    assert len(choices) == 2
    for c in choices:
        assert c["finish_reason"] == "stop", c  # ignore_eos does not outlast the grammar
        assert all(x in ("a", "b", "cc") for x in json.loads(c["text"]))
        assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["top_logprobs"]) > 0
    req = urllib.request.Request(stack["http"] + "/v1/completions",
                                 json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw = resp.read()
    texts = ["", ""]
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in choices]
    sampled = post(stack, "/v1/completions", {**body, "temperature": 1.0, "seed": 3, "n": 4})
    for c in sampled["choices"]:
        assert c["finish_reason"] == "stop", c
        assert all(x in ("a", "b", "cc") for x in json.loads(c["text"]))


def test_the_grpc_sdk_takes_the_same_constraints(stack):
    with Client(stack["addr"]) as c:
        out = c.generate("Answer: ", max_tokens=80, json_schema=SCHEMA)
        jsonschema.validate(json.loads(out.text), SCHEMA)
        http = post(stack, "/v1/completions", {
            "prompt": "Answer: ", "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w",
                                                                        "schema": SCHEMA}}})
        assert http["choices"][0]["text"] == out.text
        assert "".join(ch.text for ch in c.stream("Answer: ", max_tokens=80,
                                                  json_schema=SCHEMA)) == out.text
        assert c.generate("Pick: ", max_tokens=10, choice=["left", "right"]).text in (
            "left", "right")
        with pytest.raises(InvalidRequestError) as err:
            c.generate("x", max_tokens=4, regex="(unclosed")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.message.startswith("constraint")
        with pytest.raises(ValueError):
            c.generate("x", max_tokens=4, regex="a", choice=["a"])


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def check_call(name: str, args: dict) -> None:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(args, schema)


@pytest.mark.parametrize("tool_choice,parallel", [
    ("required", False), ("required", True),
    ({"type": "function", "function": {"name": "add"}}, False)])
def test_required_and_named_tool_choice_answer_with_valid_calls(stack, tool_choice, parallel):
    import openai

    client = openai.OpenAI(base_url=stack["http"] + "/v1", api_key="unused")
    kwargs = dict(model=stack["model"], messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  parallel_tool_calls=parallel, max_tokens=120, temperature=0)
    out = client.chat.completions.create(**kwargs).choices[0]
    off = client.chat.completions.create(**kwargs, extra_body={"speculation": False})
    assert out.finish_reason == "tool_calls", out
    assert out.message.content is None
    calls = calls_of(out.message)
    assert calls == calls_of(off.choices[0].message)
    assert calls and (parallel or len(calls) == 1)
    for name, args in calls:
        check_call(name, args)
        if isinstance(tool_choice, dict):
            assert name == "add"
    assert all(c.id.startswith("call_") and c.type == "function"
               for c in out.message.tool_calls)
    # Streamed: the same calls as delta.tool_calls, then finish_reason tool_calls.
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == calls
    assert [t.index for t in streamed] == list(range(len(calls)))
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_call_round_trip_and_auto(stack):
    """The assistant's call (content null) and the tool's answer (tool_call_id) go back
    into the conversation; ``auto`` answers with text or with valid calls."""
    import openai

    client = openai.OpenAI(base_url=stack["http"] + "/v1", api_key="unused")
    first = client.chat.completions.create(model=stack["model"], messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=120,
                                           temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    for choice in ("auto", "none"):
        kwargs = dict(model=stack["model"], messages=messages, tools=TOOLS,
                      tool_choice=choice, max_tokens=40, temperature=0)
        answer = client.chat.completions.create(**kwargs).choices[0]
        off = client.chat.completions.create(**kwargs, extra_body={"speculation": False})
        assert answer.message.content == off.choices[0].message.content
        if answer.message.tool_calls:
            assert choice == "auto" and answer.finish_reason == "tool_calls"
            for name, args in calls_of(answer.message):
                check_call(name, args)
        else:
            assert answer.finish_reason in ("stop", "length")
            assert not (answer.message.content or "").lstrip().startswith("<tool_call>") \
                or choice == "none"
        streamed = "".join(ch.choices[0].delta.content or "" for ch in
                           client.chat.completions.create(**kwargs, stream=True)
                           if ch.choices)
        assert streamed == (answer.message.content or "")


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "tool", "tool_call_id": "call_x",
                                          "content": "21"}]}, "messages[1].tool_call_id"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "wrong"}}}}}], "tool_choice": "required"},
     "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(stack, body, param):
    status, payload = http_post(stack["http"] + "/v1/chat/completions",
                                json.dumps({"messages": ASK, **body}).encode())
    assert status == 400, payload
    assert payload["error"]["param"] == param, payload
    status, payload = http_post(stack["http"] + "/v1/completions",
                                json.dumps({"prompt": "x", "tools": TOOLS}).encode())
    assert status == 400 and payload["error"]["param"] == "tools"


@pytest.fixture(scope="module")
def drafters(processes, tiny_chat_llm, tiny_chat_head):
    """A verifier with a draft head and a speculator with an SSM (a one-layer cut of the
    LLM): what the head, SSM-tree and merged modes draft with."""
    common = ("--llm", tiny_chat_llm, "--max-context", "512", "--threads", "1",
              "--datastore", "none")
    return (processes.start("verifier", *common, "--draft-head", tiny_chat_head,
                            "--slots", "8"),
            processes.start("speculator", *common, "--ssm", f"{tiny_chat_llm}#layers=1"))


# One constraint of each kind (the matrix, SPECINFER_STRUCTURED_MATRIX=1: every kind).
MODE_CASES = [dict(json_schema=SCHEMA), dict(regex="(yes|no|maybe), [a-z]{2,8}[.!]"),
              dict(choice=["the north", "the south", "the north-east"]),
              dict(grammar='start: "(" NUM " " OP " " NUM ")"\nNUM: /[0-9]{1,3}/\n'
                           'OP: "+" | "-" | "*"'),
              dict(json_object=True)]


@pytest.mark.parametrize("mode", ["head", "always", "merged"])
def test_every_drafter_mode_keeps_constrained_output(processes, tiny_chat_llm, drafters,
                                                     mode):
    """The draft head's trees ("head"), the speculator's SSM trees ("always") and both
    merged: each constrained answer identical to speculation off's and valid, and the
    drafts really used (steps accepting several tokens). Model-free drafts: ``stack``."""
    verifier, speculator = drafters
    router = processes.router(tiny_chat_llm, [verifier], "--speculation", mode,
                              "--http-port", "0",
                              speculators=() if mode == "head" else (speculator,))
    accepted, speculative = [], 0
    with Client(router.addr) as c:
        for case in MODE_CASES:
            messages = [{"role": "user", "content": "Answer as asked: where?"}]
            on = c.generate(messages=messages, max_tokens=60, **case)
            off = c.generate(messages=messages, max_tokens=60, speculation=False, **case)
            assert on.token_ids == off.token_ids, (mode, case)
            speculative += on.stats.speculative_steps  # ("{}" may leave nothing to draft)
            accepted += on.accepted_per_step
            if on.finish_reason == "stop":
                if "json_schema" in case:
                    jsonschema.validate(json.loads(on.text), SCHEMA)
                elif "json_object" in case:
                    assert isinstance(json.loads(on.text), dict)
                elif "regex" in case:
                    assert re.fullmatch(case["regex"], on.text), on.text
                elif "choice" in case:
                    assert on.text in case["choice"]
                else:
                    assert re.fullmatch(r"\([0-9]{1,3} [-+*] [0-9]{1,3}\)", on.text)
    assert speculative > 0 and max(accepted) > 1, (mode, speculative, accepted)


def test_the_grpc_sdk_calls_tools_as_http_does(stack):
    """The same tools over gRPC: the calls HTTP returns (ids aside), streamed in one message
    with finish_reason tool_calls, a round trip, and bad tool requests INVALID_ARGUMENT
    naming the proto's field."""
    http = post(stack, "/v1/chat/completions", {
        "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120,
        "temperature": 0})["choices"][0]["message"]
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in http["tool_calls"]]
    with Client(stack["addr"]) as c:
        out = c.generate(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120)
        assert out.finish_reason == "tool_calls" and out.text == ""
        assert [(t.name, json.loads(t.arguments)) for t in out.tool_calls] == want
        assert all(t.id.startswith("call_") for t in out.tool_calls)
        off = c.generate(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
                         speculation=False)
        assert [(t.name, t.arguments) for t in off.tool_calls] == \
            [(t.name, t.arguments) for t in out.tool_calls]
        chunks = list(c.stream(messages=ASK, tools=TOOLS, tool_choice="required",
                               max_tokens=120))
        assert [ch.finish_reason for ch in chunks if ch.finish_reason] == ["tool_calls"]
        streamed = [t for ch in chunks for t in ch.tool_calls]
        assert [(t.name, t.arguments) for t in streamed] == \
            [(t.name, t.arguments) for t in out.tool_calls]
        assert not "".join(ch.text for ch in chunks)
        named = c.generate(messages=ASK, tools=TOOLS, tool_choice="add", max_tokens=120)
        assert [t.name for t in named.tool_calls] and \
            {t.name for t in named.tool_calls} == {"add"}
        for t in named.tool_calls:
            check_call(t.name, json.loads(t.arguments))
        # The round trip: the call and the tool's answer go back into the conversation.
        messages = [*ASK, {"role": "assistant", "content": None,
                           "tool_calls": [out.tool_calls[0].to_openai()]},
                    {"role": "tool", "tool_call_id": out.tool_calls[0].id, "content": "21"}]
        answer = c.generate(messages=messages, tools=TOOLS, tool_choice="none",
                            max_tokens=20)
        assert answer.finish_reason in ("stop", "length") and not answer.tool_calls
        assert answer.text == post(stack, "/v1/chat/completions", {
            "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 20,
            "temperature": 0})["choices"][0]["message"]["content"]
        bad = [
            (dict(messages=ASK, tools=TOOLS, tool_choice="nope"), "tool_choice.function"),
            (dict(messages=ASK, tools=[{"name": "f", "parameters": "{"}]),
             "tools[0].parameters"),
            (dict(messages=ASK, tools=[{"name": "bad name!"}]), "tools[0].name"),
            (dict(messages=ASK, tool_choice="required"), "tool_choice"),
            (dict(messages=ASK, tools=TOOLS, json_object=True), "tools"),
            (dict(prompt="x", tools=TOOLS), "tools"),
            (dict(messages=[*ASK, {"role": "tool", "tool_call_id": "x", "content": "1"}],
                  tools=TOOLS), "messages[1].tool_call_id"),
        ]
        for kwargs, field in bad:
            with pytest.raises(InvalidRequestError) as err:
                c.generate(max_tokens=8, **kwargs)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.message.startswith(field + ":"), (field, err.value.message)


def test_a_chat_template_flag_replaces_the_models(stack, processes, tiny_chat_llm, tmp_path):
    """``--chat-template FILE``: the router renders with it; one that reads ``tools``
    renders them itself (no default tool prompt)."""
    from specinfer.models import load_tokenizer

    template = tmp_path / "tools.jinja"
    template.write_text(
        "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
        "{% endif %}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}")
    http_port = free_port()
    processes.router(tiny_chat_llm, [stack["verifier"]], "--http-port", str(http_port),
                     "--chat-template", str(template))
    tok = load_tokenizer(tiny_chat_llm)
    tok.chat_template = template.read_text()
    for tools in (None, TOOLS):
        body = {"messages": ASK, "max_tokens": 2, **({"tools": tools} if tools else {})}
        out = post({"http": f"http://127.0.0.1:{http_port}"}, "/v1/chat/completions", body)
        expected = tok.apply_chat_template(ASK, tools=tools, add_generation_prompt=True,
                                           tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert out["usage"]["prompt_tokens"] == len(expected)


def test_structured_metrics_count_requests_compiles_and_forced_tokens(stack):
    """The router counts structured requests by kind; the verifier its grammar cache
    lookups, compiles and forced tokens (each must move with this test's requests)."""
    from servers import scrape

    def total(samples, name, **labels):
        return sum(v for k, v in samples.items() if k.split("{")[0] == name and all(
            f'{a}="{b}"' in k for a, b in labels.items()))

    router, verifier = stack["http"] + "/metrics", stack["verifier_metrics"]
    before, verifier_before = scrape(router), scrape(verifier)
    assert any('kind="tools"' in k for k in before)  # every kind exists from the start
    regex = f"[a-c]{{4}}-[0-9]{{2}}-{free_port()}"  # a new grammar: one compile
    body = {"prompt": "Data: ", "max_tokens": 40, "temperature": 0, "guided_regex": regex}
    post(stack, "/v1/completions", body)
    post(stack, "/v1/completions", body)
    after, verifier_after = scrape(router), scrape(verifier)
    name = "specinfer:structured_requests_total"
    assert total(after, name, kind="regex") - total(before, name, kind="regex") == 2
    lookups = "specinfer:grammar_cache_lookups_total"
    assert total(verifier_after, lookups, result="miss") - \
        total(verifier_before, lookups, result="miss") == 1
    assert total(verifier_after, lookups, result="hit") - \
        total(verifier_before, lookups, result="hit") == 1
    assert total(verifier_after, "specinfer:grammar_compile_seconds_count") > \
        total(verifier_before, "specinfer:grammar_compile_seconds_count")
    forced = "specinfer:grammar_forced_tokens_total"  # the regex's "-" after 4 letters
    assert total(verifier_after, forced) > total(verifier_before, forced)


def test_a_constrained_request_survives_a_verifier_kill(processes, tiny_chat_llm):
    """Two verifiers; one is killed mid-generation: the router prefills its sequences
    again elsewhere (prompt + generated, the grammar replayed there) and every constrained
    answer is the one it would have been."""
    import asyncio

    from specinfer.client import AsyncClient

    verifiers = [processes.start("verifier", "--llm", tiny_chat_llm, "--slots", "8",
                                 "--max-context", "512", "--threads", "1", "--datastore",
                                 "none", "--draft-head", "none") for _ in range(2)]
    router = processes.router(tiny_chat_llm, verifiers, "--speculation", "lookup")
    prompts = [f"Record {i}: " for i in range(6)]
    with Client(router.addr) as c:
        reference = {p: c.generate(p, max_tokens=80, json_schema=SCHEMA,
                                   speculation=False).text for p in prompts}

    async def one(client, prompt):
        text = ""
        async for ch in client.stream(prompt, max_tokens=80, json_schema=SCHEMA):
            text += ch.text
            await asyncio.sleep(0.05)
        return prompt, text

    async def main():
        async with AsyncClient(router.addr) as client:
            tasks = [asyncio.create_task(one(client, p)) for p in prompts]
            await asyncio.sleep(0.6)
            verifiers[0].proc.kill()
            return await asyncio.gather(*tasks)

    for prompt, text in asyncio.run(main()):
        assert text == reference[prompt]
        jsonschema.validate(json.loads(text), SCHEMA)

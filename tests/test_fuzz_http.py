"""Schema-driven fuzzing of the router's OpenAI HTTP API with schemathesis: the router
serves its own OpenAPI document (``/openapi.json``); every operation in it is fed requests
generated from it, valid ones and invalid ones, against a real verifier and router (tiny
random Llama over SmolLM2's tokenizer, API keys on). Each answer must be no 5xx, a status
code and content type the document declares, a body matching its schema; invalid requests
must be refused (4xx), valid ones accepted; auth must be enforced. Afterwards the stack
still answers correctly. ``SPECINFER_FUZZ_EXAMPLES`` raises the examples per operation and
mode (``make fuzz``)."""

from __future__ import annotations

import json
import os

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi import checks as openapi_checks
from servers import free_port

pytestmark = pytest.mark.processes

EXAMPLES = int(os.environ.get("SPECINFER_FUZZ_EXAMPLES", "50"))
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONTEXT = 128  # every generation ends within ~127 tokens, whatever max_tokens says
MAX_BODY = 64 * 1024  # small, so the 413 check sends little

OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/health")]


@pytest.fixture(scope="module")
def stack(processes, tiny_chat_llm):
    """A verifier and a router (its HTTP API with an API key) as separate processes."""
    verifier = processes.start("verifier", "--llm", tiny_chat_llm, "--slots", "8",
                               "--max-context", str(MAX_CONTEXT), "--threads", "1",
                               "--datastore", "none", "--draft-head", "none")
    http = free_port()
    router = processes.router(tiny_chat_llm, [verifier], "--http-port", str(http),
                              "--api-key", KEY, "--max-body-bytes", str(MAX_BODY),
                              "--max-prompts", "4")
    return {"url": f"http://127.0.0.1:{http}", "procs": [verifier.proc, router.proc],
            "model": tiny_chat_llm}


@pytest.fixture(scope="module")
def api(stack):
    return schemathesis.openapi.from_url(stack["url"] + "/openapi.json")


CONSTRAINT_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "tools", "tool_choice"}


def accepts_valid_requests(ctx, response, case) -> bool | None:
    """schemathesis' positive_data_acceptance, less the refusals a schema cannot foresee:
    a prompt longer than the context in tokens, or text that tokenizes to nothing, or a
    structured-output constraint that does not compile (a regex, grammar or JSON Schema
    whose validity no OpenAPI schema can state), or tools that do not fit together (a
    tool_choice naming no tool, a call's arguments that are not JSON, a tool turn whose
    tool_call_id no assistant call made)."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return None
    if response.status_code == 400:
        error = response.json()["error"]
        if error["param"] in ("prompt", "messages") and any(
                s in error["message"] for s in ("tokens", "tokenizes to nothing")):
            return True
        if error["param"].split(".")[0] in CONSTRAINT_FIELDS or "tool_call" in error["param"]:
            return True
    assert response.status_code < 400 or response.status_code == 429, \
        f"a schema-valid request was refused: {response.status_code} {response.text[:500]}"
    return True


def rejects_invalid_requests(ctx, response, case) -> bool | None:
    """schemathesis' negative_data_rejection, with 413 a rejection too: an invalid body
    the generator made larger than --max-body-bytes is refused before it is read."""
    if response.status_code == 413:
        return True
    return openapi_checks.negative_data_rejection(ctx, response, case)


CHECKS = [
    schemathesis.checks.not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_headers_conformance,
    openapi_checks.response_schema_conformance,
    rejects_invalid_requests,
    openapi_checks.ignored_auth,
    accepts_valid_requests,
]


def test_the_document_is_served_and_describes_the_api(stack, api):
    doc = requests.get(stack["url"] + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    assert {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops} == set(OPERATIONS)
    assert doc["security"] == [{"bearerAuth": []}]  # the router runs with --api-key
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == [stack["model"], None]
    for method, path in OPERATIONS:
        assert api[path][method] is not None


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=lambda m: m.value)
@pytest.mark.parametrize("method,path", OPERATIONS, ids=lambda x: x)
def test_fuzz_operation(stack, api, method, path, mode):
    if mode is GenerationMode.NEGATIVE and path in ("/metrics", "/health"):
        pytest.skip("no input to make invalid")
    operation = api[path][method]
    session = requests.Session()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                     HealthCheck.data_too_large])
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        case.call_and_validate(base_url=stack["url"], session=session, headers=AUTH,
                               checks=CHECKS, timeout=120)

    fuzz()
    for proc in stack["procs"]:
        assert proc.poll() is None, f"{proc.args[4]} exited with {proc.returncode}"


def test_declared_refusals_conform(stack, api):
    """The answers fuzzing rarely reaches: no key, a wrong key, a body past the limit."""
    completions = api["/v1/completions"]["POST"]
    for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                            (AUTH, 413)):
        case = completions.Case(body={"prompt": "x" * (MAX_BODY + 1), "max_tokens": 1},
                                headers=headers)
        response = case.call(base_url=stack["url"], timeout=60)
        assert response.status_code == status, response.text
        case.validate_response(response, checks=CHECKS[:5])
        assert response.json()["error"]["message"]


def _raw_bodies() -> st.SearchStrategy[bytes]:
    """Bodies no schema generates: bytes, broken or odd JSON (deep nesting, numbers past
    any float or past Python's 4300 digits, NaN, lone surrogates), valid JSON of the wrong
    shape."""
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
            st.sampled_from(["prompt", "messages", "n", "max_tokens", "stop", "logit_bias",
                             "seed", "temperature", "stream", "user", "x"]), inner,
            max_size=4), max_leaves=12)
    return st.one_of(
        st.binary(max_size=256),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.builds(lambda key, n: b'{"%s": %s}' % (key.encode(), n.encode()),
                  st.sampled_from(["n", "max_tokens", "seed", "temperature", "top_k"]),
                  st.sampled_from(["1" + "0" * 400, "1" + "0" * 5000, "NaN", "-Infinity",
                                   "1e999", "-0", "2.0"])),
        st.builds(lambda depth: b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth
                  + b"}", st.integers(100, 5000)),
        st.just(b'{"prompt": "\\ud800", "max_tokens": 1}'),
        st.just(b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}'))


def test_raw_bodies_get_openai_errors(stack):
    """Anything in a POST body: a 4xx with OpenAI's error object naming the field, or 200."""
    session = requests.Session()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=_raw_bodies(), path=st.sampled_from(["/v1/completions",
                                                     "/v1/chat/completions"]))
    def fuzz(body, path):
        response = session.post(stack["url"] + path, data=body, timeout=120,
                                headers={**AUTH, "Content-Type": "application/json"})
        assert response.status_code < 500, response.text[:500]
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["message"] and error["type"] == "invalid_request_error", error

    fuzz()


def _complete(stack, path: str, body: dict) -> dict:
    response = requests.post(stack["url"] + path, json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_good_requests_still_answer_correctly_after_fuzzing(stack):
    """Greedy output with speculation equals it without, on both APIs, streamed too."""
    common = {"model": stack["model"], "max_tokens": 24, "temperature": 0}
    prompt = {**common, "prompt": "The quick brown fox"}
    chat = {**common, "messages": [{"role": "user", "content": "Hello!"}]}
    plain = _complete(stack, "/v1/completions", {**prompt, "speculation": False})
    fast = _complete(stack, "/v1/completions", prompt)
    assert fast["choices"][0]["text"] == plain["choices"][0]["text"]
    assert fast["usage"]["completion_tokens"] == 24
    plain_chat = _complete(stack, "/v1/chat/completions", {**chat, "speculation": False})
    fast_chat = _complete(stack, "/v1/chat/completions", chat)
    assert fast_chat["choices"][0]["message"] == plain_chat["choices"][0]["message"]
    streamed = requests.post(stack["url"] + "/v1/completions", headers=AUTH, timeout=120,
                             json={**prompt, "stream": True})
    assert streamed.status_code == 200
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
    assert text == plain["choices"][0]["text"]
    for proc in stack["procs"]:
        assert proc.poll() is None

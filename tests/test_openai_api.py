"""The OpenAI HTTP API as vLLM users call it, on a router and a verifier (separate
processes, a tiny random Llama with SmolLM2's tokenizer, the verifier drafting prompt-lookup
trees): bad input answered with OpenAI's errors naming the field, an unknown model (404),
chat content parts, batched prompts, and vLLM's ignore_eos, stop_token_ids and min_tokens
(the last two over gRPC too)."""

from __future__ import annotations

import json

import grpc
import pytest
from servers import free_port, http_post

from specinfer.client import Client, NotFoundError
from specinfer.models import DEFAULT_LLM, load_tokenizer

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def stack(processes, tiny_chat_llm):
    verifier = processes.start("verifier", "--llm", tiny_chat_llm, "--slots", "16",
                               "--max-context", "512", "--threads", "1", "--datastore", "none",
                               "--draft-head", "none")
    http_port = free_port()
    router = processes.router(tiny_chat_llm, [verifier], "--http-port", str(http_port),
                              "--speculation", "lookup")
    return {"addr": router.addr, "http": f"http://127.0.0.1:{http_port}"}


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "", "max_tokens": 4}', "prompt"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 100000000}', "max_tokens"),
    (b'{"prompt": "hi", "temperature": -1}', "temperature"),
    (b'{"prompt": "hi", "top_p": 0}', "top_p"),
    (b'{"prompt": "hi", "top_p": 1.5}', "top_p"),
    (b'{"prompt": "hi", "n": 9}', "n"),
    (b'{"prompt": "hi", "logprobs": 21}', "logprobs"),
    (b'{"prompt": "hi", "logprobs": "yes"}', "logprobs"),
    (b'{"prompt": "hi", ', "body"),
    (b'{"prompt": "\xff\xfe"}', "body"),
    (b'{"prompt": "' + b"word " * 600 + b'"}', "prompt"),
    (b'{"prompt": "hi", "logit_bias": {"49152": 5}}', "logit_bias[0]"),
    (b'{"prompt": "hi", "logit_bias": {"x": 5}}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": [1]}', "logit_bias"),
    (b'{"prompt": "hi", "presence_penalty": 2.5}', "presence_penalty"),
    (b'{"prompt": "hi", "frequency_penalty": -3}', "frequency_penalty"),
    (b'{"prompt": "hi", "repetition_penalty": 0}', "repetition_penalty"),
    (b'{"prompt": "hi", "response_format": {"type": "xml"}}', "response_format.type"),
    (b'{"prompt": "hi", "response_format": {"type": "json_object", "schema": {}}}',
     "response_format.schema"),
    (b'{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
     b'{"name": "x", "schema": {"type": "strange"}}}}', "response_format.json_schema.schema"),
    (b'{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
     b'{"name": "x", "schema": false}}}', "response_format.json_schema.schema"),
    (b'{"prompt": "hi", "response_format": {"type": "json_object"}, "guided_regex": "a+"}',
     "guided_regex"),
    (b'{"prompt": "hi", "guided_choice": []}', "guided_choice"),
    (b'{"prompt": "hi", "structured_outputs": {"regex": "a+", "jsn": {}}}',
     "structured_outputs.jsn"),
    (b'{"prompt": "hi", "structured_outputs": {"regex": "a+", "json_object": null}}',
     "structured_outputs"),
    (b'{"prompt": "hi", "guided_choice": ["a", 1]}', "guided_choice"),
    (b'{"prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}',
     "structured_outputs.regex"),
    (b'{"prompt": "hi", "structured_outputs": {"grammar": "start: nothing_defined"}}',
     "structured_outputs.grammar"),
    (b'{"prompt": "hi", "guided_json": "{not json"}', "guided_json"),
    (b'{"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}',
     "tools"),
    (b'{"prompt": "hi", "tool_choice": "auto"}', "tool_choice"),
    (b'{"prompt": "hi", "cache_salt": 7}', "cache_salt"),
    (b'{"prompt": "hi", "cache_salt": "' + b"s" * 257 + b'"}', "cache_salt"),
    (b'{"prompt": "hi", "best_of": 3}', "best_of"),
    (b'{"prompt": "hi", "echo": true}', "echo"),
    (b'{"prompt": "hi", "suffix": "end"}', "suffix"),
    # 17 stop strings, one empty (dropped, but counted against --max-stop-strings 16)
    (b'{"prompt": "hi", "stop": [' + b'"a", ' * 16 + b'""]}', "stop"),
])
def test_bad_http_input_gets_openai_errors(stack, body, param):
    status, payload = http_post(stack["http"] + "/v1/completions", body)
    assert status == 400, payload
    assert payload["error"]["param"] == param and payload["error"]["message"]


def test_an_unknown_model_is_404_model_not_found(stack):
    """As OpenAI (and vLLM) answer it: 404, code model_not_found; gRPC NOT_FOUND."""
    for path, body in (("/v1/completions", b'{"prompt": "hi", "model": "gpt-7"}'),
                       ("/v1/chat/completions",
                        b'{"messages": [{"role": "user", "content": "hi"}], "model": "x"}')):
        status, payload = http_post(stack["http"] + path, body)
        assert status == 404, payload
        assert payload["error"]["code"] == "model_not_found"
        assert payload["error"]["param"] == "model"
    with Client(stack["addr"]) as c, pytest.raises(NotFoundError) as err:
        c.generate("hello", max_tokens=4, model="nope")
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.message


def test_chat_content_as_text_parts_equals_the_string(stack):
    """OpenAI's content parts: text parts are served (joined by newlines, as vLLM);
    anything else is refused naming the part."""
    url = stack["http"] + "/v1/chat/completions"

    def chat(content) -> tuple[int, dict]:
        return http_post(url, json.dumps({"messages": [{"role": "user", "content": content}],
                                          "max_tokens": 8, "temperature": 0}).encode())

    status, as_string = chat("What is\nthe capital of France?")
    assert status == 200, as_string
    status, as_parts = chat([{"type": "text", "text": "What is"},
                             {"type": "text", "text": "the capital of France?"}])
    assert status == 200, as_parts
    assert as_parts["choices"][0]["message"] == as_string["choices"][0]["message"]
    assert as_parts["usage"]["prompt_tokens"] == as_string["usage"]["prompt_tokens"]
    for content, param in (
            ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
             "messages[0].content[0].type"),
            ([{"type": "text", "text": "a"}, {"type": "text", "text": 5}],
             "messages[0].content[1].text"),
            ([], "messages[0].content"), (None, "messages[0].content")):
        status, payload = chat(content)
        assert status == 400 and payload["error"]["param"] == param, payload


def test_a_batch_of_prompts_answers_each_as_alone(stack):
    """OpenAI's batched completions: a list of strings or of token-id lists, one choice per
    prompt and n (index = prompt * n + choice), each the prompt's own answer; usage counts
    every prompt once."""
    url = stack["http"] + "/v1/completions"
    prompts = ["The quick brown fox", "def fibonacci(n):", "Paris is"]

    def complete(prompt, **extra) -> dict:
        status, payload = http_post(url, json.dumps({"prompt": prompt, "max_tokens": 6,
                                                     "temperature": 0, **extra}).encode())
        assert status == 200, payload
        return payload

    alone = [complete(p) for p in prompts]
    batch = complete(prompts, n=2)
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    for k, single in enumerate(alone):
        for i in range(2):
            assert batch["choices"][2 * k + i]["text"] == single["choices"][0]["text"]
    assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert batch["usage"]["completion_tokens"] == 2 * sum(
        a["usage"]["completion_tokens"] for a in alone)
    tokenizer = load_tokenizer(DEFAULT_LLM)  # the tiny model's
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[:2]]
    by_ids = complete(ids)
    assert [ch["text"] for ch in by_ids["choices"]] == \
        [a["choices"][0]["text"] for a in alone[:2]]
    for body, param in ((b'{"prompt": ["a", ""], "max_tokens": 2}', "prompt[1]"),
                        (b'{"prompt": [[1, 2], [49152]], "max_tokens": 2}', "prompt[1][0]"),
                        (b'{"prompt": [["a"]], "max_tokens": 2}', "prompt[0]"),
                        (json.dumps({"prompt": ["x"] * 33}).encode(), "prompt")):
        status, payload = http_post(url, body)
        assert status == 400 and payload["error"]["param"] == param, payload


def test_ignore_eos_stop_token_ids_and_min_tokens(stack):
    """vLLM's ignore_eos (HTTP and gRPC), stop_token_ids and min_tokens: EOS forced by
    logit_bias ends a choice at once unless ignore_eos, or at min_tokens; a stop token id
    ends it where it first appears, not before min_tokens."""
    url = stack["http"] + "/v1/completions"
    eos = 2  # the tiny model's (SmolLM2's <|im_end|>)

    def complete(**extra) -> dict:
        status, payload = http_post(url, json.dumps({"prompt": "Paris is", "max_tokens": 6,
                                                     "temperature": 0, **extra}).encode())
        assert status == 200, payload
        return payload["choices"][0] | {"usage": payload["usage"]}

    forced = {"logit_bias": {str(eos): 100}}
    assert complete(**forced)["usage"]["completion_tokens"] == 1
    assert complete(**forced)["finish_reason"] == "stop"
    ignored = complete(**forced, ignore_eos=True)
    assert ignored["usage"]["completion_tokens"] == 6 and ignored["finish_reason"] == "length"
    with Client(stack["addr"]) as c:
        assert c.generate("Paris is", max_tokens=6, logit_bias={eos: 100}).token_ids == [eos]
        assert c.generate("Paris is", max_tokens=6, logit_bias={eos: 100},
                          ignore_eos=True).token_ids == [eos] * 6
        plain = c.generate("Paris is", max_tokens=6, speculation=False).token_ids
    stop_at = plain[2]
    cut = plain[:plain.index(stop_at) + 1]
    stopped = complete(stop_token_ids=[stop_at])
    assert stopped["usage"]["completion_tokens"] == len(cut)
    assert stopped["finish_reason"] == "stop"
    # min_tokens: EOS (forced) and the stop ids come no sooner, with speculation or not
    for spec in (True, False):
        held = complete(**forced, min_tokens=4, speculation=spec)
        assert held["usage"]["completion_tokens"] == 5 and held["finish_reason"] == "stop"
        assert held["usage"]["speculation"]["steps"] <= 5
    with Client(stack["addr"]) as c:
        out = c.generate("Paris is", max_tokens=8, logit_bias={eos: 100}, min_tokens=3)
        assert out.token_ids[3:] == [eos] and eos not in out.token_ids[:3]
        later = c.generate("Paris is", max_tokens=6, stop_token_ids=[stop_at], min_tokens=6,
                           speculation=False).token_ids
    assert stop_at not in later and len(later) == 6
    for body, param in ((b'{"prompt": "a", "stop_token_ids": [49152]}', "stop_token_ids[0]"),
                        (b'{"prompt": "a", "stop_token_ids": "x"}', "stop_token_ids"),
                        (b'{"prompt": "a", "ignore_eos": 1}', "ignore_eos"),
                        (b'{"prompt": "a", "min_tokens": -1}', "min_tokens"),
                        (b'{"prompt": "a", "min_tokens": 1.5}', "min_tokens")):
        status, payload = http_post(url, body)
        assert status == 400 and payload["error"]["param"] == param, payload

"""The whole stack as separate processes on loopback (router, speculator, two verifiers) on
a tiny random Llama with SmolLM2's tokenizer: the gRPC API, the SDK, the real `openai`
client against the HTTP API, concurrency, failover, and bad input."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from servers import free_port, http_post, scrape, service

from specinfer.client import AsyncClient, Client, InvalidRequestError

pytestmark = pytest.mark.processes

ROUTER = ("--spec-max-batch", "64")  # every batch speculates


@pytest.fixture(scope="module")
def stack(processes, tiny_chat_llm, smollm2_datastore):
    """Two verifiers and a speculator as `specinfer serve ...` processes, and the router."""
    verifiers = [processes.start("verifier", "--llm", tiny_chat_llm, "--slots", "24",
                                 "--max-context", "512", "--threads", "1") for _ in range(2)]
    speculator = processes.start("speculator", "--llm", tiny_chat_llm, "--ssm",
                                 f"{tiny_chat_llm}#layers=1", "--max-context", "512",
                                 "--threads", "1")
    http_port = free_port()
    router = processes.router(tiny_chat_llm, verifiers, *ROUTER, "--http-port", str(http_port),
                              "--speculation", "always", speculators=(speculator,))
    return {"addr": router.addr, "http": f"http://127.0.0.1:{http_port}",
            "verifiers": verifiers, "speculator": speculator}


def other_router(stack, llm: str, *args: str, speculator: bool = True):
    """``service`` of a second router over the stack's verifiers (and its speculator)."""
    peers = [arg for v in stack["verifiers"] for arg in ("--verifier", v.addr)]
    if speculator:
        peers += ["--speculator", stack["speculator"].addr]
    return service("router", "--llm", llm, *peers, *ROUTER, "--http-port", "0", *args)


@pytest.fixture(scope="module")
def reference(stack):
    """Greedy outputs with speculation off: what every other path must reproduce."""
    with Client(stack["addr"]) as c:
        return {p: c.generate(p, max_tokens=24, speculation=False).token_ids
                for p in PROMPTS}


PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paris is the capital of",
           "1, 2, 3, 4,"]


def test_greedy_with_speculation_equals_without(stack, reference):
    with Client(stack["addr"]) as c:
        for p in PROMPTS:
            out = c.generate(p, max_tokens=24)
            assert out.token_ids == reference[p]
            assert out.completion_tokens == 24 and out.finish_reason == "length"
            assert sum(out.accepted_per_step) == 24 - 1  # + the prefill token
            streamed = list(c.stream(p, max_tokens=24))
            assert [t for ch in streamed for t in ch.token_ids] == reference[p]
            assert "".join(ch.text for ch in streamed) == out.text
            assert streamed[-1].finish_reason == "length"


def test_seeded_sampling_is_reproducible(stack):
    with Client(stack["addr"]) as c:
        a = c.generate("Tell me", max_tokens=16, temperature=0.8, seed=7).token_ids
        b = c.generate("Tell me", max_tokens=16, temperature=0.8, seed=7).token_ids
        assert a == b


def test_openai_client_plain_and_streaming(stack, reference):
    import openai

    client = openai.OpenAI(base_url=stack["http"] + "/v1", api_key="unused")
    models = client.models.list()
    model = models.data[0].id
    assert models.data[0].model_extra["max_model_len"] == 512  # the verifiers' context
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=24,
                                    temperature=0)
    with Client(stack["addr"]) as c:
        expected = c.generate(PROMPTS[0], max_tokens=24).text
    assert out.choices[0].text == expected
    assert out.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    # Without include_usage no chunk lacks a choice (code reading choices[0] works), and
    # none carries usage, as OpenAI streams.
    plain = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
        temperature=0, stream=True))
    assert all(ch.choices and ch.usage is None for ch in plain)
    assert "".join(ch.choices[0].delta.content or "" for ch in plain) == text


def test_logprobs_are_the_same_with_speculation_on_and_off(stack, reference):
    """The SDK's logprobs: one per token, the chosen greedy token the most likely, and the
    same values whether the tokens came from verified trees or one-token steps."""
    with Client(stack["addr"]) as c:
        on = c.generate(PROMPTS[1], max_tokens=24, logprobs=2)
        off = c.generate(PROMPTS[1], max_tokens=24, logprobs=2, speculation=False)
        streamed = [lp for ch in c.stream(PROMPTS[1], max_tokens=24, logprobs=2)
                    for lp in ch.logprobs]
    assert on.token_ids == off.token_ids == reference[PROMPTS[1]]
    assert on.stats.speculative_steps > 0
    for lps in (on.logprobs, off.logprobs, streamed):
        assert len(lps) == 24
    for tok, a, b, s in zip(on.token_ids, on.logprobs, off.logprobs, streamed, strict=True):
        assert a.top_token_ids[0] == tok and len(a.top_token_ids) == 2
        assert a.logprob == pytest.approx(a.top_logprobs[0]) and a.logprob <= 0
        assert a.top_logprobs[0] >= a.top_logprobs[1]
        assert list(a.top_token_ids) == list(b.top_token_ids) == list(s.top_token_ids)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert a.logprob == pytest.approx(s.logprob, abs=1e-3)
    assert Client(stack["addr"]).generate(PROMPTS[1], max_tokens=4).logprobs == []


def test_openai_logprobs_plain_and_streaming(stack):
    import openai

    client = openai.OpenAI(base_url=stack["http"] + "/v1", api_key="unused")
    with Client(stack["addr"]) as c:
        sdk = c.generate(PROMPTS[0], max_tokens=12, logprobs=3)
        chat_sdk = c.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                              logprobs=2)
    out = client.completions.create(prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    logprobs=3, model=client.models.list().data[0].id)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in sdk.logprobs], abs=1e-3)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    kw = dict(model=client.models.list().data[0].id, max_tokens=12, temperature=0,
              messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0]
    chat, chat_text = whole.logprobs.content, whole.message.content
    streamed = [e for ch in client.chat.completions.create(**kw, stream=True)
                if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    for entries in (chat, streamed):
        assert [e.logprob for e in entries] == pytest.approx(
            [x.logprob for x in chat_sdk.logprobs], abs=1e-3)
        assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
                   and bytes(e.bytes).decode(errors="replace") == e.token for e in entries)
        # Raw bytes: they join into the text even where a character spans tokens.
        assert b"".join(bytes(e.bytes) for e in entries).decode(errors="replace") == chat_text
    status, payload = http_post(stack["http"] + "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}).encode())
    assert status == 400 and payload["error"]["param"] == "top_logprobs"


def test_stop_string_cuts_a_speculative_step_where_plain_decoding_stops(stack):
    """A step that accepts tokens past the one completing a stop string keeps none of
    them: the same tokens (and logprobs) as with speculation off."""
    with Client(stack["addr"]) as c:
        for p in PROMPTS:
            full = c.generate(p, max_tokens=24, speculation=False).text
            stop = full[len(full) // 2: len(full) // 2 + 3]
            if not stop.strip():
                continue
            off = c.generate(p, max_tokens=24, stop=[stop], speculation=False, logprobs=1)
            on = c.generate(p, max_tokens=24, stop=[stop], logprobs=1)
            assert off.finish_reason == on.finish_reason == "stop"
            assert on.token_ids == off.token_ids and on.text == off.text
            assert stop not in on.text and len(on.token_ids) < 24
            assert len(on.logprobs) == len(on.token_ids)


def test_openai_n_choices_are_seeded_and_stream_interleaved(stack):
    import openai

    client = openai.OpenAI(base_url=stack["http"] + "/v1", api_key="unused")
    kw = dict(model=client.models.list().data[0].id, prompt=PROMPTS[2], max_tokens=10,
              temperature=1.0, seed=11, n=3)
    out = client.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 30
    texts = [c.text for c in out.choices]
    assert len(set(texts)) > 1  # seeds 11, 12, 13: different samples
    assert [c.text for c in client.completions.create(**kw).choices] == texts
    streamed = ["", "", ""]
    for ch in client.completions.create(**kw, stream=True):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == texts


def test_sixteen_concurrent_streams(stack, reference):
    async def one(client, prompt):
        ids = []
        async for ch in client.stream(prompt, max_tokens=24):
            ids += ch.token_ids
        return prompt, ids

    async def main():
        async with AsyncClient(stack["addr"]) as client:
            return await asyncio.gather(*(one(client, PROMPTS[i % 4]) for i in range(16)))

    for prompt, ids in asyncio.run(main()):
        assert ids == reference[prompt]


def test_overlapped_micro_batches_keep_greedy_output(stack, reference, tiny_chat_llm):
    """A second router over the same services in overlap mode: drafting for one micro-batch
    while the other is verified (and reusing the trees drafted ahead) changes no token."""
    with other_router(stack, tiny_chat_llm, "--speculation", "overlap") as (router, _):
        async def one(client, prompt):
            return prompt, await client.generate(prompt, max_tokens=24)

        async def main():
            async with AsyncClient(router) as client:
                return await asyncio.gather(*(one(client, PROMPTS[i % 4]) for i in range(6)))

        results = asyncio.run(main())
    for prompt, out in results:
        assert out.token_ids == reference[prompt]
    assert sum(out.stats.speculative_steps for _, out in results) > 0
    assert any(a > 1 for _, out in results for a in out.accepted_per_step)


def test_adaptive_speculation_drafts_in_the_verifier_without_a_speculator(stack, reference,
                                                                          tiny_chat_llm):
    """A router with no speculator still speculates: in the adaptive lookup modes the
    verifier drafts model-free trees from the history it holds. Greedy output unchanged."""
    with other_router(stack, tiny_chat_llm, "--speculation", "adaptive",
                      speculator=False) as (router, _), Client(router) as client:
        outs = {p: client.generate(p, max_tokens=24) for p in PROMPTS}
    for prompt, out in outs.items():
        assert out.token_ids == reference[prompt]
    assert sum(out.stats.speculative_steps for out in outs.values()) > 0
    assert any(a > 1 for out in outs.values() for a in out.accepted_per_step)


@pytest.fixture(scope="module")
def head_verifier(processes, tiny_chat_llm, tiny_chat_head) -> str:
    """A verifier with a draft head (random, over the LLM's first 4096 tokens)."""
    return processes.start("verifier", "--llm", tiny_chat_llm, "--draft-head", tiny_chat_head,
                           "--slots", "4", "--max-context", "512", "--threads", "1").wait().addr


@pytest.mark.parametrize("mode", ["head", "merged"])
def test_head_and_merged_modes_draft_with_the_verifiers_draft_head(stack, reference,
                                                                  tiny_chat_llm,
                                                                  head_verifier, mode):
    """A verifier with a draft head (--draft-head) and a router in "head" mode: the
    verifier drafts each step's tree with its head and verifies it; no speculator. In
    "merged" mode the speculator's SSM trees (over its stream) are merged into it, at batch
    1 drafted before the step, at batch 2 while the other micro-batch is verified
    ("merged-overlap"). Greedy output unchanged, one request at a time and together."""
    speculator = ("--speculator", stack["speculator"].addr) if mode == "merged" else ()
    http_port = free_port()

    async def in_pairs() -> list:  # batches of 2: the router speculates up to 2 (default)
        async with AsyncClient(router) as client:
            return [out for i in range(0, len(PROMPTS), 2) for out in await asyncio.gather(
                *(client.generate(p, max_tokens=24) for p in PROMPTS[i:i + 2]))]

    with service("router", "--llm", tiny_chat_llm, "--verifier", head_verifier, *speculator,
                 "--speculation", mode, "--http-port", str(http_port)) as (router, _), \
            Client(router) as client:
        outs = {p: client.generate(p, max_tokens=24) for p in PROMPTS}
        batched = dict(zip(PROMPTS, asyncio.run(in_pairs()), strict=True))
        steps = {k: v for k, v in scrape(f"http://127.0.0.1:{http_port}/metrics").items()
                 if k.startswith("specinfer:steps_total")}
    for prompt, out in outs.items():
        assert out.token_ids == reference[prompt]
        assert out.stats.speculative_steps == out.steps  # every step drafted
        assert batched[prompt].token_ids == reference[prompt]
    by_mode = {m: sum(v for k, v in steps.items() if f'mode="{m}"' in k)
               for m in ("head", "merged", "merged-overlap", "plain")}
    if mode == "merged":
        assert by_mode["merged"] > 0 and by_mode["merged-overlap"] > 0, by_mode
    else:
        assert by_mode["head"] > 0 and by_mode["merged-overlap"] == 0, by_mode


def test_bad_grpc_input_is_invalid_argument(stack):
    with Client(stack["addr"]) as c:
        for kwargs in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=1.5),
                       dict(logprobs=21)):
            with pytest.raises(InvalidRequestError):
                c.generate("hello", **{"max_tokens": 4, **kwargs})
        with pytest.raises(InvalidRequestError):
            c.generate("", max_tokens=4)
        assert c.generate("still serving", max_tokens=4).completion_tokens == 4


def test_client_disconnect_mid_stream_frees_the_sequence(stack, reference):
    with Client(stack["addr"]) as c:
        stream = c.stream(PROMPTS[1], max_tokens=200)
        next(stream)
        stream.close()  # cancels the RPC
        assert c.generate(PROMPTS[0], max_tokens=24).token_ids == reference[PROMPTS[0]]


def test_killing_the_speculator_then_a_verifier_loses_nothing(stack, reference):
    async def one(client, prompt):
        ids = []
        async for ch in client.stream(prompt, max_tokens=24):
            ids += ch.token_ids
            await asyncio.sleep(0.02)
        return prompt, ids

    async def main():
        async with AsyncClient(stack["addr"]) as client:
            tasks = [asyncio.create_task(one(client, PROMPTS[i % 4])) for i in range(8)]
            await asyncio.sleep(1.0)
            stack["speculator"].proc.kill()
            await asyncio.sleep(1.0)
            stack["verifiers"][0].proc.kill()
            return await asyncio.gather(*tasks)

    for prompt, ids in asyncio.run(main()):
        assert ids == reference[prompt]
    with Client(stack["addr"]) as c:  # and the stack still serves
        assert c.generate(PROMPTS[2], max_tokens=24).token_ids == reference[PROMPTS[2]]


def test_the_client_installs_and_works_without_torch(stack, reference, tmp_path):
    """`pip install .` into a fresh venv gives the gRPC SDK with grpcio and protobuf only:
    no torch, transformers or deepspeed installed, and it generates through the stack."""
    from pathlib import Path

    venv = tmp_path / "client-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([py, "-m", "pip", "install", "-q", str(root)], check=True, env=env,
                   timeout=900)
    script = """
import importlib.util, json, sys
from specinfer.client import Client
missing = [m for m in ("torch", "transformers", "deepspeed", "numpy")
           if importlib.util.find_spec(m) is not None]
with Client(sys.argv[1], timeout=60) as c:
    out = c.generate(sys.argv[2], max_tokens=24, speculation=False)
print(json.dumps({"installed": missing, "ids": out.token_ids, "file": __import__(
    "specinfer.client").__file__}))
"""
    run = subprocess.run([py, "-c", script, stack["addr"], PROMPTS[0]], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["installed"] == []
    assert out["file"].startswith(str(venv))  # the installed copy, not the checkout
    assert out["ids"] == reference[PROMPTS[0]]


def test_logit_bias_penalties_and_a_tiny_temperature_are_honoured(stack, reference):
    """Through both APIs, speculation on and off: a +100 logit bias forces its token; a
    temperature of 1e-45 (positive, so valid) is greedy; penalties change the answer the
    same way with and without speculation, and in both APIs."""
    prompt = PROMPTS[0]
    forced = reference[PROMPTS[1]][0]
    penalties = dict(frequency_penalty=1.5, presence_penalty=1.0, repetition_penalty=1.3)
    with Client(stack["addr"]) as c:
        for speculation in (True, False):
            out = c.generate(prompt, max_tokens=8, logit_bias={forced: 100.0},
                             speculation=speculation)
            assert out.token_ids == [forced] * 8
            assert c.generate(prompt, max_tokens=24, temperature=1e-45,
                              speculation=speculation).token_ids == reference[prompt]
        penalized = [c.generate(prompt, max_tokens=24, speculation=speculation, **penalties)
                     for speculation in (True, False)]
        greedy_text = c.generate(prompt, max_tokens=24, speculation=False).text
    assert penalized[0].token_ids == penalized[1].token_ids != reference[prompt]
    for body, want in (({"temperature": 1e-45}, greedy_text),
                       ({"temperature": 0, **penalties}, penalized[0].text),
                       ({"temperature": 0, "logit_bias": {str(forced): 250}},  # clamped
                        out.text)):
        max_tokens = 8 if "logit_bias" in body else 24
        status, payload = http_post(stack["http"] + "/v1/completions", json.dumps(
            {"prompt": prompt, "max_tokens": max_tokens, **body}).encode())
        assert status == 200, payload
        assert payload["choices"][0]["text"] == want, body


def test_requests_sharing_a_prefix_go_to_the_verifier_that_caches_it(stack):
    """Four shared prefixes (a "system prompt" each), three questions on each, one at a
    time over two verifiers: every question after a prefix's first reuses its cached KV
    (with load alone, half would land on the other verifier and miss), in the gRPC usage
    and the OpenAI usage's prompt_tokens_details; the same output as with a cold cache."""
    systems = [" ".join(f"{w}{k}" for k in range(40)) for w in ("alpha", "beta", "gamma",
                                                                  "delta")]
    with Client(stack["addr"]) as c:
        for i, system in enumerate(systems):
            first = c.generate(f"{system} Question 0?", max_tokens=4, cache_salt=f"t{i}")
            assert first.cached_prompt_tokens == 0  # its own salt: nothing cached yet
            for q in (1, 2):
                out = c.generate(f"{system} Question {q}?", max_tokens=4, cache_salt=f"t{i}")
                assert out.cached_prompt_tokens >= 64, (i, q, out.cached_prompt_tokens)
                cold = c.generate(f"{system} Question {q}?", max_tokens=4,
                                  cache_salt=f"cold-{i}-{q}")
                assert cold.cached_prompt_tokens == 0 and cold.token_ids == out.token_ids
        status, body = http_post(stack["http"] + "/v1/completions", json.dumps({
            "prompt": f"{systems[0]} Question 3?", "max_tokens": 2,
            "cache_salt": "t0"}).encode())
    assert status == 200
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert body["usage"]["prompt_tokens"] > body["usage"]["prompt_tokens_details"][
        "cached_tokens"]

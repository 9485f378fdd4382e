"""What both public APIs share (``services.router.frontend``) and the request's own
bookkeeping: token bytes and text offsets for logprobs, stop strings cutting a speculative
step, and streamed text that never shows part of a stop string."""

from __future__ import annotations

import asyncio


def test_token_bytes_are_raw_and_offsets_follow_the_text():
    """Logprobs' token bytes for byte-level BPE: a character split over tokens joins back
    exactly (OpenAI's ``bytes``), and each token's text offset is where it starts."""
    from services.router.frontend import Frontend
    from specinfer.models import DEFAULT_LLM, load_tokenizer

    fe = Frontend(load_tokenizer(DEFAULT_LLM), "m", 49152)
    assert fe.byte_level
    text = "Hi 😀 naïve 東京<|im_end|>"
    ids = fe.encode_prompt(text)
    assert b"".join(fe.token_bytes(t) for t in ids) == text.encode()
    assert any(fe.token_text(t) == "\ufffd" for t in ids)  # part of a character
    offsets = fe.text_offsets(ids, 0, len(ids))
    visible = fe.tokenizer.decode(ids, skip_special_tokens=True)
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] == len(visible)
    for t, o in zip(ids, offsets, strict=True):
        if "\ufffd" not in fe.token_text(t) and t not in fe.special_ids:
            assert visible[o:].startswith(fe.token_text(t))
    assert fe.text_offsets(ids, 2, 4) == offsets[2:4]
    # An invalid byte is one U+FFFD in the text; special tokens (not in the text) take none.
    from services.router.frontend import BYTE_OF_CHAR

    orphan = fe.tokenizer.convert_tokens_to_ids(
        next(c for c, b in BYTE_OF_CHAR.items() if b == 0x84))
    ids = [orphan, *fe.encode_prompt("a<repo_name> there")]
    assert fe.tokenizer.decode(ids, skip_special_tokens=True) == "\ufffda there"
    assert fe.text_offsets(ids, 0, len(ids)) == [0, 1, 2, 2]


def test_a_stop_string_and_eos_in_one_step_keep_only_the_tokens_before_the_stop():
    """A speculative step accepting "." then EOS, with stop ".": one-token steps would stop
    at "."; so does the step (token ids, logprobs and usage included)."""
    from services.router.config import RouterConfig
    from services.router.request import GenRequest
    from services.router.scheduler import Scheduler
    from specinfer.models import DEFAULT_LLM, load_tokenizer
    from specinfer.sampling import SamplingParams
    from specinfer.v1 import common_pb2

    tok = load_tokenizer(DEFAULT_LLM)

    async def main():
        sched = Scheduler(RouterConfig(), eos_ids=[tok.eos_token_id],
                          detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True))
        head, tail = tok.encode("Hello"), tok.encode(". More words")
        req = GenRequest([1, 2, 3], 64, SamplingParams(logprobs=0), stop=["."])
        step = head + tail + [tok.eos_token_id]
        await sched.lifecycle.emit(req, step, [common_pb2.TokenLogprob(logprob=-0.5)]
                                   * len(step), step=True)
        return req, head + tail[:1]

    req, expected = asyncio.run(main())
    assert req.generated == expected and req.finish_reason == "stop"
    assert len(req.logprobs) == len(expected) and req.accepted_per_step == [len(expected)]


def test_streamed_text_never_holds_part_of_a_stop_string():
    """Text that may begin a stop string is held back until it cannot, or the request ends:
    a client never sees "a" of stop "abc"; held text that turns out not to be a stop
    string is sent with the next delta."""
    from services.router.frontend import Generation
    from services.router.request import GenRequest
    from specinfer.models import DEFAULT_LLM, load_tokenizer
    from specinfer.sampling import SamplingParams

    tok = load_tokenizer(DEFAULT_LLM)

    def stream(chunks: list[str], finish: str) -> list[str]:
        req = GenRequest([1], 64, SamplingParams(), stop=["abc", "zz"])

        async def collect() -> list[str]:
            deltas, out = Generation(req).deltas(), []
            for chunk in chunks:  # the scheduler's steps, one at a time
                new = req.append(tok.encode(chunk), {tok.eos_token_id},
                                 lambda ids: tok.decode(ids, skip_special_tokens=True))
                req.events.put_nowait(("tokens", new))
                out.append((await deltas.__anext__())[1])
            req.events.put_nowait(("done", finish))
            out.append((await deltas.__anext__())[1])
            return out

        return asyncio.run(collect())

    assert stream(["xa", "b", "d", "z"], "length") == ["x", "", "abd", "", "z"]
    assert stream(["xa", "b", "c", "yy"], "stop") == ["x", "", "", "", ""]


def test_chat_content_forms_and_a_model_without_a_chat_template():
    """Text parts render as the joined string; a base model's tokenizer (no chat
    template) refuses chat with 400 naming messages, not a server error."""
    import pytest

    from services.router.frontend import Frontend
    from specinfer.errors import InvalidArgument
    from specinfer.models import DEFAULT_LLM, load_tokenizer

    fe = Frontend(load_tokenizer(DEFAULT_LLM), "m", 49152)
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    assert fe.encode_chat([{"role": "user", "content": parts}]) == \
        fe.encode_chat([{"role": "user", "content": "Hello\nthere"}])
    with pytest.raises(InvalidArgument) as err:
        fe.encode_chat([{"role": "user", "content": [{"type": "input_audio"}]}])
    assert err.value.field == "messages[0].content[0].type"
    base = load_tokenizer(DEFAULT_LLM)
    base.chat_template = None
    with pytest.raises(InvalidArgument) as err:
        Frontend(base, "m", 49152).encode_chat([{"role": "user", "content": "hi"}])
    assert err.value.field == "messages" and "/v1/completions" in str(err.value)


def test_text_prompts_get_the_tokenizers_bos_as_generate_sees_them():
    """A tokenizer that adds a BOS (Llama's, Mistral's): a completions prompt is encoded as
    ``tokenizer(text)`` is (what ``generate`` sees, and what vLLM and TGI send), unless the
    request sets vLLM's ``add_special_tokens: false``."""
    from tokenizers import processors

    from services.router.frontend import Frontend
    from services.router.openai_request import openai_requests
    from specinfer.models import DEFAULT_LLM, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_LLM)
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    fe = Frontend(tokenizer, "m", 49152)
    text_ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert tokenizer("Hello world")["input_ids"] == [bos, *text_ids]
    [req] = openai_requests(fe, {"prompt": "Hello world"}, chat=False)
    assert req.prompt_ids == [bos, *text_ids]
    [req] = openai_requests(fe, {"prompt": "Hello world", "add_special_tokens": False},
                            chat=False)
    assert req.prompt_ids == text_ids
    [req] = openai_requests(fe, {"prompt": [5, 6]}, chat=False)  # ids are taken as given
    assert req.prompt_ids == [5, 6]
    assert fe.byte_level  # the check reads the text's tokens alone

"""Shared fixtures: tiny random Llama models saved as Hugging Face directories, the
speculator's datastore for the real default model's tokenizer, and the stacks of
services (``servers.Stack``) that tests share: ``processes`` for a module's own
configuration, session-wide ones for configurations several files need."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from servers import Stack, service

import specinfer  # noqa: F401  (first: it configures oneDNN before any test runs a kernel)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cases marked ``matrix`` widen what ``make test`` checks once (more formats,
    parameters, endpoints): they run with SPECINFER_MATRIX=1 (``make test-matrix``), which
    keeps ``make test`` within its time budget."""
    if os.environ.get("SPECINFER_MATRIX") == "1":
        return
    skip = pytest.mark.skip(reason="a wider case: SPECINFER_MATRIX=1 (make test-matrix)")
    for item in items:
        if "matrix" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _save_random_llama(path, seed: int, scale: float, **config) -> None:
    """A random Llama with its matrices scaled up, so that argmaxes are well separated."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=False, **config))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    model.save_pretrained(path)


def save_tiny_llama(path, seed: int = 0, layers: int = 4, vocab: int = 128) -> str:
    _save_random_llama(path, seed, 2.0, vocab_size=vocab, num_hidden_layers=layers,
                       max_position_embeddings=512, eos_token_id=None, bos_token_id=0,
                       pad_token_id=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def save_tiny_chat_llm(path, seed: int = 0, layers: int = 2) -> str:
    """A tiny random Llama over SmolLM2's real tokenizer and chat template (vocab 49152,
    hidden 64), for tests that need text in and text out."""
    from specinfer.models import DEFAULT_LLM, load_tokenizer

    _save_random_llama(path, seed, 3.0, vocab_size=49152, num_hidden_layers=layers,
                       max_position_embeddings=1024, eos_token_id=2, bos_token_id=1,
                       pad_token_id=2)
    load_tokenizer(DEFAULT_LLM).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_chat_llm(tmp_path_factory) -> str:
    return save_tiny_chat_llm(tmp_path_factory.mktemp("tiny-chat-llm"))


@pytest.fixture(scope="session")
def tiny_chat_head(tiny_chat_llm, tmp_path_factory) -> str:
    """A random draft head for ``tiny_chat_llm`` (over its first 8192 tokens), saved as
    ``--draft-head`` takes it."""
    from specinfer.drafting.head import DraftHead
    from specinfer.models import load_model
    from specinfer.training.head import save_head

    head = tmp_path_factory.mktemp("head") / "head"
    save_head(DraftHead(load_model(tiny_chat_llm), torch.arange(0, 8192)), head,
              tiny_chat_llm, {})
    return str(head)


@pytest.fixture(scope="session")
def smollm2_mtbench() -> list[tuple[list[int], list[int]]]:
    """The real default LLM on 8 MT-Bench first turns (one per category, chat template
    applied): each prompt's ids and transformers' greedy ``generate`` of 64 new tokens
    (computed once: the engine and stack tests compare against it)."""
    from specinfer.chat import chat_prompt_ids
    from specinfer.data import mtbench_first_turns
    from specinfer.models import DEFAULT_LLM, load_model, load_tokenizer

    model, tokenizer = load_model(DEFAULT_LLM), load_tokenizer(DEFAULT_LLM)
    out = []
    for _, text in mtbench_first_turns(per_category=1):
        ids = chat_prompt_ids(tokenizer, text)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        out.append((ids, ref[0, len(ids):].tolist()))
    return out


@pytest.fixture(scope="session")
def smollm2_datastore() -> None:
    """Build (or find cached) the speculator's ShareGPT datastore for SmolLM2's tokenizer
    before any stack starts, so no speculator spends its start-up building it."""
    from specinfer.drafting.datastore import sharegpt_datastore
    from specinfer.models import DEFAULT_LLM, load_tokenizer

    sharegpt_datastore(load_tokenizer(DEFAULT_LLM))


@pytest.fixture(scope="module")
def processes() -> Iterator[Stack]:
    """A ``Stack`` that lives as long as the test module: its stack fixtures build on it."""
    with Stack() as stack:
        yield stack


@pytest.fixture(scope="session")
def tiny_speculator(tiny_llama) -> Iterator[str]:
    """A speculator on ``tiny_llama`` (its own SSM; trees of up to 32 nodes, expansion
    1,2,1 unless a request says otherwise), shared by the files that call a speculator
    alone; its address."""
    with service("speculator", "--llm", tiny_llama, "--ssm", tiny_llama, "--max-nodes", "32",
                 "--expansion", "1,2,1", "--max-context", "512", "--threads", "1") as (addr, _):
        yield addr

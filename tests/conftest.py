"""Shared fixtures: tiny random Llama models saved as Hugging Face directories, and the
real default model (loaded once per session)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def save_tiny_llama(path, seed: int = 0, layers: int = 4, vocab: int = 128) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    # Larger weights than the default init so that argmaxes are well separated.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))

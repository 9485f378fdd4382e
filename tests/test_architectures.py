"""The runtime on every architecture it accepts (Llama, Mistral, Qwen2) and the variants
their configs allow: biases, tied embeddings, a wider head_dim, llama3 rope scaling and
sliding-window attention (Mistral's on every layer, Qwen2's on some). Speculative greedy
output must equal transformers' ``generate`` in float32, with prompts and answers longer
than the windows and trees deeper than the smallest one."""

from __future__ import annotations

import pytest
import torch
from test_verifier_engine import hf_greedy, noisy_oracle
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from services.verifier.engine import EngineConfig
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.layers import sliding_windows
from specinfer.placement import resolve

VARIANTS = {
    "qwen2-bias-tied": (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": True}),
    "qwen2-sliding-upper-layers": (Qwen2ForCausalLM, Qwen2Config, {
        "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    "mistral-sliding": (MistralForCausalLM, MistralConfig, {"sliding_window": 16}),
    "mistral-window-under-tree-depth": (MistralForCausalLM, MistralConfig,
                                        {"sliding_window": 3}),
    "llama-bias-headdim": (LlamaForCausalLM, LlamaConfig, {
        "attention_bias": True, "mlp_bias": True, "head_dim": 32}),
    "llama3-rope-scaling": (LlamaForCausalLM, LlamaConfig, {
        "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
}


def _save(path, model_cls, config_cls, extra: dict):
    torch.manual_seed(0)
    model = model_cls(config_cls(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_hidden_layers=3, max_position_embeddings=512, eos_token_id=None,
        bos_token_id=0, pad_token_id=0, **extra))
    with torch.no_grad():  # well-separated argmaxes
        for p in model.parameters():
            p.mul_(2.0)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.slow  # generate() against the engine on every variant
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_speculative_greedy_equals_generate(tmp_path, variant):
    model = _save(tmp_path, *VARIANTS[variant])
    engine = build_engine(str(tmp_path), EngineConfig(max_context=256, slots=4,
                                                      max_tree_nodes=24),
                          placement=resolve("cpu", "float32"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 17, 90)]
    results = generate_local(engine, prompts, 40, trees=noisy_oracle(model, 1, depth=5))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(model, prompt, 40), variant
    assert sum(len(r.token_ids) - 1 for r in results) > 1.5 * sum(r.steps for r in results)


def test_window_placement_follows_the_config():
    mistral = MistralConfig(num_hidden_layers=4, sliding_window=8)
    assert sliding_windows(mistral, 0, 4) == [8, 8, 8, 8]
    qwen = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                       max_window_layers=2)
    assert sliding_windows(qwen, 0, 4) == [None, None, 8, 8]
    assert sliding_windows(qwen, 1, 2) == [None, 8]  # a pipeline stage's own layers
    assert sliding_windows(Qwen2Config(num_hidden_layers=2), 0, 2) == [None, None]
    assert sliding_windows(LlamaConfig(num_hidden_layers=2), 0, 2) == [None, None]

"""The real default LLM (SmolLM2-135M-Instruct, from the GGUF wheel): speculative greedy
decoding through the verifier engine equals transformers' generate(do_sample=False) token
for token on 8 MT-Bench first-turn prompts (one per category, chat template applied) x 64
new tokens.

The trees come from a noisy oracle: transformers' own continuation, hidden among decoys
at random positions and going wrong part-way, so accepted paths are often not the
leftmost and KV compaction is exercised on every step. A verifier that computed a different
argmax anywhere, accepted a decoy or kept the wrong K/V would diverge from the reference.
"""

from __future__ import annotations

import pytest
import torch
from conftest import decoy_tree

from services.verifier.engine import EngineConfig
from services.verifier.local import generate_local
from services.verifier.parallel import build_engine
from specinfer.chat import chat_prompt_ids
from specinfer.data import mtbench_first_turns
from specinfer.models import DEFAULT_LLM, load_tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def engine():
    return build_engine(DEFAULT_LLM, EngineConfig(max_context=1024, slots=2))


def noisy_oracle(prompt: list[int], continuation: list[int], vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def trees(histories):
        done = [len(h) - len(prompt) for h in histories]
        return [decoy_tree(continuation[d : d + 5], vocab, gen) for d in done]

    return trees


def test_speculative_greedy_equals_generate_on_mtbench(engine):
    tokenizer = load_tokenizer(DEFAULT_LLM)
    hf = engine.executor.runtime.model
    prompts = [chat_prompt_ids(tokenizer, p) for _, p in mtbench_first_turns(per_category=1)]
    assert len(prompts) == 8
    multi = 0
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                              do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        ref = ref[0, len(prompt):].tolist()
        trees = noisy_oracle(prompt, ref, hf.config.vocab_size, seed=i)
        res = generate_local(engine, [prompt], NEW_TOKENS, trees=trees)[0]
        assert res.token_ids == ref, f"prompt {i} diverged"
        multi += sum(1 for a in res.accepted_per_step if a > 1)
    assert multi > 8 * 3  # many steps accepted several tokens

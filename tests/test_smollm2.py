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

from bench.trees import reference_oracle
from services.verifier.engine import EngineConfig
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.chat import chat_prompt_ids
from specinfer.data import mtbench_first_turns
from specinfer.drafting import DraftPlan
from specinfer.models import DEFAULT_LLM, load_tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def engine():
    return build_engine(DEFAULT_LLM, EngineConfig(max_context=1024, slots=8))


def test_speculative_greedy_equals_generate_on_mtbench(engine, smollm2_mtbench):
    """All 8 in one batch: rows of different trees and lengths side by side."""
    assert len(smollm2_mtbench) == 8
    assert len({tuple(p) for p, _ in smollm2_mtbench}) == 8  # the oracle tells them apart
    trees = reference_oracle(smollm2_mtbench, engine.executor.runtime.model.config.vocab_size, 0)
    results = generate_local(engine, [p for p, _ in smollm2_mtbench], NEW_TOKENS, trees=trees)
    multi = 0
    for i, ((_, ref), res) in enumerate(zip(smollm2_mtbench, results, strict=True)):
        assert res.token_ids == ref[:NEW_TOKENS], f"prompt {i} diverged"
        multi += sum(1 for a in res.accepted_per_step if a > 1)
    assert multi > 8 * 3  # many steps accepted several tokens


def textbook_penalized_greedy(hf, prompt: list[int], n: int, params, eos: set[int]
                              ) -> list[int]:
    """Plain greedy decoding with the penalties applied the textbook way: the whole text
    recomputed each step; repetition penalty over prompt and output (vLLM's), frequency
    and presence penalties over the output (OpenAI's), then logit bias."""
    from collections import Counter

    ids, out = list(prompt), []
    bias = dict(params.logit_bias)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        for t in set(ids):
            value = logits[t]
            logits[t] = value / params.repetition_penalty if value > 0 \
                else value * params.repetition_penalty
        for t, c in Counter(out).items():
            logits[t] -= params.frequency_penalty * c + params.presence_penalty
        for t, b in bias.items():
            logits[t] += b
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


def test_penalties_and_logit_bias_keep_speculation_exact(engine):
    """Greedy output with repetition, frequency and presence penalties and a logit bias
    equals the textbook reference, with speculation off, with noisy-oracle trees (whose
    deeper nodes are only right if their ancestors are counted as generated) and with the
    verifier's own model-free drafts."""
    from specinfer.sampling import SamplingParams

    tokenizer = load_tokenizer(DEFAULT_LLM)
    hf = engine.executor.runtime.model
    eos = set(engine.eos_token_ids)
    n = 32
    for i, (_, text) in enumerate(mtbench_first_turns(per_category=1)[:2]):
        prompt = chat_prompt_ids(tokenizer, text)
        plain = generate_local(engine, [prompt], 4)[0].token_ids
        params = SamplingParams(logit_bias={plain[0]: -100, plain[3]: 4.0},
                                frequency_penalty=0.6, presence_penalty=0.4,
                                repetition_penalty=1.3)
        ref = textbook_penalized_greedy(hf, prompt, n, params, eos)
        assert ref[0] != plain[0] and len(ref) > 8  # the processors change the text
        off = generate_local(engine, [prompt], n, params=params)[0]
        assert off.token_ids == ref, f"prompt {i}: plain decoding"
        oracle = generate_local(engine, [prompt], n, params=params,
                                trees=reference_oracle([(prompt, ref)], hf.config.vocab_size, i))[0]
        assert oracle.token_ids == ref, f"prompt {i}: noisy-oracle trees"
        assert any(a > 1 for a in oracle.accepted_per_step)
        drafted = generate_local(engine, [prompt], n, params=params,
                                 draft=DraftPlan(("model_free",), 8))[0]
        assert drafted.token_ids == ref, f"prompt {i}: model-free drafts"

"""Speculative sampling end to end in-process (speculator engine -> verifier engine, the
code the services run, minus RPC) on a tiny random Llama: with speculation on and off, the
second and third generated tokens have the same distribution (also with a frequency penalty,
whose target at a tree node counts the node's ancestors as generated, and with min_tokens,
which suppresses its ids at the second token and not at the third: a tree spans both).

Two-sample chi-square test of homogeneity per token position, N = 1,000 sequences each
(600 in bfloat16, int8 and on a GPU), cells with fewer than 10 pooled counts merged; pass if
p > 1e-3 (seeded: deterministic).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chi2_contingency

from services.speculator.engine import SpeculateSpec, SpeculatorEngine
from services.verifier.engine import EngineConfig
from services.verifier.factory import build_engine
from services.verifier.local import generate_local
from specinfer.drafting import DraftPlan
from specinfer.drafting.ssm import SSMDrafter
from specinfer.models import load_model, load_ssm
from specinfer.placement import resolve
from specinfer.sampling import SamplingParams

N = 1000
N_OTHER_FORMATS = 600  # bfloat16 and int8: the same test, fewer samples (time)
BATCH = 8  # sequences sampled together, a seed each (a step for 8 costs about one for 1)


def sample(engine, prompt: list[int], n: int, params: SamplingParams, **kwargs) -> list:
    """``n`` independent samples of 3 tokens after ``prompt`` (seeds 0..n-1, ``BATCH`` at a
    time): ``generate_local``'s results; ``kwargs`` go to it (trees, draft)."""
    out = []
    for start in range(0, n, BATCH):
        seeded = [dataclasses.replace(params, seed=i) for i in range(start, min(n, start + BATCH))]
        out += generate_local(engine, [prompt] * len(seeded), 3, params=seeded, **kwargs)
    return out


def homogeneity_pvalue(a: list[int], b: list[int]) -> float:
    counts: dict[int, list[int]] = {}
    for k, sample in enumerate((a, b)):
        for t in sample:
            counts.setdefault(t, [0, 0])[k] += 1
    big = [c for c in counts.values() if sum(c) >= 10]
    rest = [sum(c[0] for c in counts.values() if sum(c) < 10),
            sum(c[1] for c in counts.values() if sum(c) < 10)]
    table = big + ([rest] if sum(rest) else [])
    return float(chi2_contingency(table).pvalue)


@pytest.mark.slow  # chi-square tests over thousands of samples
@pytest.mark.parametrize("params,dtype", [
    pytest.param(SamplingParams(0.7), "float32", marks=pytest.mark.matrix),
    (SamplingParams(1.0, top_p=0.8), "float32"),
    (SamplingParams(1.0, frequency_penalty=-2.0, presence_penalty=-2.0), "float32"),
    pytest.param(SamplingParams(1.0, min_tokens=2,
                                min_tokens_stop_ids=tuple(range(0, 128, 2))),
                 "float32", marks=pytest.mark.matrix),
    (SamplingParams(0.7), "bfloat16"), (SamplingParams(0.7), "int8"),
    pytest.param(SamplingParams(0.7), "cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")),
], ids=["T=0.7", "top_p=0.8", "T=1 penalties=-2", "T=1 min_tokens=2", "T=0.7 bfloat16",
        "T=0.7 int8", "T=0.7 cuda"])
def test_speculation_on_and_off_give_the_same_distribution(tiny_llama, params, dtype):
    """In every number format: MSS is exact for whatever distribution the LLM computes
    (cuda: the GPU's default, bfloat16 with CUDA graphs, sampling on the device)."""
    placement = resolve("cpu", quantize="int8") if dtype == "int8" else \
        resolve("cuda") if dtype == "cuda" else resolve("cpu", dtype)
    engine = build_engine(tiny_llama, EngineConfig(max_context=64, slots=BATCH),
                          placement=placement)
    model, _ = load_ssm(f"{tiny_llama}#layers=2")
    spec = SpeculatorEngine([SSMDrafter(model, 0, slots=BATCH, max_context=64)], 128,
                            expansion=[2, 2, 1], max_nodes=16)
    prompt = [5, 17, 33, 2, 90]
    counter = iter(range(10**9))

    def trees(histories):
        return spec.speculate([SpeculateSpec(f"t{next(counter)}", h, params)
                               for h in histories])

    torch.manual_seed(0)
    n = N if dtype == "float32" else N_OTHER_FORMATS
    spec_results = sample(engine, prompt, n, params, trees=trees)
    on = [r.token_ids for r in spec_results]
    off = [r.token_ids for r in sample(engine, prompt, n, params)]
    accepted = sum(r.steps for r in spec_results)
    for pos in (1, 2):
        p = homogeneity_pvalue([s[pos] for s in on], [s[pos] for s in off])
        assert p > 1e-3, f"token {pos + 1}: p = {p:.2e}"
    assert accepted < 2 * n  # speculation accepted drafts, so both tokens often came at once
    if params.min_tokens:  # suppressed before it, and not after
        suppressed = set(params.min_tokens_stop_ids)
        assert not {s[pos] for s in on + off for pos in (0, 1)} & suppressed
        assert {s[2] for s in on} & suppressed


@pytest.mark.slow  # chi-square tests over thousands of samples
@pytest.mark.parametrize("merged", [pytest.param(False, marks=pytest.mark.matrix), True],
                         ids=["head", "merged"])  # merged: the head's drafts and an SSM's
def test_the_verifiers_head_drafts_keep_the_distribution(tiny_llama, tmp_path, merged):
    """The same test for trees the verifier drafts itself: its draft head's sampled chain
    (source after the model-free ones) merged with prompt-lookup drafts, at T=0.8; and
    (merged) with an SSM's sampled tree sent with the item as well, the merged mode."""
    from services.router.policy import MERGED
    from specinfer.drafting.head import DraftHead
    from specinfer.training.head import save_head

    save_head(DraftHead(load_model(tiny_llama), torch.arange(0, 128)), tmp_path / "head",
              tiny_llama, {})
    engine = build_engine(tiny_llama, EngineConfig(max_context=64, slots=BATCH,
                                                   head_expansion=(2, 1, 1)),
                          head=str(tmp_path / "head"))
    trees = None
    if merged:
        model, _ = load_ssm(f"{tiny_llama}#layers=2")
        spec = SpeculatorEngine([SSMDrafter(model, 0, slots=BATCH, max_context=64)], 128,
                                max_nodes=16)
        counter = iter(range(10**9))

        def trees(histories):  # what the router's merged mode asks for: SSM-only, its shape
            return spec.speculate([SpeculateSpec(f"m{next(counter)}", h, params,
                                                 list(MERGED.expansion), 4, ssm_only=True)
                                   for h in histories])
    prompt = [5, 17, 33, 2, 90, 5, 17]
    params = SamplingParams(0.8)
    spec_results = sample(engine, prompt, N, params, trees=trees,
                          draft=DraftPlan(("head", "model_free"), 8))
    on = [r.token_ids for r in spec_results]
    off = [r.token_ids for r in sample(engine, prompt, N, params)]
    steps = sum(r.steps for r in spec_results)
    for pos in (1, 2):
        p = homogeneity_pvalue([s[pos] for s in on], [s[pos] for s in off])
        assert p > 1e-3, f"token {pos + 1}: p = {p:.2e}"
    assert steps < 2 * N  # drafts were accepted

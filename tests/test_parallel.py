"""Tensor parallel (DeepSpeed AutoTP), pipeline parallel, and both together give the same
greedy tokens as a single process (tiny random Llama, rank processes on gloo)."""

import pytest
import torch

from services.verifier.engine import EngineConfig
from services.verifier.local import generate_local
from services.verifier.parallel import build_engine, layer_range
from specinfer.tree import TokenTree


def run(model_dir: str, tp: int, pp: int):
    engine = build_engine(model_dir, EngineConfig(max_context=128, slots=4), tp=tp, pp=pp,
                          micro_batches=2)
    try:
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 11, 8)]

        def trees(histories):  # fixed-shape trees, so verification runs the tree path
            return [TokenTree.chain([h[-1], h[-2]]) for h in histories]

        spec = generate_local(engine, prompts, 12, trees=trees)
        plain = generate_local(engine, prompts, 12)
        return [r.token_ids for r in spec], [r.token_ids for r in plain]
    finally:
        engine.executor.close()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return run(tiny_llama, 1, 1)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_matches_single_process(tiny_llama, reference, tp, pp):
    assert run(tiny_llama, tp, pp) == reference


def test_layer_ranges_cover_every_layer_once():
    for layers in (1, 4, 30, 31):
        for pp in range(1, min(layers, 5) + 1):
            ranges = [layer_range(layers, pp, s) for s in range(pp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            assert all(hi > lo for lo, hi in ranges)

"""The GPU half of ``bench/gpu_smoke.sh``: step costs of our runtime on a CUDA device, on a
model of SmolLM2-135M's exact shape with random weights (real weights cannot travel to an
offline GPU machine; a step costs the same whatever the weights hold).

For eager and CUDA-graph steps in bfloat16 it times: one decode step (1 query) at batch 1
and 8, tree verification of 16 and 64 nodes at batch 1, and transformers' own decode step
(the anchor, same device and dtype). Speculation on vs off is projected from these costs and
the tokens per step measured on the CPU with the real model (``--tokens-per-step``, from
``bench/exactness.py`` or ``make bench-quick``): on = tokens_per_step / tree step time, off =
1 / decode step time. Writes JSON to ``--out``.

    python -m bench.gpu_smoke --out DIR [--tokens-per-step 2.1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
PREFIX = 256


def save_random_smollm2(path: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(path)
    return str(path)


def cuda_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens-per-step", type=float, default=2.1,
                    help="speculation's accepted tokens per step on the CPU with real weights")
    args = ap.parse_args()
    from services.verifier.engine import EngineConfig
    from services.verifier.executor import ForwardArgs
    from services.verifier.factory import build_engine
    from specinfer.placement import resolve
    from specinfer.tree import TokenTree, TreeBatch

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = save_random_smollm2(Path(tempfile.mkdtemp()) / "smollm2-shape")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "python": platform.python_version(), "prefix": PREFIX, "configs": {}}
    gen = torch.Generator().manual_seed(0)

    def tree_of(n: int) -> TokenTree:
        tree = TokenTree()
        while len(tree) < n:
            parent = int(torch.randint(-1, len(tree), (1,), generator=gen)) if len(tree) else -1
            tree.add(parent, int(torch.randint(0, 49152, (1,), generator=gen)))
        return tree

    for name, compile_ in (("eager", "off"), ("graphs", "on")):
        start = time.perf_counter()
        engine = build_engine(model_dir, EngineConfig(max_context=1024, slots=8,
                                                      max_tree_nodes=64),
                              placement=resolve("cuda", "bfloat16", compile=compile_))
        startup = time.perf_counter() - start
        forward = engine.executor.forward

        def step(trees: list[TokenTree], forward=forward) -> float:
            batch = TreeBatch.build(trees, [1] * len(trees), [PREFIX] * len(trees))
            q = batch.tokens.shape[1]
            vis = None if batch.tokens.shape == (1, 1) else batch.visibility(PREFIX + q)
            fa = ForwardArgs(batch.tokens, batch.position_ids, torch.arange(len(trees)),
                             batch.prefix_lens, vis)
            return cuda_ms(lambda: forward(fa))

        row = {"startup_s": startup,
               "decode_ms": step([TokenTree()]),
               "decode_batch8_ms": step([TokenTree() for _ in range(8)]),
               "tree16_ms": step([tree_of(15)]),
               "tree64_ms": step([tree_of(63)])}
        row["speculation_on_tokens_per_s"] = args.tokens_per_step / row["tree16_ms"] * 1e3
        row["speculation_off_tokens_per_s"] = 1e3 / row["decode_ms"]
        report["configs"][name] = row
        print(name, {k: round(v, 3) for k, v in row.items()}, flush=True)
        del engine
        torch.cuda.empty_cache()

    from transformers import AutoModelForCausalLM, DynamicCache

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    prompt = torch.randint(0, 49152, (1, PREFIX), device="cuda")
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(prompt, past_key_values=cache, use_cache=True)

    def hf_step() -> None:
        with torch.no_grad():
            hf(prompt[:, -1:], past_key_values=cache, use_cache=True)
        cache.crop(PREFIX)

    report["transformers_decode_ms"] = cuda_ms(hf_step)
    print("transformers decode step ms", round(report["transformers_decode_ms"], 3))
    (out_dir / "gpu_smoke.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out_dir / 'gpu_smoke.json'}")


if __name__ == "__main__":
    main()

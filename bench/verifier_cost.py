"""LLM forward cost vs tree size and batch size: our verifier engine next to transformers.

For each tree size n (a random tree of n nodes after a 128-token KV prefix) it times:
  - ours: one engine forward (root + n nodes, topology-aware mask, static KV cache);
  - hf-tree: transformers' stock model, same queries, 4-D mask over a DynamicCache;
and, as the anchor, transformers' plain `generate` per decoded token (greedy, same model).
Then it times batches of B sequences (incremental step and 16-node trees).

Prints a table and writes JSON (default bench/results/verifier_cost.json).
    python -m bench.verifier_cost [--llm REF] [--reps 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from bench.trees import random_tree
from services.verifier.engine import EngineConfig
from services.verifier.executor import ForwardArgs
from services.verifier.factory import build_engine
from specinfer.config import add_arguments, from_namespace
from specinfer.models import DEFAULT_LLM, load_model
from specinfer.placement import PlacementFlags
from specinfer.tree import TokenTree, TreeBatch

PREFIX = 128


def timed(fn, reps: int, warmup: int = 2) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs) * 1e3, (max(xs) - min(xs)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llm", default=DEFAULT_LLM)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", default="1,4,8,16,32,64")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--out", default="bench/results/verifier_cost.json")
    add_arguments(ap, PlacementFlags)
    args = ap.parse_args()
    placement = from_namespace(PlacementFlags, args).resolve()
    sizes = [int(x) for x in args.sizes.split(",")]
    batches = [int(x) for x in args.batches.split(",")]

    engine = build_engine(args.llm, EngineConfig(max_context=PREFIX + 128, slots=max(batches),
                                                 max_tree_nodes=max(sizes)),
                          placement=placement)
    # The anchor is transformers as users run it: float32 on this CPU, its own copy (our
    # runtime converts its model in place for other formats).
    model = load_model(args.llm)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, PREFIX), generator=gen)
    forward = engine.executor.forward

    def ours(trees: list[TokenTree]) -> float:
        batch = TreeBatch.build(trees, [1] * len(trees), [PREFIX] * len(trees))
        q = batch.tokens.shape[1]
        vis = None if batch.tokens.shape == (1, 1) else batch.visibility(PREFIX + q)
        fa = ForwardArgs(batch.tokens, batch.position_ids, torch.arange(len(trees)),
                         batch.prefix_lens, vis)
        return timed(lambda: forward(fa), args.reps)

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, cache=cache, use_cache=True)

    def hf_tree(tree: TokenTree) -> float:
        batch = TreeBatch.build([tree], [1], [PREFIX])
        q = batch.tokens.shape[1]
        mask = batch.attention_mask(PREFIX + q, PREFIX)

        def step():
            with torch.no_grad():
                model(batch.tokens, cache=cache, position_ids=batch.position_ids,
                      attention_mask=mask, use_cache=True)
            cache.crop(-q)

        return timed(step, args.reps)

    def hf_generate_per_token() -> tuple[float, float]:
        def run(n):
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               attention_mask=torch.ones_like(prompt))
        long_ms, spread = timed(lambda: run(33), max(3, args.reps // 2), warmup=1)
        short_ms, _ = timed(lambda: run(1), max(3, args.reps // 2), warmup=1)
        return (long_ms - short_ms) / 32, spread / 32

    results = {"machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(),
                           "torch": torch.__version__},
               "llm": args.llm, "dtype": str(engine.executor.dtype), "prefix": PREFIX,
               "placement": placement.describe(),
               "tree": [], "batch": []}
    gen_ms, gen_spread = hf_generate_per_token()
    results["hf_generate_ms_per_token"] = gen_ms
    step_ms = None
    print(f"transformers generate: {gen_ms:.1f} ms/token (spread {gen_spread:.1f})")
    print(f"{'nodes':>6} {'ours ms':>9} {'x step':>7} {'hf-tree ms':>11} {'ours/hf':>8}")
    for n in sizes:
        tree = random_tree(n - 1, vocab, gen) if n > 1 else TokenTree()  # + root = n queries
        o, o_sp = ours([tree])
        h, h_sp = hf_tree(tree)
        step_ms = step_ms or o
        row = {"queries": n, "ours_ms": o, "ours_spread_ms": o_sp, "hf_tree_ms": h,
               "hf_tree_spread_ms": h_sp, "ratio_to_step": o / step_ms}
        results["tree"].append(row)
        print(f"{n:>6} {o:>9.1f} {o / step_ms:>7.2f} {h:>11.1f} {o / h:>8.2f}")
    print(f"\n{'batch':>6} {'step ms':>9} {'ms/seq':>8} {'16-node ms':>11} {'ms/seq':>8}")
    for b in batches:
        s, _ = ours([TokenTree() for _ in range(b)])
        t16, _ = ours([random_tree(15, vocab, gen) for _ in range(b)])
        results["batch"].append({"batch": b, "step_ms": s, "tree16_ms": t16})
        print(f"{b:>6} {s:>9.1f} {s / b:>8.1f} {t16:>11.1f} {t16 / b:>8.1f}")
    print(f"\nour incremental step vs transformers generate per token: "
          f"{gen_ms / step_ms:.2f}x faster")
    results["speedup_step_vs_generate"] = gen_ms / step_ms
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
